"""dsjax/model/attention.py: every attention impl against the xla reference, inside the layers,
a sharded train step and the 1F1B pipeline; the auto rule and the config errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, random_batch, run_launch, tiny
from dsjax import config as config_lib
from dsjax import remat, train
from dsjax.config import ConfigError
from dsjax.model import attention
from dsjax.model.build import make_model
from dsjax.model.layers import Attention, AttentionCore
from dsjax.model.mla import MLA

# float32 everywhere: impls differ only in summation order (blockwise online softmax), measured
# <= 1e-6 relative; a wrong mask, a dropped segment id or a wrong kv head moves them by O(1).
RTOL = 1e-5


def _inputs(batch, seq, width, seed=0):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, batch, seq, docs_per_row=3)  # packed documents, non-decreasing ids
    x = jnp.asarray(rng.normal(size=(batch, seq, width)), jnp.float32)
    return x, jnp.asarray(b["positions"]), jnp.asarray(b["segment_ids"])


def _module(kind, impl):
    blocks = dict(core=AttentionCore(impl, block_q=16, block_k=8))
    if kind == "mla":  # qk 24 = nope 16 + rope 8, v 16 (U != K)
        return MLA(num_heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0, norm_eps=1e-6,
                   init_std=0.3, **blocks)
    heads, kv_heads = {"mha": (4, 4), "gqa": (8, 2)}[kind]
    return Attention(heads, kv_heads, 8, 10000.0, 0.3, **blocks)


def _value_and_grads(module, params, x, pos, seg):
    """Forward output and the grads of every param and of the input, of a loss that weights
    each output element differently (a plain sum would hide a permuted output)."""
    w = jnp.asarray(np.random.default_rng(7).normal(size=(x.shape[0], x.shape[1], x.shape[2])),
                    jnp.float32)

    def loss(p, x):
        out = module.apply(p, x, pos, seg)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


def _assert_close(got, want, what):
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        rel = np.linalg.norm(np.asarray(g) - np.asarray(r)) / np.linalg.norm(np.asarray(r))
        assert rel < RTOL, (what, jax.tree_util.keystr(path), rel)


@pytest.mark.parametrize("impl", ["flash", "pallas"])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_layer_matches_xla_forward_and_every_gradient(kind, impl):
    """Batch 2, S = 40 (not a multiple of the 16 x 8 flash blocks nor of pallas' 64 tile),
    3 packed documents per row. pallas runs interpreted on CPU."""
    x, pos, seg = _inputs(2, 40, 32)
    params = _module(kind, "xla").init(jax.random.key(0), x, pos, seg)
    want_out, want_grads = _value_and_grads(_module(kind, "xla"), params, x, pos, seg)
    got_out, got_grads = _value_and_grads(_module(kind, impl), params, x, pos, seg)
    _assert_close(got_out, want_out, "output")
    _assert_close(got_grads, want_grads, "grads")


def test_core_masks_across_documents():
    """The test above can fail: the reference differs from attention without document masks."""
    x, pos, seg = _inputs(1, 24, 32, seed=3)
    module = _module("mha", "xla")
    params = module.init(jax.random.key(0), x, pos, seg)
    masked = module.apply(params, x, pos, seg)
    one_doc = module.apply(params, x, pos, jnp.ones_like(seg))
    assert np.max(np.abs(np.asarray(masked - one_doc))) > 1e-3


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_cudnn_arguments_give_the_xla_reference(packed):
    """What dsjax hands jax.nn.dot_product_attention for cudnn (no mask for one document a row,
    the same-document mask for packed rows), run through jax's own xla implementation: the
    reference's output and q, k, v gradients. GQA (8 query heads on 2 kv heads), S 40."""
    rng = np.random.default_rng(5)
    B, S, H, N, K = 2, 40, 8, 2, 16
    q, k, v, dy = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
                   ((B, S, H, K), (B, S, N, K), (B, S, N, K), (B, S, H, K)))
    seg = (jnp.asarray(random_batch(rng, B, S, docs_per_row=3)["segment_ids"]) if packed
           else jnp.ones((B, S), jnp.int32))

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * dy), out

    ref = lambda q, k, v: attention.attention_core(q, k, v, seg, scale=K ** -0.5, impl="xla",
                                                   block_q=16, block_k=8, dtype=jnp.float32)
    got = lambda q, k, v: attention.cudnn_call(q, k, v, seg, K ** -0.5, implementation="xla")
    grad = lambda fn: jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (want_grads, want_out), (got_grads, got_out) = grad(ref), grad(got)
    _assert_close(got_out, want_out, "output")
    _assert_close(got_grads, want_grads, "grads")
    # and it can fail: the packed rows differ from attention over the whole row
    if packed:
        whole = attention.cudnn_call(q, k, v, jnp.ones_like(seg), K ** -0.5, implementation="xla")
        assert float(jnp.max(jnp.abs(whole - got_out))) > 1e-3


TINY = tiny({"model.num_layers": 4, "model.hidden_size": 32, "model.mlp_dim": 64,
             "model.vocab_size": 128, "data.seq_len": 24, "train.steps": 4,
             "optim.warmup_steps": 1, "model.attention_block_q": 16,
             "model.attention_block_k": 8})


def _cfg(**overrides):
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **overrides})


