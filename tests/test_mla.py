"""dsjax.model.mla pieces against transformers' own DeepSeek RoPE code (full-model MLA parity is in
tests/test_moe.py)."""

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

import jax.numpy as jnp

from dsjax.model.mla import apply_rope_interleaved, rope_frequencies, yarn_mscale

# DeepSeek-V3's published rope_scaling, and a small one whose ramp sits inside the dims.
YARN = [dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
             mscale=1.0, mscale_all_dim=1.0, dim=64),
        dict(factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
             mscale=0.8, mscale_all_dim=0.6, dim=8)]


@pytest.mark.parametrize("p", YARN, ids=["v3", "small"])
def test_yarn_frequencies_match_transformers(p):
    dim = p["dim"]
    rope = {"rope_type": "yarn", "rope_theta": 10000.0,
            **{k: v for k, v in p.items() if k != "dim"}}
    hf = DeepseekV3Config(qk_rope_head_dim=dim, num_attention_heads=4, hidden_size=64,
                          num_key_value_heads=4, rope_parameters=rope)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got_freq, got_factor = rope_frequencies(dim, 10000.0, "yarn", p["factor"],
                                            p["original_max_position_embeddings"], p["beta_fast"],
                                            p["beta_slow"], p["mscale"], p["mscale_all_dim"])
    np.testing.assert_allclose(np.asarray(got_freq), want_freq.numpy(), rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    # The softmax-scale term HF applies (yarn_apply_mscale) is our yarn_mscale(all_dim)^2.
    assert hf_v2.yarn_apply_mscale(rope, 1.0) == pytest.approx(
        yarn_mscale(p["factor"], p["mscale_all_dim"]) ** 2)


def test_interleaved_rope_matches_transformers_v3_and_v2():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 7, 3, 8)).astype(np.float32)  # [B, S, H, P]
    k = rng.standard_normal((2, 7, 1, 8)).astype(np.float32)
    pos = np.tile(np.arange(7), (2, 1)) * 13  # far apart: every pair rotates noticeably
    inv_freq, factor = rope_frequencies(8, 10000.0)
    got_q = np.asarray(apply_rope_interleaved(jnp.asarray(q), jnp.asarray(pos), inv_freq, factor))
    got_k = np.asarray(apply_rope_interleaved(jnp.asarray(k), jnp.asarray(pos), inv_freq, factor))

    # V3: cos/sin of cat(freqs, freqs), heads on axis 1; the same [evens | odds] output layout.
    freqs = torch.as_tensor(pos, dtype=torch.float32)[..., None] * torch.tensor(
        np.asarray(inv_freq))
    emb = torch.cat([freqs, freqs], -1)
    tq, tk = torch.as_tensor(q).transpose(1, 2), torch.as_tensor(k).transpose(1, 2)
    want_q, want_k = hf_v3.apply_rotary_pos_emb_interleave(tq, tk, emb.cos(), emb.sin())
    np.testing.assert_allclose(got_q, want_q.transpose(1, 2).numpy(), atol=1e-6)
    np.testing.assert_allclose(got_k, want_k.transpose(1, 2).numpy(), atol=1e-6)

    # V2 (complex multiply) writes pairs back interleaved: the same rotation, other layout, so
    # the attention logits q.k agree.
    v2_q, v2_k = hf_v2.apply_rotary_emb(tq, tk, torch.polar(torch.ones_like(freqs), freqs))
    want = torch.einsum("bhsp,bhtp->bhst", v2_q, v2_k.expand(-1, 3, -1, -1)).numpy()
    got = np.einsum("bshp,btp->bhst", got_q, got_k[:, :, 0])
    np.testing.assert_allclose(got, want, atol=1e-5)
