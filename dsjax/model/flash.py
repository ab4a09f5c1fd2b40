"""Blockwise causal, segment-aware attention (FlashAttention-2) in plain JAX, with a custom_vjp.

The one idea: never hold [S, T] logits. Each query block streams over only the key blocks it can
see (on or below the causal diagonal, in its documents) with an online softmax, so memory grows
linearly in S; the backward saves only q, k, v, the output and the row logsumexp and recomputes
each probability block from them (Dao 2023, FlashAttention-2, Algorithms 1 and 2). GQA groups
query heads as [N, R] and never repeats k/v; the qk head dim K may differ from the v dim U (MLA).
The algorithm and its block schedule are described in docs/attention.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

F32 = jnp.float32


def _blocks(seq: int, block_q: int, block_k: int) -> tuple[int, int, int, int]:
    """Clamped block sizes and block counts (bq, bk, nq, nk)."""
    bq, bk = min(block_q, seq), min(block_k, seq)
    return bq, bk, -(-seq // bq), -(-seq // bk)


def block_schedule(segment_ids_BS: jax.Array, block_q: int, block_k: int):
    """Which block pairs run: (key block range [lo_I, hi_I) per query block, query block range
    [lo_J, hi_J) per key block). Both describe the same set of pairs: on or below the causal
    diagonal, and sharing a document in at least one batch row (segment ids non-decreasing)."""
    seq = segment_ids_BS.shape[1]
    bq, bk, nq, nk = _blocks(seq, block_q, block_k)
    seg_BS = segment_ids_BS.astype(jnp.int32)
    first_q_BI = seg_BS[:, ::bq]                                             # [B, nq]
    last_k_BJ = seg_BS[:, jnp.minimum(jnp.arange(1, nk + 1) * bk, seq) - 1]  # [B, nk]
    i_I, j_J = jnp.arange(nq), jnp.arange(nk)
    # Causal: key block j meets query block i iff its first key <= the block's last real row.
    hi_I = (jnp.minimum((i_I + 1) * bq, seq) - 1) // bk + 1
    lo_J = j_J * bk // bq
    # Documents: key block j is dead for query block i in row b iff all its ids precede the
    # block's first id; a pair is skipped only if it is dead in every row.
    dead_BIJ = last_k_BJ[:, None, :] < first_q_BI[:, :, None]
    lo_I = jnp.min(jnp.sum(dead_BIJ, axis=2), axis=0)
    hi_J = jnp.max(jnp.sum(~dead_BIJ, axis=1), axis=0)
    return (lo_I.astype(jnp.int32), hi_I.astype(jnp.int32),
            lo_J.astype(jnp.int32), hi_J.astype(jnp.int32))


def _pad(x: jax.Array, length: int, axis: int, mode: str = "constant", value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _masked_logits(q_BSNRK, k_BTNK, seg_q_BS, seg_k_BT, q0, k0, seq, scale):
    """Scaled float32 logits of one block pair, -inf where s may not see t: [B, N, R, bq, bk]."""
    s_BNRST = jnp.einsum("BSNRK,BTNK->BNRST", q_BSNRK, k_BTNK,
                         preferred_element_type=F32) * scale
    pos_q_S = q0 + jnp.arange(q_BSNRK.shape[1])
    pos_k_T = k0 + jnp.arange(k_BTNK.shape[1])
    causal_ST = (pos_k_T[None, :] <= pos_q_S[:, None]) & (pos_k_T[None, :] < seq)
    mask_BST = causal_ST[None] & (seg_q_BS[:, :, None] == seg_k_BT[:, None, :])
    return jnp.where(mask_BST[:, None, None], s_BNRST, -jnp.inf)


def _slice(x: jax.Array, start, size: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _like(inputs, *inits):
    """Loop initial values that vary over the manual axes the inputs vary over: inside a typed
    shard_map (the pipeline's) a loop carry must keep its type through the body. Adding a zero
    made from the inputs lets JAX insert the cast, without reading private aval fields."""
    zero = sum(jnp.sum(x[..., :0], dtype=F32) for x in inputs)
    return tuple(x + zero.astype(x.dtype) for x in inits)


def _forward(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale, block_q, block_k):
    """Output [B, S, H, U] (v's dtype) and row logsumexp [B, H, S] (float32)."""
    B, S, H, K = q_BSHK.shape
    N, U = k_BTNK.shape[2], v_BTNU.shape[3]
    R = H // N
    bq, bk, nq, nk = _blocks(S, block_q, block_k)
    inputs = (q_BSHK, k_BTNK, v_BTNU, segment_ids_BS)
    lo_I, hi_I, _, _ = block_schedule(segment_ids_BS, block_q, block_k)
    q_BSNRK = _pad(q_BSHK.reshape(B, S, N, R, K), nq * bq, 1)
    k_BTNK, v_BTNU = _pad(k_BTNK, nk * bk, 1), _pad(v_BTNU, nk * bk, 1)
    # Padded query rows repeat the last id, so they see key S - 1: no row is ever fully masked.
    seg_q_BS = _pad(segment_ids_BS, nq * bq, 1, "edge")
    seg_k_BT = _pad(segment_ids_BS, nk * bk, 1, "edge")

    def q_block(i, carry):
        out_BSNRU, lse_BNRS = carry
        q_blk = _slice(q_BSNRK, i * bq, bq)
        seg_q = _slice(seg_q_BS, i * bq, bq)

        def kv_block(j, stats):
            m_BNRS, l_BNRS, acc_BNRSU = stats
            s_BNRST = _masked_logits(q_blk, _slice(k_BTNK, j * bk, bk), seg_q,
                                     _slice(seg_k_BT, j * bk, bk), i * bq, j * bk, S, scale)
            m_new = jnp.maximum(m_BNRS, s_BNRST.max(-1))
            # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p_BNRST = jnp.exp(s_BNRST - m_use[..., None])
            alpha_BNRS = jnp.exp(m_BNRS - m_use)
            pv_BNRSU = jnp.einsum("BNRST,BTNU->BNRSU", p_BNRST.astype(v_BTNU.dtype),
                                  _slice(v_BTNU, j * bk, bk), preferred_element_type=F32)
            return (m_new, alpha_BNRS * l_BNRS + p_BNRST.sum(-1),
                    alpha_BNRS[..., None] * acc_BNRSU + pv_BNRSU)

        init = _like(inputs, jnp.full((B, N, R, bq), -jnp.inf, F32),
                     jnp.zeros((B, N, R, bq), F32), jnp.zeros((B, N, R, bq, U), F32))
        m_BNRS, l_BNRS, acc_BNRSU = lax.fori_loop(lo_I[i], hi_I[i], kv_block, init)
        ctx_BSNRU = jnp.transpose(acc_BNRSU / l_BNRS[..., None], (0, 3, 1, 2, 4))
        out_BSNRU = lax.dynamic_update_slice_in_dim(
            out_BSNRU, ctx_BSNRU.astype(out_BSNRU.dtype), i * bq, 1)
        lse_BNRS = lax.dynamic_update_slice_in_dim(
            lse_BNRS, m_BNRS + jnp.log(l_BNRS), i * bq, 3)
        return out_BSNRU, lse_BNRS

    init = _like(inputs, jnp.zeros((B, nq * bq, N, R, U), v_BTNU.dtype),
                 jnp.zeros((B, N, R, nq * bq), F32))
    out_BSNRU, lse_BNRS = lax.fori_loop(0, nq, q_block, init)
    return (out_BSNRU[:, :S].reshape(B, S, H, U), lse_BNRS[..., :S].reshape(B, H, S))


def _backward(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, out_BSHU, lse_BHS, dout_BSHU,
              scale, block_q, block_k):
    """dq, dk, dv by one pass over key blocks; each visits only the query blocks that see it."""
    B, S, H, K = q_BSHK.shape
    N, U = k_BTNK.shape[2], v_BTNU.shape[3]
    R = H // N
    bq, bk, nq, nk = _blocks(S, block_q, block_k)
    inputs = (q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, dout_BSHU)
    _, _, lo_J, hi_J = block_schedule(segment_ids_BS, block_q, block_k)
    # D = rowsum(dO * O): an elementwise product, not a dot (no float32 matmul in a bf16 step).
    delta_BSH = jnp.sum(dout_BSHU.astype(F32) * out_BSHU.astype(F32), axis=-1)
    delta_BNRS = _pad(jnp.transpose(delta_BSH, (0, 2, 1)).reshape(B, N, R, S), nq * bq, 3)
    # Padded rows get lse = +inf, so their recomputed probabilities are exactly 0.
    lse_BNRS = _pad(lse_BHS.reshape(B, N, R, S), nq * bq, 3, value=jnp.inf)
    q_BSNRK = _pad(q_BSHK.reshape(B, S, N, R, K), nq * bq, 1)
    do_BSNRU = _pad(dout_BSHU.reshape(B, S, N, R, U), nq * bq, 1)
    k_BTNK, v_BTNU = _pad(k_BTNK, nk * bk, 1), _pad(v_BTNU, nk * bk, 1)
    seg_q_BS = _pad(segment_ids_BS, nq * bq, 1, "edge")
    seg_k_BT = _pad(segment_ids_BS, nk * bk, 1, "edge")

    def kv_block(j, carry):
        dq_BSNRK, dk_BTNK, dv_BTNU = carry
        k_blk, v_blk = _slice(k_BTNK, j * bk, bk), _slice(v_BTNU, j * bk, bk)
        seg_k = _slice(seg_k_BT, j * bk, bk)

        def q_block(i, acc):
            dk_acc, dv_acc, dq_acc = acc
            q_blk, do_blk = _slice(q_BSNRK, i * bq, bq), _slice(do_BSNRU, i * bq, bq)
            s_BNRST = _masked_logits(q_blk, k_blk, _slice(seg_q_BS, i * bq, bq), seg_k,
                                     i * bq, j * bk, S, scale)
            p_BNRST = jnp.exp(s_BNRST - _slice(lse_BNRS, i * bq, bq, 3)[..., None])
            dv_acc += jnp.einsum("BNRST,BSNRU->BTNU", p_BNRST.astype(do_blk.dtype), do_blk,
                                 preferred_element_type=F32)
            dp_BNRST = jnp.einsum("BSNRU,BTNU->BNRST", do_blk, v_blk, preferred_element_type=F32)
            ds_BNRST = p_BNRST * (dp_BNRST - _slice(delta_BNRS, i * bq, bq, 3)[..., None])
            dk_acc += jnp.einsum("BNRST,BSNRK->BTNK", ds_BNRST.astype(q_blk.dtype), q_blk,
                                 preferred_element_type=F32)
            dq_blk = jnp.einsum("BNRST,BTNK->BSNRK", ds_BNRST.astype(k_blk.dtype), k_blk,
                                preferred_element_type=F32)
            dq_acc = lax.dynamic_update_slice_in_dim(
                dq_acc, _slice(dq_acc, i * bq, bq) + dq_blk, i * bq, 1)
            return dk_acc, dv_acc, dq_acc

        init = _like(inputs, jnp.zeros((B, bk, N, K), F32), jnp.zeros((B, bk, N, U), F32)) + (
            dq_BSNRK,)
        dk_acc, dv_acc, dq_BSNRK = lax.fori_loop(lo_J[j], hi_J[j], q_block, init)
        dk_BTNK = lax.dynamic_update_slice_in_dim(
            dk_BTNK, (dk_acc * scale).astype(dk_BTNK.dtype), j * bk, 1)
        dv_BTNU = lax.dynamic_update_slice_in_dim(dv_BTNU, dv_acc.astype(dv_BTNU.dtype), j * bk, 1)
        return dq_BSNRK, dk_BTNK, dv_BTNU

    init = _like(inputs, jnp.zeros((B, nq * bq, N, R, K), F32),
                 jnp.zeros(k_BTNK.shape, k_BTNK.dtype), jnp.zeros(v_BTNU.shape, v_BTNU.dtype))
    dq_BSNRK, dk_BTNK, dv_BTNU = lax.fori_loop(0, nk, kv_block, init)
    dq_BSHK = (dq_BSNRK[:, :S] * scale).astype(q_BSHK.dtype).reshape(B, S, H, K)
    return dq_BSHK, dk_BTNK[:, :S], dv_BTNU[:, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale, block_q, block_k):
    out_BSHU, _ = _forward(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale, block_q, block_k)
    return checkpoint_name(out_BSHU, "attn_context")


def _flash_fwd(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale, block_q, block_k):
    out_BSHU, lse_BHS = _forward(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale, block_q, block_k)
    out_BSHU = checkpoint_name(out_BSHU, "attn_context")
    lse_BHS = checkpoint_name(lse_BHS, "attn_lse")
    return out_BSHU, (q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, out_BSHU, lse_BHS)


def _flash_bwd(scale, block_q, block_k, residuals, dout_BSHU):
    q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, out_BSHU, lse_BHS = residuals
    dq, dk, dv = _backward(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, out_BSHU, lse_BHS,
                           dout_BSHU, scale, block_q, block_k)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BSHK: jax.Array, k_BTNK: jax.Array, v_BTNU: jax.Array,
                    segment_ids_BS: jax.Array, *, scale: float,
                    block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Causal attention within documents (`layers.attention_mask`): ctx [B, S, H, U] in v's dtype.

    Query head h reads kv head h // (H // N). Segment ids must be non-decreasing along each row
    (packed documents); block sizes are clamped to S and S need not be a multiple of them."""
    B, S, H, _ = q_BSHK.shape
    N = k_BTNK.shape[2]
    if H % N or k_BTNK.shape[:2] != (B, S) or v_BTNU.shape[:3] != k_BTNK.shape[:3]:
        raise ValueError(f"flash_attention: q {q_BSHK.shape}, k {k_BTNK.shape}, "
                         f"v {v_BTNU.shape} do not fit [B, S, N*R, K], [B, S, N, K], [B, S, N, U]")
    return _flash(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, float(scale), int(block_q), int(block_k))
