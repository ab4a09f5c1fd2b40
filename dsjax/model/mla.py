"""Multi-head latent attention (DeepSeek-V2 §2.1), with decoupled RoPE and YaRN scaling.

The one idea: keys and values are rebuilt per head from one compressed latent per token
(kv_a -> RMSNorm -> kv_b), plus one RoPE'd key k_pe of qk_rope_head_dim shared by every head; the
query has a matching RoPE'd part q_pe per head. Position information lives only in the q_pe.k_pe
term, so the latent itself is position-free (what makes its KV cache small at inference).

Numerics follow Hugging Face `DeepseekV2Attention` / `DeepseekV3Attention`, our reference:
- RoPE pairs are DeepSeek's interleaved (2i, 2i+1) dims, not rotate-half's (i, i + K/2). We rotate
  the even/odd slices and write them back as [evens | odds]; q_pe and k_pe get the same
  permutation, so the logits are those of the interleaved layout.
- YaRN (Peng et al. 2023) blends interpolated and extrapolated frequencies with a linear ramp,
  scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale
  (qk_nope + qk_rope)^-0.5 is multiplied by mscale(factor, mscale_all_dim)^2.
The attention core (attention.py: logits, softmax, PV) runs in the compute dtype, never fp8.
Letters: see dsjax/model/__init__.py; C latent rank, P RoPE dim, A nope dim, U value dim.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dsjax.fp8_policy import Fp8Policy
from dsjax.model import kv_cache
from dsjax.model.attention import masked_softmax
from dsjax.model.dots import einsum_f32
from dsjax.model.layers import AttentionCore, RMSNorm, _param, _project

Dtype = Any


def mla_fields(cfg) -> tuple[tuple[str, Any], ...]:
    """The `MLA` fields a `ModelConfig` sets, as hashable (name, value) pairs for the block."""
    return tuple((name, getattr(cfg, name)) for name in (
        "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "rope_theta", "norm_eps", "init_std", "rope_scaling", "rope_factor",
        "rope_original_max_len", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
        "rope_mscale_all_dim"))


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                     original_max_len: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                     mscale: float = 1.0, mscale_all_dim: float = 0.0
                     ) -> tuple[jax.Array, float]:
    """(inverse frequencies [dim/2], cos/sin multiplier) of the default or YaRN rotary embedding."""
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    extrapolated = 1.0 / theta ** exponents
    if scaling == "none":
        return extrapolated, 1.0
    interpolated = extrapolated / factor

    def correction_dim(rotations: float) -> float:
        # The dim whose wavelength makes `rotations` turns over the original context.
        return dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: high-frequency dims keep their frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                        if mscale and mscale_all_dim else yarn_mscale(factor, 1.0))
    return inv_freq, attention_factor


def apply_rope_interleaved(x_BSHP: jax.Array, positions_BS: jax.Array, inv_freq: jax.Array,
                           attention_factor: float = 1.0) -> jax.Array:
    """RoPE on interleaved pairs (x[2i], x[2i+1]); output laid out [rotated evens | odds]."""
    angles_BS1p = (positions_BS[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]
    cos, sin = jnp.cos(angles_BS1p) * attention_factor, jnp.sin(angles_BS1p) * attention_factor
    x = x_BSHP.astype(jnp.float32)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.astype(x_BSHP.dtype)


class MLA(nn.Module):
    """Multi-head latent attention with a causal, segment-aware mask; no biases.

    Params: q ([D, H, A+P]) or q_a [D, Cq] -> q_norm -> q_b [Cq, H, A+P]; kv_a [D, C+P] (latent
    and shared k_pe, as HF's kv_a_proj_with_mqa); kv_norm; kv_b [C, H, A+U]; o [H, U, D].
    fp8: q_a/q_b/q run as fp8 when the policy names "q", kv_a/kv_b when it names "k", o with "o".
    With a `cache` ({"latent" [B, T, C], "k_pe" [B, T, P]}, dsjax.model.kv_cache) it decodes as
    DeepSeek-V2 §2.1.3 serves: kv_b's key part is absorbed into the query and its value part
    into the output, so attention runs on the cached latents themselves; returns (out, cache).
    """
    num_heads: int
    q_lora_rank: int  # 0: plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    norm_eps: float
    init_std: float
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    dtype: Dtype = jnp.float32
    fp8_policy: Fp8Policy | None = None  # asked for q, k, o
    core: AttentionCore = AttentionCore()

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array,
                 cache: dict[str, jax.Array] | None = None) -> Any:
        D = x_BSD.shape[-1]
        H, A, P, U = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        C, std = self.kv_lora_rank, self.init_std
        x = x_BSD.astype(self.dtype)

        if self.q_lora_rank:
            w_qa = _param(self, "q_a", (D, self.q_lora_rank), ("embed", None), std)
            w_qb = _param(self, "q_b", (self.q_lora_rank, H, A + P), (None, "heads", "head_dim"),
                          std)
            q_BSc = _project(self, "q_a", "BSD,Dc->BSc", x, w_qa)
            q_BSc = RMSNorm(self.norm_eps, name="q_norm")(q_BSc)
            q_BSHK = _project(self, "q_b", "BSc,cHK->BSHK", q_BSc, w_qb)
        else:
            w_q = _param(self, "q", (D, H, A + P), ("embed", "heads", "head_dim"), std)
            q_BSHK = _project(self, "q", "BSD,DHK->BSHK", x, w_q)
        w_kva = _param(self, "kv_a", (D, C + P), ("embed", None), std)
        w_kvb = _param(self, "kv_b", (C, H, A + U), (None, "heads", "head_dim"), std)
        w_o = _param(self, "o", (H, U, D), ("heads", "head_dim", "embed"), std)

        kv_BSc = _project(self, "kv_a", "BSD,Dc->BSc", x, w_kva)
        latent_BSC, k_pe_BSP = kv_BSc[..., :C], kv_BSc[..., C:]
        latent_BSC = checkpoint_name(RMSNorm(self.norm_eps, name="kv_norm")(latent_BSC),
                                     "kv_latent")
        inv_freq, attention_factor = rope_frequencies(
            P, self.rope_theta, self.rope_scaling, self.rope_factor, self.rope_original_max_len,
            self.rope_beta_fast, self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim)
        q_nope_BSHA = q_BSHK[..., :A]
        q_pe_BSHP = apply_rope_interleaved(q_BSHK[..., A:], positions_BS, inv_freq,
                                           attention_factor)
        k_pe_BT1P = apply_rope_interleaved(k_pe_BSP[:, :, None, :], positions_BS, inv_freq,
                                           attention_factor)
        scale = (A + P) ** -0.5
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        if cache is not None:
            cache = {name: nn.with_logical_constraint(kv_cache.write(cache[name], new,
                                                                     positions_BS),
                                                      kv_cache.MLA_AXES)
                     for name, new in (("latent", latent_BSC), ("k_pe", k_pe_BT1P[:, :, 0]))}
            ctx_BSHU = self._absorbed(q_nope_BSHA, q_pe_BSHP, cache, positions_BS, w_kvb, scale)
            return _project(self, "o", "BSHU,HUD->BSD", ctx_BSHU, w_o), cache

        if self.core.gathers_kv(latent_BSC.shape[1]):  # context parallel: gather the latent, up-project locally
            latent_BSC = nn.with_logical_constraint(latent_BSC, ("act_batch", None, None))
            k_pe_BT1P = nn.with_logical_constraint(k_pe_BT1P, ("act_batch", None, None, None))
        kv_BSHK = _project(self, "kv_b", "BSC,CHK->BSHK", latent_BSC, w_kvb)
        k_nope_BTHA, v_BTHU = kv_BSHK[..., :A], kv_BSHK[..., A:]
        # Tags name what remat policies may save (see dsjax/remat.py).
        q_nope_BSHA = checkpoint_name(q_nope_BSHA, "q_proj")
        q_pe_BSHP = checkpoint_name(q_pe_BSHP, "q_proj")
        k_nope_BTHA = checkpoint_name(k_nope_BTHA, "k_proj")
        v_BTHU = checkpoint_name(v_BTHU, "v_proj")

        # [q_nope | q_pe] . [k_nope | k_pe]: the shared k_pe goes in on its own (attention.py)
        ctx_BSHU = self.core(q_nope_BSHA, k_nope_BTHA, v_BTHU, segment_ids_BS, scale=scale,
                             dtype=self.dtype, q_pe_BSHP=q_pe_BSHP, k_pe_BTP=k_pe_BT1P[:, :, 0])
        ctx_BSHU = checkpoint_name(ctx_BSHU, "attn_context")
        return checkpoint_name(_project(self, "o", "BSHU,HUD->BSD", ctx_BSHU, w_o), "attn_out")

    def _absorbed(self, q_nope_BSHA, q_pe_BSHP, cache, positions_BS, w_kvb, scale):
        """Attention on the cached latents: q_nope . k_nope = (q_nope W_uk) . latent and
        probs . v = (probs . latent) W_uv, with W_uk, W_uv the key and value parts of kv_b
        [C, H, A + U]; logits float32 as in training (attention.masked_attention)."""
        A = self.qk_nope_head_dim
        w_kvb = w_kvb.astype(self.dtype)
        q_BSHC = jnp.einsum("BSHA,CHA->BSHC", q_nope_BSHA.astype(self.dtype), w_kvb[..., :A])
        logits_BHST = (einsum_f32("BSHC,BTC->BHST", q_BSHC, cache["latent"])
                       + einsum_f32("BSHP,BTP->BHST", q_pe_BSHP, cache["k_pe"]))
        mask_BST = kv_cache.readable(positions_BS, cache["latent"].shape[1])
        probs_BHST = masked_softmax(logits_BHST, mask_BST, scale, self.dtype)
        ctx_BSHC = jnp.einsum("BHST,BTC->BSHC", probs_BHST, cache["latent"].astype(self.dtype))
        return jnp.einsum("BSHC,CHU->BSHU", ctx_BSHC, w_kvb[..., A:])