def _one_step(impl, mesh, **overrides):
    data, tensor, stages = mesh
    cfg = _cfg(**{"model.attention_impl": impl, "mesh.data": data, "mesh.tensor": tensor,
                  "mesh.pipeline": stages, **overrides})
    trainer = train.build_trainer(cfg)
    host_batch = random_batch(np.random.default_rng(1), cfg.data.global_batch, 24, vocab=128)
    _, m = trainer.step(trainer.init(), trainer.device_batch(host_batch))
    return float(m["loss"]), float(m["grad_norm"])


@pytest.mark.parametrize("mesh, overrides", [
    ((4, 2, 1), {}),  # tensor parallel: heads split over 2 devices
    ((2, 2, 2), {"pipeline.schedule": "1f1b", "pipeline.microbatches": 2}),
], ids=["tp", "1f1b"])
def test_train_step_with_flash_matches_xla(mesh, overrides):
    want = _one_step("xla", mesh, **overrides)
    got = _one_step("flash", mesh, **overrides)
    np.testing.assert_allclose(got, want, rtol=RTOL)


def test_attention_core_remat_keeps_flash_residuals_and_matches_xla():
    """remat.policy=attention_core with flash saves the kernel's residuals (nothing S x S
    exists to recompute); loss and grad norm equal xla's under the same policy."""
    want = _one_step("xla", (8, 1, 1), **{"remat.policy": "attention_core"})
    got = _one_step("flash", (8, 1, 1), **{"remat.policy": "attention_core"})
    np.testing.assert_allclose(got, want, rtol=RTOL)
    _, policy = remat.checkpoint_policy("attention_core", "flash")
    _, xla_policy = remat.checkpoint_policy("attention_core", "xla")
    assert {"attn_context", "attn_lse"} <= policy.saveable_names
    assert "attn_context" not in xla_policy.saveable_names


class _Model:
    """A ModelConfig stand-in for resolve_impl."""
    def __init__(self, impl, attention="mha", head_dim=128):
        self.attention_impl, self.attention, self.resolved_head_dim = impl, attention, head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = 128, 64, 128


@pytest.mark.parametrize("impl, backend, dtype, seq, want", [
    ("auto", "cpu", jnp.float32, attention.AUTO_FLASH_MIN_SEQ - 1, "xla"),
    ("auto", "cpu", jnp.float32, attention.AUTO_FLASH_MIN_SEQ, "flash"),
    ("auto", "cuda", jnp.bfloat16, 128, "cudnn"),
    ("auto", "cuda", jnp.float16, 4096, "cudnn"),
    ("xla", "cuda", jnp.bfloat16, 4096, "xla"),
    ("pallas", "cpu", jnp.float32, 64, "pallas"),  # interpreted: for tests
])
def test_resolve_impl(impl, backend, dtype, seq, want):
    assert attention.resolve_impl(_Model(impl), backend, dtype, seq) == want


def test_auto_falls_back_to_flash_where_cudnn_cannot_run():
    # head dim 320 > cuDNN's 256: auto picks flash; an explicit cudnn is an error
    assert attention.resolve_impl(_Model("auto", head_dim=320), "cuda", jnp.bfloat16, 64) == "flash"
    with pytest.raises(ConfigError, match=r"^model.attention_impl: cudnn needs head dims"):
        attention.resolve_impl(_Model("cudnn", head_dim=320), "cuda", jnp.bfloat16, 64)


@pytest.mark.parametrize("backend, dtype, match", [
    ("cpu", jnp.bfloat16, r"^model.attention_impl: cudnn needs an NVIDIA GPU, this backend is cpu"),
    ("rocm", jnp.bfloat16, r"^model.attention_impl: cudnn needs an NVIDIA GPU"),
    ("cuda", jnp.float32, r"^model.attention_impl: cudnn runs bfloat16/float16 only"),
])
def test_cudnn_where_it_cannot_run_is_a_config_error(backend, dtype, match):
    with pytest.raises(ConfigError, match=match):
        attention.resolve_impl(_Model("cudnn"), backend, dtype, 1024)


def test_cudnn_on_cpu_fails_when_the_model_is_built():
    cfg = _cfg(**{"model.attention_impl": "cudnn", "train.compute_dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"^model.attention_impl: cudnn needs an NVIDIA GPU"):
        make_model(cfg)


def test_fp8_runs_the_core_in_the_other_dtype():
    cfg = _cfg(**{"train.compute_dtype": "fp8", "fp8.other_dtype": "bfloat16"})
    assert make_model(cfg).dtype == jnp.bfloat16  # what every layer hands attention_core


@pytest.mark.parametrize("overrides, match", [
    ({"model.attention_impl": "triton"},
     r"^model.attention_impl: unknown implementation 'triton'; valid: xla, flash, cudnn"),
    ({"model.attention_block_q": 0}, r"^model.attention_block_q: must be > 0"),
    ({"model.attention_block_k": -8}, r"^model.attention_block_k: must be > 0"),
])
def test_bad_values_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**overrides)


def test_a_run_prints_and_records_the_resolved_impl(tmp_path):
    """The impl is in the run's first line and in summary.json (flash: auto would pick xla at
    this sequence length on CPU)."""
    proc = run_launch(tmp_path, {"model.attention_impl": "flash", "train.steps": 2})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| attention flash |" in proc.stdout + proc.stderr
    with open(tmp_path / "summary.json", encoding="utf-8") as f:
        assert json.load(f)["attention_impl"] == "flash"
