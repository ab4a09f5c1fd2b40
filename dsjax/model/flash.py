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


def _blocks(S: int, T: int, block_q: int, block_k: int) -> tuple[int, int, int, int]:
    """Clamped block sizes and block counts (bq, bk, nq, nk) for S queries and T keys."""
    bq, bk = min(block_q, S), min(block_k, T)
    return bq, bk, -(-S // bq), -(-T // bk)


def block_schedule(seg_q_BS: jax.Array, seg_k_BT: jax.Array, pos_q_S: jax.Array,
                   pos_k_T: jax.Array, block_q: int, block_k: int):
    """Which block pairs run: (key block range [lo_I, hi_I) per query block, query block range
    [lo_J, hi_J) per key block). Both describe the same set of pairs: some key at or before some
    query (global token indices pos_q / pos_k, increasing), sharing a document in at least one
    batch row (segment ids non-decreasing along the global order)."""
    S, T = seg_q_BS.shape[1], seg_k_BT.shape[1]
    bq, bk, nq, nk = _blocks(S, T, block_q, block_k)
    seg_q_BS, seg_k_BT = seg_q_BS.astype(jnp.int32), seg_k_BT.astype(jnp.int32)
    last_q = jnp.minimum(jnp.arange(1, nq + 1) * bq, S) - 1
    last_k = jnp.minimum(jnp.arange(1, nk + 1) * bk, T) - 1
    first_q_BI, last_k_BJ = seg_q_BS[:, ::bq], seg_k_BT[:, last_k]          # [B, nq], [B, nk]
    # Causal: key block j meets query block i iff its first key <= the block's last query.
    first_pos_k_J, last_pos_q_I = pos_k_T[::bk], pos_q_S[last_q]
    hi_I = jnp.sum(first_pos_k_J[None, :] <= last_pos_q_I[:, None], axis=1)
    lo_J = jnp.sum(last_pos_q_I[None, :] < first_pos_k_J[:, None], axis=1)
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


def _masked_logits(q_BSNRK, k_BTNK, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, scale):
    """Scaled float32 logits of one block pair, -inf where s may not see t: [B, N, R, bq, bk]."""
    s_BNRST = jnp.einsum("BSNRK,BTNK->BNRST", q_BSNRK, k_BTNK,
                         preferred_element_type=F32) * scale
    causal_ST = pos_k_T[None, :] <= pos_q_S[:, None]
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


def _padded(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, block_q, block_k):
    """The block-padded operands: padded query rows repeat the last row's id and index (they
    are sliced off), padded keys sit after every query (INT32 max), so causality hides them."""
    B, S, H, K = q_BSHK.shape
    N = k_BTNK.shape[2]
    bq, bk, nq, nk = _blocks(S, k_BTNK.shape[1], block_q, block_k)
    return ((bq, bk, nq, nk), _pad(q_BSHK.reshape(B, S, N, H // N, K), nq * bq, 1),
            _pad(k_BTNK, nk * bk, 1), _pad(v_BTNU, nk * bk, 1),
            _pad(seg_q_BS, nq * bq, 1, "edge"), _pad(seg_k_BT, nk * bk, 1, "edge"),
            _pad(pos_q_S, nq * bq, 0, "edge"),
            _pad(pos_k_T, nk * bk, 0, value=jnp.iinfo(jnp.int32).max))


def forward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, scale, block_q,
            block_k):
    """Output [B, S, H, U] (v's dtype) and row logsumexp [B, H, S] (float32) of S queries at
    global token indices pos_q [S] against T keys at pos_k [T] (both increasing). A row that sees
    no key (a ring step's pair can hide every key from it) gets output 0 and lse -inf."""
    B, S, H, _ = q_BSHK.shape
    N, U = k_BTNK.shape[2], v_BTNU.shape[3]
    R = H // N
    inputs = (q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT)
    lo_I, hi_I, _, _ = block_schedule(seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, block_q, block_k)
    (bq, bk, nq, _), q_BSNRK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T = _padded(
        q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, block_q, block_k)

    def q_block(i, carry):
        out_BSNRU, lse_BNRS = carry
        q_blk, seg_q, pos_q = (_slice(q_BSNRK, i * bq, bq), _slice(seg_q_BS, i * bq, bq),
                               _slice(pos_q_S, i * bq, bq, 0))

        def kv_block(j, stats):
            m_BNRS, l_BNRS, acc_BNRSU = stats
            s_BNRST = _masked_logits(q_blk, _slice(k_BTNK, j * bk, bk), seg_q,
                                     _slice(seg_k_BT, j * bk, bk), pos_q,
                                     _slice(pos_k_T, j * bk, bk, 0), scale)
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
        seen_BNRS = l_BNRS > 0
        ctx_BNRSU = acc_BNRSU / jnp.where(seen_BNRS, l_BNRS, 1.0)[..., None]
        out_BSNRU = lax.dynamic_update_slice_in_dim(
            out_BSNRU, jnp.transpose(ctx_BNRSU, (0, 3, 1, 2, 4)).astype(out_BSNRU.dtype),
            i * bq, 1)
        lse_BNRS = lax.dynamic_update_slice_in_dim(
            lse_BNRS, jnp.where(seen_BNRS, m_BNRS + jnp.log(l_BNRS), -jnp.inf), i * bq, 3)
        return out_BSNRU, lse_BNRS

    init = _like(inputs, jnp.zeros((B, nq * bq, N, R, U), v_BTNU.dtype),
                 jnp.zeros((B, N, R, nq * bq), F32))
    out_BSNRU, lse_BNRS = lax.fori_loop(0, nq, q_block, init)
    return (out_BSNRU[:, :S].reshape(B, S, H, U), lse_BNRS[..., :S].reshape(B, H, S))


def backward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, out_BSHU, lse_BHS,
             dout_BSHU, scale, block_q, block_k):
    """dq (float32), dk, dv by one pass over key blocks; each visits only the query blocks that
    see it. `out` and `lse` are the attention's final output and logsumexp over all its keys:
    with a ring's pair of shards, this is the pair's share of the gradients."""
    B, S, H, K = q_BSHK.shape
    N, U = k_BTNK.shape[2], v_BTNU.shape[3]
    R = H // N
    T = k_BTNK.shape[1]
    inputs = (q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, dout_BSHU)
    _, _, lo_J, hi_J = block_schedule(seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, block_q, block_k)
    (bq, bk, nq, nk), q_BSNRK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T = _padded(
        q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, block_q, block_k)
    # D = rowsum(dO * O): an elementwise product, not a dot (no float32 matmul in a bf16 step).
    delta_BSH = jnp.sum(dout_BSHU.astype(F32) * out_BSHU.astype(F32), axis=-1)
    delta_BNRS = _pad(jnp.transpose(delta_BSH, (0, 2, 1)).reshape(B, N, R, S), nq * bq, 3)
    # Padded rows get lse = +inf, so their recomputed probabilities are exactly 0.
    lse_BNRS = _pad(lse_BHS.reshape(B, N, R, S), nq * bq, 3, value=jnp.inf)
    do_BSNRU = _pad(dout_BSHU.reshape(B, S, N, R, U), nq * bq, 1)

    def kv_block(j, carry):
        dq_BSNRK, dk_BTNK, dv_BTNU = carry
        k_blk, v_blk = _slice(k_BTNK, j * bk, bk), _slice(v_BTNU, j * bk, bk)
        seg_k, pos_k = _slice(seg_k_BT, j * bk, bk), _slice(pos_k_T, j * bk, bk, 0)

        def q_block(i, acc):
            dk_acc, dv_acc, dq_acc = acc
            q_blk, do_blk = _slice(q_BSNRK, i * bq, bq), _slice(do_BSNRU, i * bq, bq)
            s_BNRST = _masked_logits(q_blk, k_blk, _slice(seg_q_BS, i * bq, bq), seg_k,
                                     _slice(pos_q_S, i * bq, bq, 0), pos_k, scale)
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
    dq_BSHK = (dq_BSNRK[:, :S] * scale).reshape(B, S, H, K)
    return dq_BSHK, dk_BTNK[:, :T], dv_BTNU[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def flash_pair(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, scale, block_q,
               block_k):
    """Causal attention of S queries over T keys at global token indices pos_q, pos_k, within
    documents: ctx [B, S, H, U] in v's dtype (`flash_attention` with both positions arange(S))."""
    out_BSHU, _ = forward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, scale,
                          block_q, block_k)
    return checkpoint_name(out_BSHU, "attn_context")


def _flash_fwd(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, scale, block_q,
               block_k):
    out_BSHU, lse_BHS = forward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T,
                                scale, block_q, block_k)
    out_BSHU = checkpoint_name(out_BSHU, "attn_context")
    lse_BHS = checkpoint_name(lse_BHS, "attn_lse")
    return out_BSHU, (q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, out_BSHU,
                      lse_BHS)


def _flash_bwd(scale, block_q, block_k, residuals, dout_BSHU):
    q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T, out_BSHU, lse_BHS = residuals
    dq, dk, dv = backward(q_BSHK, k_BTNK, v_BTNU, seg_q_BS, seg_k_BT, pos_q_S, pos_k_T,
                          out_BSHU, lse_BHS, dout_BSHU, scale, block_q, block_k)
    return dq.astype(q_BSHK.dtype), dk, dv, None, None, None, None


flash_pair.defvjp(_flash_fwd, _flash_bwd)


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
    pos_S = jnp.arange(S, dtype=jnp.int32)
    return flash_pair(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, segment_ids_BS, pos_S, pos_S,
                      float(scale), int(block_q), int(block_k))
