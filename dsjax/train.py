"""Training: sharded state init, the module-level pure `train_step`, and the loop.

The one idea: shardings are derived without allocating (`eval_shape` of the boxed init gives
logical axis names -> the rules table gives NamedShardings), then `jit(init, out_shardings=...)`
materialises the state directly in place, and `train_step` is jitted once with the same shardings
and a donated state. The host reads step n-1's metrics after it has dispatched step n.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from dsjax import checkpoint as ckpt
from dsjax import fp8, remat
from dsjax import metrics as mx
from dsjax import sharding
from dsjax.config import Config
from dsjax.model import Transformer, count_params, weighted_cross_entropy
from dsjax.optim import loss_scale as ls
from dsjax.optim import make_optimizer

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says why and where."""


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: ls.LossScale  # float16: dynamic scale; otherwise fixed 1, counts skipped steps
    fp8_meta: Any  # delayed fp8 scaling state ({} otherwise): never seen by the optimizer
    apply_fn: Callable = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    lr_fn: Callable = struct.field(pytree_node=False)
    fp8_margin: float = struct.field(pytree_node=False, default=0.0)


def make_model(cfg: Config, layer_policies: tuple[str, ...] | None = None, unroll: bool = False,
               for_eval: bool = False) -> Transformer:
    """The decoder `cfg` describes: compute dtype, fp8 precision policy, per-layer remat."""
    L = cfg.model.num_layers
    if layer_policies is None:
        layer_policies = remat.layer_policies(cfg.remat.policy, cfg.remat.layers, L)
    if cfg.train.compute_dtype != "fp8":
        return Transformer(cfg.model, dtype=COMPUTE_DTYPES[cfg.train.compute_dtype],
                           layer_policies=layer_policies, scan_unroll=unroll)
    f = cfg.fp8
    fp8_layers = tuple(f.keep_first_layers <= i < L - f.keep_last_layers for i in range(L))
    # Delayed scaling's amax history is training state; eval scales each tensor by itself.
    recipe = "current" if for_eval and f.recipe == "delayed" else f.recipe
    return Transformer(cfg.model, dtype=COMPUTE_DTYPES[f.other_dtype],
                       layer_policies=layer_policies, scan_unroll=unroll,
                       fp8_matmuls=f.matmul_names, fp8_recipe=recipe,
                       fp8_history=f.history_len, fp8_layers=fp8_layers)


