"""The chunked cross-entropy (dsjax/model/chunked_loss.py) against the plain path: the whole
[B, S, V] logits and `weighted_cross_entropy`, which is the same formula written without chunks.
Value and gradients per function, the model's loss and every param gradient, the 1f1b pipeline;
bfloat16 dot dtypes and temp memory from the lowered / compiled program."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import ROOT, random_batch
from dsjax import config as config_lib
from dsjax import sharding, train
from dsjax.metrics import gemms
from dsjax.config import ConfigError, ModelConfig
from dsjax.model.chunked_loss import chunked_cross_entropy, output_logits
from dsjax.model.decoder import Transformer
from dsjax.model.loss import ModelLoss, loss_fn, weighted_cross_entropy

# float32 sums of the same terms in another order (per chunk, then over chunks): measured
# <= 3e-7 relative on loss and every gradient below (the tests print theirs); a dropped weight
# moved the x gradient by 0.6, a missing chunk or a wrong softmax term would by far more.
RTOL = 1e-6


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(B, S, D, V, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (B, S, D), jnp.float32).astype(dtype)
    head = (jax.random.normal(k[1], (D, V), jnp.float32) * 0.5).astype(dtype)
    targets = jax.random.randint(k[2], (B, S), 0, V)
    # Padding: about a third of the positions carry weight 0.
    weights = (jax.random.uniform(k[3], (B, S)) > 0.3).astype(jnp.float32)
    return x, head, targets, weights


def _plain(x, head, targets, weights):
    """The reference: whole logits, the (log-softmax, one-hot) formula in NumPy float64."""
    logits = np.einsum("bsd,dv->bsv", np.asarray(x, np.float64), np.asarray(head, np.float64))
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return float(np.sum((logz - target) * np.asarray(weights))), float(np.sum(weights))


@pytest.mark.parametrize("B, S, chunk", [
    (1, 24, 8),    # chunk divides S
    (3, 37, 5),    # batch > 1, chunk does not divide S (a padded last chunk)
    (2, 16, 64),   # chunk larger than the sequence: one chunk
])
def test_chunked_matches_the_plain_loss_and_gradients(B, S, chunk):
    x, head, targets, weights = _inputs(B, S, 16, 48)

    def chunked(x, head, weights):
        return chunked_cross_entropy(x, head, targets, weights, dtype=jnp.float32, chunk=chunk)

    def plain(x, head, weights):
        return weighted_cross_entropy(output_logits(x, head, jnp.float32), targets, weights)

    (total, count), grads = jax.jit(jax.value_and_grad(chunked, (0, 1, 2), has_aux=True))(
        x, head, weights)
    (ref_total, ref_count), ref_grads = jax.jit(jax.value_and_grad(plain, (0, 1, 2),
                                                                   has_aux=True))(x, head, weights)
    np_total, np_count = _plain(x, head, targets, weights)
    assert float(count) == ref_count == np_count
    assert abs(float(total) - np_total) / np_total < RTOL
    assert abs(float(total) - float(ref_total)) / abs(float(ref_total)) < RTOL
    print(f"B {B} S {S} chunk {chunk}: loss rel {abs(float(total) / np_total - 1):.1e}, grad rel "
          + ", ".join(f"{_rel(g, r):.1e}" for g, r in zip(grads, ref_grads)))
    for name, g, r in zip(("x", "head", "weights"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert _rel(g, r) < RTOL, (name, _rel(g, r))
    # Zero-weight positions get no gradient in x.
    assert not np.any(np.asarray(grads[0])[np.asarray(weights) == 0])


def test_chunk_must_be_positive_and_config_names_the_field():
    x, head, targets, weights = _inputs(1, 4, 8, 16)
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(x, head, targets, weights, dtype=jnp.float32, chunk=0)
    with pytest.raises(ConfigError, match=r"^model\.loss_chunk: must be >= 0"):
        config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {"model.loss_chunk": -1})


_TINY = dict(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
             vocab_size=96)


@pytest.mark.parametrize("mtp", [0, 1])
def test_model_loss_with_and_without_chunks(mtp):
    """`ModelLoss.loss_and_aux`: loss, aux terms (MTP losses) and every param gradient, with
    loss_chunk 5 (S = 16: chunks of 5, 5, 5, 1) against loss_chunk 0 (whole logits)."""
    cfg = ModelConfig(**_TINY, num_mtp_layers=mtp, mtp_loss_weight=0.5, loss_chunk=5)
    batch = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(2), 3, 16,
                                                        vocab=96).items()}
    chunked = ModelLoss(Transformer(cfg))
    plain = ModelLoss(Transformer(dataclasses.replace(cfg, loss_chunk=0)))
    params = jax.jit(chunked.model.init)(jax.random.key(0), batch["inputs"])["params"]

    def objective(loss):
        def f(p):
            nll, _, aux = loss.loss_and_aux(p, batch)
            return nll + aux.get("aux_loss", 0.0), (nll, aux)
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (total, (nll, aux)), grads = objective(chunked)
    (ref_total, (ref_nll, ref_aux)), ref_grads = objective(plain)
    assert abs(float(nll) - float(ref_nll)) / float(ref_nll) < RTOL
    assert abs(float(total) - float(ref_total)) / float(ref_total) < RTOL
    assert set(aux) == set(ref_aux) == ({"mtp_loss", "aux_loss"} if mtp else set())
    if mtp:
        assert aux["mtp_loss"].shape == (mtp,)
        assert _rel(aux["mtp_loss"], ref_aux["mtp_loss"]) < RTOL
    flat, ref_flat = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads, ref_grads))
    rels = {jax.tree_util.keystr(path): _rel(g, r) for (path, g), (_, r) in zip(flat, ref_flat)}
    print(f"mtp {mtp}: loss rel {abs(float(total) / float(ref_total) - 1):.1e}, "
          f"worst grad rel {max(rels.values()):.1e}")
    assert max(rels.values()) < RTOL, rels
    if mtp:
        return
    # Evaluation and generation still get logits; evaluation's loss is chunked.
    logits = jax.jit(chunked)({"params": params}, batch["inputs"], batch["positions"],
                              batch["segment_ids"])
    assert logits.shape == (3, 16, 96) and logits.dtype == jnp.float32
    nll_sum, count = jax.jit(chunked.nll_sum)(params, batch)
    ref_sum, _ = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    assert abs(float(nll_sum) - float(ref_sum)) / float(ref_sum) < RTOL
    assert float(count) == float(jnp.sum(batch["weights"]))


def test_1f1b_pipeline_with_and_without_chunks():
    """cpu_tiny's (2, 2, 2) mesh and 1f1b schedule, with an MTP module on the last stage: the
    training objective and its gradient norm, loss_chunk 5 against 0."""
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {
        "model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.mlp_dim": 64, "model.vocab_size": 128,
        "model.num_mtp_layers": 1, "model.loss_chunk": 5, "data.seq_len": 16,
        "data.global_batch": 8, "pipeline.schedule": "1f1b", "pipeline.microbatches": 2})
    assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline) == (2, 2, 2)
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    chunked = state.objective
    assert chunked.schedule == "1f1b" and chunked.model.cfg.loss_chunk == 5
    plain = dataclasses.replace(chunked, model=chunked.model.clone(
        cfg=dataclasses.replace(chunked.model.cfg, loss_chunk=0)))
    batch = trainer.device_batch(random_batch(np.random.default_rng(3), 8, 16, vocab=128))

    def loss_and_norm(objective):
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: loss_fn(p, objective, batch)[0]))(state.params)
        return float(loss), float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))

    with sharding.activate(trainer.mesh, trainer.rules):
        loss, norm = loss_and_norm(chunked)
        ref_loss, ref_norm = loss_and_norm(plain)
    print(f"1f1b: loss rel {abs(loss / ref_loss - 1):.1e}, grad norm rel "
          f"{abs(norm / ref_norm - 1):.1e}")
    assert abs(loss - ref_loss) / ref_loss < RTOL
    assert abs(norm - ref_norm) / ref_norm < RTOL


def _grad_of_chunked(chunk):
    def f(x, head, targets, weights):
        return chunked_cross_entropy(x, head, targets, weights, dtype=x.dtype, chunk=chunk)[0]
    return jax.grad(f, (0, 1))


def test_bfloat16_step_has_no_float32_dot():
    x, head, targets, weights = _inputs(2, 40, 16, 64, dtype=jnp.bfloat16)
    text = jax.jit(_grad_of_chunked(16)).lower(x, head, targets, weights).as_text()
    dots = gemms.dot_general_dtypes(text)
    # Forward logits (twice: once recomputed), dx and dhead: bf16 operands, f32 accumulation.
    assert len(dots) >= 3 and all(d[:2] == ("bf16", "bf16") for d in dots), dots
    assert all(d[2] == "f32" for d in dots), dots
    # The plain path (output_logits' einsum_f32) rounds the float32 logits' cotangent to bf16
    # before its dx and dhead dots: none is float32 x float32 either (a plain einsum's transpose
    # had two; tests/test_precision.py).
    plain = jax.grad(lambda x, h: weighted_cross_entropy(output_logits(x, h, jnp.bfloat16),
                                                         targets, weights)[0], (0, 1))
    plain_dots = gemms.dot_general_dtypes(jax.jit(plain).lower(x, head).as_text())
    assert len(plain_dots) == 3 and ("f32", "f32", "f32") not in plain_dots, plain_dots


def test_chunked_temp_memory_is_a_fraction_of_the_plain_path():
    """rows 4096 (B 2, S 2048), V 32768, D 256: the plain gradient holds [rows, V] float32 logits
    and their one-hot product; the chunked one [B, 256, V] at a time."""
    B, S, D, V = 2, 2048, 256, 32768
    spec = (jax.ShapeDtypeStruct((B, S, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.float32))
    plain = jax.grad(lambda x, h, t, w: weighted_cross_entropy(output_logits(x, h, jnp.float32),
                                                               t, w)[0], (0, 1))

    def temp(fn):
        return jax.jit(fn).lower(*spec).compile().memory_analysis().temp_size_in_bytes

    chunked_bytes, plain_bytes = temp(_grad_of_chunked(256)), temp(plain)
    print(f"temp bytes: chunked {chunked_bytes:,}, plain {plain_bytes:,}")
    assert chunked_bytes < plain_bytes / 4


def test_sharded_vocab_gathers_no_logits_block():
    """(data, tensor, pipeline) = (4, 2, 1), vocab over `tensor`: the target-logit gather and
    the softmax stay on each device's vocab slice; no all-gather at all in the compiled grad."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2, 1, 1), sharding.MESH_AXES)
    B, S, D, V = 8, 64, 32, 256

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (arg((B, S, D), jnp.float32, P("data")), arg((D, V), jnp.float32, P(None, "tensor")),
            arg((B, S), jnp.int32, P("data")), arg((B, S), jnp.float32, P("data")))
    with sharding.activate(mesh, sharding.logical_rules()):
        hlo = jax.jit(_grad_of_chunked(16)).lower(*args).compile().as_text()
    assert not re.search(r"all-gather(-start)?\(", hlo)
    # Each device's logits chunk is [B/4, 16, V/2].
    assert re.search(r"f32\[2,16,128\]", hlo)
