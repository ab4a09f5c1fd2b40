"""Next-token choice (dsjax.evaluate.sampling) against a NumPy transcription of temperature,
top-k and top-p filtering, and the generator's stop ids, vocabulary limit and mesh independence
(dsjax.evaluate.generation)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import sharding
from dsjax.config import ModelConfig
from dsjax.evaluate import Generator, Sampling
from dsjax.evaluate.sampling import filtered_logits, next_tokens
from dsjax.model import Transformer


def numpy_kept(logits, temperature, top_k, top_p):
    """The ids each row may sample, written from the definitions: the top_k largest logits, then
    of those (renormalised) the most likely tokens in order until their mass reaches top_p."""
    kept = []
    for row in logits / temperature:
        order = np.argsort(-row, kind="stable")
        if top_k:
            order = order[:top_k]
        p = np.exp(row[order] - row[order].max())
        p /= p.sum()
        n, mass = 0, 0.0
        while n < len(order) and (n == 0 or mass < top_p):
            mass += p[n]
            n += 1
        kept.append(set(order[:n].tolist()))
    return kept


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 0.9), (0.7, 5, 1.0), (1.3, 8, 0.6), (0.5, 0, 0.3)])
def test_filter_keeps_the_tokens_the_definitions_keep(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(0, 2, (16, 40)).astype(np.float32)
    got = np.asarray(filtered_logits(jnp.asarray(logits),
                                     Sampling(temperature, top_p, top_k)))
    want = numpy_kept(logits.astype(np.float64), temperature, top_k, top_p)
    assert [set(np.flatnonzero(np.isfinite(r)).tolist()) for r in got] == want
    kept = np.isfinite(got)
    np.testing.assert_allclose(got[kept], (logits / np.float32(temperature))[kept], rtol=1e-6)


def test_samples_follow_the_filtered_distribution():
    """20,000 seeded draws of one row: each kept token's frequency is within 5 standard
    deviations of its renormalised probability, and no dropped token is ever drawn."""
    logits = np.array([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]], np.float32)
    sampling = Sampling(temperature=0.8, top_p=0.85, top_k=4)
    draws = jax.vmap(lambda k: next_tokens(jnp.asarray(logits), k, sampling)[0])(
        jax.random.split(jax.random.key(0), 20_000))
    counts = np.bincount(np.asarray(draws), minlength=6) / 20_000
    kept = sorted(numpy_kept(logits.astype(np.float64), 0.8, 4, 0.85)[0])
    p = np.exp(logits[0, kept] / 0.8)
    p /= p.sum()
    assert set(np.flatnonzero(counts)) == set(kept)
    np.testing.assert_allclose(counts[kept], p, atol=5 * np.sqrt(0.25 / 20_000))


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(size=(5, 30)).astype(np.float32)
    got = next_tokens(jnp.asarray(logits), jax.random.key(0), Sampling(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))


CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                  vocab_size=64, init_std=0.3)


def _mesh(data):
    devices = np.array(jax.devices()[:data]).reshape(data, 1, 1)
    return jax.sharding.Mesh(devices, ("data", "tensor", "pipeline"))


@pytest.fixture(scope="module")
def params():
    model = Transformer(CFG)
    return nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])


PROMPTS = [[3, 9, 27, 17], [5], [60, 61, 62, 63, 1, 2, 3]]


def test_stop_ids_vocab_limit_and_max_new_tokens(params):
    def run(**kw):
        generator = Generator(Transformer(CFG), _mesh(1), sharding.logical_rules(),
                              Sampling(temperature=0.0), **kw)
        return generator.generate(params, PROMPTS)

    free = run(max_new_tokens=12)
    assert [len(r) for r in free] == [12, 12, 12]
    # stop at each row's 4th token: the rows end before it (and before an earlier repeat of it)
    stops = tuple(r[3] for r in free)
    stopped = run(max_new_tokens=12, stop_ids=stops)
    for row, full in zip(stopped, free):
        first = min(i for i, t in enumerate(full) if t in stops)
        assert row == full[:first]
    limited = run(max_new_tokens=12, vocab_size=16)
    assert max(max(r) for r in limited) < 16
    assert limited != free  # the limit binds: unlimited greedy picks ids >= 16


def test_generation_is_the_same_on_a_data_parallel_mesh(params):
    """Greedy and seeded sampling give the same tokens with the rows split over 4 devices."""
    for sampling in (Sampling(temperature=0.0), Sampling(temperature=1.0, top_p=0.9)):
        one, four = (Generator(Transformer(CFG), _mesh(n), sharding.logical_rules(), sampling,
                               max_new_tokens=10).generate(params, PROMPTS, seed=3)
                     for n in (1, 4))
        assert one == four
