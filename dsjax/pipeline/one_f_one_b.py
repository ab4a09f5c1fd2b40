"""The 1F1B schedule (PipeDream-Flush) and its interleaved form (Megatron-LM's virtual stages):
forwards and backwards alternate in one `lax.scan`, gradients by hand (per-unit `jax.vjp`),
wrapped in a `jax.custom_vjp` so the caller differentiates it like any loss. Activation memory
is flat in the number of microbatches. See docs/pipeline.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax import fp8
from dsjax.sharding import varying_axes
from dsjax.model.decoder import FP8_ON
from dsjax.model.batch import BATCH_KEYS
from dsjax.pipeline import stash
from dsjax.pipeline.stages import (FRONT_BATCH_KEYS, PREFIX_META, STAGE, StagedModel,
                                   aux_terms, front_params, head_nll, heavy_front, index,
                                   interleave, mtp_terms, run_chunk, split_params, stage0_input,
                                   stage_specs, ticks)


def one_f_one_b_loss(pipe: StagedModel, params: Any, meta: Any, micro: dict[str, jax.Array],
                     count: jax.Array, mtp_count: jax.Array, seed: Any = 1.0
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean NLL, the model's aux terms) whose gradient (w.r.t. params and, for delayed fp8, the
    amax observations of fp8_meta) the schedule computes itself: the NLL carries the gradient of
    the objective NLL + aux_loss (see `Pipelined.loss_and_aux`). `seed`: the cotangent its
    backward starts from, the float16 loss scale, so that the backward runs at the scaled
    magnitude that keeps float16 gradients from underflowing; the caller's own cotangent is
    applied relative to it."""
    seed = jnp.asarray(seed, jnp.float32)

    @jax.custom_vjp
    def objective(params, meta):
        return _one_f_one_b(pipe, params, meta, micro, count, mtp_count, seed)[0]

    def fwd(params, meta):
        out, grads, meta_grads = _one_f_one_b(pipe, params, meta, micro, count, mtp_count, seed)
        return out, (grads, meta_grads)

    def bwd(res, ct):
        grads, meta_grads = res
        # Only the objective's cotangent: the NLL, balance and load values carry no gradient.
        # The grads are seed x the objective's gradient (exact: the loss scale is a power of
        # two). The observed amaxes are not scaled by the loss cotangent (as in fp8's own VJP).
        rel = ct[0] / seed
        return jax.tree.map(lambda g: g * rel.astype(g.dtype), grads), meta_grads

    objective.defvjp(fwd, bwd)
    value, (nll, balance, load_LE, mtp) = objective(params, meta)
    return (lax.stop_gradient(nll) + (value - lax.stop_gradient(value)),
            aux_terms(pipe, *lax.stop_gradient((balance, load_LE, mtp)), mtp_count))


def _zeros(shapes: Any, typed: bool) -> Any:
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return lax.pcast(zeros, STAGE, to="varying") if typed and jax.tree.leaves(zeros) else zeros


def _varying(tree: Any, typed: bool) -> Any:
    """`tree` typed as varying over the stages (what the stash and lax.cond's other branch
    hold): a residual computed from replicated values alone (a mask from the segment ids) is
    not, when it leaves its branch."""
    if not typed:
        return tree
    return jax.tree.map(lambda x: x if STAGE in varying_axes(x)
                        else lax.pcast(x, STAGE, to="varying"), tree)


def stash_slots(S: int, R: int) -> int:
    """Ring slots: a unit's residuals live at most 2(RS - 1) ticks (docs/pipeline.md)."""
    return 2 * R * S - 1


class TickPlan(NamedTuple):
    """What stage s does at tick t: a forward unit and a backward unit, each (busy?, microbatch,
    chunk, stash slot); idle units carry a clipped, in-range microbatch and chunk."""
    on_f: Any
    mf: Any
    rf: Any
    put_at: Any
    on_b: Any
    mb: Any
    rb: Any
    take_at: Any


