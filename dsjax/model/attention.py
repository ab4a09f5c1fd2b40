"""The attention core, softmax(q k^T * scale + mask) v, behind one call with four implementations.

The one idea: the layers (layers.Attention, mla.MLA) project, rotate and tag q, k, v, then hand
them here with `impl` (model.attention_impl, resolved by `resolve_impl` when it is "auto"); every
impl computes the same function: causal and within one document (segment ids), query head h
reads kv head h // R, context [B, S, H, U] in the compute dtype. `xla` is the reference, it
materialises the [B, H, S, S] float32 logits; flash / cudnn / pallas never do. MLA passes its
decoupled RoPE part separately (q_pe [B, S, H, P], k_pe [B, T, P] shared by every head): `xla`
adds it as a second contraction (never broadcast), the kernels take q = [q | q_pe] and
k = [k | k_pe broadcast to the heads]. What each impl supports, and `auto`: docs/attention.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dsjax.config.validate import ATTENTION_IMPLS
from dsjax.errors import ConfigError, one_of
from dsjax.model.context import context_attention
from dsjax.model.context_layout import Layout
from dsjax.model.dots import einsum_f32
from dsjax.model.flash import flash_attention

# auto on CPU: flash from this sequence length up, xla below it. A placeholder until the
# attention table measures where flash stops losing to xla (docs/attention.md).
AUTO_FLASH_MIN_SEQ = 1024
HALF_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256  # Hopper and later (128 before); a multiple of 8 (jax cudnn checks)
PALLAS_TILE = 128  # the pallas kernel's forward tile (its BlockSizes default); backward 32


def attention_mask(segment_ids_BS: jax.Array) -> jax.Array:
    """[B, S, T] True where query s may attend to key t: causal, and within the same document."""
    seq = segment_ids_BS.shape[1]
    causal_ST = jnp.tril(jnp.ones((seq, seq), dtype=jnp.bool_))
    same_doc_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
    return causal_ST[None] & same_doc_BST


def current_backend() -> str:
    """"cuda", "rocm", "tpu" or "cpu": what the default device is (`resolve_impl`'s backend)."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return "cuda" if "cuda" in device.client.platform_version.lower() else "rocm"
    return device.platform


def _cudnn_unsupported(backend: str, dtype: str, head_dim: int, seq_len: int) -> str:
    """Why cuDNN flash attention cannot run this ("" when it can)."""
    if backend != "cuda":
        return f"cudnn needs an NVIDIA GPU, this backend is {backend}"
    if dtype not in HALF_DTYPES:
        return f"cudnn runs bfloat16/float16 only, the attention dtype is {dtype}"
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return (f"cudnn needs head dims <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8, got "
                f"{head_dim}")
    if seq_len % 2:  # jax's cuDNN check for a bias (our document mask) in training
        return f"cudnn with packed documents needs an even sequence length, got {seq_len}"
    return ""


def head_dims(cfg_model: Any) -> tuple[int, int]:
    """(query/key head dim, value head dim) the core sees for this model."""
    if cfg_model.attention == "mla":
        return cfg_model.qk_nope_head_dim + cfg_model.qk_rope_head_dim, cfg_model.v_head_dim
    return cfg_model.resolved_head_dim, cfg_model.resolved_head_dim


def resolve_impl(cfg_model: Any, backend: str, dtype: Any, seq_len: int) -> str:
    """The concrete impl for `model.attention_impl` on `backend` (`current_backend()`) with the
    attention core's dtype (the compute dtype; fp8 runs the core in fp8.other_dtype) and
    sequence length. An explicit impl that cannot run here is a ConfigError, never a fallback."""
    impl = cfg_model.attention_impl
    one_of("model.attention_impl", impl, ATTENTION_IMPLS, "implementation")
    dtype = jnp.dtype(dtype).name
    qk, v = head_dims(cfg_model)
    # the kernels pad v to the q/k head dim (or q/k to v's): the padded size is what they see
    why_not_cudnn = _cudnn_unsupported(backend, dtype, max(qk, v), seq_len)
    if impl == "cudnn" and why_not_cudnn:
        raise ConfigError(f"model.attention_impl: {why_not_cudnn}; use flash or xla")
    if impl == "pallas" and backend not in ("cuda", "rocm", "cpu"):
        raise ConfigError(f"model.attention_impl: pallas is a GPU kernel (interpreted on CPU), "
                          f"this backend is {backend}")
    if impl != "auto":
        return impl
    if backend in ("cuda", "rocm") and dtype in HALF_DTYPES:
        return "flash" if why_not_cudnn else "cudnn"
    return "flash" if seq_len >= AUTO_FLASH_MIN_SEQ else "xla"


def attention_core(q_BSHK: jax.Array, k_BTNK: jax.Array, v_BTNU: jax.Array,
                   segment_ids_BS: jax.Array, *, scale: float, impl: str, block_q: int,
                   block_k: int, dtype: Any, q_pe_BSHP: jax.Array | None = None,
                   k_pe_BTP: jax.Array | None = None, context: tuple[str, Layout] | None = None
                   ) -> jax.Array:
    """Causal, segment-masked attention -> context [B, S, H, U] in `dtype`. `impl` is concrete
    (`resolve_impl`); `block_q` / `block_k` tile flash. q_pe / k_pe: MLA's RoPE part (N = H).
    `context`: (model.context_impl, layout) when the sequence is split over `context`; the
    flash blocks then run as that impl places them (dsjax.model.context)."""
    if impl == "xla" and context is None:
        return masked_attention(q_BSHK, k_BTNK, v_BTNU, attention_mask(segment_ids_BS),
                                scale=scale, dtype=dtype, q_pe_BSHP=q_pe_BSHP, k_pe_BTP=k_pe_BTP)
    if q_pe_BSHP is not None:
        H = q_BSHK.shape[2]
        k_pe_BTHP = jnp.broadcast_to(k_pe_BTP[:, :, None, :], (*k_pe_BTP.shape[:2], H,
                                                                 k_pe_BTP.shape[-1]))
        q_BSHK = jnp.concatenate([q_BSHK, q_pe_BSHP.astype(q_BSHK.dtype)], axis=-1)
        k_BTNK = jnp.concatenate([k_BTNK, k_pe_BTHP.astype(k_BTNK.dtype)], axis=-1)
    q_BSHK, k_BTNK, v_BTNU = (x.astype(dtype) for x in (q_BSHK, k_BTNK, v_BTNU))
    if context is not None:
        ctx_BSHU = context_attention(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale=scale,
                                     block_q=block_q, block_k=block_k, impl=context[0],
                                     layout=context[1])
    elif impl == "flash":
        ctx_BSHU = flash_attention(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale=scale,
                                   block_q=block_q, block_k=block_k)
    elif impl == "cudnn":
        ctx_BSHU = _cudnn(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale)
    elif impl == "pallas":
        ctx_BSHU = _pallas(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale)
    else:
        raise ConfigError(f"model.attention_impl: {impl!r} is not a concrete implementation "
                          f"(resolve_impl turns auto into one)")
    return ctx_BSHU.astype(dtype)


def masked_attention(q_BSHK: jax.Array, k_BTNK: jax.Array, v_BTNU: jax.Array,
                     mask_BST: jax.Array, *, scale: float, dtype: Any,
                     q_pe_BSHP: jax.Array | None = None, k_pe_BTP: jax.Array | None = None
                     ) -> jax.Array:
    """The reference ("xla") under any mask [B, S, T] (training: `attention_mask`; decoding:
    the cache's `kv_cache.readable`): float32 logits [B, H, S, T] (their backward dots in
    `dtype`: einsum_f32), where(mask), softmax, PV in `dtype`."""
    B, S, H, K = q_BSHK.shape
    N, T = k_BTNK.shape[2], k_BTNK.shape[1]
    if q_pe_BSHP is None:
        q_BSNRK = q_BSHK.reshape(B, S, N, H // N, K)
        logits_BNRST = einsum_f32("BSNRK,BTNK->BNRST", q_BSNRK, k_BTNK)
        logits_BHST = logits_BNRST.reshape(B, H, S, T)
    else:  # MLA (N = H): the shared RoPE key is its own contraction, never broadcast
        logits_BHST = (einsum_f32("BSHK,BTHK->BHST", q_BSHK, k_BTNK)
                       + einsum_f32("BSHP,BTP->BHST", q_pe_BSHP, k_pe_BTP))
    probs_BHST = masked_softmax(logits_BHST, mask_BST, scale, dtype)
    if q_pe_BSHP is not None:
        return jnp.einsum("BHST,BTHU->BSHU", probs_BHST, v_BTNU.astype(dtype))
    probs_BNRST = probs_BHST.reshape(B, N, H // N, S, T)
    ctx_BSNRU = jnp.einsum("BNRST,BTNU->BSNRU", probs_BNRST, v_BTNU.astype(dtype))
    return ctx_BSNRU.reshape(B, S, H, -1)


def masked_softmax(logits_BHST: jax.Array, mask_BST: jax.Array, scale: float, dtype: Any
                   ) -> jax.Array:
    """softmax(logits * scale) over the keys a query may attend to (float32), in `dtype`."""
    logits_BHST = jnp.where(mask_BST[:, None], logits_BHST * scale, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits_BHST, axis=-1).astype(dtype)


def _pad_last(x: jax.Array, size: int) -> jax.Array:
    """Zero-pads the last dim to `size` (zero dims add nothing to q.k; zero v dims are sliced)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def cudnn_call(q_BSHK, k_BTNK, v_BTNK, segment_ids_BS, scale, implementation="cudnn"):
    """jax.nn.dot_product_attention on cuDNN, causal by `is_causal`. A batch of one document a
    row takes the mask-free kernel; packed documents add a [B, 1, S, T] same-document mask (jax
    hands it to cuDNN as a bias). JAX's public call has no segment-id argument (its sequence
    lengths describe padding, not packing), so the mask is the packed layout it offers. Which
    branch runs is decided per batch, on device: `lax.cond` on whether every row is one
    document. `implementation="xla"` runs the same arguments through jax's reference (tests)."""
    def attend(mask_B1ST):
        return jax.nn.dot_product_attention(q_BSHK, k_BTNK, v_BTNK, mask=mask_B1ST, scale=scale,
                                            is_causal=True, implementation=implementation)

    def packed(segment_ids_BS):
        return attend((segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None])

    one_doc = jnp.all(segment_ids_BS == segment_ids_BS[:, :1])
    return jax.lax.cond(one_doc, lambda _: attend(None), packed, segment_ids_BS)


def _cudnn(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale):
    """`cudnn_call`, which needs v's head dim equal to k's: pad, then slice the context."""
    K, U = q_BSHK.shape[-1], v_BTNU.shape[-1]
    width = max(K, U)
    q_BSHK, k_BTNK, v_BTNU = (_pad_last(x, width) for x in (q_BSHK, k_BTNK, v_BTNU))
    return cudnn_call(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale)[..., :U]


def _pallas(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS, scale):
    """jax's Pallas (Triton) flash kernel; interpreted off GPU. It needs equal heads (k, v
    repeated for GQA), one head dim for q, k, v (zero-padded), and a sequence that its tiles
    divide: padded at the end, where causality hides the padding from every real query. Imported
    here: the module is deprecated in JAX 0.11 (its successor is tokamax), so an import at the top
    would break every import of dsjax when JAX removes it."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    B, S, H, K = q_BSHK.shape
    U = v_BTNU.shape[-1]
    R = H // k_BTNK.shape[2]
    if R > 1:
        k_BTNK, v_BTNU = jnp.repeat(k_BTNK, R, axis=2), jnp.repeat(v_BTNU, R, axis=2)
    width = max(K, U)
    q_BSHK, k_BTNK, v_BTNU = (_pad_last(x, width) for x in (q_BSHK, k_BTNK, v_BTNU))
    tile = min(PALLAS_TILE, max(32, 1 << (S - 1).bit_length()))  # powers of 2, for Triton
    pad = -S % tile
    if pad:
        q_BSHK, k_BTNK, v_BTNU = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
                                  for x in (q_BSHK, k_BTNK, v_BTNU))
        segment_ids_BS = jnp.pad(segment_ids_BS, ((0, 0), (0, pad)), mode="edge")
    blocks = pallas_attention.BlockSizes(block_q=tile, block_k=tile, block_q_dkv=32,
                                         block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    ctx = pallas_attention.mha(q_BSHK, k_BTNK, v_BTNU, segment_ids_BS.astype(jnp.int32),
                               sm_scale=scale, causal=True, block_sizes=blocks,
                               interpret=jax.default_backend() != "gpu")
    return ctx[:, :S, :, :U]