def loss_fn(params: Any, apply_fn: Callable, batch: dict[str, jax.Array], fp8_meta: Any = None
            ) -> tuple[jax.Array, jax.Array]:
    """Mean next-token NLL over weighted positions, and the weight sum."""
    variables = {"params": params}
    if fp8_meta:
        variables[fp8.META_COLLECTION] = fp8_meta
    logits = apply_fn(variables, batch["inputs"], batch["positions"], batch["segment_ids"])
    total, count = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return total / jnp.maximum(count, 1.0), count


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
    """One optimizer step. A non-finite loss or gradient leaves params, optimizer state and fp8
    state as they were (so nothing non-finite can be checkpointed), halves a float16 loss scale,
    and reports `finite = False`; the host decides whether to stop (train.nonfinite)."""
    def scaled_loss(params, fp8_meta):
        loss, tokens = loss_fn(params, state.apply_fn, batch, fp8_meta)
        return ls.scale_loss(state.loss_scale, loss), (loss, tokens)

    (_, (loss, tokens)), (grads, meta_grads) = jax.value_and_grad(
        scaled_loss, argnums=(0, 1), has_aux=True)(state.params, state.fp8_meta)
    grads = ls.unscale_grads(state.loss_scale, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    new_meta = fp8.commit(state.fp8_meta, meta_grads, state.fp8_margin) if state.fp8_meta else {}
    params, opt_state, fp8_meta = ls.select(finite, (new_params, new_opt_state, new_meta),
                                            (state.params, state.opt_state, state.fp8_meta))
    new_state = state.replace(step=state.step + finite.astype(state.step.dtype), params=params,
                              opt_state=opt_state, fp8_meta=fp8_meta,
                              loss_scale=ls.update(state.loss_scale, finite))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": state.lr_fn(state.step),
               "finite": finite, "tokens": tokens, "loss_scale": state.loss_scale.scale,
               "skipped_steps": new_state.loss_scale.skipped_steps}
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
    step_fn: Callable
    param_count: int

    def init(self, seed: int | None = None) -> TrainState:
        seed = self.cfg.train.seed if seed is None else seed
        with sharding.activate(self.mesh, self.rules):
            return self.init_fn(jax.random.key(seed))

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        with sharding.activate(self.mesh, self.rules):
            return self.step_fn(state, batch)

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Process-local numpy batch -> global arrays sharded over `data`."""
        return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], host_batch[k])
                for k in BATCH_KEYS}


def build_trainer(cfg: Config, mesh: Mesh | None = None) -> Trainer:
    mesh = sharding.make_mesh(cfg) if mesh is None else mesh
    sharding.validate_mesh(cfg, mesh.size)
    rules = sharding.logical_rules(cfg.mesh.fsdp)
    if cfg.remat.policy == "auto":
        from dsjax import remat_plan  # compiles candidate policies; only needed for "auto"
        policy, layers, _ = remat_plan.choose(cfg, mesh, log=mx.log)
        cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy=policy,
                                                                 layers=layers))
    model = make_model(cfg)
    tx, lr_fn = make_optimizer(cfg.optim, cfg.train.steps)
    dummy = jnp.zeros((1, min(cfg.data.seq_len, 8)), jnp.int32)
    loss_scale = (ls.dynamic_scale(cfg.train.loss_scale_init, cfg.train.loss_scale_growth)
                  if cfg.train.compute_dtype == "float16" else ls.skip_policy())

    def init_boxed(rng):
        variables = model.init(rng, dummy)
        params = variables["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          loss_scale=loss_scale, fp8_meta=variables.get(fp8.META_COLLECTION, {}),
                          apply_fn=model.apply, tx=tx, lr_fn=lr_fn, fp8_margin=cfg.fp8.margin)

    # Optimizer moments mirror the boxed params, so they inherit the same logical axis names.
    abstract = jax.eval_shape(init_boxed, jax.random.key(0))
    state_shardings = sharding.logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
    init_fn = jax.jit(lambda rng: nn.unbox(init_boxed(rng)), out_shardings=state_shardings)
    batch_shardings = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
    step_fn = jax.jit(train_step, in_shardings=(state_shardings, batch_shardings),
                      out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
    return Trainer(cfg, mesh, model, make_model(cfg, for_eval=True), rules, state_shardings, batch_shardings, init_fn, step_fn,
                   count_params(abstract.params))


def train_extras(state: TrainState) -> dict[str, Any]:
    """Everything besides params that defines the run's future, as checkpointed."""
    return {"opt_state": state.opt_state, "loss_scale": state.loss_scale,
            "fp8_meta": state.fp8_meta}


def abstract_state(trainer: Trainer) -> TrainState:
    """The state's shapes, dtypes and target shardings, without allocating."""
    with sharding.activate(trainer.mesh, trainer.rules):
        shapes = jax.eval_shape(trainer.init_fn, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, trainer.state_shardings)


