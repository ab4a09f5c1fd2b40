"""The forward pipeline of the gpipe and circular schedules: microbatches stream through the
stages in a `lax.scan` over ticks, and `jax.grad` differentiates it (all backwards after all
forwards). See docs/pipeline.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax.model.decoder import embed_tokens
from dsjax.model.batch import BATCH_KEYS
from dsjax.pipeline.stages import (FRONT_BATCH_KEYS, STAGE, StagedModel, head_nll,
                                   heavy_front, index, interleave, mtp_terms, run_chunk,
                                   split_params, stage0_input, stage_specs, ticks)


def forward_pipeline(pipe: StagedModel, params: Any, meta: Any, micro: dict[str, jax.Array]
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict]:
    """(summed weighted NLL of the global batch, MoE balance terms summed over layers and
    microbatches, per-layer expert loads [L, E]; None, None for a dense model; the MTP head's
    sums, `mtp_terms`), the layers pipelined over `pipeline`. Each stage runs the head and MTP
    on its M/S microbatches of the last stage's outputs."""
    S, M = pipe.stages, pipe.microbatches
    R = pipe.per_stage
    T = ticks(pipe.schedule, S, M, R)
    model, chunk_model = pipe.model, pipe.chunk_model()
    moe = model.cfg.is_moe
    chunks, top = split_params(pipe, params, meta)
    x_shape = jax.eval_shape(lambda: embed_tokens(top["embedding"], micro["inputs"], model.dtype))
    # A lap of the ring ends on the last stage; with R > 1 it continues on stage 0.
    perm = [(i, (i + 1) % S) for i in range(S if R > 1 else S - 1)]

    # Block: manual over `pipeline`. chunks [L/S, ...] (this stage's layers), top and
    # micro [M, B/M, S] replicated over stages -> this stage's share of the NLL sum, psummed;
    # MoE: the balance sum (psummed) and this stage's loads [R, Lc, E] (chunk r*S + s at r).
    def body(chunks, top, micro):
        chunks = interleave(jax.tree.map(  # [L/S, ...] -> [R, Lc, ...]
            lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), chunks), S, R)
        s = lax.axis_index(STAGE)
        if heavy_front(pipe):  # dense prefix blocks, a vision tower: they feed stage 0 only
            prefix_MBSD = lambda: _unfold(stage0_input(
                pipe, top, {k: _fold(micro[k]) for k in FRONT_BATCH_KEYS if k in micro}), M)
            if jax.default_backend() == "cpu":
                # Every stage runs them and keeps stage 0's: no collective in a branch only
                # some devices take (docs/pipeline.md, "Dense prefix on XLA:CPU").
                x_MBSD = jnp.where(s == 0, prefix_MBSD(), jnp.zeros((), x_shape.dtype))
            else:
                x_MBSD = lax.cond(s == 0, prefix_MBSD,
                                  lambda: jnp.zeros(x_shape.shape, x_shape.dtype))
        else:
            x_MBSD = embed_tokens(top["embedding"], micro["inputs"], model.dtype)

        def tick(carry, t):
            state_BSD, laps_MBSD, balance_RL, load_RLE = carry  # from the previous stage;
            # stage 0's waiting room; MoE stats of this stage's chunks, summed over microbatches
            u = t - s  # this stage's position in its stream of R*M microbatch-chunks
            m, r = jnp.mod(u, M), jnp.clip(u // M, 0, R - 1)
            if R > 1:
                # Stage 0 just received microbatch (t-S) mod M from the last stage; it waits
                # until its next lap starts (M - S ticks later).
                laps_MBSD = lax.dynamic_update_index_in_dim(laps_MBSD, state_BSD,
                                                            jnp.mod(t - S, M), 0)
                fresh_BSD = jnp.where(u < M, x_MBSD[m], laps_MBSD[m])
            else:
                fresh_BSD = x_MBSD[m]
            in_BSD = jnp.where(s == 0, fresh_BSD, state_BSD)
            y_BSD, stats = run_chunk(chunk_model, index(chunks, r), in_BSD,
                                     micro["positions"][m], micro["segment_ids"][m])
            if moe:  # idle ticks (the bubble) run on filler: their stats count for nothing
                busy = (u >= 0) & (u < R * M)
                balance_RL = balance_RL.at[r].add(jnp.where(busy, stats["balance"], 0.0))
                load_RLE = load_RLE.at[r].add(jnp.where(busy, stats["load"], 0.0))
            return (lax.ppermute(y_BSD, STAGE, perm), laps_MBSD, balance_RL, load_RLE), y_BSD

        # Fresh zeros (not zeros_like: stage 0's input may already vary over the stages).
        state = jnp.zeros(x_MBSD.shape[1:], x_MBSD.dtype)
        laps = jnp.zeros(x_MBSD.shape, x_MBSD.dtype) if R > 1 else jnp.zeros((), x_MBSD.dtype)
        Lc, E = chunk_model.cfg.num_layers, model.cfg.n_routed_experts
        balance = jnp.zeros((R, Lc) if moe else (), jnp.float32)
        load = jnp.zeros((R, Lc, E) if moe else (), jnp.float32)
        if pipe.typed:
            state, laps = lax.pcast((state, laps), STAGE, to="varying")
            if moe:
                balance, load = lax.pcast((balance, load), STAGE, to="varying")
        (_, _, balance, load), ys_TBSD = lax.scan(tick, (state, laps, balance, load),
                                                  jnp.arange(T), unroll=model.scan_unroll)
        # The last lap's outputs on the last stage: ticks T-M .. T-1 are microbatches 0 .. M-1.
        # Spread them over the stages, M/S microbatches each, for the head and loss.
        n = M // S
        mine_mBSD = _scatter_from_last(ys_TBSD[T - M:], S, n)
        pick = lambda a: lax.dynamic_slice_in_dim(a, s * n, n, 0)
        mine = {k: _fold(pick(micro[k])) for k in BATCH_KEYS}
        nll = head_nll(model, top, _fold(mine_mBSD), mine["targets"], mine["weights"])
        mtp = lax.psum(mtp_terms(pipe, top, _fold(mine_mBSD), mine, n), STAGE)
        if not moe:
            return lax.psum(nll, STAGE), mtp
        return lax.psum(nll, STAGE), mtp, lax.psum(jnp.sum(balance), STAGE), load

    # MoE loads: stage s's [R, Lc, E] -> [R, S*Lc, E], whose row-major order is the layer order.
    out = jax.shard_map(body, in_specs=(stage_specs(chunks), P(), P()),
                        out_specs=(P(), P(), P(), P(None, STAGE)) if moe else (P(), P()),
                        axis_names={STAGE}, check_vma=pipe.typed)(chunks, top, micro)
    if not moe:
        return out[0], None, None, out[1]
    nll, mtp, balance, load_RXE = out
    return nll, balance, load_RXE.reshape(-1, load_RXE.shape[-1]), mtp


def _scatter_from_last(out_MBSD: jax.Array, S: int, n: int) -> jax.Array:
    """The last stage's [S*n, ...] -> stage d's rows [d*n, (d+1)*n): one ppermute per other
    stage, sent by the last stage only. (A psum_scatter would also do, but sums zeros from every
    stage, and XLA:CPU cannot compile one in bfloat16.)"""
    last = lax.axis_index(STAGE) == S - 1
    mine = jnp.where(last, out_MBSD[(S - 1) * n:], 0)
    for d in range(S - 1):
        mine = mine + lax.ppermute(out_MBSD[d * n:(d + 1) * n], STAGE, [(S - 1, d)])
    return mine


def _fold(a: jax.Array) -> jax.Array:
    """[n, b, ...] -> [n * b, ...]."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _unfold(a: jax.Array, n: int) -> jax.Array:
    """[n * b, ...] -> [n, b, ...]."""
    return a.reshape(n, a.shape[0] // n, *a.shape[1:])
