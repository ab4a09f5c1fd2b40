"""Dynamic loss scaling for float16 compute, and the skip-the-step policy for every compute dtype.

The one idea: float16 has 5 exponent bits, so small gradients underflow to zero unless the loss
is multiplied by a large scale before differentiation (Micikevicius et al. 2018, "Mixed precision
training"). The right scale drifts, so it adapts: start at 2**15, halve it and skip the step when
a gradient overflows to inf/NaN, double it after `growth_interval` (2000) finite steps in a row.
bfloat16 and fp8 compute keep float32's exponent range (fp8 scales per tensor, see dsjax.fp8) and
need no loss scale, but still skip a step whose gradients are non-finite; `skip_policy()` is the
same state with the scale pinned to 1, so one train step serves every dtype.

Everything is a pure function of a small pytree (`LossScale`), usable inside a jitted step:

    scaled_loss_fn = lambda p: loss_scale.scale_loss(ls, loss_fn(p))
    grads = loss_scale.unscale_grads(ls, jax.grad(scaled_loss_fn)(params))
    ok = loss_scale.should_apply(grads)          # before clipping: a clipped inf is NaN anyway
    params, opt_state = loss_scale.select(ok, (new_params, new_opt_state), (params, opt_state))
    ls = loss_scale.update(ls, ok)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LossScale:
    scale: jax.Array  # f32 scalar: the loss multiplier (a power of two, so unscaling is exact)
    good_steps: jax.Array  # i32: finite steps since the scale last changed
    skipped_steps: jax.Array  # i32: steps skipped for non-finite gradients, ever
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    dynamic: bool = struct.field(pytree_node=False, default=True)
    min_scale: float = struct.field(pytree_node=False, default=1.0)
    max_scale: float = struct.field(pytree_node=False, default=2.0 ** 24)


def dynamic_scale(initial_scale: float = 2.0 ** 15, growth_interval: int = 2000,
                  min_scale: float = 1.0, max_scale: float = 2.0 ** 24) -> LossScale:
    """The float16 recipe: adaptive scale, halve + skip on overflow, double after good steps."""
    return LossScale(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32),
                     jnp.zeros((), jnp.int32), growth_interval, True, min_scale, max_scale)


def skip_policy() -> LossScale:
    """bfloat16 / fp8 / float32: scale fixed at 1; non-finite steps are skipped and counted."""
    return LossScale(jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32),
                     jnp.zeros((), jnp.int32), dynamic=False)


def for_compute_dtype(compute_dtype: str, growth_interval: int = 2000) -> LossScale:
    """`dynamic_scale` for "float16", `skip_policy` for everything else."""
    return dynamic_scale(growth_interval=growth_interval) if compute_dtype == "float16" \
        else skip_policy()


def scale_loss(state: LossScale, loss: jax.Array) -> jax.Array:
    return loss * state.scale.astype(loss.dtype)


def unscale_grads(state: LossScale, grads: Any) -> Any:
    """grads / scale, leaf by leaf in each leaf's dtype (exact: the scale is a power of two)."""
    inv = 1.0 / state.scale
    return jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)


def should_apply(grads: Any) -> jax.Array:
    """True iff every gradient leaf is finite: this step's update may be applied."""
    leaves = jax.tree.leaves(grads)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves])) if leaves \
        else jnp.asarray(True)


def select(apply: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `apply`, else `old`, leaf by leaf (keeps params/opt state on a skipped step)."""
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def update(state: LossScale, grads_finite: jax.Array) -> LossScale:
    """The state after a step: count a skip, and (if dynamic) halve on overflow or double after
    `growth_interval` finite steps in a row."""
    good = jnp.where(grads_finite, state.good_steps + 1, 0)
    skipped = state.skipped_steps + jnp.where(grads_finite, 0, 1).astype(jnp.int32)
    if not state.dynamic:
        return state.replace(good_steps=good, skipped_steps=skipped)
    grow = grads_finite & (good >= state.growth_interval)
    scale = jnp.where(grow, jnp.minimum(state.scale * 2.0, state.max_scale), state.scale)
    scale = jnp.where(grads_finite, scale, jnp.maximum(state.scale * 0.5, state.min_scale))
    return state.replace(scale=scale, good_steps=jnp.where(grow, 0, good), skipped_steps=skipped)
