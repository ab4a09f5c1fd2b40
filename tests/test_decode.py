"""KV-cache decoding (dsjax.model.decode, kv_cache; dsjax.evaluate.generation): cached logits
against full recomputation, on one device and on a tensor-parallel mesh, for grouped-query
attention, MLA and MoE; MLA's latent cache size from the compiled step; greedy tokens against
transformers' generate() for converted Llama, DeepSeek-V2 and DeepSeek-V3 models."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dsjax import config as config_lib
from dsjax import convert, sharding
from dsjax.config import ModelConfig
from dsjax.evaluate import Generator, Sampling
from dsjax.model import Transformer, decode, kv_cache
from dsjax.train.trainer import build_trainer
from test_convert import dsjax_params, quiet, save_random_llama
from test_moe import save_random_deepseek

GQA = ModelConfig(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=4, mlp_dim=96,
                  vocab_size=128, init_std=0.15)
MLA = dataclasses.replace(GQA, num_heads=4, num_kv_heads=4, attention="mla", q_lora_rank=24,
                          kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
# MoE: a dense first block, then routed experts (sigmoid router, V3), dropless as HF's.
MOE = dataclasses.replace(MLA, num_layers=3, q_lora_rank=0, n_routed_experts=8,
                          n_shared_experts=1, moe_intermediate_size=24, num_experts_per_tok=2,
                          first_k_dense_replace=1, scoring="sigmoid", norm_topk_prob=True,
                          routed_scaling_factor=2.0)
MODELS = {"gqa": GQA, "mla": MLA, "moe": MOE}
LENGTHS = (11, 5, 8, 2)  # batched prompts of different lengths (4 rows: data = 2 divides)
NEW = 6  # decoded tokens per row


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (len(LENGTHS), max(LENGTHS) + NEW),
                                                dtype=np.int32)


def _decoded_and_full(model, params, tokens, forward=None):
    """(logits of every decoded position through the cache, the same positions' logits of one
    full forward over each row's whole sequence), each [rows, NEW, V]. Every row is prefilled
    with its own prompt (padded to the longest), then fed its next tokens one at a time."""
    forward = forward or (lambda *a: decode.forward(model, *a))
    B, P = len(LENGTHS), max(LENGTHS)
    lengths = np.array(LENGTHS)
    cache = decode.init_cache(model, B, P + NEW)
    _, cache = forward(params, jnp.asarray(tokens[:, :P]),
                       jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
    decoded = []
    for i in range(NEW):
        at = lengths + i
        logits, cache = forward(params, jnp.asarray(tokens[np.arange(B), at][:, None]),
                                jnp.asarray(at[:, None]), cache)
        decoded.append(np.asarray(logits[:, 0]))
    full = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
    want = np.stack([full[np.arange(B), lengths + i] for i in range(NEW)], axis=1)
    return np.stack(decoded, axis=1), want


@pytest.mark.parametrize("kind", list(MODELS))
def test_cached_logits_equal_full_recomputation(kind):
    cfg = MODELS[kind]
    model = Transformer(cfg)
    tokens = _tokens(cfg.vocab_size)
    params = nn.unbox(model.init(jax.random.key(1), jnp.asarray(tokens[:, :4]))["params"])
    got, want = _decoded_and_full(model, params, tokens)
    assert want.std() > 0.5  # O(1) logits: a wrong cache slot or mask cannot hide
    # float32 both ways; only the summation order differs (MLA absorbs kv_b into q and o).
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gqa", "moe"])
def test_cached_logits_on_a_tensor_parallel_mesh(kind):
    """data 2 x tensor 4: the cache shards with the batch and (GQA) the kv heads; the decoded
    logits still equal the full forward's on the same mesh."""
    m = MODELS[kind]
    overrides = {f"model.{f.name}": getattr(m, f.name) for f in dataclasses.fields(m)
                 if getattr(m, f.name) != f.default}
    cfg = config_lib.load("configs/cpu_tiny.py", {**overrides, "mesh.data": 2, "mesh.tensor": 4,
                                                  "mesh.pipeline": 1, "data.seq_len": 16,
                                                  "model.vocab_size": 128})
    trainer = build_trainer(cfg)
    params = trainer.init(seed=3).params
    model = trainer.eval_model
    tokens = _tokens(cfg.model.vocab_size, seed=4)
    step = jax.jit(lambda *a: decode.forward(model, *a))
    with sharding.activate(trainer.mesh, trainer.rules):
        got, want = _decoded_and_full(model, params, tokens, step)
        cache = jax.jit(lambda: decode.init_cache(model, 4, 8))()
    assert want.std() > 0.5
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    entry = cache["layers"]["k" if kind == "gqa" else "latent"]
    spec = entry.sharding.spec
    assert spec[1] == "data"  # [layers, B, T, ...]: rows over data
    if kind == "gqa":
        assert spec[3] == "tensor"  # kv heads over tensor, as the k/v projections


def test_mla_cache_holds_the_latent_and_rope_key_per_token():
    """The compiled decode step's arguments grow by layers x rows x (kv_lora_rank +
    qk_rope_head_dim) x 4 bytes per cache slot: no per-head keys or values are cached."""
    model = Transformer(MLA)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    B, L = 2, MLA.num_layers

    def argument_bytes(slots):
        cache = jax.eval_shape(lambda: decode.init_cache(model, B, slots))
        compiled = jax.jit(lambda p, c: decode.forward(model, p, jnp.zeros((B, 1), jnp.int32),
                                                       jnp.zeros((B, 1), jnp.int32), c)
                           ).lower(params, cache).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    per_slot = (argument_bytes(96) - argument_bytes(32)) / 64
    assert per_slot == L * B * (MLA.kv_lora_rank + MLA.qk_rope_head_dim) * 4
    assert kv_cache.values_per_token(MLA) == 28
    # what caching every head's keys and values would take: H (A + P + U) = 4 x 30 per token
    assert kv_cache.values_per_token(MLA) < MLA.num_heads * (12 + 8 + 10)


# ---------------------------------------------------------------------------------------------
# Against transformers' generate()

def _hf_greedy(model, prompt, new):
    """HF's greedy continuation of one prompt, and the smallest top-1 / top-2 logit gap on its
    path (a near tie could flip under a different summation order)."""
    with torch.no_grad():
        out = model.generate(torch.as_tensor([prompt]), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    scores = torch.stack(out.scores)[:, 0]
    top2 = torch.topk(scores, 2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def _greedy_matches_hf(hf, cfg, params, vocab, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (9, 3)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "tensor", "pipeline"))
    generator = Generator(Transformer(cfg), mesh, sharding.logical_rules(),
                          Sampling(temperature=0.0), max_new_tokens=64)
    got = generator.generate(params, prompts)
    for prompt, tokens in zip(prompts, got):
        want, gap = _hf_greedy(hf, prompt, 64)
        assert gap > 1e-4  # no near tie on the path: the comparison is meaningful
        assert tokens == want


def test_greedy_tokens_equal_transformers_llama(tmp_path):
    save_random_llama(tmp_path / "hf", seed=5)
    cfg = convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=quiet)
    from test_convert import hf_model
    _greedy_matches_hf(hf_model(tmp_path / "hf"), cfg, dsjax_params(str(tmp_path / "ckpt"), cfg),
                       cfg.vocab_size, seed=6)


@pytest.mark.parametrize("version", [2, 3])
def test_greedy_tokens_equal_transformers_deepseek(tmp_path, version):
    hf = save_random_deepseek(str(tmp_path / "hf"), version, seed=version)
    cfg = convert.hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=quiet)
    _greedy_matches_hf(hf, cfg, dsjax_params(str(tmp_path / "ckpt"), cfg), cfg.vocab_size,
                       seed=7)
