"""Dots with a float32 result whose backward stays in the compute dtype.

`jnp.einsum(..., preferred_element_type=float32)` on bfloat16 operands gives a float32 result,
and so a float32 cotangent: JAX's transpose then multiplies that float32 cotangent with the other
(upcast) operand, a float32 x float32 dot that runs as TF32 at best on a GPU, at half the bf16
rate. `einsum_f32` rounds the cotangent to the operands' dtype first, as a fused attention or
loss kernel does with its dS / dlogits: the backward dots are compute-dtype x compute-dtype. In
a float32 step it is plain `jnp.einsum` (the rounding would be a no-op).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(eq, a, b)` with a float32 result; a and b share one dtype."""
    if a.dtype != b.dtype:
        raise ValueError(f"einsum_f32: operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == jnp.float32:
        return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)
    return _rounded_backward(eq, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounded_backward(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def _forward(eq, a, b):
    return _rounded_backward(eq, a, b), (a, b)


def _backward(eq, residuals, g):
    a, b = residuals
    # The transpose of the compute-dtype einsum: its dots take compute-dtype operands.
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(eq, a, b), a, b)
    return vjp(g.astype(a.dtype))


_rounded_backward.defvjp(_forward, _backward)
