"""Orbax checkpoints: save, restore (onto any mesh), and start a run from another run's weights.

The one idea: a checkpoint is a step directory managed by `ocp.CheckpointManager` with separate
items, so a reader can take only what it needs:
  params     the float32 master weights (StandardSave pytree)
  train      optimizer state, loss scale, fp8 scaling state (everything else that is trained)
  errors     1-bit Adam only: the per-worker error buffers. Their layout (mesh, bucket shapes) is
             in `meta`, so a run on another data-parallel size sees the mismatch before reading
             them and starts them from zero instead (DeepSpeed resets them on every load).
  data       the data iterator position (JSON)
  meta       the model config, step and `train_layout` (JSON), checked before any array is read
`dsjax.convert` writes `params` + `meta` only; such a checkpoint starts a run
(`checkpoint.init_from`) but is not resumed as one.
Restoring takes abstract arrays carrying the *target* shardings, so a checkpoint written on one
mesh restores onto another. The saved trees are compared with the target first (`meta`): a
difference is a config change, never corruption, and `restore(..., sources=...)` reads only the
`train` leaves a continuation keeps. Sealing and verification: `seal`.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from dsjax.checkpoint.meta import (check_model, find_steps, item_leaves, key_path, leaves_by_path,
                                   mismatch, model_meta, try_read_meta, tree_difference)
from dsjax.checkpoint.seal import incomplete_entries, seal, verify
from dsjax.config import ModelConfig
from dsjax.errors import CheckpointCorrupt, CheckpointError
from dsjax.sharding import DATA

ITEMS = ("params", "train", "errors", "data", "meta")


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@jax.jit
def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with dsjax's items, sealing and verification.

    `log`: where warnings go (incomplete saves found, corrupt steps set aside). `train_layout`:
    this run's settings that decide the `train` item's tree (JSON), written into every step's
    meta so a later run can name what changed."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 log: Callable[[str], None] = print, train_layout: dict | None = None):
        self.directory = os.path.abspath(directory)
        self.log = log
        self.train_layout = train_layout
        for path in incomplete_entries(self.directory):
            log(f"warning: ignoring {path}: a checkpoint save that never finished (the process "
                "was killed while writing it); it is removed, earlier checkpoints are intact")
        try:
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                   enable_async_checkpointing=async_save,
                                                   cleanup_tmp_directories=True)
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.directory} is not usable: {e}"
                                  ) from e
        self._unsealed: int | None = None  # the step saved last, sealed once its save completes
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _finish_pending(self, background: bool) -> None:
        """Waits for the last save (its failure is a CheckpointError naming it), then seals it."""
        step = self._unsealed
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # Orbax re-raises the writer thread's error; name step and cause
            raise CheckpointError(f"could not write checkpoint step {step} to {self.directory}: "
                                  f"{type(e).__name__}: {e} (disk full or not writable?). "
                                  "Earlier checkpoints are intact.") from e
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        if self._seal_error is not None:
            raise CheckpointError(f"could not seal a checkpoint in {self.directory}: "
                                  f"{self._seal_error}")
        self._unsealed = None
        if step is None or jax.process_index() != 0 or not os.path.isdir(self._step_dir(step)):
            return

        def work():
            try:
                seal(self._step_dir(step))
            except OSError as e:
                self._seal_error = e
        if background:  # CRC of a 7B model's state is ~a minute of reading: overlap it
            self._sealer = threading.Thread(target=work, name=f"seal-{step}", daemon=True)
            self._sealer.start()
        else:
            work()

    def usable_step(self, allow_fallback: bool = False) -> int | None:
        """The newest complete step whose files match its manifest. A damaged newest step is an
        error unless `allow_fallback`, which moves it aside (not deleted) and tries the previous."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = verify(self._step_dir(step))
            if problem is None:
                return step
            self.reject(step, problem, allow_fallback)
        return None

    def reject(self, step: int, problem: str, allow_fallback: bool) -> None:
        """Handles a damaged step: raises CheckpointCorrupt, or with `allow_fallback` moves it to
        `<directory>.corrupt/` so the run continues from the previous step."""
        older = [s for s in self.manager.all_steps() if s < step]
        if not allow_fallback:
            hint = (f"pass --allow_fallback to resume from step {max(older)}, the previous "
                    "complete checkpoint" if older else "no earlier checkpoint exists")
            raise CheckpointCorrupt(
                f"checkpoint step {step} in {self.directory} is corrupt: {problem}. Stopping so "
                f"nothing is trained from a wrong state; {hint}, or restore the file from a "
                "backup.")
        aside = os.path.join(self.directory + ".corrupt", f"{step}-{int(time.time())}")
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        shutil.move(self._step_dir(step), aside)
        self.manager.reload()
        self.log(f"warning: checkpoint step {step} is corrupt ({problem}); moved it to {aside} "
                 f"and falling back to {'step ' + str(max(older)) if older else 'a fresh start'}")

    def save(self, step: int, params: Any, train: Any, data_state: dict | None,
             model: ModelConfig, errors: Any = None, errors_layout: dict | None = None) -> None:
        """Saves (asynchronously when enabled); refuses non-finite values. `errors`: 1-bit
        Adam's error buffers, restored only onto the same `errors_layout` (JSON-able)."""
        if not all(bool(all_finite(tree)) for tree in (params, train, errors or {})):
            raise CheckpointError(f"refusing to save step {step}: parameters or optimizer state "
                                  "contain NaN/Inf")
        items = dict(params=ocp.args.StandardSave(params),
                     train=ocp.args.StandardSave(train),
                     meta=ocp.args.JsonSave(model_meta(model, step, errors_layout,
                                                       self.train_layout)))
        if errors is not None:
            items["errors"] = ocp.args.StandardSave(errors)
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        self._finish_pending(background=True)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # synchronous part of the save (directory creation, first writes)
            raise CheckpointError(f"could not write checkpoint step {step} to {self.directory}: "
                                  f"{type(e).__name__}: {e} (disk full or not writable?). "
                                  "Earlier checkpoints are intact.") from e
        self._unsealed = step

    def step_meta(self, step: int) -> dict[str, Any]:
        meta, why = try_read_meta(self.manager, step)
        if why is not None:
            raise CheckpointCorrupt(f"checkpoint step {step} in {self.directory}: its metadata "
                                    f"is unreadable ({why})")
        return meta

    def saved_leaves(self, step: int, item: str) -> dict[tuple[str, ...], Any]:
        """The leaves of `item` ("params", "train") of `step` by path, with shape and dtype, from
        its metadata: no array is read. Unreadable metadata is corruption."""
        where = f"checkpoint step {step} in {self.directory}"
        if item == "train" and not os.path.isdir(os.path.join(self._step_dir(step), item)):
            raise CheckpointError(f"{where} has no optimizer state (a converted weights-only "
                                  "checkpoint?); start from it with --config.checkpoint.init_from")
        leaves, why = item_leaves(self._step_dir(step), item)
        if why is not None:
            raise CheckpointCorrupt(f"{where}: the metadata of its {item} item is unreadable "
                                    f"({why})")
        return leaves

    def restore(self, step: int, params: Any, train: Any, model: ModelConfig,
                sources: dict[tuple[str, ...], tuple[str, ...]] | None = None
                ) -> tuple[Any, Any, dict | None]:
        """Restores onto the shardings of the given (abstract or concrete) params/train state.

        `sources`: {train leaf path: checkpoint leaf path} of the `train` leaves to read (same
        shape); every other leaf keeps `train`'s value, which must then be concrete (freshly
        initialised). None: every leaf from its own path, which must match the checkpoint's
        tree. Any mismatch is a CheckpointError naming it (a config change), found before any
        array is read; only a file that then cannot be read is corruption."""
        where = f"checkpoint step {step} in {self.directory}"
        check_model(self.step_meta(step), model, where)
        saved, here = self.saved_leaves(step, "train"), leaves_by_path(train)
        problem = tree_difference(self.saved_leaves(step, "params"), leaves_by_path(params))
        if problem is None and sources is None:
            problem = tree_difference(saved, here)
            sources = {p: p for p in here}
        if problem is None:
            problem = next((f"{'/'.join(p)} has no counterpart of its shape in the checkpoint"
                            for p, q in sources.items()
                            if q not in saved or tuple(saved[q].shape) != tuple(here[p].shape)),
                           None)
        if problem is not None:
            raise mismatch(where, self.directory, problem)
        wanted = {q: here[p] for p, q in sources.items()}  # checkpoint path -> target leaf

        def target(path, _):  # the saved tree, with the target's sharding where it is read
            leaf = wanted.get(key_path(path))
            return (ocp.PLACEHOLDER if leaf is None else
                    jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding))

        step_dir = self._step_dir(step)
        has_data = os.path.isdir(os.path.join(step_dir, "data"))
        items = dict(params=ocp.args.StandardRestore(_abstract(params)))
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        handler = ocp.PyTreeCheckpointHandler()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            item = jax.tree_util.tree_map_with_path(target, handler.metadata(
                epath.Path(os.path.join(step_dir, "train"))).tree)
            read = leaves_by_path(handler.restore(
                epath.Path(os.path.join(step_dir, "train")), args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item))))
        except Exception as e:  # the trees match: a file that cannot be read
            raise CheckpointCorrupt(f"could not restore {where}: {type(e).__name__}: {e}") from e
        finally:
            handler.close()
        train = jax.tree_util.tree_map_with_path(
            lambda p, x: read[sources[key_path(p)]] if key_path(p) in sources else x, train)
        return restored["params"], train, restored.get("data") if has_data else None

    def restore_errors(self, step: int, errors: Any, layout: dict
                       ) -> tuple[Any | None, str | None]:
        """1-bit Adam's error buffers of `step` onto the shardings of `errors`, if they were
        written with the same `layout`; else (None, why not) and nothing is read."""
        where = f"checkpoint step {step}"
        saved = self.step_meta(step).get("errors_layout")
        if saved is None or not os.path.isdir(os.path.join(self.directory, str(step), "errors")):
            return None, f"{where} has no 1-bit Adam error buffers"
        if saved != layout:
            old, new = saved.get("mesh", {}), layout.get("mesh", {})
            if old.get(DATA) != new.get(DATA):
                why = f"mesh.data {old.get(DATA)}, this run has mesh.data {new.get(DATA)}"
            elif saved.get("compress", "momentum") != layout.get("compress"):
                why = (f"optim.compress={saved.get('compress', 'momentum')!r}, this run has "
                       f"{layout.get('compress')!r}")
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
        """Blocks until the last save is complete and sealed."""
        self._finish_pending(background=False)

    def close(self) -> None:
        try:
            self._finish_pending(background=False)
        finally:
            self.manager.close()


