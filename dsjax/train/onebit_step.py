"""1-bit Adam's train step (Tang et al. 2021, arXiv 2102.02888, as DeepSpeed runs it): each
data-parallel worker's gradient, reduced by the optimizer itself, exactly during warmup and 1-bit
compressed after the freeze (docs/onebit.md)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsjax import sharding
from dsjax.batching import accumulate, scale_updates
from dsjax.model import moe
from dsjax.optim import OneBitAdam
from dsjax.optim import loss_scale as ls
from dsjax.optim.compressed_allreduce import tree_sq_norm
from dsjax.train.step import TrainState, finish_step, finite_by_group

DATA = "data"  # the mesh axis 1-bit Adam reduces over (see dsjax.sharding.MESH_AXES)


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
                mean, local, aux = state.objective.loss_and_aux(params, micro, fp8_meta,
                                                                loss_scale.scale)
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
        (total, aux), grads, meta_grads = accumulate(micro_grads, batch, vary)
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
        return (optax.apply_updates(params, scale_updates(updates, lr_scale)),
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
    new_state, metrics = finish_step(state, loss, tokens, grad_norm, new_params, new_opt_state,
                                      meta_grads, finite_by_group(grads))  # every worker's
    metrics.update(moe.load_metrics(aux))
    metrics["onebit_compressed"] = jnp.asarray(int(compressed), jnp.int32)
    metrics["lr"] = metrics["lr"] * lr_scale
    return new_state, metrics


def onebit_init_and_phases(cfg: Any, mesh: Mesh, tx: OneBitAdam, init_unboxed: Any,
                           state_shardings: Any, typed: bool) -> tuple[Any, Any, tuple]:
    """1-bit Adam's jitted state init (moments sharded like the params, error buffers per worker,
    `OneBitAdam.state_specs`), the state shardings with its optimizer state, and its two steps
    (warmup, compressed) for `Trainer.phase_fns`. `init_unboxed(rng)`: the state without
    optimizer state."""
    param_specs = jax.tree.map(lambda sh: sh.spec, state_shardings.params)
    opt_specs = tx.state_specs(param_specs)  # one spec per error group: a prefix
    # optim.hierarchical: the optimizer runs on the host view of the mesh (its specs name the
    # view's axes; `from_host_view` gives the same sharding on `mesh`).
    opt_mesh = sharding.hierarchical_view(cfg, mesh) if tx.fast_axis is not None else None

    def init_onebit(rng):
        state = init_unboxed(rng)
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
                              clip_norm=cfg.optim.clip_norm, typed=typed, opt_mesh=opt_mesh,
                              with_aux=cfg.model.num_mtp_layers > 0)
    return init_fn, state_shardings, tuple(functools.partial(phase, compressed=c)
                                           for c in (False, True))
