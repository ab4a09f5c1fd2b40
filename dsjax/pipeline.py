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
  flight). Idle slots are skipped with `lax.cond`, so the bubble is GPipe's (S-1)/(M+S-1).
  The loss is a `jax.custom_vjp` whose forward runs the whole schedule and whose backward
  returns the gradients it computed, so `train_step` differentiates it like any loss.

Embedding, final norm and output head are replicated over stages (their specs never name
`pipeline`): every stage stores them, their gradients and optimizer moments (2 x V x D params:
0.84B for DeepSeek-7B, ~13 GB of fp32 params + Adam moments per device). Stage 0 embeds; the
head runs on the last stage's outputs, split over all stages for gpipe/circular (a reduce-scatter
of the outputs, then M/S microbatches' head and loss per stage), on the last stage for 1f1b.

Microbatch m of a global batch [B, ...] is rows m, M + m, 2M + m, ...: the reshape
[B] -> [B/M, M] keeps the `data` sharding of the rows, so no data moves.
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
from dsjax.model.decoder import Transformer, embed_tokens, output_logits, weighted_cross_entropy
from dsjax.model.layers import RMSNorm

STAGE = sharding.MESH_AXES[2]  # the mesh axis the stages live on ("pipeline")
MICRO_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The analytic idle share of a stage's time (0 without pipelining)."""
    S, M = stages, microbatches
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
    """A `Transformer` trained through a pipeline schedule; `TrainState.apply_fn` when
    mesh.pipeline > 1. Calling it is the unpipelined `model.apply` (evaluation, generation);
    `loss` is the pipelined mean next-token loss, differentiable with `jax.grad`. Call both under
    the mesh (`sharding.activate`)."""
    model: Transformer
    stages: int
    schedule: str = "gpipe"
    microbatches: int = 1
    repeats: int = 1
    typed: bool = True  # shard_map check_vma; False for fp8 (see dsjax/train.py `onebit_step`)

    def __call__(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs)

    @property
    def chunks(self) -> int:
        return self.stages * (self.repeats if self.schedule == "circular" else 1)

    def chunk_model(self) -> Transformer:
        """The decoder restricted to one chunk of layers (every chunk makes the same choices)."""
        m = self.model
        n = m.cfg.num_layers // self.chunks
        return m.clone(parent=None, cfg=dataclasses.replace(m.cfg, num_layers=n),
                       layer_policies=tuple(m.layer_policies)[:n],
                       fp8_layers=tuple(m.fp8_layers)[:n])

    def loss(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
             ) -> tuple[jax.Array, jax.Array]:
        """(mean next-token NLL over the global batch, weight sum), like `train.loss_fn`."""
        rows = batch["inputs"].shape[0]
        if rows % self.microbatches:  # e.g. a dynamic batch size (dsjax/batching.py) off the grid
            raise ConfigError(f"pipeline.microbatches: a batch of {rows} rows does not split "
                              f"into {self.microbatches} microbatches")
        count = jnp.sum(batch["weights"])
        micro = _microbatches(batch, self.microbatches)
        if self.schedule == "1f1b":
            return _one_f_one_b_loss(self, params, fp8_meta or {}, micro, count), count
        total = _forward_pipeline(self, params, fp8_meta or {}, micro)
        return total / jnp.maximum(count, 1.0), count


def make(model: Transformer, cfg: PipelineConfig, stages: int, typed: bool) -> Pipelined:
    """The `Pipelined` model for `cfg` (the validated pipeline section) over `stages` stages."""
    return Pipelined(model, stages, cfg.schedule, cfg.microbatches, cfg.repeats, typed)


# ---------------------------------------------------------------------------------------------
# Layout helpers.