def restore_params(directory: str, params: Any, model: ModelConfig, allow_fallback: bool = False,
                   log: Callable[[str], None] = print) -> Any:
    """Loads only the weights of the latest step under `directory` (a run's `checkpoints/` dir,
    a run workdir, or a converted checkpoint), onto the shardings of `params`. A damaged step
    is an error, or with `allow_fallback` skipped (left in place) for the previous one."""
    directory, manager = find_steps(directory)
    steps = sorted(manager.all_steps(), reverse=True)
    for i, step in enumerate(steps):
        where = f"checkpoint step {step} in {directory}"
        problem = verify(os.path.join(directory, str(step)))
        if problem is None:
            meta, why = try_read_meta(manager, step)
            if why is not None:
                problem = f"its metadata is unreadable ({why})"
        if problem is None:
            check_model(meta, model, where)
            saved, why = item_leaves(os.path.join(directory, str(step)), "params")
            problem = None if why is None else f"its params metadata is unreadable ({why})"
        if problem is None:
            diff = tree_difference(saved, leaves_by_path(params))
            if diff is not None:
                raise CheckpointError(f"{where} does not match this model's parameters: {diff}")
            try:
                return manager.restore(step, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(_abstract(params))))["params"]
            except Exception as e:  # pylint: disable=broad-except
                problem = f"{type(e).__name__}: {e}"
        older = steps[i + 1:]
        if not allow_fallback:
            hint = (f"pass --allow_fallback to use step {older[0]}" if older else
                    "no earlier checkpoint exists")
            raise CheckpointCorrupt(f"{where} is corrupt: {problem}; {hint}")
        log(f"warning: {where} is corrupt ({problem}); trying the previous one")
    raise CheckpointCorrupt(f"no intact checkpoint in {directory}")


def save_params(directory: str, params: Any, model: ModelConfig, step: int = 0) -> None:
    """Writes a weights-only checkpoint (what `dsjax.convert` produces)."""
    manager = ocp.CheckpointManager(os.path.abspath(directory),
                                    options=ocp.CheckpointManagerOptions(create=True))
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                               meta=ocp.args.JsonSave(model_meta(model, step))),
                 force=True)
    manager.wait_until_finished()
    manager.close()
    if jax.process_index() == 0:
        seal(os.path.join(os.path.abspath(directory), str(step)))
