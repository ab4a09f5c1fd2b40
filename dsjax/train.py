"""Training: sharded state init, the module-level pure `train_step`, and the loop.

The one idea: shardings are derived without allocating (`eval_shape` of the boxed init gives
logical axis names -> the rules table gives NamedShardings), then `jit(init, out_shardings=...)`
materialises the state directly in place, and `train_step` is jitted once with the same shardings
and a donated state. The host reads step n-1's metrics after it has dispatched step n.

With `optim.name = "onebit_adam"` the step is `onebit_step` instead (1-bit Adam, Tang et al. 2021,
arXiv 2102.02888, as DeepSpeed runs it): the per-worker gradients are computed in a `shard_map`
manual over `data` and reduced by the optimizer itself, exactly during warmup and 1-bit
compressed after `optim.freeze_step`. The two phases are two compiled programs; `Trainer.step`
picks one on the host. docs/onebit.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsjax import batching
from dsjax import checkpoint as ckpt
from dsjax import fp8, pipeline, remat
from dsjax import metrics as mx
from dsjax import sharding
from dsjax.runtime import xla_flags
from dsjax.config import Config
from dsjax.errors import TrainingError
from dsjax.model import ModelLoss, Transformer, count_params
from dsjax.model.build import make_model
from dsjax.model.loss import BATCH_KEYS, loss_fn
from dsjax.model import moe
from dsjax.optim import loss_scale as ls
from dsjax.optim import OneBitAdam, OneBitAdamState, make_optimizer
from dsjax.optim.onebit import tree_sq_norm

DATA = "data"  # the mesh axis 1-bit Adam reduces over (see dsjax.sharding.MESH_AXES)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: ls.LossScale  # float16: dynamic scale; otherwise fixed 1, counts skipped steps
    fp8_meta: Any  # delayed fp8 scaling state ({} otherwise): never seen by the optimizer
    objective: Any = struct.field(pytree_node=False)  # ModelLoss, or Pipelined (mesh.pipeline > 1)
    tx: optax.GradientTransformation | OneBitAdam = struct.field(pytree_node=False)
    lr_fn: Callable = struct.field(pytree_node=False)
    fp8_margin: float = struct.field(pytree_node=False, default=0.0)
    router_bias_speed: float = struct.field(pytree_node=False, default=0.0)  # MoE sigmoid
                            # routers: aux-loss-free bias step after each step (DeepSeek-V3)


def moe_record(m: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl fields of a MoE/MTP model ({} for dense): per-expert load of each MoE layer
    (share of its assignments; MTP blocks last), its max relative to even, aux and MTP losses."""
    out = {}
    if "expert_load" in m:
        out["expert_load"] = np.round(np.asarray(m["expert_load"], np.float64), 4).tolist()
        out["expert_load_max"] = float(m["expert_load_max"])
    for key in ("aux_loss", "mtp_loss"):
        if key in m:
            out[key] = float(np.mean(m[key]))
    return out


def finite_by_group(grads: Any) -> dict[str, jax.Array]:
    """{"layers/mlp/up/kernel": all finite?} per gradient leaf: what a non-finite report names."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return {name(path): jnp.all(jnp.isfinite(g))
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


def nonfinite_groups(metrics: dict[str, Any]) -> str:
    """The host's one-line account of which parameter groups had non-finite gradients."""
    bad = [k for k, ok in sorted(metrics.get("grad_finite", {}).items()) if not bool(ok)]
    if not bad:
        return "every gradient is finite: the loss itself is not"
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return f"non-finite gradients in {', '.join(bad[:6])}{more}"