def run(cfg: Config, workdir: str) -> dict[str, Any]:
    """Trains `cfg` in `workdir` (resuming from its latest checkpoint), evaluates, writes summary."""
    from dsjax import evaluate  # local: evaluate imports train for the trainer
    from dsjax.data import train_iterator

    os.makedirs(workdir, exist_ok=True)
    trainer = build_trainer(cfg)
    mx.log(f"dsjax: config {cfg.name} | mesh {sharding.describe(trainer.mesh)} | "
           f"{trainer.param_count:,} params | compute {cfg.train.compute_dtype} | "
           f"devices {jax.device_count()} x {jax.devices()[0].device_kind}")
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            f.write(cfg.to_json())

    splits = evaluate.data_splits(cfg, workdir)
    per_process = cfg.data.global_batch // jax.process_count()
    data_it = train_iterator(splits.train, cfg.data.seq_len, per_process, cfg.train.seed,
                             jax.process_index(), jax.process_count(), prefetch=cfg.data.prefetch)

    checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.keep,
                                     cfg.checkpoint.async_save)
    state = trainer.init()
    start = checkpointer.latest_step()
    if start is not None:
        params, extras, data_state = checkpointer.restore(start, state.params,
                                                          train_extras(state), cfg.model)
        state = state.replace(step=jnp.asarray(start, jnp.int32), params=params, **extras)
        if data_state is not None:
            data_it.set_state(data_state)
        mx.log(f"resumed from step {start} ({checkpointer.directory})")
    elif cfg.checkpoint.init_from:
        params = ckpt.restore_params(cfg.checkpoint.init_from, state.params, cfg.model)
        state = state.replace(params=params)
        mx.log(f"initialised weights from {cfg.checkpoint.init_from}")
    start = start or 0

    flops_tok = mx.flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = mx.peak_flops_per_device(cfg.metrics.peak_flops_per_device)
    peak_total = peak * jax.device_count()
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    writer = mx.MetricsWriter(workdir, cfg.train.steps, cfg.metrics.tensorboard)
    mx.log(f"MFU is relative to {peak_total:.3g} FLOP/s ({peak_source}); "
           f"{flops_tok:.3g} model FLOPs/token")

    pending = None  # (step index, device metrics) of the step dispatched last
    skips_in_a_row = [0]
    last_time = time.perf_counter()
    step_times: list[float] = []

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
                    f", grad_norm={float(m['grad_norm'])}, {why}); stopping without writing a "
                    f"checkpoint. The last checkpoint in {checkpointer.directory} is intact; "
                    f"lower optim.lr or check the data.")
            mx.log(f"skipped step {step_idx + 1}: non-finite loss or gradient (loss scale was "
                   f"{float(m['loss_scale']):g}; {int(m['skipped_steps'])} skipped so far)")
        else:
            skips_in_a_row[0] = 0
        if step_idx > start:  # the first step of a process includes compilation
            step_times.append(dt)
        done = step_idx + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            typical = float(np.median(step_times[-50:])) if step_times else dt
            tps = tokens_per_step / typical
            record = {"step": done, "loss": float(m["loss"]), "lr": float(m["lr"]),
                      "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tps,
                      "samples_per_sec": cfg.data.global_batch / typical,
                      "step_ms": 1000 * typical, "mfu": tps * flops_tok / peak_total,
                      "batch_size": cfg.data.global_batch}
            writer.write(record, eta_s=typical * (cfg.train.steps - done))

    try:
        for step_idx in range(start, cfg.train.steps):
            batch = trainer.device_batch(next(data_it))
            state, m = trainer.step(state, batch)
            if pending is not None:
                drain(pending)
            pending = (step_idx, m)
            done = step_idx + 1
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
                drain(pending)  # never checkpoint a step whose loss we have not seen
                pending = None
                checkpointer.save(done, state.params, train_extras(state), data_it.get_state(),
                                  cfg.model)
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                ev = evaluate.evaluate_params(trainer, state.params, splits.eval, cfg)
                writer.write_eval(done, ev)
                mx.log(f"eval at step {done}: loss {ev['eval_loss']:.4f}")
        if pending is not None:
            drain(pending)
        if start < cfg.train.steps:
            checkpointer.save(cfg.train.steps, state.params, train_extras(state),
                              data_it.get_state(), cfg.model)
    finally:
        checkpointer.close()
        writer.close()

    history = writer.history
    summary = {
        "config": cfg.name, "mesh": sharding.describe(trainer.mesh),
        "param_count": trainer.param_count, "steps": cfg.train.steps,
        "final_train_loss": history[-1]["loss"] if history else None,
        "median_tokens_per_sec": mx.median_of(history, "tokens_per_sec"),
        "median_step_ms": mx.median_of(history, "step_ms"),
        "mfu": mx.median_of(history, "mfu"), "mfu_peak_source": peak_source,
        "flops_per_token": flops_tok,
    }
    mx.update_summary(workdir, summary)
    results = evaluate.evaluate_and_report(trainer, state.params, splits, cfg, workdir)
    writer_eval = {k: v for k, v in results.items() if isinstance(v, float)}
    mx.log("summary: " + ", ".join(f"{k}={v:.4g}" for k, v in writer_eval.items()))
    summary.update(results)
    return summary


def losses_for(cfg: Config, batches: list[dict[str, np.ndarray]], mesh: Mesh | None = None,
               state: TrainState | None = None) -> tuple[list[float], TrainState]:
    """Runs `train_step` over host batches and returns the losses (used by tests and tools)."""
    trainer = build_trainer(cfg, mesh)
    state = trainer.init() if state is None else state
    losses = []
    for b in batches:
        state, m = trainer.step(state, trainer.device_batch(b))
        losses.append(float(m["loss"]))
    return losses, state
