"""Decoder properties that hold for any weights: causality, document isolation, RoPE relativity."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import ModelConfig
from dsjax.model import Transformer
from dsjax.model.layers import apply_rope

CFG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=96,
                  vocab_size=300, init_std=0.2)  # large init so a leak would show clearly
SEQ = 24


@pytest.fixture(scope="module")
def model_and_params():
    model = Transformer(CFG)
    params = model.init(jax.random.key(1), jnp.zeros((1, SEQ), jnp.int32))["params"]
    return model, params


def _logits(model, params, tokens, positions=None, segments=None):
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens),
                                  None if positions is None else jnp.asarray(positions),
                                  None if segments is None else jnp.asarray(segments)))


def test_changing_a_future_token_never_changes_an_earlier_logit(model_and_params):
    model, params = model_and_params
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (2, SEQ))
    base = _logits(model, params, tokens)
    for t in (5, 13, SEQ - 1):
        changed = tokens.copy()
        changed[:, t] = (changed[:, t] + 1 + rng.integers(0, 50)) % CFG.vocab_size
        out = _logits(model, params, changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert np.abs(out[:, t:] - base[:, t:]).max() > 1e-3  # the change is visible from t on


def test_packed_documents_do_not_attend_across_segments(model_and_params):
    model, params = model_and_params
    rng = np.random.default_rng(1)
    cut = 10
    doc_a = rng.integers(0, CFG.vocab_size, cut)
    doc_b = rng.integers(0, CFG.vocab_size, SEQ - cut)
    packed = np.concatenate([doc_a, doc_b])[None]
    segments = np.array([[1] * cut + [2] * (SEQ - cut)])
    positions = np.array([list(range(cut)) + list(range(SEQ - cut))])
    out = _logits(model, params, packed, positions, segments)
    alone_b = _logits(model, params, doc_b[None])
    alone_a = _logits(model, params, doc_a[None])
    # float32 rounding: the packed row runs longer attention rows padded with exact zeros.
    np.testing.assert_allclose(out[0, cut:], alone_b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0, :cut], alone_a[0], rtol=1e-5, atol=1e-5)
    # and the mask is what makes it so: without segment ids, doc B sees doc A.
    unmasked = _logits(model, params, packed, positions, np.ones_like(segments))
    assert np.abs(unmasked[0, cut:] - alone_b[0]).max() > 1e-3


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 6, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 6, 2, 16)), jnp.float32)
    pos = jnp.arange(6)[None]
    scores = lambda p: jnp.einsum("BSHK,BTHK->BHST", apply_rope(q, p, 10000.0),
                                  apply_rope(k, p, 10000.0))
    np.testing.assert_allclose(scores(pos), scores(pos + 37), rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores(pos), jnp.einsum("BSHK,BTHK->BHST", q, k), atol=1e-2)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    """GQA with N kv heads == MHA whose kv weights repeat each kv head R times (HF's repeat_kv)."""
    rng = np.random.default_rng(3)
    gqa = Transformer(CFG)
    mha_cfg = ModelConfig(**{**CFG.__dict__, "num_kv_heads": CFG.num_heads})
    mha = Transformer(mha_cfg)
    params = nn.unbox(gqa.init(jax.random.key(4), jnp.zeros((1, 8), jnp.int32))["params"])
    mha_params = jax.tree.map(lambda x: x, params)
    reps = CFG.num_heads // CFG.num_kv_heads
    for name in ("k", "v"):  # [L, D, N, K] -> [L, D, H, K]
        mha_params["layers"]["attn"][name] = jnp.repeat(params["layers"]["attn"][name], reps, axis=2)
    tokens = rng.integers(0, CFG.vocab_size, (2, 16))
    np.testing.assert_allclose(_logits(gqa, params, tokens), _logits(mha, mha_params, tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_unrolled_layers_equal_the_scanned_stack(policy):
    """`model.scan_layers=False` runs the same layers as straight-line code: the same loss and
    gradients (float32; only the order of float operations may differ), and no layer loop left
    in the compiled program."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    tokens = jax.random.randint(jax.random.key(2), (2, SEQ), 0, CFG.vocab_size)
    policies = (policy,) * CFG.num_layers
    scanned = Transformer(CFG, layer_policies=policies)
    unrolled = Transformer(dataclasses.replace(CFG, scan_layers=False), layer_policies=policies)
    assert not scanned.layers_unrolled and unrolled.layers_unrolled
    params = scanned.init(jax.random.key(1), tokens)["params"]

    def loss(model):
        def f(p):
            logits = model.apply({"params": p}, tokens)
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return jax.jit(jax.value_and_grad(f))

    (l0, g0), (l1, g1) = loss(scanned)(params), loss(unrolled)(params)
    assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-5 * np.linalg.norm(b)
    loops = lambda model: loss(model).lower(params).compile().as_text().count(" while(")
    assert loops(scanned) >= 2 and loops(unrolled) < loops(scanned)