def _finish_step(state: TrainState, loss: jax.Array, tokens: jax.Array, grad_norm: jax.Array,
                 new_params: Any, new_opt_state: Any, meta_grads: Any, grad_finite: dict
                 ) -> tuple[TrainState, dict]:
    """Applies a step's results unless the loss or gradient is non-finite; the metrics."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_meta = fp8.commit(state.fp8_meta, meta_grads, state.fp8_margin) if state.fp8_meta else {}
    params, opt_state, fp8_meta = ls.select(finite, (new_params, new_opt_state, new_meta),
                                            (state.params, state.opt_state, state.fp8_meta))
    new_state = state.replace(step=state.step + finite.astype(state.step.dtype), params=params,
                              opt_state=opt_state, fp8_meta=fp8_meta,
                              loss_scale=ls.update(state.loss_scale, finite))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": state.lr_fn(state.step),
               "finite": finite, "tokens": tokens, "loss_scale": state.loss_scale.scale,
               "skipped_steps": new_state.loss_scale.skipped_steps, "grad_finite": grad_finite}
    return new_state, metrics


def train_step(state: TrainState, batch: dict[str, jax.Array], lr_scale: float = 1.0
               ) -> tuple[TrainState, dict]:
    """One optimizer step. A non-finite loss or gradient leaves params, optimizer state and fp8
    state as they were (so nothing non-finite can be checkpointed), halves a float16 loss scale,
    and reports `finite = False`; the host decides whether to stop (train.nonfinite).
    `batch`: [B, S] arrays, or [k, B/k, S]: k micro-batches whose gradients are accumulated
    (dsjax.batching), the same update as one [B, S] batch. `lr_scale` multiplies the learning
    rate (bound per batch size by dsjax.batching)."""
    accumulating = batch["inputs"].ndim == 3
    count = jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    def micro_grads(micro):
        def scaled_loss(params, fp8_meta):
            loss, tokens, aux = state.objective.loss_and_aux(params, micro, fp8_meta)
            if accumulating:  # this micro-batch's share of the whole batch's mean loss
                share = tokens / count
                loss = loss * share
                # Expert loads are counts: they add up; the losses are shares like `loss`.
                aux = {k: v if k == "moe_load" else v * share for k, v in aux.items()}
            objective = loss + aux.get("aux_loss", 0.0)
            return ls.scale_loss(state.loss_scale, objective), (loss, tokens, aux)

        (_, sums), (grads, meta_grads) = jax.value_and_grad(
            scaled_loss, argnums=(0, 1), has_aux=True)(state.params, state.fp8_meta)
        return sums, grads, meta_grads

    (loss, tokens, aux), grads, meta_grads = batching.accumulate(micro_grads, batch)
    grads = ls.unscale_grads(state.loss_scale, grads)
    grad_norm = optax.tree.norm(grads)
    updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, batching.scale_updates(updates, lr_scale))
    if "moe_load" in aux and state.router_bias_speed:  # outside the gradient (DeepSeek-V3)
        new_params = moe.with_updated_router_bias(new_params, state.params, aux["moe_load"],
                                                  state.router_bias_speed)
    new_state, metrics = _finish_step(state, loss, tokens, grad_norm, new_params, new_opt_state,
                                      meta_grads, finite_by_group(grads))
    metrics.update(moe.load_metrics(aux))
    metrics["lr"] = metrics["lr"] * lr_scale
    return new_state, metrics


def _clip(grads: Any, norm: jax.Array, clip_norm: float) -> Any:
    """optax.clip_by_global_norm's arithmetic, given the norm."""
    if not clip_norm:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < clip_norm, g, (g / norm) * clip_norm), grads)


