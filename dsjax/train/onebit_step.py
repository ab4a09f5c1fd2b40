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
from dsjax.model.loss import objective_value, weigh_aux
from dsjax.optim import OneBitAdam
from dsjax.optim import loss_scale as ls
from dsjax.optim.compressed_allreduce import tree_sq_norm
from dsjax.train.step import TrainState, finish_step

DATA = sharding.DATA  # the mesh axis 1-bit Adam reduces over


def _clip(grads: Any, norm: jax.Array, clip_norm: float) -> Any:
    """optax.clip_by_global_norm's arithmetic, given the norm."""
    if not clip_norm:
        return grads
    return jax.tree.map(lambda g: jnp.where(norm < clip_norm, g, (g / norm) * clip_norm), grads)


def _owned(spec: P) -> bool:
    """Is a param with this spec split over `data` (a routed expert under expert parallelism)?"""
    return any(entry == DATA or (isinstance(entry, tuple) and DATA in entry) for entry in spec)


def _data_part(spec: P) -> P:
    """The part of a param's spec that names `data` (block 1's in_spec: manual over it only)."""
    return P(*(DATA if entry == DATA else None for entry in spec))


def _on_view(param_specs: Any, opt: OneBitAdam, opt_mesh: Mesh | None) -> Any:
    """The params' specs on the optimizer's mesh: with optim.hierarchical an expert's `data`
    is the host view's (hosts, workers per host), the same devices in the same order."""
    if opt_mesh is None:
        return param_specs
    return jax.tree.map(lambda spec: P(*(opt.data_axes if entry == DATA else entry
                                         for entry in spec)),
                        param_specs, is_leaf=lambda x: isinstance(x, P))


