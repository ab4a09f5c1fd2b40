"""Attention with the sequence split over the `context` mesh axis: all-gather or ring.

The one idea: each device keeps its own queries (S / C of them, in the layout of
`context_layout`) and must see every earlier key. `all_gather` gathers the keys and values (MLA
gathers its latent and RoPE key before the up-projection, mla.py) and runs the flash blocks of
its queries over them. `ring` never holds more than two devices' keys: C steps, each attending to
the shard it holds while the next one arrives by `ppermute`, combined by their logsumexps; the
backward sends the key and value gradients around the ring with the keys. Both run
`flash.forward` / `flash.backward` with the global token index of every query and key, so
blocks that causality or the documents hide are skipped, and a zigzag layout gives every device
the same number of blocks. Inside a `shard_map` manual over `context` only: batch and heads stay
split over `data` and `tensor` as outside. Docs: docs/context.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from dsjax.model import flash
from dsjax.model.context_layout import Layout, layout_order, natural_order
from dsjax.sharding import CONTEXT

F32 = jnp.float32


def context_attention(q_BSHK: jax.Array, k_BTNK: jax.Array, v_BTNU: jax.Array,
                      segment_ids_BS: jax.Array, *, scale: float, block_q: int, block_k: int,
                      impl: str, layout: Layout) -> jax.Array:
    """Causal, segment-masked attention of rows split over `context` (layout order) ->
    ctx [B, S, H, U] in v's dtype, split the same way. impl: "all_gather" or "ring"."""
    return _attend(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS,
                   (impl, layout, float(scale), int(block_q), int(block_k)))


# The custom_vjp sits outside the shard_maps: one for the forward, one for the backward, and
# their residuals are plain inputs and outputs (a shard_map's own partial evaluation, nested in
# the pipeline's, hands Shardy residual shardings it rejects).
SPLIT = P(None, CONTEXT)  # [B, S, ...] split over `context`
LSE_SPLIT = P(None, None, CONTEXT)  # [B, H, S]


def _specs(impl):
    """(k, v and key ids) spec: all_gather takes whole rows (XLA gathers them; a no-op for MLA,
    whose latent was gathered before its up-projection), ring its own shard."""
    return P() if impl == "all_gather" else SPLIT


def _shard_map(body, in_specs, out_specs):
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={CONTEXT},
                         check_vma=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q_BSHK, k_BTNK, v_BTNU, seg_BS, how):
    return _attend_fwd(q_BSHK, k_BTNK, v_BTNU, seg_BS, how)[0]


def _attend_fwd(q_BSHK, k_BTNK, v_BTNU, seg_BS, how):
    impl, layout, scale, block_q, block_k = how
    kv = _specs(impl)
    body = functools.partial(_gathered_forward if impl == "all_gather" else _ring_forward,
                             scale=scale, block_q=block_q, block_k=block_k, layout=layout)
    out_BSHU, lse_BHS = _shard_map(body, (SPLIT, kv, kv, SPLIT, kv), (SPLIT, LSE_SPLIT))(
        q_BSHK, k_BTNK, v_BTNU, seg_BS, seg_BS)
    out_BSHU = checkpoint_name(out_BSHU, "attn_context")
    lse_BHS = checkpoint_name(lse_BHS, "attn_lse")
    return out_BSHU, (q_BSHK, k_BTNK, v_BTNU, seg_BS, out_BSHU, lse_BHS)


def _attend_bwd(how, residuals, dout_BSHU):
    impl, layout, scale, block_q, block_k = how
    kv = _specs(impl)
    body = functools.partial(_gathered_backward if impl == "all_gather" else _ring_backward,
                             scale=scale, block_q=block_q, block_k=block_k, layout=layout)
    dq, dk, dv = _shard_map(body, (SPLIT, kv, kv, SPLIT, kv, SPLIT, LSE_SPLIT, SPLIT),
                            (SPLIT, kv, kv))(*residuals[:4], residuals[3], *residuals[4:],
                                             dout_BSHU)
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _gathered_forward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, *, scale, block_q, block_k,
                      layout):
    """Local queries over the whole row's keys, put in natural order (increasing indices, so
    the flash schedule's block ranges hold)."""
    T = k_BTNK.shape[1]
    k_BTNK, v_BTNU, seg_k_BT = (natural_order(x, layout) for x in (k_BTNK, v_BTNU, seg_k_BT))
    return flash.forward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT,
                         layout.indices(T, lax.axis_index(CONTEXT)),
                         jnp.arange(T, dtype=jnp.int32), scale, block_q, block_k)


