"""Pipeline parallelism over the "pipeline" mesh axis: GPipe, circular and 1F1B schedules.

The one idea: the decoder's layer stack (every block parameter has a leading "layers" axis, which
the rules table shards over `pipeline`) is cut into S stages of contiguous layers, each run by
the decoder's own scanned, rematerialised `run_layers`. Inside one `jax.shard_map` that is manual
over `pipeline` only (data and tensor parallelism stay with GSPMD inside each stage),
microbatches stream through the stages in a `lax.scan` over clock ticks and move to the next
stage with an explicit `lax.ppermute`. Every stage runs the same program: which microbatch a
stage works on at tick t is arithmetic on (t, stage index).

Schedules, for S stages, M microbatches, R repeats (bubble = idle share of a stage's time):
- gpipe (Huang et al. 2019, GPipe): M forwards over M + S - 1 ticks; `jax.grad` runs the
  transposed scan, i.e. all backwards after all forwards. Every microbatch's activations live
  until the backward, so memory grows with M. Bubble (S-1)/(M+S-1).
- circular (the interleaved schedule of Narayanan et al. 2021, "Efficient large-scale language
  model training on GPU clusters using Megatron-LM" §2.2, in MaxText's SPMD form): the stack is
  cut into R*S chunks and device s holds chunks s, S+s, 2S+s, ...; a microbatch goes round the
  ring R times. R*M + S - 1 ticks of 1/R the work each: bubble (S-1)/(R*M+S-1). Needs M >= S
  (a microbatch leaving the last stage waits M-S ticks in stage 0's buffer for its next lap).
- 1f1b (PipeDream-Flush, Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN
  training"): one `lax.scan` in which stage s, at tick t, runs the forward of microbatch t - s
  and the backward of microbatch t - 2(S-1) + s, each a per-microbatch `jax.vjp`; the loss
  gradient starts on the last stage in the tick its forward ends. A stage stashes at most
  2S - 1 stage inputs whatever M is, so activation memory is flat in M. The backward recomputes
  its stage's forward from the stashed input (one extra stage forward per microbatch: stashing
  the vjp residuals instead would also stash casts of the weights, once per microbatch in
  flight). Idle slots are skipped with `lax.cond`, so the bubble is GPipe's (S-1)/(M+S-1)
  (MoE models compute them: see `_one_f_one_b`).
  The loss is a `jax.custom_vjp` whose forward runs the whole schedule and whose backward
  returns the gradients it computed, so `train_step` differentiates it like any loss.

Embedding, final norm, output head and MTP modules are replicated over stages (their specs never
name `pipeline`): every stage stores them, their gradients and optimizer moments (2 x V x D params:
0.84B for DeepSeek-7B, ~13 GB of fp32 params + Adam moments per device). Stage 0 embeds; the
head runs on the last stage's outputs, split over all stages for gpipe/circular (a reduce-scatter
of the outputs, then M/S microbatches' head and loss per stage), on the last stage for 1f1b. MTP
modules (DeepSeek-V3 §2.2) run with the head on the same hidden states (`_mtp_terms`); each
module's loss is its NLL summed over microbatches over the batch's count of valid positions.

Microbatch m of a global batch [B, ...] is rows m, M + m, 2M + m, ...: the reshape
[B] -> [B/M, M] keeps the `data` sharding of the rows, so no data moves.

MoE models (stack "moe_layers"): each stage also returns its blocks' balance terms and expert
loads, which the schedules sum over microbatches, so the loss comes with the unpipelined model's
"aux" terms for the whole batch (`Pipelined.loss_and_aux`). Their leading dense blocks
(`first_k_dense_replace`, params "layers", logical axis "extra_layers") are replicated over the
stages like the embedding and run on stage 0 right after it (`_embed`), under a `lax.cond` on the
stage index so the other stages skip them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax import fp8, sharding
from dsjax.config import ConfigError, PipelineConfig
from dsjax.model.decoder import (Transformer, embed_tokens, mtp_weights, output_logits,
                                 weighted_cross_entropy)
from dsjax.model.layers import RMSNorm

STAGE = sharding.MESH_AXES[2]  # the mesh axis the stages live on ("pipeline")
MICRO_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")
# The MTP modules' params: replicated over the stages, run with the head (`_mtp_terms`).
MTP_KEYS = ("mtp_enorm", "mtp_hnorm", "mtp_norm", "mtp_eh_proj", "mtp_layers")


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1,
                    moe: bool = False) -> float:
    """The analytic idle share of a stage's time (0 without pipelining). `moe`: 1f1b cannot skip
    idle ticks of MoE stages (see `Pipelined`), so they cost 2(S-1) ticks, not S-1."""
    S, M = stages, microbatches
    if schedule == "1f1b" and moe:
        return 2 * (S - 1) / (M + 2 * (S - 1))
    R = repeats if schedule == "circular" else 1
    return (S - 1) / (R * M + S - 1)


def ticks(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> int:
    """Clock ticks (iterations of the schedule's scan)."""
    S, M = stages, microbatches
    if schedule == "1f1b":
        return M + 2 * (S - 1)
    return (repeats if schedule == "circular" else 1) * M + S - 1


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """A `Transformer` trained through a pipeline schedule; `TrainState.objective` when
    mesh.pipeline > 1. Calling it is the unpipelined `model.apply` (evaluation, generation);
    `loss` is the pipelined mean next-token loss, differentiable with `jax.grad`. Call both under
    the mesh (`sharding.activate`)."""
    model: Transformer
    stages: int
    schedule: str = "gpipe"
    microbatches: int = 1
    repeats: int = 1
    typed: bool = True  # shard_map check_vma; False for fp8 (see dsjax/train.py `onebit_step`)
                        # and expert-parallel MoE (see `make`)

    def __call__(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs)

    @property
    def chunks(self) -> int:
        return self.stages * (self.repeats if self.schedule == "circular" else 1)

    @property
    def prefix(self) -> int:
        """Leading layers that run before the stages, on stage 0: a MoE model's dense blocks
        (`first_k_dense_replace`); 0 for a dense model."""
        cfg = self.model.cfg
        return cfg.first_k_dense_replace if cfg.is_moe else 0

    def chunk_model(self) -> Transformer:
        """The decoder restricted to one chunk of the pipelined layers (every chunk makes the
        same choices; the dense prefix and MTP are not part of it)."""
        m, k = self.model, self.prefix
        n = (m.cfg.num_layers - k) // self.chunks
        return m.clone(parent=None, cfg=dataclasses.replace(m.cfg, num_layers=n,
                                                            first_k_dense_replace=0,
                                                            num_mtp_layers=0),
                       layer_policies=tuple(m.layer_policies)[k:k + n],
                       fp8_layers=tuple(m.fp8_layers)[k:k + n])

    @property
    def stack(self) -> str:
        """The params key of the pipelined layer stack: a MoE model's MoE blocks (its dense
        prefix, params "layers", runs on stage 0 before them, see `_embed`), else every block."""
        return "moe_layers" if self.model.cfg.is_moe else "layers"

    def loss(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
             ) -> tuple[jax.Array, jax.Array]:
        """(mean next-token NLL over the global batch, weight sum): `loss_and_aux` without the
        auxiliary terms (a dense model has none)."""
        return self.loss_and_aux(params, batch, fp8_meta)[:2]

    def loss_and_aux(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
                     ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(mean next-token NLL, weight sum, auxiliary terms), like `train.loss_and_aux`. A MoE
        model's terms are the unpipelined model's for the whole batch: "aux_loss" = alpha x the
        balance loss summed over layers (each layer's mean over rows: the mean over microbatches
        of their row means) and "moe_load" [L, E] (assignment counts summed over microbatches).
        gpipe/circular: `jax.grad` differentiates each term. 1f1b differentiates the training
        objective NLL + aux_loss as one inside its schedule: the returned NLL carries that whole
        gradient and aux_loss none, so any function of their sum (the training objective) has
        the exact gradient, but not the NLL alone."""
        rows = batch["inputs"].shape[0]
        if rows % self.microbatches:  # e.g. a dynamic batch size (dsjax/batching.py) off the grid
            raise ConfigError(f"pipeline.microbatches: a batch of {rows} rows does not split "
                              f"into {self.microbatches} microbatches")
        count = jnp.sum(batch["weights"])
        # Each MTP module's loss is its mean over the whole batch's valid positions: [n].
        mtp_count = jnp.sum(mtp_weights(batch["weights"], self.model.cfg.num_mtp_layers),
                            axis=(1, 2))
        micro = _microbatches(batch, self.microbatches)
        if self.schedule == "1f1b":
            nll, aux = _one_f_one_b_loss(self, params, fp8_meta or {}, micro, count, mtp_count)
            return nll, count, aux
        total, balance, load_LE, mtp = _forward_pipeline(self, params, fp8_meta or {}, micro)
        return (total / jnp.maximum(count, 1.0), count,
                _aux_terms(self, balance, load_LE, mtp, mtp_count))


def make(model: Transformer, cfg: PipelineConfig, stages: int, typed: bool) -> Pipelined:
    """The `Pipelined` model for `cfg` (the validated pipeline section) over `stages` stages.
    Expert parallelism makes it untyped: the MoE all-to-all's own shard_map (manual over `data`,
    unchecked) nests inside the stages' and hands back cotangents without the `pipeline`
    variance a typed outer shard_map expects (the gradients are the same either way)."""
    if model.cfg.is_moe and model.cfg.expert_parallel:
        typed = False
    return Pipelined(model, stages, cfg.schedule, cfg.microbatches, cfg.repeats, typed)


# ---------------------------------------------------------------------------------------------
# Layout helpers.

def _aux_terms(pipe: Pipelined, balance: jax.Array | None, load_LE: jax.Array | None,
               mtp: dict[str, jax.Array], mtp_count: jax.Array) -> dict[str, jax.Array]:
    """The model's "aux" terms, as the unpipelined model sows them, from the stages' balance
    terms summed over layers and microbatches, their per-layer loads [L, E] (None, None for a
    dense model) and the MTP head's sums (`_mtp_terms`, summed over microbatches; {} without
    MTP). MTP blocks' loads come after the layers', as in the unpipelined model."""
    cfg = pipe.model.cfg
    aux: dict[str, jax.Array] = {}
    aux_loss = jnp.zeros((), jnp.float32)
    if balance is not None:
        if "balance" in mtp:
            balance = balance + jnp.sum(mtp["balance"])
            load_LE = jnp.concatenate([load_LE, mtp["load"]])
        aux_loss += cfg.aux_loss_alpha * balance / pipe.microbatches
        aux["moe_load"] = load_LE
    if mtp:
        aux["mtp_loss"] = mtp["nll"] / jnp.maximum(mtp_count, 1.0)
        aux_loss += cfg.mtp_loss_weight * jnp.mean(aux["mtp_loss"])
    if aux:
        aux["aux_loss"] = aux_loss
    return aux


def _microbatches(batch: dict[str, jax.Array], M: int) -> dict[str, jax.Array]:
    """[B, S] -> [M, B/M, S]; microbatch m = rows m, M + m, ... (keeps the rows' sharding)."""
    def split(a):
        return jnp.swapaxes(a.reshape(a.shape[0] // M, M, *a.shape[1:]), 0, 1)
    return {k: split(batch[k]) for k in MICRO_KEYS}


def _split_params(params: Any, meta: Any, name: str) -> tuple[Any, Any]:
    """(layer variables {"params", maybe "fp8_meta"} of stack `name`, leading "layers" axis;
    the replicated top-level params)."""
    stack = {"params": params[name]}
    if meta:
        stack[fp8.META_COLLECTION] = meta[name]
    return stack, {k: v for k, v in params.items() if k != name}


def _run_chunk(chunk_model: Transformer, variables: Any, x_BSD: jax.Array, positions_BS,
               segment_ids_BS) -> tuple[jax.Array, Any]:
    """One chunk's layers: (y [B, S, D], MoE stats {"load": [Lc, E], "balance": [Lc]}, or None
    for a dense model)."""
    moe = chunk_model.cfg.is_moe
    y_BSD, stats = chunk_model.run_layers(x_BSD, variables, positions_BS, segment_ids_BS,
                                          moe=moe)
    if not moe:
        return y_BSD, None
    return y_BSD, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)


def _stage_specs(tree: Any) -> Any:
    """The layer stack's leading axis over the stages: stage s holds layers [s*L/S, (s+1)*L/S)."""
    return jax.tree.map(lambda _: P(STAGE), tree)


def _interleave_tables(S: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Index tables that move chunk c = s*R + j (stage s's j-th contiguous chunk) to stage
    c % S, slot c // S. send[s, d, p]: the local chunk stage s sends to stage d in slot p (R:
    padding); recv[d, r]: (source stage, slot) of stage d's r-th circular chunk."""
    P_ = -(-R // S)  # slots per (source, destination) pair
    send = np.full((S, S, P_), R, np.int32)
    recv = np.zeros((S, R, 2), np.int32)
    used = np.zeros((S, S), np.int32)
    for c in range(R * S):
        (src, j), (dst, r) = divmod(c, R), (c % S, c // S)
        send[src, dst, used[src, dst]] = j
        recv[dst, r] = (src, used[src, dst])
        used[src, dst] += 1
    return send, recv


def _interleave(local: Any, S: int, R: int) -> Any:
    """This stage's contiguous chunks [R, Lc, ...] (chunk s*R + j at j) -> its circular chunks
    (chunk r*S + s at r), with one all_to_all over `pipeline`. Checkpoints keep the natural
    layer order; the weights move here every step, and their gradients back (its transpose)."""
    if R == 1:
        return local
    send, recv = _interleave_tables(S, R)
    s = lax.axis_index(STAGE)
    send_row, recv_row = jnp.asarray(send)[s], jnp.asarray(recv)[s]

    def move(a):
        padded = jnp.concatenate([a, jnp.zeros_like(a[:1])])  # index R is padding
        got = lax.all_to_all(padded[send_row], STAGE, 0, 0, tiled=True)  # [S, P, Lc, ...]
        return got[recv_row[:, 0], recv_row[:, 1]]

    return jax.tree.map(move, local)


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _embed(pipe: Pipelined, top: Any, tokens_BS: jax.Array, positions_BS: jax.Array,
           segment_ids_BS: jax.Array) -> jax.Array:
    """Stage 0's input: the embedding, then a MoE model's dense prefix blocks (whose params,
    "layers", are replicated over the stages like the embedding). [B, S] -> [B, S, D]."""
    model = pipe.model
    x_BSD = embed_tokens(top["embedding"], tokens_BS, model.dtype)
    if not pipe.prefix:
        return x_BSD
    x_BSD, _ = model.run_layers(x_BSD, {"params": top["layers"]}, positions_BS, segment_ids_BS,
                                0, pipe.prefix)
    return x_BSD


def _mtp_terms(pipe: Pipelined, top: Any, x_BSD: jax.Array, mb: dict[str, jax.Array],
               rows_in: int = 1) -> dict[str, jax.Array]:
    """The MTP modules on final-stage activations x [B, S, D] (before final_norm) of rows `mb`
    (`MICRO_KEYS` arrays [B, S]) that hold `rows_in` microbatches: {"nll": summed weighted NLL
    per module [n]; MoE models also "balance" [n] (each module's balance term, summed over the
    microbatches) and "load" [n, E]}. {} without MTP."""
    model = pipe.model
    if not model.cfg.num_mtp_layers:
        return {}
    sums, _, stats = model.mtp_sums({k: top[k] for k in MTP_KEYS}, x_BSD, top["embedding"],
                                    top["lm_head"], mb["inputs"], mb["positions"],
                                    mb["segment_ids"], mb["targets"], mb["weights"])
    out = {"nll": sums}
    if stats:  # per module a mean over rows: x rows_in = the sum of the microbatches' means
        out["balance"] = jnp.concatenate([s["balance"] for s in stats]) * rows_in
        out["load"] = jnp.concatenate([s["load"] for s in stats])
    return out


def _head_nll(model: Transformer, top: Any, x_BSD: jax.Array, targets_BS: jax.Array,
              weights_BS: jax.Array) -> jax.Array:
    """Final norm, output head and summed weighted NLL of final-stage activations."""
    x_BSD = RMSNorm(model.cfg.norm_eps, parent=None).apply({"params": top["final_norm"]}, x_BSD)
    logits_BSV = output_logits(x_BSD, top["lm_head"], model.dtype)
    return weighted_cross_entropy(logits_BSV, targets_BS, weights_BS)[0]


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


def _fold(a: jax.Array) -> jax.Array:
    """[n, b, ...] -> [n * b, ...]."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _unfold(a: jax.Array, n: int) -> jax.Array:
    """[n * b, ...] -> [n, b, ...]."""
    return a.reshape(n, a.shape[0] // n, *a.shape[1:])


# ---------------------------------------------------------------------------------------------
# GPipe and circular: a forward-only pipeline; jax.grad differentiates through it.

def _forward_pipeline(pipe: Pipelined, params: Any, meta: Any, micro: dict[str, jax.Array]
                      ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict]:
    """(summed weighted NLL of the global batch, MoE balance terms summed over layers and
    microbatches, per-layer expert loads [L, E]; None, None for a dense model; the MTP head's
    sums, `_mtp_terms`), the layers pipelined over `pipeline`. Each stage runs the head and MTP
    on its M/S microbatches of the last stage's outputs."""
    S, M = pipe.stages, pipe.microbatches
    R = pipe.repeats if pipe.schedule == "circular" else 1
    T = ticks(pipe.schedule, S, M, R)
    model, chunk_model = pipe.model, pipe.chunk_model()
    moe = model.cfg.is_moe
    chunks, top = _split_params(params, meta, pipe.stack)
    x_shape = jax.eval_shape(lambda: embed_tokens(top["embedding"], micro["inputs"], model.dtype))
    # A lap of the ring ends on the last stage; with R > 1 it continues on stage 0.
    perm = [(i, (i + 1) % S) for i in range(S if R > 1 else S - 1)]

    # Block: manual over `pipeline`. chunks [L/S, ...] (this stage's layers), top and
    # micro [M, B/M, S] replicated over stages -> this stage's share of the NLL sum, psummed;
    # MoE: the balance sum (psummed) and this stage's loads [R, Lc, E] (chunk r*S + s at r).
    def body(chunks, top, micro):
        chunks = _interleave(jax.tree.map(  # [L/S, ...] -> [R, Lc, ...]
            lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), chunks), S, R)
        s = lax.axis_index(STAGE)
        if pipe.prefix:  # the dense prefix blocks run on stage 0 only
            x_MBSD = lax.cond(s == 0, lambda: _unfold(_embed(
                pipe, top, *(_fold(micro[k]) for k in ("inputs", "positions", "segment_ids"))),
                M), lambda: jnp.zeros(x_shape.shape, x_shape.dtype))
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
            y_BSD, stats = _run_chunk(chunk_model, _index(chunks, r), in_BSD,
                                      micro["positions"][m], micro["segment_ids"][m])
            if moe:  # idle ticks (the bubble) run on filler: their stats count for nothing
                busy = (u >= 0) & (u < R * M)
                balance_RL = balance_RL.at[r].add(jnp.where(busy, stats["balance"], 0.0))
                load_RLE = load_RLE.at[r].add(jnp.where(busy, stats["load"], 0.0))
            return (lax.ppermute(y_BSD, STAGE, perm), laps_MBSD, balance_RL, load_RLE), y_BSD

        state = jnp.zeros_like(x_MBSD[0])
        laps = jnp.zeros_like(x_MBSD) if R > 1 else jnp.zeros((), x_MBSD.dtype)
        Lc, E = chunk_model.cfg.num_layers, model.cfg.n_routed_experts
        balance = jnp.zeros((R, Lc) if moe else (), jnp.float32)
        load = jnp.zeros((R, Lc, E) if moe else (), jnp.float32)
        if pipe.typed:
            state, laps = lax.pcast((state, laps), STAGE, to="varying")
            if moe:
                balance, load = lax.pcast((balance, load), STAGE, to="varying")
        (_, _, balance, load), ys_TBSD = lax.scan(tick, (state, laps, balance, load),
                                                  jnp.arange(T))
        # The last lap's outputs on the last stage: ticks T-M .. T-1 are microbatches 0 .. M-1.
        # Spread them over the stages, M/S microbatches each, for the head and loss.
        n = M // S
        mine_mBSD = _scatter_from_last(ys_TBSD[T - M:], S, n)
        pick = lambda a: lax.dynamic_slice_in_dim(a, s * n, n, 0)
        mine = {k: _fold(pick(micro[k])) for k in MICRO_KEYS}
        nll = _head_nll(model, top, _fold(mine_mBSD), mine["targets"], mine["weights"])
        mtp = lax.psum(_mtp_terms(pipe, top, _fold(mine_mBSD), mine, n), STAGE)
        if not moe:
            return lax.psum(nll, STAGE), mtp
        return lax.psum(nll, STAGE), mtp, lax.psum(jnp.sum(balance), STAGE), load

    # MoE loads: stage s's [R, Lc, E] -> [R, S*Lc, E], whose row-major order is the layer order.
    out = jax.shard_map(body, in_specs=(_stage_specs(chunks), P(), P()),
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


# ---------------------------------------------------------------------------------------------
# 1F1B: forwards and backwards interleaved in one scan, gradients by hand.

def _one_f_one_b_loss(pipe: Pipelined, params: Any, meta: Any, micro: dict[str, jax.Array],
                      count: jax.Array, mtp_count: jax.Array
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean NLL, the model's aux terms) whose gradient (w.r.t. params and, for delayed fp8, the
    amax observations of fp8_meta) the schedule computes itself: the NLL carries the gradient of
    the objective NLL + aux_loss (see `Pipelined.loss_and_aux`)."""

    @jax.custom_vjp
    def objective(params, meta):
        return _one_f_one_b(pipe, params, meta, micro, count, mtp_count)[0]

    def fwd(params, meta):
        out, grads, meta_grads = _one_f_one_b(pipe, params, meta, micro, count, mtp_count)
        return out, (grads, meta_grads)

    def bwd(res, ct):
        grads, meta_grads = res
        # Only the objective's cotangent: the NLL, balance and load values carry no gradient.
        # The observed amaxes are not scaled by the loss cotangent (as in fp8's own VJP).
        return jax.tree.map(lambda g: g * ct[0], grads), meta_grads

    objective.defvjp(fwd, bwd)
    value, (nll, balance, load_LE, mtp) = objective(params, meta)
    return (lax.stop_gradient(nll) + (value - lax.stop_gradient(value)),
            _aux_terms(pipe, *lax.stop_gradient((balance, load_LE, mtp)), mtp_count))


def _zeros(shapes: Any, typed: bool) -> Any:
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return lax.pcast(zeros, STAGE, to="varying") if typed and jax.tree.leaves(zeros) else zeros


def _one_f_one_b(pipe: Pipelined, params: Any, meta: Any, micro: dict[str, jax.Array],
                 count: jax.Array, mtp_count: jax.Array) -> tuple[Any, Any, Any]:
    """((objective, (mean NLL, MoE balance sum, loads [L, E]; None, None if dense; MTP sums,
    `_mtp_terms`)), the objective's gradient w.r.t. params, fp8 amax observations) by the 1F1B
    schedule. The objective is the mean NLL plus, for MoE models, alpha x the balance terms
    summed over layers and averaged over microbatches, plus mtp_loss_weight x the mean of the
    MTP modules' losses (`Pipelined.loss_and_aux`). `mtp_count`: each module's weight sum [n]."""
    S, M = pipe.stages, pipe.microbatches
    T, K = ticks("1f1b", S, M), 2 * S - 1  # ticks; stash slots (>= microbatches in flight)
    model, chunk_model = pipe.model, pipe.chunk_model()
    moe = model.cfg.is_moe
    # MoE stages run in every tick, idle or not, instead of under a `lax.cond` that only some
    # stages take: collectives inside such a branch (the experts' all-to-all over `data`, GSPMD's
    # resharding of experts) deadlock XLA:CPU, whose collective-permute rendezvous waits for
    # every device, or fail XLA's SPMD partitioner. The bubble is then 2(S-1) ticks, not S-1.
    branchless = moe
    n_mtp = model.cfg.num_mtp_layers
    chunks, top = _split_params(params, meta, pipe.stack)
    has_meta = fp8.META_COLLECTION in chunks
    typed = pipe.typed
    inv_count = 1.0 / jnp.maximum(count, 1.0)
    inv_mtp = 1.0 / jnp.maximum(mtp_count, 1.0)

    # Block: manual over `pipeline`. chunks [L/S, ...], top and micro [M, B/M, S] replicated
    # -> loss (psummed), layer grads [L/S, ...] and meta observations, top grads (psummed);
    # MoE: the balance sum (psummed) and this stage's loads [L/S, E].
    def body(chunks, top, micro, inv_count, inv_mtp):
        stage_vars = chunks  # [Lc, ...]
        if typed:
            # Varying: each stage's vjp then returns its own gradient of the replicated params
            # instead of one all-reduced inside the loop (DESIGN invariant 3).
            top = lax.pcast(top, STAGE, to="varying")
        s = lax.axis_index(STAGE)
        first, last = s == 0, s == S - 1
        pos, seg = micro["positions"], micro["segment_ids"]

        def stage(variables, x_BSD, m):  # (y, MoE stats or None)
            return _run_chunk(chunk_model, variables, x_BSD, pos[m], seg[m])

        def embed(emb, m):  # `emb`: the embedding, and the dense prefix's "layers" if any
            sub = emb if isinstance(emb, dict) else {"embedding": emb}
            return _embed(pipe, sub, micro["inputs"][m], pos[m], seg[m])

        # What stage 0 differentiates before the stages: the embedding and the dense prefix.
        def front(top):
            return ({k: top[k] for k in ("embedding", "layers")} if pipe.prefix
                    else top["embedding"])

        def head(top, y_BSD, m):
            """(this microbatch's share of the objective, (its NLL share, MTP sums))."""
            nll = _head_nll(model, top, y_BSD, micro["targets"][m],
                            micro["weights"][m]) * inv_count
            mtp = _mtp_terms(pipe, top, y_BSD, {k: micro[k][m] for k in MICRO_KEYS})
            value = nll
            if mtp:
                value += model.cfg.mtp_loss_weight * jnp.mean(mtp["nll"] * inv_mtp)
            if "balance" in mtp:
                value += model.cfg.aux_loss_alpha * jnp.sum(mtp["balance"]) / M
            return value, (nll, mtp)

        x_shape = jax.eval_shape(embed, front(top), 0)
        grad_shapes = jax.eval_shape(lambda: (stage_vars, top))
        out_shapes = jax.eval_shape(lambda: stage(stage_vars, _zeros(x_shape, typed), 0))
        # The objective's cotangent of a stage's MoE stats: alpha / M per layer's balance term
        # (the aux loss averages microbatches), none for the loads (counts, no gradient).
        stats_ct = (None if not moe else
                    {"balance": jnp.full(out_shapes[1]["balance"].shape,
                                         model.cfg.aux_loss_alpha / M, jnp.float32),
                     "load": jnp.zeros(out_shapes[1]["load"].shape, jnp.float32)})
        if typed and moe:
            stats_ct = lax.pcast(stats_ct, STAGE, to="varying")

        def tick(carry, t):
            fwd_BSD, bwd_BSD, stash_KBSD, acc, loss, stats_acc, mtp_acc = carry
            # Forward slot: microbatch t - s.
            mf = t - s
            on_f = (mf >= 0) & (mf < M)
            mf = jnp.clip(mf, 0, M - 1)
            if pipe.prefix:  # dense blocks: only stage 0 runs them
                in_BSD = lax.cond(first, lambda: embed(front(top), mf), lambda: fwd_BSD)
            else:
                in_BSD = jnp.where(first, embed(front(top), mf), fwd_BSD)
            if branchless:  # an idle slot runs on filler; its stats count for nothing
                y_BSD, stats = stage(stage_vars, in_BSD, mf)
                stats = jax.tree.map(lambda a: jnp.where(on_f, a, 0.0), stats)
            else:
                y_BSD, stats = lax.cond(on_f, lambda: stage(stage_vars, in_BSD, mf),
                                        lambda: _zeros(out_shapes, typed))
            stats_acc = jax.tree.map(jnp.add, stats_acc, stats)  # zeros when idle
            slot = lax.dynamic_index_in_dim(stash_KBSD, mf % K, 0, keepdims=False)
            stash_KBSD = lax.dynamic_update_index_in_dim(
                stash_KBSD, jnp.where(on_f, in_BSD, slot), mf % K, 0)

            # The last stage turns its output into the loss and the loss gradient at once.
            def loss_and_grad(scale=1.0):
                value, vjp, aux = jax.vjp(lambda top, y: head(top, y, mf), top, y_BSD,
                                          has_aux=True)
                d_top, dy = vjp(jnp.ones_like(value) * scale)
                return aux, d_top, dy
            if branchless and n_mtp:  # MoE blocks in the MTP modules: no branch (see above)
                use = (on_f & last).astype(jnp.float32)
                (nll, mtp), d_top_head, dy_BSD = jax.tree.map(
                    lambda a: jnp.where(use > 0, a, 0.0), loss_and_grad(use))
            else:
                (nll, mtp), d_top_head, dy_BSD = lax.cond(
                    on_f & last, loss_and_grad,
                    lambda: _zeros(jax.eval_shape(loss_and_grad), typed))
            mtp_acc = jax.tree.map(jnp.add, mtp_acc, mtp)

            # Backward slot: microbatch t - 2(S-1) + s, its output gradient from stage s+1 (on
            # the last stage: the one just computed). Recompute the stage forward, then its vjp.
            mb = t - 2 * (S - 1) + s
            on_b = (mb >= 0) & (mb < M)
            mb = jnp.clip(mb, 0, M - 1)
            g_BSD = jnp.where(last, dy_BSD, bwd_BSD)
            x_BSD = lax.dynamic_index_in_dim(stash_KBSD, mb % K, 0, keepdims=False)

            def stage_grad(scale=1.0):
                _, vjp = jax.vjp(lambda v, x: stage(v, x, mb), stage_vars, x_BSD)
                return vjp(jax.tree.map(lambda c: c * scale, (g_BSD, stats_ct)))
            if branchless:  # an idle slot's zero cotangents give zero gradients
                d_vars, dx_BSD = stage_grad(on_b.astype(jnp.float32))
            else:
                d_vars, dx_BSD = lax.cond(on_b, stage_grad,
                                          lambda: _zeros(jax.eval_shape(stage_grad), typed))

            def embed_grad():
                _, vjp = jax.vjp(lambda e: embed(e, mb), front(top))
                return vjp(dx_BSD)[0]
            d_front = lax.cond(on_b & first, embed_grad,
                               lambda: _zeros(jax.eval_shape(embed_grad), typed))

            d_stage, d_top = acc
            d_top = jax.tree.map(jnp.add, d_top, d_top_head)
            if pipe.prefix:
                d_top = {**d_top, **jax.tree.map(jnp.add, front(d_top), d_front)}
            else:
                d_top = {**d_top, "embedding": d_top["embedding"] + d_front}
            new_stage = {"params": jax.tree.map(jnp.add, d_stage["params"], d_vars["params"])}
            if has_meta:  # amax observations combine by maximum, gradients add
                new_stage[fp8.META_COLLECTION] = fp8.combine(d_stage[fp8.META_COLLECTION],
                                                             d_vars[fp8.META_COLLECTION])
            if jax.default_backend() == "cpu":
                # The transfers start after everything else in the tick (stage 0's embedding
                # backward is its last collective; one output of its lax.cond stands for all
                # of them); see `_after`. Not on GPUs: each device issues its collectives in
                # the program's order there, and the tie would only delay the forward send.
                front_done = jnp.ravel(jax.tree.leaves(d_front)[0])[0]
                y_BSD, dx_BSD = _after(y_BSD, dx_BSD, front_done), _after(dx_BSD, front_done)
            carry = (lax.ppermute(y_BSD, STAGE, [(i, i + 1) for i in range(S - 1)]),
                     lax.ppermute(dx_BSD, STAGE, [(i + 1, i) for i in range(S - 1)]),
                     stash_KBSD, (new_stage, d_top), loss + nll, stats_acc, mtp_acc)
            return carry, None

        zero_x = _zeros(x_shape, typed)
        init = (zero_x, zero_x, _zeros(jax.ShapeDtypeStruct((K, *x_shape.shape), x_shape.dtype),
                                       typed),
                _zeros(grad_shapes, typed), _zeros(jax.ShapeDtypeStruct((), jnp.float32), typed),
                _zeros(out_shapes[1], typed),
                _zeros(jax.eval_shape(lambda: head(top, zero_x, 0)[1][1]), typed))
        (_, _, _, (d_stage, d_top), loss, stats, mtp), _ = lax.scan(tick, init, jnp.arange(T))
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

    chunk_specs = _stage_specs(chunks)
    values, d_stack, d_top = jax.shard_map(
        body, in_specs=(chunk_specs, P(), P(), P(), P()),
        out_specs=((P(), P(), P(), P(STAGE) if moe else None, P()), chunk_specs, P()),
        axis_names={STAGE}, check_vma=typed)(chunks, top, micro, inv_count, inv_mtp)
    objective, nll, balance, load_LE, mtp = values
    grads = {**d_top, pipe.stack: d_stack["params"]}
    meta_grads = {pipe.stack: d_stack[fp8.META_COLLECTION]} if has_meta else {}
    return (objective, (nll, balance, load_LE, mtp)), grads, meta_grads