def onebit_step(state: TrainState, batch: dict[str, jax.Array], *, compressed: bool,
                param_specs: Any, clip_norm: float, typed: bool = True,
                opt_mesh: Mesh | None = None, lr_scale: float = 1.0, with_aux: bool = False
                ) -> tuple[TrainState, dict]:
    """One 1-bit Adam step (Tang et al. 2021; DeepSpeed's OnebitAdam), warmup or `compressed`.

    `param_specs`: the params' mesh PartitionSpecs (none may name `data`). Bind it, `compressed`,
    `clip_norm` and `typed` with functools.partial; the result is a `train_step`. `typed=False`
    for fp8 models (see the gradient block). `opt_mesh`: where the update runs with
    optim.hierarchical (`sharding.host_view` of the mesh). Everything `train_step` does is
    kept: loss scaling, skip-on-non-finite, the fp8 delayed-scaling commit, the metrics (plus
    `onebit_compressed`). Differences, all about the gradient (docs/onebit.md):
    - Each worker differentiates its share of the *global* mean loss, sum of its NLL * W /
      (global weight), so the mean of the W per-worker gradients is exactly `train_step`'s.
    - Warmup: the exact mean gradient (one float all-reduce), its norm, clipped like optax.
    - Compressed: the mean gradient never exists. `grad_norm` is the root mean square of the
      workers' gradient norms, sqrt(mean_i |g_i|^2) >= |mean_i g_i| (one scalar pmean), and
      clipping scales every worker's gradient by the same min(1, clip_norm / grad_norm): the
      mean is clipped at least as hard as `train_step` would clip it.
    `batch` and `lr_scale` as in `train_step`; each worker sums its micro-batches' gradients
    before any communication, so accumulation costs no extra all-reduce. `with_aux`: the model
    has auxiliary losses (MTP): each worker adds its rows' aux_loss, weighted by its share of
    the tokens like its NLL, and the metrics report them averaged the same way.
    """
    opt: OneBitAdam = state.tx
    # The model's activation constraints name `data` (act_batch); inside a shard_map that is
    # manual over `data` a constraint may only name the other (auto) axes. Same table otherwise.
    local_rules = tuple((name, None if axis == DATA else axis)
                        for name, axis in nn.get_logical_axis_rules())

    # Block 1, manual over `data` only (tensor parallelism stays with GSPMD inside the model).
    # batch [B, S] -> this worker's [B/W, S]; grads [...] -> [1, ...], global [W, ...].
    # Accumulation: batch [k, B/k, S] -> [k, B/(kW), S], summed here (dsjax.batching), so the
    # (compressed) all-reduce below runs once per optimizer step, not once per micro-batch.
    def local_grads(params, fp8_meta, loss_scale, batch):
        count = lax.psum(jnp.sum(batch["weights"]), DATA)
        share = lax.axis_size(DATA) / jnp.maximum(count, 1.0)

        def objective(params, fp8_meta, micro):
            with nn.logical_axis_rules(local_rules):
                # Pipelined: the pipeline's shard_map (manual over `pipeline`) nests in this one.
                mean, local, aux = state.objective.loss_and_aux(params, micro, fp8_meta)
            local = jnp.maximum(local, 1.0)
            total = mean * local
            # MTP (pipelined or not): token-weighted like the NLL.
            aux = {k: aux[k] * local for k in ("aux_loss", "mtp_loss")} if with_aux else {}
            return (ls.scale_loss(loss_scale, (total + aux.get("aux_loss", 0.0)) * share),
                    (total, aux))

        if typed:
            # Varying over `data`: jax.grad then returns this worker's gradient instead of
            # inserting its own all-reduce (DESIGN invariant 3).
            params, fp8_meta = lax.pcast((params, fp8_meta), DATA, to="varying")

        def micro_grads(micro):
            (_, sums), (grads, meta_grads) = jax.value_and_grad(
                objective, argnums=(0, 1), has_aux=True)(params, fp8_meta, micro)
            return sums, grads, meta_grads

        vary = (lambda t: lax.pcast(t, DATA, to="varying")) if typed else (lambda t: t)
        (total, aux), grads, meta_grads = batching.accumulate(micro_grads, batch, vary)
        grads = ls.unscale_grads(loss_scale, grads)
        loss, aux = jax.tree.map(lambda x: lax.psum(x, DATA) / jnp.maximum(count, 1.0),
                                 (total, aux))
        # fp8 amax observations of this worker's activations: the global amax is their max.
        meta_grads = jax.tree.map(lambda g: lax.pmax(g, DATA), meta_grads)
        return jax.tree.map(lambda g: g[None], grads), loss, count, meta_grads, aux

    # fp8's custom VJP returns per-worker amax observations as cotangents of its scaling inputs,
    # typed varying for an invariant input (current scaling's constants) or invariant for a
    # varying one (delayed: the scale), which a typed (check_vma) shard_map rejects. Untyped,
    # jax.grad inserts no all-reduce either: the gradients are the worker's own all the same.
    grads, loss, tokens, meta_grads, aux = jax.shard_map(
        local_grads, in_specs=(P(), P(), P(), P(DATA) if batch["inputs"].ndim == 2 else
                               P(None, DATA)), out_specs=(P(DATA), P(), P(), P(), P()),
        axis_names={DATA}, check_vma=typed)(state.params, state.fp8_meta, state.loss_scale,
                                             batch)

    # Block 2, manual over every axis: the buckets hold this device's shards. grads [1, ...]
    # local (this worker's), params and moments this device's shards, errors [1, n_b/...].
    def update(grads, opt_state, params):
        grads = jax.tree.map(lambda g: g[0], grads)
        if compressed:
            grad_norm = jnp.sqrt(lax.pmean(tree_sq_norm(grads, opt.data_axes), opt.data_axes))
            updates, opt_state = opt.compressed_update(_clip(grads, grad_norm, clip_norm),
                                                       opt_state, params)
        else:
            grads = opt.mean_gradient(grads)
            grad_norm = jnp.sqrt(tree_sq_norm(grads))
            updates, opt_state = opt.exact_update(_clip(grads, grad_norm, clip_norm),
                                                  opt_state, params)
        return (optax.apply_updates(params, batching.scale_updates(updates, lr_scale)),
                opt_state, grad_norm)

    # Hierarchical: on `opt_mesh` (the same devices, `data` seen as hosts x workers per host) the
    # grads' P(DATA) is P(opt.data_axes), and the optimizer's specs name the view's axes.
    opt_specs = opt.state_specs(param_specs)
    data_spec = DATA if opt_mesh is None else opt.data_axes
    grad_specs = jax.tree.map(lambda spec: P(data_spec, *spec), param_specs)
    with sharding.on_view(opt_mesh):
        new_params, new_opt_state, grad_norm = jax.shard_map(
            update, mesh=opt_mesh, in_specs=(grad_specs, opt_specs, param_specs),
            out_specs=(param_specs, opt_specs, P()))(grads, state.opt_state, state.params)
    new_state, metrics = _finish_step(state, loss, tokens, grad_norm, new_params, new_opt_state,
                                      meta_grads, finite_by_group(grads))  # every worker's
    metrics.update(moe.load_metrics(aux))
    metrics["onebit_compressed"] = jnp.asarray(int(compressed), jnp.int32)
    metrics["lr"] = metrics["lr"] * lr_scale
    return new_state, metrics


