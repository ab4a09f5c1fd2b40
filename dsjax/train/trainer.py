"""The `Trainer`: everything built for one config on one mesh, and its one compile path.

The one idea: shardings are derived without allocating (`eval_shape` of the boxed init gives
logical axis names -> the rules table gives NamedShardings), then `jit(init, out_shardings=...)`
materialises the state directly in place. Every step program, whatever its phase (1-bit Adam:
warmup or compressed) or batch shape, is compiled by `dsjax.batching.Programs`, once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dsjax import batching, fp8, pipeline, remat_plan, sharding
from dsjax import metrics as mx
from dsjax.config import Config, trainable_groups
from dsjax.errors import ConfigError
from dsjax.model import ModelLoss, Transformer, count_params
from dsjax.model.build import make_model
from dsjax.model.batch import BATCH_KEYS, media_layout
from dsjax.model.context_layout import Layout, to_layout
from dsjax.model.preference import PreferenceLoss
from dsjax.optim import OneBitAdam, make_optimizer
from dsjax.optim import loss_scale as ls
from dsjax.train.onebit_step import onebit_init_and_phases
from dsjax.train.step import TrainState, train_step


@dataclasses.dataclass
class Trainer:
    """Everything built for one config on one mesh."""
    cfg: Config
    mesh: Mesh
    model: Transformer
    eval_model: Transformer  # the same weights; fp8 "delayed" evaluates with "current" scaling
    rules: Any
    state_shardings: Any
    batch_shardings: dict[str, NamedSharding]
    init_fn: Callable
    param_count: int
    tx: Any  # the optimizer (optax transform, or OneBitAdam)
    phase_fns: tuple[Callable, ...]  # the step per phase, unjitted (train_step; 1-bit Adam:
                                     # warmup, compressed), compiled by `programs`
    # (state.step array of the last returned state, lower and upper bound of its value): the host
    # knows the phase without waiting for the device, except at the switch (see `phase_for`).
    _step_bounds: tuple[Any, int, int] | None = dataclasses.field(default=None, repr=False)

    def init(self, seed: int | None = None) -> TrainState:
        seed = self.cfg.train.seed if seed is None else seed
        with sharding.activate(self.mesh, self.rules):
            return self.init_fn(jax.random.key(seed))

    def phase_at(self, step: int) -> int:
        """THE phase rule: the program index (into `phase_fns`) of the step after `step`
        completed steps. 1-bit Adam's optimizer decides (`OneBitAdam.uses_compression`)."""
        return int(len(self.phase_fns) > 1 and self.tx.uses_compression(step))

    def phase_for(self, state: TrainState) -> tuple[int, int, int]:
        """The phase of the step that `state` goes into, and bounds of `state.step`.

        A skipped (non-finite) step does not count, so the host's count of dispatched steps is
        only an upper bound; it reads `state.step` from the device (waiting for the step that
        produced it) only when the bounds straddle a phase change: freeze_step, normally once
        per run, and with optim.refresh_every = K twice per K steps (into and out of each
        exact refresh step).
        """
        if len(self.phase_fns) == 1:
            return 0, 0, 0
        known = self._step_bounds
        lo, hi = (known[1], known[2]) if known is not None and known[0] is state.step else (
            None, None)
        if lo is None or self.phase_at(lo) != self.phase_at(hi):
            lo = hi = int(state.step)
        return self.phase_at(lo), lo, hi

    @functools.cached_property
    def programs(self) -> batching.Programs:
        """The step compiled once per phase and batch shape, ahead of time (dsjax.batching)."""
        cfg = self.cfg
        return batching.Programs(self.phase_fns, self.mesh, self.rules, self.state_shardings,
                                 self.abstract_state, self.batch_shardings, self.media,
                                 cfg.data.seq_len,
                                 cfg.batch.reference_batch or cfg.data.global_batch,
                                 cfg.batch.lr_scaling)

    def _shape(self, batch: dict[str, Any]) -> batching.Shape:
        return batching.batch_shape(batch, sharding.data_size(self.mesh))

    def program_for(self, state: TrainState, batch: dict[str, Any]) -> Any:
        """The compiled step for `state`'s phase and `batch`'s shape ([B, S] or [k, B/k, S])."""
        return self.programs.get(self.phase_for(state)[0], self._shape(batch))

    def jitted(self, phase: int = 0) -> Any:
        """The jitted step of `phase` at data.global_batch (no accumulation): `.lower(...)` it to
        read its HLO or cost (tests, benchmarks). The same function `programs` compiles."""
        return self.programs.jitted(phase, batching.Shape(self.cfg.data.global_batch, 1,
                                                          sharding.data_size(self.mesh)))

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        phase, lo, hi = self.phase_for(state)
        fn = self.programs.get(phase, self._shape(batch))
        with sharding.activate(self.mesh, self.rules):
            state, metrics = fn(state, batch)
        if len(self.phase_fns) > 1:
            self._step_bounds = (state.step, lo, hi + 1)
        return state, metrics

    def switch_precision(self, layers: str, state: TrainState) -> TrainState:
        """Runs the per-layer precision map `layers` (`fp8.layers`) from the next step: another
        model and step program over the same state layout. Each map's parts and compiled
        programs are kept, so returning to a map compiles nothing. Returns `state` as the
        switched step takes it (its static fields, the objective among them, are the map's)."""
        variants = self.__dict__.setdefault("_variants", {})
        if self.cfg.fp8.layers not in variants:  # a copy: its programs bind the copy's state
            variants[self.cfg.fp8.layers] = dataclasses.replace(self)
        if layers not in variants:
            variants[layers] = build_trainer(dataclasses.replace(
                self.cfg, fp8=dataclasses.replace(self.cfg.fp8, layers=layers)), self.mesh)
        other = variants[layers]
        for f in ("cfg", "model", "eval_model", "state_shardings", "init_fn", "tx",
                  "phase_fns"):
            setattr(self, f, getattr(other, f))
        self.__dict__["programs"] = other.programs
        self.__dict__["_abstract_state"] = other.abstract_state()
        return jax.tree.unflatten(jax.tree.structure(self.abstract_state()),
                                  jax.tree.leaves(state))

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Process-local numpy batch ([B, S], or [k, B/k, S] for accumulation) -> global arrays
        sharded over `data`, rows in the context layout (split over `context`)."""
        accumulating = host_batch["inputs"].ndim == 3
        layout = Layout(self.cfg.mesh.context, self.cfg.model.context_layout)
        host_batch = {k: to_layout(a, layout) if k in BATCH_KEYS else a
                      for k, a in host_batch.items()}
        return {k: jax.make_array_from_process_local_data(
            batching.step_sharding(sharding_k, accumulating), host_batch[k])
                for k, sharding_k in self.batch_shardings.items()}

    @property
    def media(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The batch's media arrays (pixels, image_mask) beside the token arrays; {} for text."""
        return media_layout(self.cfg.vision, self.cfg.data.seq_len)

    @functools.cached_property
    def _abstract_state(self) -> TrainState:
        with sharding.activate(self.mesh, self.rules):
            shapes = jax.eval_shape(self.init_fn, jax.random.key(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and target shardings, without allocating (cached)."""
        return self._abstract_state

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One global batch (data.global_batch rows, no accumulation), abstract, for lowering."""
        return batching.abstract_batch(self.batch_shardings, batching.Shape(
            self.cfg.data.global_batch, 1, sharding.data_size(self.mesh)), self.cfg.data.seq_len,
            self.media)


def check_fits(trainer: Trainer, shape: batching.Shape, phase: int) -> None:
    """Stops, before any state is allocated, a run whose step cannot fit: the compiled step's
    predicted bytes per device (state + temporaries, `memory_analysis()`; the program is the
    one the run will use, compiled once) against the device's memory (CPU: host RAM)."""
    need = trainer.programs.predict(shape, phase)
    have, source = mx.fit_capacity(trainer.mesh.local_devices[0],
                                   trainer.cfg.batch.device_memory_gb,
                                   len(trainer.mesh.local_devices))
    if need > have:
        raise ConfigError(
            f"memory: the train step needs {mx.format_bytes(need)} per device (state + "
            f"temporaries, from the compiled program) but a device has {mx.format_bytes(have)} "
            f"({source}); nothing was allocated. To fit: remat.policy=full, a smaller "
            f"batch.micro_batch, mesh.fsdp=True, or a larger mesh (mesh.data/tensor/pipeline)")


def build_trainer(cfg: Config, mesh: Mesh | None = None) -> Trainer:
    mesh = sharding.make_mesh(cfg) if mesh is None else mesh
    sharding.check_device_count(cfg, mesh.size)
    rules = sharding.rules_for(cfg)
    if cfg.remat.policy == "auto":  # compiles candidate policies, then builds the chosen one
        policy, layers, _ = remat_plan.choose(cfg, mesh, log=mx.log)
        cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy=policy,
                                                                 layers=layers))
    model = make_model(cfg)
    trainable = trainable_groups(cfg.train.trainable)
    tx, lr_fn = make_optimizer(cfg.optim, cfg.train.steps, trainable)
    onebit = isinstance(tx, OneBitAdam)
    dummy = jnp.zeros((1, min(cfg.data.seq_len, 8)), jnp.int32)
    loss_scale = (ls.dynamic_scale(cfg.train.loss_scale_init, cfg.train.loss_scale_growth)
                  if cfg.train.compute_dtype == "float16" else ls.skip_policy())

    # mesh.pipeline > 1: the objective streams microbatches through the stages (dsjax/pipeline).
    # Shard_maps are typed (check_vma) except for fp8 (see `onebit_step`) and for a pipeline
    # nested in 1-bit Adam's gradient shard_map (the schedule types its values over `pipeline`
    # alone; inside, they also vary over `data`), and for context parallelism (its attention's
    # unchecked shard_maps over `context` nest inside the stages').
    typed = (cfg.train.compute_dtype != "fp8" and not (onebit and cfg.mesh.pipeline > 1)
             and cfg.mesh.context == 1)
    # train.task='dpo': preference pairs against a frozen copy of the starting params, which the
    # state keeps beside the params (dsjax/model/preference.py).
    dpo = cfg.train.task == "dpo"
    if cfg.mesh.pipeline > 1:
        objective = pipeline.make(model, cfg.pipeline, cfg.mesh.pipeline, typed=typed)
    else:
        objective = PreferenceLoss(model, cfg.train.dpo_beta) if dpo else ModelLoss(model)

    def init_boxed(rng):
        variables = model.init(rng, dummy)
        params = variables["params"]
        # 1-bit Adam's state is built inside a shard_map (onebit_init_and_phases).
        opt_state = () if onebit else tx.init(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                          loss_scale=loss_scale, fp8_meta=variables.get(fp8.META_COLLECTION, {}),
                          objective=objective, tx=tx, lr_fn=lr_fn,
                          fp8_margin=model.fp8_policy.margin if model.fp8_policy else 0.0,
                          router_bias_speed=(cfg.model.bias_update_speed
                                             if cfg.model.scoring == "sigmoid" else 0.0),
                          trainable=trainable, ref_params=params if dpo else None,
                          layer_norms=cfg.fp8.select == "auto")

    # Optimizer moments mirror the boxed params, so they inherit the same logical axis names.
    abstract = jax.eval_shape(init_boxed, jax.random.key(0))
    state_shardings = sharding.logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
    if cfg.mesh.fsdp and cfg.mesh.pipeline > 1:
        # The same params under the rules without fsdp: what the pipeline gathers them to.
        whole = sharding.logical_to_sharding(nn.get_partition_spec(abstract.params), mesh,
                                             sharding.logical_rules(False, pipeline=True))
        leaves, treedef = jax.tree.flatten(whole)
        objective = dataclasses.replace(objective, gathered=(treedef,
                                                             tuple(s.spec for s in leaves)))
        state_shardings = state_shardings.replace(objective=objective)  # a static field
    if onebit:
        init_fn, state_shardings, phases = onebit_init_and_phases(
            cfg, mesh, tx, lambda rng: nn.unbox(init_boxed(rng)), state_shardings, typed)
    else:
        init_fn = jax.jit(lambda rng: nn.unbox(init_boxed(rng)), out_shardings=state_shardings)
        phases = (train_step,)
    media = media_layout(cfg.vision, cfg.data.seq_len)
    batch_shardings = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS + tuple(media)}
    return Trainer(cfg, mesh, model, make_model(cfg, for_eval=True), rules, state_shardings,
                   batch_shardings, init_fn, count_params(abstract.params), tx, tuple(phases))