def tick_plan(t: Any, s: Any, S: int, R: int, M: int) -> TickPlan:
    """Stage s runs forward unit u = t - s and backward unit w = t - lag + s of its R*M units.
    Units go in groups of S microbatches, each group through the stage's chunk 0, 1, ..., R-1
    forward and R-1, ..., 0 backward, so a unit's input arrives from the previous stage (stage
    0: from the last, one chunk earlier) the tick before, and the unit leaving the last stage
    turns around in the same tick. Works on Python ints and traced arrays alike."""
    N, K, lag = R * M, stash_slots(S, R), (R + 1) * S - 2

    def unit(u):
        group, rem = u // (S * R), u % (S * R)
        return group * S + rem % S, rem // S

    u, w = t - s, t - lag + s
    mf, rf = unit(jnp.clip(u, 0, N - 1))
    wc = jnp.clip(w, 0, N - 1)
    mb, r = unit(wc)
    rb = R - 1 - r
    # The residuals of (mb, rb): forward unit rb*S + mb % S of the same group.
    take_at = ((wc // (S * R)) * (S * R) + rb * S + wc % S) % K
    return TickPlan((u >= 0) & (u < N), mf, rf, u % K, (w >= 0) & (w < N), mb, rb, take_at)


def _one_f_one_b(pipe: StagedModel, params: Any, meta: Any, micro: dict[str, jax.Array],
                 count: jax.Array, mtp_count: jax.Array, seed: jax.Array
                 ) -> tuple[Any, Any, Any]:
    """((objective, (mean NLL, MoE balance sum, loads [L, E]; None, None if dense; MTP sums,
    `mtp_terms`)), `seed` x the objective's gradient w.r.t. params, fp8 amax observations) by the 1F1B
    schedule, interleaved over R = `pipe.per_stage` layer chunks per stage. The objective is the
    mean NLL plus, for MoE models, alpha x the balance terms summed over layers and averaged
    over microbatches, plus mtp_loss_weight x the mean of the MTP modules' losses
    (`Pipelined.loss_and_aux`). `mtp_count`: each module's weight sum [n]."""
    S, M, R = pipe.stages, pipe.microbatches, pipe.per_stage
    T, K = ticks(pipe.schedule, S, M, R), stash_slots(S, R)
    # A lap of the ring ends on the last stage; interleaved, it continues on stage 0.
    wrap = range(S if R > 1 else S - 1)
    model, chunk_model = pipe.model, pipe.chunk_model()
    moe = model.cfg.is_moe
    # MoE stages run in every tick, idle or not, instead of under a `lax.cond` that only some
    # stages take: collectives inside such a branch (the experts' all-to-all over `data`, GSPMD's
    # resharding of experts) deadlock XLA:CPU, whose collective-permute rendezvous waits for
    # every device, or fail XLA's SPMD partitioner. The bubble is then 2(S-1) ticks, not S-1.
    branchless = moe
    n_mtp = model.cfg.num_mtp_layers
    chunks, top = split_params(pipe, params, meta)
    has_meta = fp8.META_COLLECTION in chunks
    typed = pipe.typed
    inv_count = 1.0 / jnp.maximum(count, 1.0)
    inv_mtp = 1.0 / jnp.maximum(mtp_count, 1.0)

    # Block: manual over `pipeline`. chunks [L/S, ...], top and micro [M, B/M, S] replicated
    # -> loss (psummed), layer grads [L/S, ...] and meta observations, top grads (psummed);
    # MoE: the balance sum (psummed) and this stage's loads [R, Lc, E] (chunk r*S + s at r).
    def body(chunks, top, micro, inv_count, inv_mtp, seed):
        stage_vars = interleave(jax.tree.map(  # [L/S, ...] -> [R, Lc, ...]
            lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), chunks), S, R)
        if typed:
            # Varying: each stage's vjp then returns its own gradient of the replicated params
            # instead of one all-reduced inside the loop (DESIGN invariant 3).
            top = lax.pcast(top, STAGE, to="varying")
        s = lax.axis_index(STAGE)
        first, last = s == 0, s == S - 1
        pos, seg = micro["positions"], micro["segment_ids"]

        def stage(variables, x_BSD, aux):  # (y, MoE stats or None); aux: (positions, segs)
            return run_chunk(chunk_model, variables, x_BSD, *aux)

        def embed(front, _, aux):  # `front`: `front_params` of top; aux: microbatch arrays
            return stage0_input(pipe, front, aux)

        def stage_aux(m):
            return pos[m], seg[m]

        def embed_aux(m):
            return {k: micro[k][m] for k in FRONT_BATCH_KEYS if k in micro}

        # What stage 0 differentiates before the stages: the embedding, the dense prefix (with
        # delayed fp8 also its state, whose "gradient" is the amax observations), the tower.
        def front(top):
            return front_params(pipe, top)

        def head(top, y_BSD, m):
            """(this microbatch's share of the objective, (its NLL share, MTP sums))."""
            nll = head_nll(model, top, y_BSD, micro["targets"][m],
                            micro["weights"][m]) * inv_count
            mtp = mtp_terms(pipe, top, y_BSD, {k: micro[k][m] for k in BATCH_KEYS})
            value = nll
            if mtp:
                value += model.cfg.mtp_loss_weight * jnp.mean(mtp["nll"] * inv_mtp)
            if "balance" in mtp:
                value += model.cfg.aux_loss_alpha * jnp.sum(mtp["balance"]) / M
            return value, (nll, mtp)

        x_shape = jax.eval_shape(embed, front(top), (), embed_aux(0))
        zero_x = _zeros(x_shape, typed)
        # The pullbacks of the stage and of stage 0's input, traced once: which residuals each
        # microbatch stashes until its backward tick, and the shared ones (from the params).
        m0 = s * 0  # a traced index, as the ticks' are (a constant one slices statically)
        stage_res = stash.stack([stash.plan(stage, index(stage_vars, r), zero_x, stage_aux(m0))
                                 for r in range(R)])
        embed_res = stash.plan(embed, front(top), (), embed_aux(m0))
        # Gradients of the params and fp8 observations; the fp8 switch flags have none.
        grad_shapes = jax.eval_shape(lambda: ({k: v for k, v in stage_vars.items()
                                               if k != FP8_ON}, top))
        out_shapes = jax.eval_shape(lambda: stage(index(stage_vars, 0), zero_x, stage_aux(0)))
        # The objective's cotangent of a stage's MoE stats: alpha / M per layer's balance term
        # (the aux loss averages microbatches), none for the loads (counts, no gradient).
        stats_ct = (None if not moe else
                    {"balance": jnp.full(out_shapes[1]["balance"].shape,
                                         model.cfg.aux_loss_alpha / M, jnp.float32) * seed,
                     "load": jnp.zeros(out_shapes[1]["load"].shape, jnp.float32)})
        if typed and moe:
            stats_ct = lax.pcast(stats_ct, STAGE, to="varying")

        def tick(carry, t):
            fwd_BSD, bwd_BSD, stage_ring, embed_ring, acc, loss, stats_acc, mtp_acc = carry
            # The forward unit's residuals go to its ring slot also when idle: that slot's
            # last unit has had its backward (docs/pipeline.md).
            plan = tick_plan(t, s, S, R, M)
            on_f, mf, rf, put_at = plan.on_f, plan.mf, plan.rf, plan.put_at
            enter = first & (rf == 0)  # the unit enters the pipeline: stage 0's input
            leave = last & (rf == R - 1)  # it leaves it: the head and the loss

            def embed_forward():
                return _varying(embed_res.forward(embed, front(top), (), embed_aux(mf)), typed)
            if heavy_front(pipe):  # dense blocks, a vision tower: only stage 0 runs them
                in_BSD, embed_leaves = lax.cond(
                    enter, embed_forward,
                    lambda: (fwd_BSD, _zeros(embed_res.stash_shapes, typed)))
            else:
                x0_BSD, embed_leaves = embed_forward()
                in_BSD = jnp.where(enter, x0_BSD, fwd_BSD)
            embed_ring = stash.put(embed_ring, embed_leaves, put_at)

            def stage_forward():
                return _varying(stage_res.forward(stage, index(stage_vars, rf), in_BSD,
                                                  stage_aux(mf)), typed)
            if branchless:  # an idle slot runs on filler; its stats count for nothing
                (y_BSD, stats), stage_leaves = stage_forward()
                stats = jax.tree.map(lambda a: jnp.where(on_f, a, 0.0), stats)
            else:
                (y_BSD, stats), stage_leaves = lax.cond(
                    on_f, stage_forward,
                    lambda: _zeros(jax.eval_shape(stage_forward), typed))
            stats_acc = jax.tree.map(lambda a, x: a.at[rf].add(x), stats_acc, stats)  # 0 if idle
            stage_ring = stash.put(stage_ring, stage_leaves, put_at)

            # The last stage turns its output into the loss and the loss gradient at once.
            def loss_and_grad(scale=1.0):
                value, vjp, aux = jax.vjp(lambda top, y: head(top, y, mf), top, y_BSD,
                                          has_aux=True)
                d_top, dy = vjp(jnp.ones_like(value) * (scale * seed))
                return aux, d_top, dy
            if branchless and n_mtp:  # MoE blocks in the MTP modules: no branch (see above)
                use = (on_f & leave).astype(jnp.float32)
                (nll, mtp), d_top_head, dy_BSD = jax.tree.map(
                    lambda a: jnp.where(use > 0, a, 0.0), loss_and_grad(use))
            else:
                (nll, mtp), d_top_head, dy_BSD = lax.cond(
                    on_f & leave, loss_and_grad,
                    lambda: _zeros(jax.eval_shape(loss_and_grad), typed))
            mtp_acc = jax.tree.map(jnp.add, mtp_acc, mtp)

            # The backward unit: its output gradient from the next stage (leaving the pipeline:
            # the one just computed), its residuals from the ring.
            on_b, rb, take_at = plan.on_b, plan.rb, plan.take_at
            g_BSD = jnp.where(last & (rb == R - 1), dy_BSD, bwd_BSD)

            def stage_grad():
                return stage_res.at(rb).backward(stash.take(stage_ring, take_at),
                                                 (g_BSD, stats_ct))
            if branchless:  # an idle slot's residuals may be a filler's, or zeros: drop them
                d_vars, dx_BSD = jax.tree.map(lambda d: jnp.where(on_b, d, 0), stage_grad())
            else:
                d_vars, dx_BSD = lax.cond(on_b, stage_grad,
                                          lambda: _zeros(jax.eval_shape(stage_grad), typed))

            def embed_grad():
                return embed_res.backward(stash.take(embed_ring, take_at), dx_BSD)[0]
            d_front = lax.cond(on_b & first & (rb == 0), embed_grad,
                               lambda: _zeros(jax.eval_shape(embed_grad), typed))

            d_stage, d_top = acc
            d_top = jax.tree.map(jnp.add, d_top, d_top_head)
            if isinstance(d_front, dict):  # front_params: a dict with prefix or tower
                d_params = dict(d_front)
                seen = d_params.pop(PREFIX_META, None)
                d_top = {**d_top, **jax.tree.map(jnp.add, {k: d_top[k] for k in d_params},
                                                 d_params)}
                if seen is not None:  # amax observations combine by maximum, as the stack's
                    d_top[PREFIX_META] = fp8.combine(d_top[PREFIX_META], seen)
            else:
                d_top = {**d_top, "embedding": d_top["embedding"] + d_front}
            d_chunk = index(d_stage, rb)
            new_chunk = {"params": jax.tree.map(jnp.add, d_chunk["params"], d_vars["params"])}
            if has_meta:  # amax observations combine by maximum, gradients add
                new_chunk[fp8.META_COLLECTION] = fp8.combine(d_chunk[fp8.META_COLLECTION],
                                                             d_vars[fp8.META_COLLECTION])
            new_stage = jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, rb, 0),
                                     d_stage, new_chunk)
            if jax.default_backend() == "cpu":
                # The transfers start after everything else in the tick (stage 0's embedding
                # backward is its last collective; one output of its lax.cond stands for all
                # of them); see `_after`. Not on GPUs: each device issues its collectives in
                # the program's order there, and the tie would only delay the forward send.
                front_done = jnp.ravel(jax.tree.leaves(d_front)[0])[0]
                y_BSD, dx_BSD = _after(y_BSD, dx_BSD, front_done), _after(dx_BSD, front_done)
            carry = (lax.ppermute(y_BSD, STAGE, [(i, (i + 1) % S) for i in wrap]),
                     lax.ppermute(dx_BSD, STAGE, [((i + 1) % S, i) for i in wrap]),
                     stage_ring, embed_ring, (new_stage, d_top), loss + nll, stats_acc, mtp_acc)
            return carry, None

        init = (zero_x, zero_x, _zeros(stash.ring_shapes(stage_res.stash_shapes, K), typed),
                _zeros(stash.ring_shapes(embed_res.stash_shapes, K), typed),
                _zeros(grad_shapes, typed), _zeros(jax.ShapeDtypeStruct((), jnp.float32), typed),
                _zeros(jax.tree.map(lambda a: jax.ShapeDtypeStruct((R, *a.shape), a.dtype),
                                    out_shapes[1]), typed),
                _zeros(jax.eval_shape(lambda: head(top, zero_x, 0)[1][1]), typed))
        # Unrolled with the layer scan (`Transformer.scan_unroll`: FLOPs counted per tick).
        (_, _, _, _, (d_stage, d_top), loss, stats, mtp), _ = lax.scan(
            tick, init, jnp.arange(T), unroll=model.scan_unroll)
        d_stage = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]),  # -> [L/S, ...]
                               interleave(d_stage, S, R, inverse=True))
        loss = lax.psum(loss, STAGE)
        mtp = lax.psum(mtp, STAGE) if mtp else mtp  # the last stage's sums
        objective = loss
        if mtp:
            objective += model.cfg.mtp_loss_weight * jnp.mean(mtp["nll"] * inv_mtp)
        if not moe:
            return (objective, loss, None, None, mtp), d_stage, lax.psum(d_top, STAGE)
        balance = lax.psum(jnp.sum(stats["balance"]), STAGE)
        objective += model.cfg.aux_loss_alpha * (balance + jnp.sum(mtp.get("balance", 0.0))) / M
        return (objective, loss, balance, stats["load"], mtp), d_stage, lax.psum(d_top, STAGE)

    chunk_specs = stage_specs(chunks)
    values, d_stack, d_top = jax.shard_map(
        body, in_specs=(chunk_specs, P(), P(), P(), P(), P()),
        out_specs=((P(), P(), P(), P(None, STAGE) if moe else None, P()),
                   {k: v for k, v in chunk_specs.items() if k != FP8_ON}, P()),
        axis_names={STAGE}, check_vma=typed)(chunks, top, micro, inv_count, inv_mtp, seed)
    objective, nll, balance, load_LE, mtp = values
    if moe:  # [R, S*Lc, E], whose row-major order is the layer order
        load_LE = load_LE.reshape(-1, load_LE.shape[-1])
    prefix_observed = d_top.pop(PREFIX_META, None)  # psummed: only stage 0 observed it
    grads = {**d_top, pipe.stack: d_stack["params"]}
    meta_grads = {pipe.stack: d_stack[fp8.META_COLLECTION]} if has_meta else {}
    if prefix_observed is not None:
        meta_grads["layers"] = prefix_observed
    return (objective, (nll, balance, load_LE, mtp)), grads, meta_grads


def _after(x: jax.Array, *deps: jax.Array) -> jax.Array:
    """`x` + 0 * each of `deps`: the same values, computed only once `deps` are.

    Each dep is an array of x's shape and sharding (elementwise: no communication) or a scalar.
    XLA:CPU runs independent operations of a program concurrently on a small thread pool, and a
    collective holds its thread until every device has arrived. Two collectives that are ready
    at once (the forward's ppermute, say, and an all-reduce in the backward's layer scan) can
    then start in different orders on two devices of one group and deadlock: an abort after
    XLA's 40 s rendezvous timeout, rare for some programs and every time for others. A data
    dependency orders them. (`lax.optimization_barrier` would say it better, but XLA:CPU drops
    it before scheduling.) A float times zero is not folded away; a NaN in `deps` reaches `x`,
    which happens only when the step is non-finite anyway.
    """
    for d in deps:
        x = x + (0.0 * d).astype(x.dtype)
    return x