def _gathered_backward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, out_BSHU, lse_BHS,
                       dout_BSHU, *, scale, block_q, block_k, layout):
    """dq of the local queries; dk, dv of the whole row from them, summed over `context`."""
    T = k_BTNK.shape[1]
    k_nat, v_nat, seg_k_BT = (natural_order(x, layout) for x in (k_BTNK, v_BTNU, seg_k_BT))
    dq, dk, dv = flash.backward(q_BSHK, k_nat, v_nat, seg_q_BS, seg_k_BT,
                                layout.indices(T, lax.axis_index(CONTEXT)),
                                jnp.arange(T, dtype=jnp.int32), out_BSHU, lse_BHS, dout_BSHU,
                                scale, block_q, block_k)
    dk, dv = (lax.psum(layout_order(d.astype(F32), layout), CONTEXT).astype(x.dtype)
              for d, x in ((dk, k_BTNK), (dv, v_BTNU)))
    return dq.astype(q_BSHK.dtype), dk, dv


def _after(x, *deps):
    """x, once `deps` exist: orders a collective after another. XLA:CPU runs independent
    collectives concurrently, and devices that start them in different orders deadlock."""
    return lax.optimization_barrier((x, *deps))[0]


def _send(x, parts):
    """x to the next device of the ring (device d receives d - 1's)."""
    return lax.ppermute(x, CONTEXT, [(i, (i + 1) % parts) for i in range(parts)])


def _source_indices(layout, seq, step):
    """The natural indices of the shard a device holds at ring step `step` (d - step's)."""
    source = (lax.axis_index(CONTEXT) - step) % layout.parts
    return layout.indices(seq, source)


def _combine(out_BSHU, lse_BHS, part_BSHU, part_lse_BHS):
    """Two softmax-normalised partial outputs over disjoint keys -> the output over both."""
    lse_new = jnp.logaddexp(lse_BHS, part_lse_BHS)
    shift = jnp.where(lse_new == -jnp.inf, 0.0, lse_new)  # rows that have seen nothing yet
    w_old, w_new = (jnp.transpose(jnp.exp(x - shift), (0, 2, 1))[..., None]
                    for x in (lse_BHS, part_lse_BHS))
    return out_BSHU * w_old + part_BSHU.astype(F32) * w_new, lse_new


def _rotate(shards, parts, after=()):
    """Each array of `shards` to the next device, one collective after another, the first
    once `after` exists (a step's compute: so at most two steps' shards are ever held)."""
    out = []
    for x in shards:
        out.append(_send(_after(x, *after, *out[-1:]), parts))
    return out


def _ring_forward(q_BSHK, k_BTNK, v_BTNU, seg_BS, seg_k_BT, *, scale, block_q, block_k, layout):
    """C steps: the local queries against the shard held (the own one first), while the next
    shard travels; partial outputs combined by their logsumexps. A loop, not C copies of the
    flash blocks: each copy would keep its own block buffers."""
    del seg_k_BT  # the same shard as seg_BS: the ring sends it on
    B, S, H, _ = q_BSHK.shape
    parts, seq = layout.parts, S * layout.parts
    pos_q_S = layout.indices(seq, lax.axis_index(CONTEXT))

    def attend(step, out_BSHU, lse_BHS, shard):
        part, part_lse = flash.forward(q_BSHK, shard[0], shard[1], seg_BS, shard[2], pos_q_S,
                                       _source_indices(layout, seq, step), scale, block_q,
                                       block_k)
        return _combine(out_BSHU, lse_BHS, part, part_lse)

    def step_fn(step, carry):  # the next shard travels while this one is attended to
        out_BSHU, lse_BHS, shard = carry
        arriving = _rotate(shard, parts, after=(out_BSHU,))
        out_BSHU, lse_BHS = attend(step, out_BSHU, lse_BHS, shard)
        return out_BSHU, lse_BHS, tuple(arriving)

    init = (jnp.zeros((B, S, H, v_BTNU.shape[-1]), F32), jnp.full((B, H, S), -jnp.inf, F32),
            (k_BTNK, v_BTNU, seg_BS))
    out_BSHU, lse_BHS, shard = lax.fori_loop(0, parts - 1, step_fn, init)
    out_BSHU, lse_BHS = attend(parts - 1, out_BSHU, lse_BHS, shard)
    return out_BSHU.astype(v_BTNU.dtype), lse_BHS