def _microbatches(batch: dict[str, jax.Array], M: int) -> dict[str, jax.Array]:
    """[B, S] -> [M, B/M, S]; microbatch m = rows m, M + m, ... (keeps the rows' sharding)."""
    def split(a):
        return jnp.swapaxes(a.reshape(a.shape[0] // M, M, *a.shape[1:]), 0, 1)
    return {k: split(batch[k]) for k in MICRO_KEYS}


def _split_params(params: Any, meta: Any) -> tuple[Any, Any]:
    """(layer variables {"params", maybe "fp8_meta"}, leading "layers" axis; the replicated
    top-level params)."""
    stack = {"params": params["layers"]}
    if meta:
        stack[fp8.META_COLLECTION] = meta["layers"]
    return stack, {k: v for k, v in params.items() if k != "layers"}


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


def _head_nll(model: Transformer, top: Any, x_BSD: jax.Array, targets_BS: jax.Array,
              weights_BS: jax.Array) -> jax.Array:
    """Final norm, output head and summed weighted NLL of final-stage activations."""
    x_BSD = RMSNorm(model.cfg.norm_eps, parent=None).apply({"params": top["final_norm"]}, x_BSD)
    logits_BSV = output_logits(x_BSD, top["lm_head"], model.dtype)
    return weighted_cross_entropy(logits_BSV, targets_BS, weights_BS)[0]


def _fold(a: jax.Array) -> jax.Array:
    """[n, b, ...] -> [n * b, ...]."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


# ---------------------------------------------------------------------------------------------
# GPipe and circular: a forward-only pipeline; jax.grad differentiates through it.

def _forward_pipeline(pipe: Pipelined, params: Any, meta: Any, micro: dict[str, jax.Array]
                      ) -> jax.Array:
    """Summed weighted NLL of the global batch, the layers pipelined over `pipeline`."""
    S, M = pipe.stages, pipe.microbatches
    R = pipe.repeats if pipe.schedule == "circular" else 1
    T = ticks(pipe.schedule, S, M, R)
    model, chunk_model = pipe.model, pipe.chunk_model()
    chunks, top = _split_params(params, meta)
    # A lap of the ring ends on the last stage; with R > 1 it continues on stage 0.
    perm = [(i, (i + 1) % S) for i in range(S if R > 1 else S - 1)]

    # Block: manual over `pipeline`. chunks [L/S, ...] (this stage's layers), top and
    # micro [M, B/M, S] replicated over stages -> this stage's share of the NLL sum, psummed.
    def body(chunks, top, micro):
        chunks = _interleave(jax.tree.map(  # [L/S, ...] -> [R, Lc, ...]
            lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), chunks), S, R)
        s = lax.axis_index(STAGE)
        x_MBSD = embed_tokens(top["embedding"], micro["inputs"], model.dtype)

        def tick(carry, t):
            state_BSD, laps_MBSD = carry  # from the previous stage; stage 0's waiting room
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
            y_BSD, _ = chunk_model.run_layers(in_BSD, _index(chunks, r), micro["positions"][m],
                                              micro["segment_ids"][m])
            return (lax.ppermute(y_BSD, STAGE, perm), laps_MBSD), y_BSD

        state = jnp.zeros_like(x_MBSD[0])
        laps = jnp.zeros_like(x_MBSD) if R > 1 else jnp.zeros((), x_MBSD.dtype)
        if pipe.typed:
            state, laps = lax.pcast((state, laps), STAGE, to="varying")
        _, ys_TBSD = lax.scan(tick, (state, laps), jnp.arange(T))
        # The last lap's outputs on the last stage: ticks T-M .. T-1 are microbatches 0 .. M-1.
        # Spread them over the stages, M/S microbatches each, for the head and loss.
        n = M // S
        mine_mBSD = _scatter_from_last(ys_TBSD[T - M:], S, n)
        pick = lambda a: lax.dynamic_slice_in_dim(a, s * n, n, 0)
        nll = _head_nll(model, top, _fold(mine_mBSD), _fold(pick(micro["targets"])),
                        _fold(pick(micro["weights"])))
        return lax.psum(nll, STAGE)

    return jax.shard_map(body, in_specs=(_stage_specs(chunks), P(), P()), out_specs=P(),
                         axis_names={STAGE}, check_vma=pipe.typed)(chunks, top, micro)


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
                      count: jax.Array) -> jax.Array:
    """Mean loss whose gradient (w.r.t. params and, for delayed fp8, the amax observations of
    fp8_meta) the schedule computes itself."""

    @jax.custom_vjp
    def loss(params, meta):
        return _one_f_one_b(pipe, params, meta, micro, count)[0]

    def fwd(params, meta):
        value, grads, meta_grads = _one_f_one_b(pipe, params, meta, micro, count)
        return value, (grads, meta_grads)

    def bwd(res, ct):
        grads, meta_grads = res
        # The observed amaxes are not scaled by the loss cotangent (as in fp8's own VJP).
        return jax.tree.map(lambda g: g * ct, grads), meta_grads

    loss.defvjp(fwd, bwd)
    return loss(params, meta)


def _zeros(shapes: Any, typed: bool) -> Any:
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return lax.pcast(zeros, STAGE, to="varying") if typed and jax.tree.leaves(zeros) else zeros


def _one_f_one_b(pipe: Pipelined, params: Any, meta: Any, micro: dict[str, jax.Array],
                 count: jax.Array) -> tuple[jax.Array, Any, Any]:
    """(mean loss, its gradient w.r.t. params, fp8 amax observations) by the 1F1B schedule."""
    S, M = pipe.stages, pipe.microbatches
    T, K = ticks("1f1b", S, M), 2 * S - 1  # ticks; stash slots (>= microbatches in flight)
    model, chunk_model = pipe.model, pipe.chunk_model()
    chunks, top = _split_params(params, meta)
    has_meta = fp8.META_COLLECTION in chunks
    typed = pipe.typed
    inv_count = 1.0 / jnp.maximum(count, 1.0)

    # Block: manual over `pipeline`. chunks [L/S, ...], top and micro [M, B/M, S] replicated
    # -> loss (psummed), layer grads [L/S, ...] and meta observations, top grads (psummed).
    def body(chunks, top, micro, inv_count):
        stage_vars = chunks  # [Lc, ...]
        if typed:
            # Varying: each stage's vjp then returns its own gradient of the replicated params
            # instead of one all-reduced inside the loop (DESIGN invariant 3).
            top = lax.pcast(top, STAGE, to="varying")
        s = lax.axis_index(STAGE)
        first, last = s == 0, s == S - 1
        pos, seg = micro["positions"], micro["segment_ids"]

        def stage(variables, x_BSD, m):
            return chunk_model.run_layers(x_BSD, variables, pos[m], seg[m])[0]

        def embed(emb, m):
            return embed_tokens(emb, micro["inputs"][m], model.dtype)

        def head(top, y_BSD, m):
            return _head_nll(model, top, y_BSD, micro["targets"][m],
                             micro["weights"][m]) * inv_count

        x_shape = jax.eval_shape(embed, top["embedding"], 0)
        grad_shapes = jax.eval_shape(lambda: (stage_vars, top))

        def tick(carry, t):
            fwd_BSD, bwd_BSD, stash_KBSD, acc, loss = carry
            # Forward slot: microbatch t - s.
            mf = t - s
            on_f = (mf >= 0) & (mf < M)
            mf = jnp.clip(mf, 0, M - 1)
            in_BSD = jnp.where(first, embed(top["embedding"], mf), fwd_BSD)
            y_BSD = lax.cond(on_f, lambda: stage(stage_vars, in_BSD, mf),
                             lambda: _zeros(x_shape, typed))
            slot = lax.dynamic_index_in_dim(stash_KBSD, mf % K, 0, keepdims=False)
            stash_KBSD = lax.dynamic_update_index_in_dim(
                stash_KBSD, jnp.where(on_f, in_BSD, slot), mf % K, 0)

            # The last stage turns its output into the loss and the loss gradient at once.
            def loss_and_grad():
                nll, vjp = jax.vjp(lambda top, y: head(top, y, mf), top, y_BSD)
                d_top, dy = vjp(jnp.ones_like(nll))
                return nll, d_top, dy
            nll, d_top_head, dy_BSD = lax.cond(
                on_f & last, loss_and_grad,
                lambda: _zeros(jax.eval_shape(loss_and_grad), typed))

            # Backward slot: microbatch t - 2(S-1) + s, its output gradient from stage s+1 (on
            # the last stage: the one just computed). Recompute the stage forward, then its vjp.
            mb = t - 2 * (S - 1) + s
            on_b = (mb >= 0) & (mb < M)
            mb = jnp.clip(mb, 0, M - 1)
            g_BSD = jnp.where(last, dy_BSD, bwd_BSD)
            x_BSD = lax.dynamic_index_in_dim(stash_KBSD, mb % K, 0, keepdims=False)

            def stage_grad():
                _, vjp = jax.vjp(lambda v, x: stage(v, x, mb), stage_vars, x_BSD)
                return vjp(g_BSD)
            d_vars, dx_BSD = lax.cond(on_b, stage_grad,
                                      lambda: _zeros(jax.eval_shape(stage_grad), typed))

            def embed_grad():
                _, vjp = jax.vjp(lambda e: embed(e, mb), top["embedding"])
                return vjp(dx_BSD)[0]
            d_emb = lax.cond(on_b & first, embed_grad,
                             lambda: _zeros(jax.eval_shape(embed_grad), typed))

            d_stage, d_top = acc
            d_top = jax.tree.map(jnp.add, d_top, d_top_head)
            d_top = {**d_top, "embedding": d_top["embedding"] + d_emb}
            new_stage = {"params": jax.tree.map(jnp.add, d_stage["params"], d_vars["params"])}
            if has_meta:  # amax observations combine by maximum, gradients add
                new_stage[fp8.META_COLLECTION] = fp8.combine(d_stage[fp8.META_COLLECTION],
                                                             d_vars[fp8.META_COLLECTION])
            carry = (lax.ppermute(y_BSD, STAGE, [(i, i + 1) for i in range(S - 1)]),
                     lax.ppermute(dx_BSD, STAGE, [(i + 1, i) for i in range(S - 1)]),
                     stash_KBSD, (new_stage, d_top), loss + nll)
            return carry, None

        zero_x = _zeros(x_shape, typed)
        init = (zero_x, zero_x, _zeros(jax.ShapeDtypeStruct((K, *x_shape.shape), x_shape.dtype),
                                       typed),
                _zeros(grad_shapes, typed), _zeros(jax.ShapeDtypeStruct((), jnp.float32), typed))
        (_, _, _, (d_stage, d_top), loss), _ = lax.scan(tick, init, jnp.arange(T))
        return lax.psum(loss, STAGE), d_stage, lax.psum(d_top, STAGE)

    chunk_specs = _stage_specs(chunks)
    loss, d_chunks, d_top = jax.shard_map(
        body, in_specs=(chunk_specs, P(), P(), P()), out_specs=(P(), chunk_specs, P()),
        axis_names={STAGE}, check_vma=typed)(chunks, top, micro, inv_count)
    d_stack = d_chunks
    grads = {**d_top, "layers": d_stack["params"]}
    meta_grads = {"layers": d_stack[fp8.META_COLLECTION]} if has_meta else {}
    return loss, grads, meta_grads