def onebit_step(state: TrainState, batch: dict[str, jax.Array], *, compressed: bool,
                param_specs: Any, clip_norm: float, typed: bool = True,
                opt_mesh: Mesh | None = None, lr_scale: float = 1.0, with_aux: bool = False
                ) -> tuple[TrainState, dict]:
    """One 1-bit Adam step (Tang et al. 2021; DeepSpeed's OnebitAdam), warmup or `compressed`.

    `param_specs`: the params' mesh PartitionSpecs; only a MoE model's routed experts may name
    `data` (expert parallelism): they are owned by their device, their gradient arrives whole
    through the all-to-all's transpose, and they take exact Adam in both phases (docs/onebit.md,
    "MoE"). Bind it, `compressed`,
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
    has auxiliary terms (MTP, MoE): each worker adds its rows' aux_loss, weighted by its share of
    the tokens like its NLL, and the metrics report them averaged the same way; expert loads are
    counts, summed over workers, and move the router biases as in `train_step`.
    """
    opt: OneBitAdam = state.tx
    owned = jax.tree.map(_owned, param_specs, is_leaf=lambda x: isinstance(x, P))
    # The model's activation constraints name `data` (act_batch); inside a shard_map that is
    # manual over `data` a constraint may only name the other (auto) axes. Same table otherwise,
    # plus where the experts live: the MoE layer finds that axis manual and exchanges its tokens
    # itself (a nested shard_map over `data` would split its blocks again).
    rules = nn.get_logical_axis_rules()
    local_rules = tuple((name, None if axis == DATA else axis) for name, axis in rules) + tuple(
        (moe.EXPERT_MANUAL, axis) for name, axis in rules if name == moe.EXPERT and axis == DATA)

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
            # MTP, MoE balance (pipelined or not): token-weighted like the NLL; loads: counts.
            aux = weigh_aux(aux, local) if with_aux else {}
            return (ls.scale_loss(loss_scale, objective_value(total, aux) * share),
                    (total, aux))

        if typed:
            # Varying over `data`: jax.grad then returns this worker's gradient instead of
            # inserting its own all-reduce (DESIGN invariant 3). Owned experts vary already.
            params = jax.tree.map(lambda p, o: p if o else lax.pcast(p, DATA, to="varying"),
                                  params, owned)
            fp8_meta = lax.pcast(fp8_meta, DATA, to="varying")

        def micro_grads(micro):
            (_, sums), (grads, meta_grads) = jax.value_and_grad(
                objective, argnums=(0, 1), has_aux=True)(params, fp8_meta, micro)
            return sums, grads, meta_grads

        vary = (lambda t: lax.pcast(t, DATA, to="varying")) if typed else (lambda t: t)
        (total, aux), grads, meta_grads = accumulate(micro_grads, batch, vary)
        grads = ls.unscale_grads(loss_scale, grads)
        # An owned expert's gradient sums every worker's objective, each W x its share of the
        # mean loss (`share`): W x the mean loss's gradient. The others' mean over workers is it.
        w = lax.axis_size(DATA)
        grads = jax.tree.map(lambda g, o: g / w if o else g[None], grads, owned)
        loss = lax.psum(total, DATA) / jnp.maximum(count, 1.0)
        aux = {k: lax.psum(v, DATA) if k == "moe_load" else
               lax.psum(v, DATA) / jnp.maximum(count, 1.0) for k, v in aux.items()}
        # fp8 amax observations of this worker's activations: the global amax is their max.
        meta_grads = jax.tree.map(lambda g: lax.pmax(g, DATA), meta_grads)
        return grads, loss, count, meta_grads, aux

    # fp8's custom VJP returns per-worker amax observations as cotangents of its scaling inputs,
    # typed varying for an invariant input (current scaling's constants) or invariant for a
    # varying one (delayed: the scale), which a typed (check_vma) shard_map rejects. Untyped,
    # jax.grad inserts no all-reduce either: the gradients are the worker's own all the same.
    # Block 1's specs: experts [..., E, ...] -> this device's [..., E/W, ...], gradients the
    # same; other params whole, their gradients [1, ...] per worker, global [W, ...].
    local_specs = jax.tree.map(_data_part, param_specs, is_leaf=lambda x: isinstance(x, P))
    local_grad_specs = jax.tree.map(lambda spec, o: spec if o else P(DATA), local_specs, owned,
                                    is_leaf=lambda x: isinstance(x, P))
    grads, loss, tokens, meta_grads, aux = jax.shard_map(
        local_grads, in_specs=(local_specs, P(), P(), P(DATA) if batch["inputs"].ndim == 2 else
                               P(None, DATA)), out_specs=(local_grad_specs, P(), P(), P(), P()),
        axis_names={DATA}, check_vma=typed)(state.params, state.fp8_meta, state.loss_scale,
                                             batch)

    # Block 2, manual over every axis: the buckets hold this device's shards. grads [1, ...]
    # local (this worker's), params and moments this device's shards, errors [1, n_b/...].
    def update(grads, opt_state, params):
        grads = jax.tree.map(lambda g, o: g if o else g[0], grads, owned)
        if compressed:
            # Per-worker leaves: the workers' root mean square; owned: their one norm.
            split = lambda keep: [g for g, o in zip(jax.tree.leaves(grads),
                                                    jax.tree.leaves(owned)) if o == keep]
            grad_norm = jnp.sqrt(lax.pmean(tree_sq_norm(split(False), opt.data_axes),
                                           opt.data_axes) + tree_sq_norm(split(True)))
            updates, opt_state = opt.compressed_update(_clip(grads, grad_norm, clip_norm),
                                                       opt_state, params)
        else:
            grads = opt.mean_gradient(grads, params)
            grad_norm = jnp.sqrt(tree_sq_norm(grads))
            updates, opt_state = opt.exact_update(_clip(grads, grad_norm, clip_norm),
                                                  opt_state, params)
        return (optax.apply_updates(params, scale_updates(updates, lr_scale)),
                opt_state, grad_norm)

    # Hierarchical: on `opt_mesh` (the same devices, `data` seen as hosts x workers per host) the
    # grads' P(DATA) is P(opt.data_axes), and the optimizer's specs name the view's axes.
    view_specs = _on_view(param_specs, opt, opt_mesh)
    opt_specs = opt.state_specs(view_specs, owned=True)
    data_spec = DATA if opt_mesh is None else opt.data_axes
    grad_specs = jax.tree.map(lambda spec, o: spec if o else P(data_spec, *spec), view_specs,
                              owned, is_leaf=lambda x: isinstance(x, P))
    with sharding.on_view(opt_mesh):
        new_params, new_opt_state, grad_norm = jax.shard_map(
            update, mesh=opt_mesh, in_specs=(grad_specs, opt_specs, view_specs),
            out_specs=(view_specs, opt_specs, P()))(grads, state.opt_state, state.params)
    new_state, metrics = finish_step(state, batch, lr_scale, loss, tokens, aux,
                                     grads,  # every worker's: the report names a bad one
                                     grad_norm, new_params, new_opt_state, meta_grads,
                                     per_worker=jax.tree.map(lambda o: not o, owned))
    metrics["onebit_compressed"] = jnp.asarray(int(compressed), jnp.int32)
    return new_state, metrics


def onebit_init_and_phases(cfg: Any, mesh: Mesh, tx: OneBitAdam, init_unboxed: Any,
                           state_shardings: Any, typed: bool) -> tuple[Any, Any, tuple]:
    """1-bit Adam's jitted state init (moments sharded like the params, error buffers per worker,
    `OneBitAdam.state_specs`), the state shardings with its optimizer state, and its two steps
    (warmup, compressed) for `Trainer.phase_fns`. `init_unboxed(rng)`: the state without
    optimizer state."""
    param_specs = jax.tree.map(lambda sh: sh.spec, state_shardings.params)
    # optim.hierarchical: the optimizer runs on the host view of the mesh (its specs name the
    # view's axes; `from_host_view` gives the same sharding on `mesh`).
    opt_mesh = sharding.hierarchical_view(cfg, mesh) if tx.fast_axis is not None else None
    view_specs = _on_view(param_specs, tx, opt_mesh)
    opt_specs = tx.state_specs(view_specs, owned=True)  # one spec per error group: a prefix

    def init_onebit(rng):
        state = init_unboxed(rng)
        with sharding.on_view(opt_mesh):
            opt_state = jax.shard_map(tx.init, mesh=opt_mesh or mesh, in_specs=(view_specs,),
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
                              with_aux=cfg.model.num_mtp_layers > 0 or cfg.model.is_moe)
    return init_fn, state_shardings, tuple(functools.partial(phase, compressed=c)
                                           for c in (False, True))
