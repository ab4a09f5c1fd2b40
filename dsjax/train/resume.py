"""The training state <-> checkpoint items: what is saved besides the params, 1-bit Adam's error
buffers (their own item, restored only onto the layout that wrote them), and resuming a run from
its newest intact checkpoint, also under a changed config where that has a meaning.

The one idea: a resume compares the checkpoint's `train` tree (paths and shapes, from metadata)
with this run's, part by part. A part that matches restores; the parts a supported config change
reshapes (fp8 scaling state for fp8.recipe / compute dtype, the optimizer state for optim.name)
start fresh, with what has an exact counterpart carried over (Adam's moments by parameter, step
counters) and one warning each; any other difference stops the run before anything is read or
changed. Continuations and their warnings: docs/reliability.md.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dsjax import checkpoint as ckpt
from dsjax import sharding
from dsjax.config import Config, ConfigError
from dsjax.optim import OneBitAdamState
from dsjax.train.step import TrainState

Path = tuple[str, ...]
# train_layout key -> the config field it records
FIELDS = {"optimizer": "optim.name", "compute_dtype": "train.compute_dtype",
          "fp8_recipe": "fp8.recipe", "fp8_history_len": "fp8.history_len",
          "batch_policy": "batch.policy", "data_source": "data.source", "data_path": "data.path",
          "data_mix": "data.mix", "data_tokenizer": "data.tokenizer", "task": "train.task"}
# What the data cursor counts through: a checkpoint trained on other data does not continue.
DATA_KEYS = ("data_source", "data_path", "data_mix", "data_tokenizer")


def train_layout(cfg: Config) -> dict[str, Any]:
    """The settings that decide the tree of the checkpoint's `train` item (and what the batch
    controller's and the data cursor's states mean), written into every step's meta so a resume
    can name a change."""
    return {"optimizer": cfg.optim.name, "compute_dtype": cfg.train.compute_dtype,
            "fp8_recipe": cfg.fp8.recipe, "fp8_history_len": cfg.fp8.history_len,
            "batch_policy": cfg.batch.policy, "data_source": cfg.data.source,
            "data_path": cfg.data.path, "data_mix": cfg.data.mix,
            "data_tokenizer": cfg.data.tokenizer, "task": cfg.train.task}


def check_same_data(saved: dict | None, here: dict | None, where: str, directory: str) -> None:
    """ConfigError, in one line naming the fields, when the checkpoint was trained on other data
    (its cursor would index another stream). A checkpoint older than the record passes."""
    differ = [k for k in DATA_KEYS if saved and here and k in saved and saved[k] != here.get(k)]
    if differ:
        what = "; ".join(f"{FIELDS[k]} was {saved[k]!r}, now {here.get(k)!r}" for k in differ)
        raise ConfigError(
            f"{where} was trained on other data ({what}); nothing was changed. Train on this "
            f"data in a new --workdir (--config.checkpoint.init_from={directory} starts it from "
            f"these weights), or resume with the data fields that wrote it")


def train_extras(state: TrainState) -> dict[str, Any]:
    """Everything besides params that defines the run's future, as checkpointed: DPO's
    reference params too (so a resume trains against the run's own start, whatever
    checkpoint.init_from holds by then). 1-bit Adam's error buffers are left out: they are
    checkpointed apart (see `onebit_errors`)."""
    opt_state = state.opt_state
    if isinstance(opt_state, OneBitAdamState):
        opt_state = opt_state._replace(worker_error={}, server_error={})
    extras = {"opt_state": opt_state, "loss_scale": state.loss_scale, "fp8_meta": state.fp8_meta}
    if state.ref_params is not None:
        extras["ref_params"] = state.ref_params
    return extras


def with_initial_weights(state: TrainState, directory: str, model_cfg: Any) -> TrainState:
    """A fresh run's `state` with the weights of checkpoint.init_from (`directory`); for DPO
    the reference too: a frozen copy (its own buffers, as the step donates both)."""
    params = ckpt.restore_params(directory, state.params, model_cfg)
    state = state.replace(params=params)
    if state.ref_params is not None:
        state = state.replace(ref_params=jax.tree.map(jnp.copy, params))
    return state


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


def changed(saved: dict | None, here: dict | None, keys: tuple[str, ...]) -> str:
    """'fp8.recipe changed from current to delayed; ...' for the `keys` that differ between two
    train layouts; '' when either is unknown (a checkpoint older than the record) or none do."""
    if not saved or not here:
        return ""
    return "; ".join(f"{FIELDS[k]} changed from {saved.get(k)} to {here.get(k)}"
                     for k in keys if saved.get(k) != here.get(k))


def moment_sources(saved: dict[Path, Any], here: dict[Path, Any]) -> dict[Path, Path] | None:
    """{this run's Adam moment: the checkpoint's}, paired by moment (`mu`, `nu`) and parameter
    path (AdamW keeps them at opt_state/1/0/mu/..., 1-bit Adam at opt_state/mu/...); None unless
    every moment here has exactly one counterpart of its shape."""
    def key(path):
        i = next((i for i, k in enumerate(path) if k in ("mu", "nu")), None)
        return None if i is None else path[i:]
    found: dict[Path, list[Path]] = {}
    for path in saved:
        if key(path) is not None:
            found.setdefault(key(path), []).append(path)
    out = {}
    for path, leaf in here.items():
        if key(path) is not None:
            match = found.get(key(path), [])
            if len(match) != 1 or tuple(saved[match[0]].shape) != tuple(leaf.shape):
                return None
            out[path] = match[0]
    return out or None


def continuation(saved: dict[Path, Any], here: dict[Path, Any], saved_layout: dict | None,
                 layout: dict | None, where: str, directory: str
                 ) -> tuple[dict[Path, Path], list[Path], list[str]]:
    """How this run's `train` leaves (`here`) come from a checkpoint's (`saved`), part by part:
    (sources for `Checkpointer.restore`, the step counters to set to the restored step, one
    warning per part that starts fresh). A difference that no supported config change explains
    is a CheckpointError naming it."""
    sources: dict[Path, Path] = {}
    counters: list[Path] = []
    notes: list[str] = []
    fp8_fields = ("compute_dtype", "fp8_recipe", "fp8_history_len")
    float16 = [d and d.get("compute_dtype") == "float16" for d in (saved_layout, layout)]
    for part in sorted({p[0] for p in saved} | {p[0] for p in here}):
        old = {p: x for p, x in saved.items() if p[0] == part}
        new = {p: x for p, x in here.items() if p[0] == part}
        problem = ckpt.tree_difference(old, new)
        if part == "loss_scale" and saved_layout and layout and float16[0] != float16[1]:
            # Same tree, other meaning: float16's dynamic scale vs the fixed scale of 1.
            why = changed(saved_layout, layout, ("compute_dtype",))
            notes.append(f"loss_scale starts fresh: {why} (float16's dynamic loss scale and the "
                         "fixed one do not carry over)")
        elif problem is None:
            sources.update({p: p for p in new})
        elif part == "fp8_meta":  # its tree follows from the fp8 settings (and the model) alone
            why = changed(saved_layout, layout, fp8_fields) or "the fp8 settings changed"
            notes.append(f"fp8_meta starts fresh: {why} (amax histories start empty)" if new else
                         f"its fp8_meta is not used: {why} (this run keeps no amax history)")
        elif part == "ref_params":  # only DPO keeps one: a checkpoint of another task has none
            raise ckpt.mismatch(where, directory, problem,
                                changed(saved_layout, layout, ("task",)) or "train.task changed")
        elif part == "opt_state" and changed(saved_layout, layout, ("optimizer",)):
            moments = moment_sources(old, new)
            sources.update(moments or {})
            counters += [p for p in new if p[-1] == "count"]
            notes.append(
                f"opt_state starts fresh: {changed(saved_layout, layout, ('optimizer',))}; "
                + ("Adam's moments (mu, nu) carry over by parameter" if moments else
                   "Adam's moments start from zero (no one-to-one match by parameter)")
                + " and its step counters continue from the checkpoint's step")
        else:
            raise ckpt.mismatch(where, directory, problem)
    return sources, counters, notes


def with_counters(extras: dict[str, Any], counters: list[Path], step: int) -> dict[str, Any]:
    """`extras` with the step counters at `counters` set to `step` (on their own sharding)."""
    def put(path, x):
        if ckpt.key_path(path) not in counters:
            return x
        return jax.device_put(np.asarray(step, x.dtype), x.sharding)
    return jax.tree_util.tree_map_with_path(put, extras)


def resume(checkpointer: ckpt.Checkpointer, state: TrainState, mesh: Mesh, model_cfg: Any,
           allow_fallback: bool, log: Callable[[str], None]
           ) -> tuple[TrainState, int | None, Any]:
    """(state, step, data state) from the newest intact checkpoint; (state, None, None) if there
    is none. A damaged newest checkpoint stops the run (CheckpointCorrupt) unless
    `allow_fallback`, which moves it aside and tries the previous one. A checkpoint of another
    config continues where `continuation` knows how, else stops (CheckpointError); neither
    changes a file. `state` is freshly initialised: what starts fresh keeps its values."""
    extras = train_extras(state)
    while True:
        start = checkpointer.usable_step(allow_fallback)
        if start is None:
            return state, None, None
        where = f"checkpoint step {start} in {checkpointer.directory}"
        try:
            meta = checkpointer.step_meta(start)
            ckpt.check_model(meta, model_cfg, where)
            check_same_data(meta.get("train_layout"), checkpointer.train_layout, where,
                            checkpointer.directory)
            sources, counters, notes = continuation(
                checkpointer.saved_leaves(start, "train"), ckpt.leaves_by_path(extras),
                meta.get("train_layout"), checkpointer.train_layout, where,
                checkpointer.directory)
            params, extras, data_state = checkpointer.restore(start, state.params, extras,
                                                              model_cfg, sources)
            break
        except ckpt.CheckpointCorrupt as e:
            checkpointer.reject(start, str(e), allow_fallback)
    for note in notes:
        log(f"warning: checkpoint step {start}: {note}")
    extras = with_counters(extras, counters, start)
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
