"""The training state <-> checkpoint items: what is saved besides the params, 1-bit Adam's error
buffers (their own item, restored only onto the layout that wrote them), and resuming a run from
its newest intact checkpoint."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dsjax import checkpoint as ckpt
from dsjax import sharding
from dsjax.optim import OneBitAdamState
from dsjax.train.step import TrainState


def train_extras(state: TrainState) -> dict[str, Any]:
    """Everything besides params that defines the run's future, as checkpointed. 1-bit Adam's
    error buffers are left out: they are checkpointed apart (see `onebit_errors`)."""
    opt_state = state.opt_state
    if isinstance(opt_state, OneBitAdamState):
        opt_state = opt_state._replace(worker_error={}, server_error={})
    return {"opt_state": opt_state, "loss_scale": state.loss_scale, "fp8_meta": state.fp8_meta}


def onebit_errors(state: TrainState) -> dict[str, Any] | None:
    """1-bit Adam's per-worker error buffers (None for AdamW). They only mean something on the
    data-parallel layout that wrote them, so they are their own checkpoint item."""
    if not isinstance(state.opt_state, OneBitAdamState):
        return None
    return {"worker_error": state.opt_state.worker_error,
            "server_error": state.opt_state.server_error}


def errors_layout(state: TrainState, mesh: Mesh) -> dict[str, Any]:
    """What must match for saved error buffers to be restored: the mesh, the bucket shapes and
    what was compressed (optim.compress: the errors of m and of m / sqrt(v) differ in units)."""
    return {"mesh": sharding.describe(mesh),
            "shapes": [list(x.shape) for x in jax.tree.leaves(onebit_errors(state))],
            "compress": state.tx.compress}


def with_restored(state: TrainState, extras: dict[str, Any], errors: dict | None) -> TrainState:
    """`state` with the restored `train_extras` and (1-bit Adam) error buffers; errors None:
    keep `state`'s (freshly initialised, zero) buffers."""
    opt_state = extras["opt_state"]
    if isinstance(opt_state, OneBitAdamState):
        errors = onebit_errors(state) if errors is None else errors
        opt_state = opt_state._replace(**errors)
    return state.replace(**{**extras, "opt_state": opt_state})


def save(checkpointer: ckpt.Checkpointer, step: int, state: TrainState, data_state: Any,
         mesh: Mesh, model_cfg: Any) -> None:
    """Checkpoint `state` at `step` with the data iterator's (and batch controller's) state."""
    errors = onebit_errors(state)
    checkpointer.save(step, state.params, train_extras(state), data_state, model_cfg,
                      errors=errors,
                      errors_layout=None if errors is None else errors_layout(state, mesh))


def resume(checkpointer: ckpt.Checkpointer, state: TrainState, mesh: Mesh, model_cfg: Any,
           allow_fallback: bool, log: Callable[[str], None]
           ) -> tuple[TrainState, int | None, Any]:
    """(state, step, data state) from the newest intact checkpoint; (state, None, None) if there
    is none. A damaged newest checkpoint stops the run (CheckpointCorrupt) unless
    `allow_fallback`, which moves it aside and tries the previous one."""
    while True:
        start = checkpointer.usable_step(allow_fallback)
        if start is None:
            return state, None, None
        try:
            params, extras, data_state = checkpointer.restore(start, state.params,
                                                              train_extras(state), model_cfg)
            break
        except ckpt.CheckpointCorrupt as e:
            checkpointer.reject(start, str(e), allow_fallback)
    errors = None
    if onebit_errors(state) is not None:
        errors, why = checkpointer.restore_errors(start, onebit_errors(state),
                                                  errors_layout(state, mesh))
        if errors is None:
            # DeepSpeed resets them on every load and reports no loss of convergence.
            log(f"warning: {why}; 1-bit Adam's error buffers restart from zero")
    state = with_restored(state, extras, errors)
    state = state.replace(step=jnp.asarray(start, jnp.int32), params=params)
    log(f"resumed from step {start} ({checkpointer.directory})")
    return state, start, data_state