@dataclasses.dataclass
class Trainer:
    """Everything compiled for one config on one mesh."""
    cfg: Config
    mesh: Mesh
    model: Transformer
    eval_model: Transformer  # the same weights; fp8 "delayed" evaluates with "current" scaling
    rules: Any
    state_shardings: Any
    batch_shardings: dict[str, NamedSharding]
    init_fn: Callable
    step_fn: Callable  # `train_step`; with 1-bit Adam its warmup step
    param_count: int
    compressed_step_fn: Callable | None = None  # 1-bit Adam after freeze_step (jit: compiled
                                                # the first time it is called)
    phase_fns: tuple[Callable, ...] = ()  # the steps unjitted, in phase order (train_step; 1-bit
                                          # Adam: warmup, compressed), for dsjax.batching.Programs
    # (state.step array of the last returned state, lower and upper bound of its value): the host
    # knows the phase without waiting for the device, except at the switch (see `step_fn_for`).
    _step_bounds: tuple[Any, int, int] | None = dataclasses.field(default=None, repr=False)

    def init(self, seed: int | None = None) -> TrainState:
        seed = self.cfg.train.seed if seed is None else seed
        with sharding.activate(self.mesh, self.rules):
            return self.init_fn(jax.random.key(seed))

    def step_fn_for(self, state: TrainState) -> tuple[Callable, int, int]:
        """The compiled step for `state` (warmup or compressed), and bounds of `state.step`.

        A skipped (non-finite) step does not count, so the host's count of dispatched steps is
        only an upper bound; it reads `state.step` from the device (waiting for the step that
        produced it) only when the bounds straddle a phase change: freeze_step, normally once
        per run, and with optim.refresh_every = K twice per K steps (into and out of each
        exact refresh step).
        """
        if self.compressed_step_fn is None:
            return self.step_fn, 0, 0
        known = self._step_bounds
        if known is not None and known[0] is state.step:
            lo, hi = known[1], known[2]
        else:
            lo = hi = None
        opt: OneBitAdam = state.tx
        if lo is None or opt.uses_compression(lo) != opt.uses_compression(hi):
            lo = hi = int(state.step)
        return (self.compressed_step_fn if opt.uses_compression(lo) else self.step_fn), lo, hi

    @functools.cached_property
    def programs(self) -> batching.Programs:
        """The step compiled once per phase and batch shape, ahead of time (dsjax.batching)."""
        return batching.Programs(self)

    def program_for(self, state: TrainState, batch: dict[str, Any]) -> Any:
        """The compiled step for `state`'s phase and `batch`'s shape ([B, S] or [k, B/k, S])."""
        fn, _, _ = self.step_fn_for(state)
        return self.programs.get(int(fn is not self.step_fn),
                                 batching.batch_shape(batch, self.mesh.shape["data"]))

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        fn, lo, hi = self.step_fn_for(state)
        if self.phase_fns:
            fn = self.programs.get(int(fn is not self.step_fn),
                                   batching.batch_shape(batch, self.mesh.shape["data"]))
        with sharding.activate(self.mesh, self.rules):
            state, metrics = fn(state, batch)
        if self.compressed_step_fn is not None:
            self._step_bounds = (state.step, lo, hi + 1)
        return state, metrics

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Process-local numpy batch ([B, S], or [k, B/k, S] for accumulation) -> global arrays
        sharded over `data`."""
        return {k: jax.make_array_from_process_local_data(
            batching.step_sharding(self.batch_shardings[k], host_batch[k].ndim), host_batch[k])
                for k in BATCH_KEYS}


def build_trainer(cfg: Config, mesh: Mesh | None = None) -> Trainer:
    mesh = sharding.make_mesh(cfg) if mesh is None else mesh
    sharding.validate_mesh(cfg, mesh.size)
    rules = sharding.logical_rules(cfg.mesh.fsdp, pipeline=cfg.mesh.pipeline > 1)
    if cfg.remat.policy == "auto":
        from dsjax import remat_plan  # compiles candidate policies; only needed for "auto"
        policy, layers, _ = remat_plan.choose(cfg, mesh, log=mx.log)
        cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy=policy,
                                                                 layers=layers))
    model = make_model(cfg)
    tx, lr_fn = make_optimizer(cfg.optim, cfg.train.steps)
    onebit = isinstance(tx, OneBitAdam)
    dummy = jnp.zeros((1, min(cfg.data.seq_len, 8)), jnp.int32)
    loss_scale = (ls.dynamic_scale(cfg.train.loss_scale_init, cfg.train.loss_scale_growth)
                  if cfg.train.compute_dtype == "float16" else ls.skip_policy())

    # mesh.pipeline > 1: `loss_fn` streams microbatches through the stages (dsjax/pipeline.py).
    # Shard_maps are typed (check_vma) except for fp8 (see `onebit_step`) and for a pipeline
    # nested in 1-bit Adam's gradient shard_map (the schedule types its values over `pipeline`
    # alone; inside, they also vary over `data`).
    typed = cfg.train.compute_dtype != "fp8" and not (onebit and cfg.mesh.pipeline > 1)
    objective = (pipeline.make(model, cfg.pipeline, cfg.mesh.pipeline, typed=typed)
                 if cfg.mesh.pipeline > 1 else ModelLoss(model))

    def init_boxed(rng):
        variables = model.init(rng, dummy)
        params = variables["params"]
        # 1-bit Adam's state is built inside a shard_map below, from the unboxed params.
        opt_state = () if onebit else tx.init(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                          loss_scale=loss_scale, fp8_meta=variables.get(fp8.META_COLLECTION, {}),
                          objective=objective, tx=tx, lr_fn=lr_fn, fp8_margin=cfg.fp8.margin,
                          router_bias_speed=(cfg.model.bias_update_speed
                                             if cfg.model.scoring == "sigmoid" else 0.0))

    # Optimizer moments mirror the boxed params, so they inherit the same logical axis names.
    abstract = jax.eval_shape(init_boxed, jax.random.key(0))
    state_shardings = sharding.logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
    if not onebit:
        init_fn = jax.jit(lambda rng: nn.unbox(init_boxed(rng)), out_shardings=state_shardings)
        phases = [train_step]
    else:
        # 1-bit Adam: moments sharded like the params, error buffers per worker (state_specs).
        param_specs = jax.tree.map(lambda sh: sh.spec, state_shardings.params)
        opt_specs = tx.state_specs(param_specs)  # one spec per error group: a prefix
        # optim.hierarchical: the optimizer runs on the host view of the mesh (its specs name
        # the view's axes; `from_host_view` gives the same sharding on `mesh`).
        opt_mesh = sharding.hierarchical_view(cfg, mesh) if tx.fast_axis is not None else None

        def init_onebit(rng):
            state = nn.unbox(init_boxed(rng))
            with sharding.on_view(opt_mesh):
                opt_state = jax.shard_map(tx.init, mesh=opt_mesh or mesh, in_specs=(param_specs,),
                                          out_specs=opt_specs)(state.params)
            return state.replace(opt_state=opt_state)

        opt_shapes = jax.eval_shape(init_onebit, jax.random.key(0)).opt_state
        state_shardings = state_shardings.replace(opt_state=jax.tree.map(
            lambda spec, sub: jax.tree.map(
                lambda _: NamedSharding(mesh, sharding.from_host_view(spec)), sub),
            opt_specs, opt_shapes, is_leaf=lambda x: isinstance(x, P)))
        init_fn = jax.jit(init_onebit, out_shardings=state_shardings)
        phase = functools.partial(onebit_step, param_specs=param_specs,
                                  clip_norm=cfg.optim.clip_norm,
                                  typed=typed, opt_mesh=opt_mesh,
                                  with_aux=cfg.model.num_mtp_layers > 0)
        phases = [functools.partial(phase, compressed=c) for c in (False, True)]
    batch_shardings = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
    step_fn, *compressed = [
        jax.jit(fn, in_shardings=(state_shardings, batch_shardings),
                out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
        for fn in phases]
    compressed_step_fn = compressed[0] if compressed else None
    return Trainer(cfg, mesh, model, make_model(cfg, for_eval=True), rules, state_shardings,
                   batch_shardings, init_fn, step_fn, count_params(abstract.params),
                   compressed_step_fn, phase_fns=tuple(phases))


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


def abstract_state(trainer: Trainer) -> TrainState:
    """The state's shapes, dtypes and target shardings, without allocating."""
    with sharding.activate(trainer.mesh, trainer.rules):
        shapes = jax.eval_shape(trainer.init_fn, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, trainer.state_shardings)


