"""Gradient accumulation inside the compiled step: `lax.scan` over micro-batches, the same
update as one big batch."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from dsjax import fp8


def _no_observation(tree: Any) -> Any:
    """Zeros shaped like a gradient tree, except fp8 amax observations: -inf ("unused"), the
    identity of the maximum that combines them (dsjax.fp8.combine)."""
    def unused(m):
        return m.replace(amax=jnp.full(m.amax.shape, -jnp.inf, m.amax.dtype))

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    return jax.tree.map(lambda n: unused(n) if isinstance(n, fp8.Fp8Meta) else n, zeros,
                        is_leaf=lambda n: isinstance(n, fp8.Fp8Meta))


def accumulate(grad_fn: Callable[[dict], tuple[Any, Any, Any]], batch: dict[str, jax.Array],
               vary: Callable[[Any], Any] = lambda x: x) -> tuple[Any, Any, Any]:
    """`grad_fn(micro_batch) -> (sums, grads, fp8 observations)` over every micro-batch of
    `batch`, with `lax.scan` over its leading axis ([k, b, S] arrays; a [b, S] batch is one
    micro-batch and calls `grad_fn` once). `sums` and `grads` are added, the fp8 amax
    observations max-combined (dsjax.fp8.combine), so with `grad_fn` differentiating each
    micro-batch's share of the *whole* batch's mean loss, the result is the big batch's gradient.
    `vary`: applied to the zero carry; inside a typed `shard_map` it must make it varying over the
    axes `grad_fn`'s outputs vary over (scan needs equal carry types)."""
    if batch["inputs"].ndim == 2:
        return grad_fn(batch)
    first = jax.tree.map(lambda x: x[0], batch)
    init = vary(_no_observation(jax.eval_shape(grad_fn, first)))

    def body(carry, micro):
        sums, grads, seen = grad_fn(micro)
        acc_sums, acc_grads, acc_seen = carry
        return (jax.tree.map(jnp.add, acc_sums, sums), jax.tree.map(jnp.add, acc_grads, grads),
                fp8.combine(acc_seen, seen)), None

    out, _ = lax.scan(body, init, batch)
    return out


def scale_updates(updates: Any, scale: float) -> Any:
    """Optimizer updates times the lr multiplier (Adam's update is -lr x direction, weight decay
    included, so this is the same as scaling the learning rate). No-op at 1."""
    if scale == 1.0:
        return updates
    return jax.tree.map(lambda u: u * jnp.asarray(scale, u.dtype), updates)
