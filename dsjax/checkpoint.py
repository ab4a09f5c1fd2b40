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

Crash safety (docs/reliability.md): Orbax writes a step into `N.orbax-checkpoint-tmp` and renames it
to `N` when complete, so a process killed mid-save leaves only a temporary directory, which is
reported and removed. Once a step is complete, dsjax *seals* it: `dsjax_manifest.json` records the
size and CRC-32 of every file. Before a sealed step is restored its files are checked against the
manifest, so a truncated or altered file is reported by step and path instead of restoring wrong
values (Orbax itself notices truncation but not altered bytes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dsjax.config import ModelConfig
from dsjax.errors import CheckpointCorrupt, CheckpointError

ITEMS = ("params", "train", "errors", "data", "meta")
MANIFEST = "dsjax_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step that is still being written


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names if n != MANIFEST]
    return sorted(out)


def seal(step_dir: str) -> None:
    """Writes the manifest (size and CRC-32 of every file) of a complete step, atomically."""
    files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc32(os.path.join(step_dir, rel))]
             for rel in _files(step_dir)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": "crc32-v1", "files": files}, f)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify(step_dir: str) -> str | None:
    """None if the step matches its manifest (or has none: sealed steps only are checked), else
    what is wrong, naming the file."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its manifest {path} is unreadable ({e})"
    for rel, (size, crc) in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"{full} is missing"
        if os.path.getsize(full) != size:
            return f"{full} has {os.path.getsize(full)} bytes, {size} were written"
        if _crc32(full) != crc:
            return f"{full} does not match the checksum written when it was saved"
    return None


def incomplete_entries(directory: str) -> list[str]:
    """Step directories a killed save left behind (Orbax ignores them when listing steps)."""
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if TMP_SUFFIX in n)


def find_steps(directory: str) -> tuple[str, ocp.CheckpointManager]:
    """(the directory holding the steps, its manager) for a converted checkpoint, a run workdir
    or its `checkpoints/` dir: the first of `directory`, `directory/checkpoints` with a step."""
    for candidate in (directory, os.path.join(directory, "checkpoints")):
        if os.path.isdir(candidate):
            manager = ocp.CheckpointManager(os.path.abspath(candidate))
            if manager.latest_step() is not None:
                return candidate, manager
    raise CheckpointError(f"no checkpoint found in {directory!r}")


def read_meta(manager: ocp.CheckpointManager, step: int
              ) -> tuple[dict[str, Any] | None, str | None]:
    """(the `meta` item of `step`, None), or (None, why it is unreadable: "Type: message"), for
    each caller to report in its own terms (corrupt step, fallback, conversion error)."""
    try:
        restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  # Orbax raises many types
        return None, f"{type(e).__name__}: {e}"
    return restored["meta"], None


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
    # MLA/MoE/MTP shape fields; checkpoints written before they existed hold the defaults (off).
    defaults = dataclasses.asdict(ModelConfig(1, 1, 1, 1, 1, 1))
    diffs += [f"model.{k}: checkpoint has {saved.get(k, defaults[k])!r}, config has {want[k]!r}"
              for k in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                        "moe_intermediate_size", "first_k_dense_replace", "scoring",
                        "num_mtp_layers")
              if saved.get(k, defaults[k]) != want[k]]
    # Not shapes, but restoring under another value silently computes a different model.
    diffs += [f"model.{k}: checkpoint has {saved.get(k)!r}, config has {want[k]!r}"
              for k in ("rope_theta", "norm_eps")
              if saved.get(k) is None or not math.isclose(saved[k], want[k], rel_tol=1e-9)]
    if diffs:
        raise CheckpointError(f"{where} was written for a different model shape: " + "; ".join(diffs))


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with dsjax's items, sealing and verification.

    `log`: where warnings go (incomplete saves found, corrupt steps set aside)."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 log: Callable[[str], None] = print):
        self.directory = os.path.abspath(directory)
        self.log = log
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
                     meta=ocp.args.JsonSave(model_meta(model, step, errors_layout)))
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

    def read_meta(self, step: int) -> dict[str, Any]:
        meta, why = read_meta(self.manager, step)
        if why is not None:
            raise CheckpointCorrupt(f"checkpoint step {step} in {self.directory}: its metadata "
                                    f"is unreadable ({why})")
        return meta

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
            raise CheckpointCorrupt(f"could not restore {where}: {type(e).__name__}: {e}") from e
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
            meta, why = read_meta(manager, step)
            if why is not None:
                problem = f"its metadata is unreadable ({why})"
        if problem is None:
            check_model(meta, model, where)
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