def abstract_batch(trainer: Trainer) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch's shapes, dtypes and shardings, for lowering a step without data."""
    shape = (trainer.cfg.data.global_batch, trainer.cfg.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "weights" else jnp.int32,
                                    sharding=s) for k, s in trainer.batch_shardings.items()}


def check_workdir(workdir: str) -> None:
    """Fails early, in one line, if the run directory cannot be created or written."""
    probe = os.path.join(workdir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(workdir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise TrainingError(f"--workdir {workdir}: not a writable directory ({e.strerror or e})"
                            ) from None


def run(cfg: Config, workdir: str, *, allow_fallback: bool = False, max_runtime_s: float = 0.0
        ) -> dict[str, Any]:
    """Trains `cfg` in `workdir` (resuming from its latest intact checkpoint), evaluates, writes
    summary. SIGTERM/SIGINT or `max_runtime_s` end it early: checkpoint, no eval, and the returned
    summary has `stopped_early` (docs/reliability.md). `allow_fallback`: a corrupt newest
    checkpoint is moved aside and the previous one resumed, instead of stopping."""
    from dsjax import evaluate  # local: evaluate imports train for the trainer
    from dsjax.runtime.preemption import StopConditions
    from dsjax.data import SampleStream

    check_workdir(workdir)
    trainer = build_trainer(cfg)
    mx.log(f"dsjax: config {cfg.name} | mesh {sharding.describe(trainer.mesh)} | "
           f"{trainer.param_count:,} params | compute {cfg.train.compute_dtype} | "
           f"devices {jax.device_count()} x {jax.devices()[0].device_kind}")
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            # Beside the sections: the XLA flags in effect (launch.py applied mesh.xla_profile).
            json.dump({**cfg.to_dict(), "xla_flags": xla_flags.record(cfg.mesh.xla_profile)},
                      f, indent=2, sort_keys=True)

    splits = evaluate.data_splits(cfg, workdir)
    # The stream is read by a global sample cursor, the batch shape chosen per step (#8).
    largest = max(cfg.batch.sizes(cfg.data.global_batch))
    stream = SampleStream(splits.train, cfg.data.seq_len, cfg.train.seed, jax.process_index(),
                          jax.process_count(), prefetch=cfg.data.prefetch,
                          prefetch_rows=max(cfg.data.prefetch, 1) * largest // jax.process_count(),
                          legacy_batch=cfg.data.global_batch)
    batcher = batching.Batcher(trainer, stream, log=mx.log)

    checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.keep,
                                     cfg.checkpoint.async_save, log=mx.log)
    state = trainer.init()
    while True:  # the newest intact checkpoint (a damaged one stops the run unless allow_fallback)
        start = checkpointer.usable_step(allow_fallback)
        if start is None:
            break
        try:
            params, extras, data_state = checkpointer.restore(start, state.params,
                                                              train_extras(state), cfg.model)
            break
        except ckpt.CheckpointCorrupt as e:
            checkpointer.reject(start, str(e), allow_fallback)
    if start is not None:
        errors = None
        if onebit_errors(state) is not None:
            errors, why = checkpointer.restore_errors(start, onebit_errors(state),
                                                      errors_layout(state, trainer.mesh))
            if errors is None:
                # DeepSpeed resets them on every load and reports no loss of convergence.
                mx.log(f"warning: {why}; 1-bit Adam's error buffers restart from zero")
        state = with_restored(state, extras, errors)
        state = state.replace(step=jnp.asarray(start, jnp.int32), params=params)
        if data_state is not None:
            batcher.set_state(data_state)  # the cursor, and the batch-size controller
        mx.log(f"resumed from step {start} ({checkpointer.directory})")
    elif cfg.checkpoint.init_from:
        params = ckpt.restore_params(cfg.checkpoint.init_from, state.params, cfg.model)
        state = state.replace(params=params)
        mx.log(f"initialised weights from {cfg.checkpoint.init_from}")
    start = start or 0
    batcher.step = start

    flops_tok = mx.flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = mx.peak_flops_per_device(cfg.metrics.peak_flops_per_device)
    peak_total = peak * jax.device_count()
    writer = mx.MetricsWriter(workdir, cfg.train.steps, cfg.metrics.tensorboard)
    mx.log(f"MFU is relative to {peak_total:.3g} FLOP/s ({peak_source}); "
           f"{flops_tok:.3g} model FLOPs/token")

    observer = _Observer(trainer, workdir)

    def save(step: int) -> None:
        errors = onebit_errors(state)
        checkpointer.save(step, state.params, train_extras(state), batcher.get_state(), cfg.model,
                          errors=errors,
                          errors_layout=None if errors is None else errors_layout(state,
                                                                                  trainer.mesh))

    pending = None  # (step index, device metrics) of the step dispatched last
    saved = start or 0  # the step of the newest checkpoint
    stopped = None  # why the run ended before train.steps
    skips_in_a_row = [0]
    last_time = time.perf_counter()
    step_times: list[float] = []
    shape_timed = [None]  # (batch, accum) whose step times `step_times` holds

    def drain(item) -> None:
        nonlocal last_time
        step_idx, m = item
        m = jax.device_get(m)
        now = time.perf_counter()
        dt, last_time = now - last_time, now
        if not bool(m["finite"]):
            skipping = cfg.train.nonfinite == "skip" or cfg.train.compute_dtype == "float16"
            skips_in_a_row[0] += 1
            if not skipping or skips_in_a_row[0] > cfg.train.max_consecutive_skips:
                why = (f"{skips_in_a_row[0]} consecutive non-finite steps" if skipping else
                       "train.nonfinite='stop'")
                raise TrainingError(
                    f"non-finite loss or gradient at step {step_idx + 1} (loss={float(m['loss'])}"
                    f", grad_norm={float(m['grad_norm'])}, {why}; {nonfinite_groups(m)}); "
                    f"stopping without writing a checkpoint. The last checkpoint in "
                    f"{checkpointer.directory} (step {saved}) is intact; lower optim.lr or check "
                    f"the data.")
            mx.log(f"skipped step {step_idx + 1}: non-finite loss or gradient (loss scale was "
                   f"{float(m['loss_scale']):g}; {int(m['skipped_steps'])} skipped so far; "
                   f"{nonfinite_groups(m)})")
        else:
            skips_in_a_row[0] = 0
        timed = step_idx > start and step_idx not in observer.untimed  # compile / profiler
        if shape_timed[0] != (m["batch_size"], m["accum_steps"]):  # a new shape (may compile)
            shape_timed[0], timed = (m["batch_size"], m["accum_steps"]), False
            step_times.clear()
        if timed:
            step_times.append(dt)
        batcher.observe(m, 1000 * dt if timed else None)  # adaptive batch size: the reading
        done = step_idx + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            typical = float(np.median(step_times[-50:])) if step_times else dt
            tps = m["batch_size"] * cfg.data.seq_len / typical
            record = {"step": done, "loss": float(m["loss"]), "lr": float(m["lr"]),
                      "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tps,
                      "samples_per_sec": m["batch_size"] / typical,
                      "step_ms": 1000 * typical, "mfu": tps * flops_tok / peak_total,
                      "loss_scale": float(m["loss_scale"]),
                      "skipped_steps": int(m["skipped_steps"])}
            record.update(batcher.record_fields(m, step_idx))
            record.update(observer.readings())
            if "onebit_compressed" in m:
                record["onebit_compressed"] = int(m["onebit_compressed"])
            record.update(moe_record(m))
            writer.write(record, eta_s=typical * (cfg.train.steps - done))

    stops = StopConditions(max_runtime_s, log=mx.log).__enter__()  # signal handlers until the end
    done = start
    try:
        for step_idx in range(start, cfg.train.steps):
            typical = float(np.median(step_times[-20:])) if step_times else 0.0
            stopped = stops.should_stop(step_idx, typical)
            if stopped:
                break
            host_batch, shape = batcher.next_batch()
            batch = trainer.device_batch(host_batch)
            if (step_idx + 1) % cfg.train.log_every == 0 or step_idx + 1 == cfg.train.steps:
                observer.measure_memory(state, batch)  # read by this step's record
            if observer.profile_due(step_idx):
                if pending is not None:
                    drain(pending)
                    pending = None
                state, m = observer.traced_step(step_idx, state, batch)
                last_time = time.perf_counter()
            else:
                state, m = trainer.step(state, batch)
            m.update(batcher.record(shape))  # host values: batch shape, memory, compilations
            if pending is not None:
                drain(pending)
            pending = (step_idx, m)
            done = step_idx + 1
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
                drain(pending)  # never checkpoint a step whose loss we have not seen
                pending = None
                save(done)
                saved = done
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                ev = evaluate.evaluate_params(trainer, state.params, splits.eval, cfg)
                writer.write_eval(done, ev)
                mx.log(f"eval at step {done}: loss {ev['eval_loss']:.4f}")
        if pending is not None:
            drain(pending)
        if done > saved:  # the end of training, or the step an early stop finished
            save(done)
            saved = done
    finally:
        stops.__exit__()
        trainer.programs.close()
        checkpointer.close()
        writer.close()
    if stopped:
        mx.log(f"stopped early at step {saved} of {cfg.train.steps} ({stopped}): checkpoint "
               f"written to {checkpointer.directory}; run the same command to resume")
        mx.update_summary(workdir, {"stopped_early": stopped, "steps_done": saved})
        return {"stopped_early": stopped, "steps_done": saved}

    history = writer.history
    summary = {
        "config": cfg.name, "mesh": sharding.describe(trainer.mesh),
        "param_count": trainer.param_count, "steps": cfg.train.steps,
        "final_train_loss": history[-1]["loss"] if history else None,
        "median_tokens_per_sec": mx.median_of(history, "tokens_per_sec"),
        "median_step_ms": mx.median_of(history, "step_ms"),
        "mfu": mx.median_of(history, "mfu"), "mfu_peak_source": peak_source,
        "flops_per_token": flops_tok,
        "pipeline_bubble": pipeline.bubble_fraction(cfg.pipeline.schedule, cfg.mesh.pipeline,
                                                    cfg.pipeline.microbatches,
                                                    cfg.pipeline.repeats,
                                                    moe=cfg.model.n_routed_experts > 0),
        **observer.summary(),
        **batcher.summary(),
    }
    mx.update_summary(workdir, summary)
    results = evaluate.evaluate_and_report(trainer, state.params, splits, cfg, workdir)
    writer_eval = {k: v for k, v in results.items() if isinstance(v, float)}
    mx.log("summary: " + ", ".join(f"{k}={v:.4g}" for k, v in writer_eval.items()))
    summary.update(results)
    return summary


class _Observer:
    """Memory, device utilisation and communication share for the run's records.

    Memory: the allocator's peak where the device keeps statistics (GPU), else the compiled step's
    `memory_analysis()` (measured once per step function). Communication share: every
    `metrics.profile_every` steps one step runs under `jax.profiler` (trace in tensorboard/), and
    its collective time over device time is reported until the next trace; that step is left out
    of the step-time median. Utilisation: NVML where present, absent (not 0) elsewhere.
    """

    def __init__(self, trainer: Trainer, workdir: str):
        self.trainer = trainer
        self.every = trainer.cfg.metrics.profile_every
        self.logdir = os.path.join(workdir, "tensorboard")
        self.device = trainer.mesh.local_devices[0]  # addressable by this process
        self.memory: dict[str, Any] = {}
        self.compiled_memory: dict[Any, dict[str, Any]] = {}
        self.comm: dict[str, Any] = {}
        self.untimed: set[int] = set()

    def measure_memory(self, state: TrainState, batch: dict[str, jax.Array]) -> None:
        reading = mx.memory_reading(self.device)
        if reading["peak_bytes"] is None:  # no allocator statistics: ask the compiler, once
            program = self.trainer.program_for(state, batch)  # compiled once per shape anyway
            if id(program) not in self.compiled_memory:
                self.compiled_memory[id(program)] = mx.memory_reading(self.device, program)
            reading = self.compiled_memory[id(program)]
        self.memory = reading

    def profile_due(self, step_idx: int) -> bool:
        # Never the first step of a process: it would trace compilation.
        return bool(self.every) and step_idx > 0 and (step_idx + 1) % self.every == 0

    def traced_step(self, step_idx: int, state: TrainState, batch: dict[str, jax.Array]):
        from dsjax.metrics import trace as profiling  # TEMP

        hlo = self.trainer.program_for(state, batch).as_text()
        (state, m), run_dir = profiling.trace_step(self.trainer.step, state, batch,
                                                   logdir=self.logdir, hlo_text=hlo)
        share = profiling.comm_share(run_dir)
        self.comm = {"comm_fraction": share["comm_fraction"],
                     "exposed_comm_fraction": share["exposed_comm_fraction"]}
        self.untimed.add(step_idx)
        mx.log(f"profiled step {step_idx + 1}: communication {100 * share['comm_fraction']:.1f}% "
               f"of device time ({100 * share['exposed_comm_fraction']:.1f}% not overlapped; "
               f"{', '.join(sorted(share['kinds'])) or 'no collectives'}); trace in "
               f"{run_dir}")
        return state, m

    def readings(self) -> dict[str, Any]:
        out = dict(self.comm)
        if self.memory.get("peak_bytes") is not None:
            out["mem_bytes"] = self.memory["peak_bytes"]
        util = mx.device_utilisation(self.device)
        if util is not None:
            out["device_utilisation"] = util
        return out

    def summary(self) -> dict[str, Any]:
        return {"mem_bytes": self.memory.get("peak_bytes"),
                "mem_source": self.memory.get("source"), **self.comm}