def _ring_backward(q_BSHK, k_BTNK, v_BTNU, seg_BS, seg_k_BT, out_BSHU, lse_BHS, dout_BSHU, *,
                   scale, block_q, block_k, layout):
    """Each step: the local queries against the shard held (`flash.backward` with the final
    output and logsumexp), dq kept, the shard's dk, dv (float32) sent on with it; after the
    last step they travel once more and arrive home."""
    del seg_k_BT
    S = q_BSHK.shape[1]
    parts, seq = layout.parts, S * layout.parts
    pos_q_S = layout.indices(seq, lax.axis_index(CONTEXT))

    def grads_of(step, dq_BSHK, grads, shard):
        dq, dk, dv = flash.backward(q_BSHK, shard[0], shard[1], seg_BS, shard[2], pos_q_S,
                                    _source_indices(layout, seq, step), out_BSHU, lse_BHS,
                                    dout_BSHU, scale, block_q, block_k)
        return dq_BSHK + dq, (grads[0] + dk.astype(F32), grads[1] + dv.astype(F32))

    def step_fn(step, carry):
        dq_BSHK, grads, shard = carry
        arriving = _rotate(shard, parts, after=grads[-1:])
        dq_BSHK, grads = grads_of(step, dq_BSHK, grads, shard)
        return dq_BSHK, tuple(_rotate(grads, parts, after=arriving[-1:])), tuple(arriving)

    init = (jnp.zeros(q_BSHK.shape, F32),
            (jnp.zeros(k_BTNK.shape, F32), jnp.zeros(v_BTNU.shape, F32)),
            (k_BTNK, v_BTNU, seg_BS))
    dq_BSHK, grads, shard = lax.fori_loop(0, parts - 1, step_fn, init)
    dq_BSHK, grads = grads_of(parts - 1, dq_BSHK, grads, shard)
    dk, dv = _rotate(grads, parts)  # home
    return dq_BSHK.astype(q_BSHK.dtype), dk.astype(k_BTNK.dtype), dv.astype(v_BTNU.dtype)


def block_pairs(layout: Layout, seq: int, block_q: int, block_k: int, impl: str) -> list[int]:
    """Per device, the (query block, key block) pairs its flash loops run for one causal row of
    `seq` tokens in one document: its attention work (each pair is the same FLOPs). From the
    same schedule the loops read (`flash.block_schedule`)."""
    S = seq // layout.parts
    ones = jnp.ones((1, S), jnp.int32)
    counts = []
    for d in range(layout.parts):
        pos_q = layout.indices(seq, jnp.int32(d))
        if impl == "all_gather":
            keys = [jnp.arange(seq, dtype=jnp.int32)]
        else:
            keys = [layout.indices(seq, jnp.int32((d - step) % layout.parts))
                    for step in range(layout.parts)]
        total = 0
        for pos_k in keys:
            lo, hi, _, _ = flash.block_schedule(ones, jnp.ones((1, pos_k.shape[0]), jnp.int32),
                                                pos_q, pos_k, block_q, block_k)
            total += int(jnp.sum(jnp.maximum(hi - lo, 0)))
        counts.append(total)
    return counts
