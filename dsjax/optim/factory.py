"""AdamW with linear warmup + cosine decay, global-norm clipping and weight decay off the norms;
or 1-bit Adam with the same schedule and weight-decay mask.

The gradient norm used for clipping is the norm of the full (global) gradient: under GSPMD the
gradients are already reduced over `data`, so `optax.clip_by_global_norm` sees the true norm.
1-bit Adam is not an optax transform (it reduces over `data` itself, inside `jax.shard_map`), so
its train step (`dsjax.train.onebit_step`) clips; see docs/onebit.md.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from dsjax import sharding
from dsjax.config import OptimConfig
from dsjax.config.sections import TRAINABLE_GROUPS
from dsjax.optim.groups import only_trainable
from dsjax.optim.onebit import OneBitAdam, onebit_adam


def make_schedule(cfg: OptimConfig, total_steps: int) -> Callable[[Any], Any]:
    """0 -> lr linearly over `warmup_steps`, then cosine down to lr * min_lr_ratio at the end."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
    """True for weights that get weight decay: everything except norm scales."""
    def keep(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any("norm" in n for n in names)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig, total_steps: int,
                   trainable: tuple[str, ...] = TRAINABLE_GROUPS
                   ) -> tuple[optax.GradientTransformation | OneBitAdam, Callable[[Any], Any]]:
    """(optimizer, lr schedule of the number of steps taken) for `cfg.name`. `trainable`: the
    parameter groups that learn (train.trainable; dsjax.optim.groups): the others get zero
    updates and no optimizer state (AdamW; 1-bit Adam trains every group)."""
    schedule = make_schedule(cfg, total_steps)
    if cfg.name == "onebit_adam":
        # Hierarchical: the axes of `sharding.host_view`, 1-bit across hosts and exact inside
        # one; the train step runs the optimizer on that view of the mesh (docs/multihost.md).
        axes = ((sharding.DATA_HOSTS, sharding.DATA_LOCAL) if cfg.hierarchical
                else (sharding.DATA, None))
        return onebit_adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, weight_decay_mask=decay_mask,
                           freeze_step=cfg.freeze_step, bias_correction=cfg.bias_correction,
                           bucket_bytes=int(cfg.bucket_mb * 2**20), axis_name=axes[0],
                           fast_axis=axes[1], error_feedback=cfg.error_feedback,
                           compress=cfg.compress,
                           refresh_every=cfg.refresh_every,
                           refresh_catchup=cfg.refresh_catchup,
                           update_bound=cfg.update_bound), schedule
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return only_trainable(optax.chain(*parts), trainable), schedule
