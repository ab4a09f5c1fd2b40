"""Orbax checkpoints: save, restore (onto any mesh), and start a run from another run's weights.

The one idea: a checkpoint is a step directory managed by `ocp.CheckpointManager` with separate
items, so a reader can take only what it needs:
  params     the float32 master weights (StandardSave pytree)
  train      optimizer state, loss scale, fp8 scaling state (everything else that is trained)
  errors     1-bit Adam only: the per-worker error buffers. Their layout (mesh, bucket shapes) is
             in `meta`, so a run on another data-parallel size sees the mismatch before reading
             them and starts them from zero instead (DeepSpeed resets them on every load).
  data       the data iterator position (JSON)
  meta       the model config and step (JSON), checked before any array is read
`dsjax.convert` writes `params` + `meta` only; such a checkpoint starts a run
(`checkpoint.init_from`) but is not resumed as one.
Restoring takes abstract arrays carrying the *target* shardings, so a checkpoint written on one
mesh restores onto another.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dsjax.config import ModelConfig

ITEMS = ("params", "train", "errors", "data", "meta")


class CheckpointError(ValueError):
    """A checkpoint is missing, incompatible or corrupt; the message names it."""


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@jax.jit
def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def model_meta(model: ModelConfig, step: int, errors_layout: dict | None = None
               ) -> dict[str, Any]:
    meta = {"format": "dsjax-checkpoint-v1", "model": dataclasses.asdict(model), "step": int(step)}
    if errors_layout is not None:
        meta["errors_layout"] = errors_layout
    return meta


def check_model(meta: dict[str, Any], model: ModelConfig, where: str) -> None:
    """Fails with one message naming every model field that differs from the checkpoint's."""
    saved = meta.get("model", {})
    want = dataclasses.asdict(model)
    shape_keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "mlp_dim", "vocab_size",
                  "head_dim")
    diffs = [f"model.{k}: checkpoint has {saved.get(k)!r}, config has {want[k]!r}"
             for k in shape_keys if saved.get(k) != want[k]]
    # Not shapes, but restoring under another value silently computes a different model.
    diffs += [f"model.{k}: checkpoint has {saved.get(k)!r}, config has {want[k]!r}"
              for k in ("rope_theta", "norm_eps")
              if saved.get(k) is None or not math.isclose(saved[k], want[k], rel_tol=1e-9)]
    if diffs:
        raise CheckpointError(f"{where} was written for a different model shape: " + "; ".join(diffs))


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with dsjax's items."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, train: Any, data_state: dict | None,
             model: ModelConfig, errors: Any = None, errors_layout: dict | None = None) -> None:
        """Saves (asynchronously when enabled); refuses non-finite values. `errors`: 1-bit
        Adam's error buffers, restored only onto the same `errors_layout` (JSON-able)."""
        if not all(bool(all_finite(tree)) for tree in (params, train, errors or {})):
            raise CheckpointError(f"refusing to save step {step}: parameters or optimizer state "
                                  "contain NaN/Inf")
        items = dict(params=ocp.args.StandardSave(params),
                     train=ocp.args.StandardSave(train),
                     meta=ocp.args.JsonSave(model_meta(model, step, errors_layout)))
        if errors is not None:
            items["errors"] = ocp.args.StandardSave(errors)
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def read_meta(self, step: int) -> dict[str, Any]:
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def restore(self, step: int, params: Any, train: Any, model: ModelConfig
                ) -> tuple[Any, Any, dict | None]:
        """Restores onto the shardings of the given (abstract or concrete) params/train state."""
        where = f"checkpoint step {step} in {self.directory}"
        check_model(self.read_meta(step), model, where)
        step_dir = os.path.join(self.directory, str(step))
        has_data = os.path.isdir(os.path.join(step_dir, "data"))
        items = dict(params=ocp.args.StandardRestore(_abstract(params)),
                     train=ocp.args.StandardRestore(_abstract(train)))
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        if not os.path.isdir(os.path.join(step_dir, "train")):
            raise CheckpointError(f"{where} has no optimizer state (a converted weights-only "
                                  "checkpoint?); start from it with --config.checkpoint.init_from")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # Orbax raises many types; name the checkpoint and the cause.
            raise CheckpointError(f"could not restore {where}: {type(e).__name__}: {e}") from e
        return restored["params"], restored["train"], restored.get("data") if has_data else None

    def restore_errors(self, step: int, errors: Any, layout: dict
                       ) -> tuple[Any | None, str | None]:
        """1-bit Adam's error buffers of `step` onto the shardings of `errors`, if they were
        written with the same `layout`; else (None, why not) and nothing is read."""
        where = f"checkpoint step {step}"
        saved = self.read_meta(step).get("errors_layout")
        if saved is None or not os.path.isdir(os.path.join(self.directory, str(step), "errors")):
            return None, f"{where} has no 1-bit Adam error buffers"
        if saved != layout:
            old, new = saved.get("mesh", {}), layout.get("mesh", {})
            if old.get("data") != new.get("data"):
                why = f"mesh.data {old.get('data')}, this run has mesh.data {new.get('data')}"
            else:
                why = (f"mesh {old} and error buffers {saved.get('shapes')}, this run has mesh "
                       f"{new} and {layout.get('shapes')} (optim.bucket_mb or the mesh changed)")
            return None, f"{where} was written with {why}"
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                errors=ocp.args.StandardRestore(_abstract(errors))))
        except Exception as e:  # Orbax raises many types; name the checkpoint and the cause.
            raise CheckpointError(f"could not restore the error buffers of {where} in "
                                  f"{self.directory}: {type(e).__name__}: {e}") from e
        return restored["errors"], None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(directory: str, params: Any, model: ModelConfig) -> Any:
    """Loads only the weights of the latest step under `directory` (a run's `checkpoints/` dir,
    a run workdir, or a converted checkpoint), onto the shardings of `params`."""
    for candidate in (directory, os.path.join(directory, "checkpoints")):
        if os.path.isdir(candidate) and ocp.CheckpointManager(candidate).latest_step() is not None:
            directory = candidate
            break
    else:
        raise CheckpointError(f"no checkpoint found in {directory!r}")
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step()
    where = f"checkpoint step {step} in {directory}"
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    check_model(meta, model, where)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params))))
    except Exception as e:
        raise CheckpointError(f"could not restore params of {where}: {type(e).__name__}: {e}") from e
    return restored["params"]


def save_params(directory: str, params: Any, model: ModelConfig, step: int = 0) -> None:
    """Writes a weights-only checkpoint (what `dsjax.convert` produces)."""
    manager = ocp.CheckpointManager(os.path.abspath(directory),
                                    options=ocp.CheckpointManagerOptions(create=True))
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                               meta=ocp.args.JsonSave(model_meta(model, step))),
                 force=True)
    manager.wait_until_finished()
    manager.close()
