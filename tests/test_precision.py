"""A bfloat16 step runs no float32 x float32 dot: `einsum_f32` (dsjax/model/dots.py) keeps the
float32 results the attention logits and the output head need while its backward dots stay in the
compute dtype, checked on the lowered StableHLO of single dots and of whole train steps."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from dsjax import config as config_lib
from dsjax import sharding
from dsjax.metrics import gemms
from dsjax.model.dots import einsum_f32
from dsjax.train import build_trainer

F32_F32 = lambda dots: [d for d in dots if d[0] == "f32" and d[1] == "f32"]  # noqa: E731


def _grad_text(fn, *args):
    return jax.jit(jax.grad(fn, tuple(range(len(args))))).lower(*args).as_text()


def test_einsum_f32_backward_runs_in_the_compute_dtype():
    rng = np.random.default_rng(0)
    a64, b64 = rng.normal(size=(2, 16, 8)), rng.normal(size=(2, 24, 8))
    loss = lambda dot: lambda a, b: jnp.sum(jnp.sin(dot("bsk,btk->bst", a, b)))  # noqa: E731
    plain = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)  # noqa: E731
    a, b = jnp.asarray(a64, jnp.bfloat16), jnp.asarray(b64, jnp.bfloat16)
    assert einsum_f32("bsk,btk->bst", a, b).dtype == jnp.float32
    # The plain einsum's transpose multiplies the float32 cotangent with the upcast operand.
    assert F32_F32(gemms.dot_general_dtypes(_grad_text(loss(plain), a, b))) == [("f32", "f32",
                                                                                "f32")] * 2
    dots = gemms.dot_general_dtypes(_grad_text(loss(einsum_f32), a, b))
    assert dots == [("bf16", "bf16", "f32"), ("bf16", "bf16", "bf16"), ("bf16", "bf16", "bf16")]
    # The values: the float64 gradients of sum(sin(a b^T)), to bf16's rounding of the cotangent.
    s = np.einsum("bsk,btk->bst", np.asarray(a, np.float64), np.asarray(b, np.float64))
    want_a = np.einsum("bst,btk->bsk", np.cos(s), np.asarray(b, np.float64))
    want_b = np.einsum("bst,bsk->btk", np.cos(s), np.asarray(a, np.float64))
    got_a, got_b = jax.grad(loss(einsum_f32), (0, 1))(a, b)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < 2e-2, err  # bf16: 8 bits of mantissa, a sum over 24 / 16 terms
    # float32: plain einsum, the same numbers and the same dots.
    a32, b32 = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32)
    for got, want in zip(jax.grad(loss(einsum_f32), (0, 1))(a32, b32),
                         jax.grad(loss(plain), (0, 1))(a32, b32)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="operands of one dtype"):
        einsum_f32("ij,jk->ik", a32[0], b[0].T)


def _step_text(overrides):
    """The lowered StableHLO of a bfloat16 train step of a tiny cpu_tiny model on (4, 2, 1)."""
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {
        "model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512,
        "data.seq_len": 32, "data.global_batch": 8, "train.compute_dtype": "bfloat16",
        "mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1, **overrides})
    trainer = build_trainer(cfg)
    with sharding.activate(trainer.mesh, trainer.rules):
        return trainer.jitted(0).lower(trainer.abstract_state(),
                                       trainer.abstract_batch()).as_text()


MOE = {"model.n_routed_experts": 12, "model.num_experts_per_tok": 2, "model.n_shared_experts": 1,
       "model.moe_intermediate_size": 32, "model.first_k_dense_replace": 1,
       "model.aux_loss_alpha": 0.01}


@pytest.mark.parametrize("impl", ["xla", "flash"])
@pytest.mark.parametrize("loss_chunk", [0, 16])
def test_a_bfloat16_dense_step_has_no_float32_x_float32_dot(impl, loss_chunk):
    dots = gemms.dot_general_dtypes(_step_text({"model.attention_impl": impl,
                                              "model.loss_chunk": loss_chunk}))
    assert ("bf16", "bf16", "f32") in dots  # the attention logits and the head kept float32
    assert F32_F32(dots) == [], (impl, loss_chunk, dots)


def _dot_shapes(text):
    """(lhs, rhs, result) shapes of every dot_general, in the order of `dot_general_dtypes`."""
    return [tuple(tuple(int(d) for d in t.split("x")[:-1]) for t in m.groups())
            for m in map(gemms._DOT_SIGNATURE.search, text.splitlines()) if m]


def test_a_bfloat16_moe_step_runs_float32_dots_only_in_the_router():
    """The MoE router computes its logits in float32 on purpose (dsjax/model/moe.py: routing
    decisions and the balance loss follow Hugging Face's float32 router): its forward and both
    gradients are the only float32 x float32 dots, each with the 12 experts as an axis."""
    text = _step_text({**MOE, "model.attention_impl": "flash", "model.loss_chunk": 16})
    dots = gemms.dot_general_dtypes(text)
    shapes = _dot_shapes(text)
    assert len(shapes) == len(dots)
    f32 = [s for d, s in zip(dots, shapes) if d[0] == "f32" and d[1] == "f32"]
    # One MoE layer (layer 0 is dense): the router's forward, d(x) and d(router).
    assert len(f32) == 3, f32
    assert all(any(12 in t for t in s) for s in f32), f32
