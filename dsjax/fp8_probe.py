"""The precision probe's matmul: a projection computed in float32 that measures, in its backward
pass, what fp8 and the other compute dtype would lose on these very operands.

The one idea: the measurements leave through autodiff, as the delayed-scaling amaxes do (fp8.py).
Each probed projection reads a zero vector `token` from the `fp8_probe` collection; the gradient
of that vector is the projection's `STATS`. One forward and backward of a float32 model on a
training batch thus measures every (layer, projection) at once, on its real inputs and output
gradients, and changes nothing (docs/precision.md).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dsjax import fp8

COLLECTION = "fp8_probe"
# Per probed projection: relative errors of the output and of the weight gradient against
# float32, in fp8 (e4m3 forward, e5m2 output gradients, the configured scaling) and in the
# other compute dtype; the share of the input's (e4m3) and the output gradient's (e5m2) nonzero
# values that a per-tensor scale puts below the format's smallest normal number (fewer
# mantissa bits, or zero: what an outlier does to everything else); the share of input values
# beyond OUTLIER_RMS x its RMS; the input's and the output gradient's crest factors (amax/RMS).
STATS = ("fwd_fp8", "fwd_other", "wgrad_fp8", "wgrad_other", "x_underflow", "dy_underflow",
         "x_outliers", "x_crest", "dy_crest")
OUTLIER_RMS = 6.0


def _rel(a: jax.Array, ref: jax.Array) -> jax.Array:
    """||a - ref|| / ||ref|| (0 for an all-zero pair)."""
    num = jnp.sqrt(jnp.sum(jnp.square(a - ref)))
    den = jnp.sqrt(jnp.sum(jnp.square(ref)))
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def _rms(a: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(a)))


def underflow(a: jax.Array, dtype: Any) -> jax.Array:
    """The share of `a`'s nonzero values below `dtype`'s smallest normal number once a is
    scaled so that its amax is the format's largest (current per-tensor scaling)."""
    info = jnp.finfo(dtype)
    scaled = jnp.abs(a) * (float(info.max) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
    nonzero = a != 0
    small = nonzero & (scaled < float(info.smallest_normal))
    return jnp.sum(small) / jnp.maximum(jnp.sum(nonzero), 1)


def _einsum(eq: str, x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """The projection with operands in `dtype` (float32 accumulation, the result rounded to
    `dtype`, as a GEMM in that dtype writes it), returned in float32."""
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    y = jnp.einsum(eq, x.astype(dtype), w.astype(dtype), precision=precision,
                   preferred_element_type=jnp.float32)
    return y.astype(dtype).astype(jnp.float32)


def measure(eq: str, x: jax.Array, w: jax.Array, dy: jax.Array, recipe: str, other: Any
            ) -> jax.Array:
    """`STATS` [len(STATS)] of projection `eq` on input x, weight w, output gradient dy."""
    x, w, dy = (a.astype(jnp.float32) for a in (x, w, dy))
    y32, vjp32 = jax.vjp(lambda x, w: _einsum(eq, x, w, jnp.float32), x, w)
    dw32 = vjp32(dy)[1]
    # "delayed" scales from a history of such amaxes; the probe has one step: current scaling.
    recipe = "current" if recipe == "delayed" else recipe
    y8, _, dw8 = fp8.emulate_einsum(eq, x, w, dy, recipe=recipe, out_dtype=jnp.float32)
    yo, vjpo = jax.vjp(lambda x, w: _einsum(eq, x, w, other), x, w)
    dwo = vjpo(dy.astype(other).astype(jnp.float32))[1]
    rms_x = _rms(x)
    return jnp.stack([
        _rel(y8, y32), _rel(yo, y32), _rel(dw8, dw32), _rel(dwo, dw32),
        underflow(x, fp8.E4M3), underflow(dy, fp8.E5M2),
        jnp.mean((jnp.abs(x) > OUTLIER_RMS * rms_x).astype(jnp.float32)),
        jnp.max(jnp.abs(x)) / jnp.maximum(rms_x, 1e-30),
        jnp.max(jnp.abs(dy)) / jnp.maximum(_rms(dy), 1e-30)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def probe_einsum(eq: str, recipe: str, other: Any, x: jax.Array, w: jax.Array,
                 token: jax.Array) -> jax.Array:
    """`jnp.einsum(eq, x, w)` in float32; the gradient of `token` ([len(STATS)] zeros) is
    `measure`'s STATS for the output gradient the backward pass brings."""
    del recipe, other, token
    return _einsum(eq, x, w, jnp.float32)


def _fwd(eq, recipe, other, x, w, token):
    del token
    return _einsum(eq, x, w, jnp.float32), (x, w)


def _bwd(eq, recipe, other, res, dy):
    x, w = res
    _, vjp32 = jax.vjp(lambda x, w: _einsum(eq, x, w, jnp.float32), x, w)
    dx, dw = vjp32(dy.astype(jnp.float32))
    return (dx.astype(x.dtype), dw.astype(w.dtype), measure(eq, x, w, dy, recipe, other))


probe_einsum.defvjp(_fwd, _bwd)
