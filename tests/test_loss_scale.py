"""dsjax.optim.loss_scale: a float16 step that overflows halves the scale and skips, good steps
double it, and the bfloat16 skip policy counts skipped steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.optim import loss_scale as ls

LR = 0.1


def _loss(params, x, compute_dtype):
    """Mean squared output of a linear layer computed in `compute_dtype`, loss in float32."""
    y = x.astype(compute_dtype) @ params["w"].astype(compute_dtype)
    return jnp.mean(y.astype(jnp.float32) ** 2)


@jax.jit
def fp16_step(params, scale_state, x):
    grads = jax.grad(lambda p: ls.scale_loss(scale_state, _loss(p, x, jnp.float16)))(params)
    grads = ls.unscale_grads(scale_state, grads)
    ok = ls.should_apply(grads)
    new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return ls.select(ok, new_params, params), ls.update(scale_state, ok), grads


@jax.jit
def bf16_step(params, scale_state, x):
    grads = ls.unscale_grads(scale_state, jax.grad(_loss)(params, x, jnp.bfloat16))
    ok = ls.should_apply(grads)
    new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return ls.select(ok, new_params, params), ls.update(scale_state, ok)


def _setup(rng):
    params = {"w": jnp.asarray(rng.standard_normal((16, 8)) * 0.1, jnp.float32)}
    return params, lambda std=1.0: jnp.asarray(rng.standard_normal((32, 16)) * std, jnp.float32)


def test_float16_overflow_halves_the_scale_and_skips_the_step():
    rng = np.random.default_rng(0)
    params, batch = _setup(rng)
    state = ls.dynamic_scale(2.0 ** 15, growth_interval=3)
    # Inputs 1e3x larger: d(loss)/dy * 2**15 is ~1e5 > float16's 65504, so the float16
    # backward matmul overflows to inf.
    new_params, new_state, _ = fp16_step(params, state, batch(1e3))
    assert float(new_state.scale) == 2.0 ** 14
    assert int(new_state.skipped_steps) == 1 and int(new_state.good_steps) == 0
    np.testing.assert_array_equal(new_params["w"], params["w"])


def test_float16_good_steps_double_the_scale_and_grads_are_unscaled():
    rng = np.random.default_rng(1)
    params, batch = _setup(rng)
    state = ls.dynamic_scale(2.0 ** 10, growth_interval=3)
    scales = []
    for _ in range(4):
        x = batch()
        new_params, state, grads = fp16_step(params, state, x)
        # Unscaled float16 gradients match float32 ones to float16 rounding (2**-11 per
        # element, a few ulps after the matmul's 32-term sums): 1e-2 relative.
        want = jax.grad(_loss)(params, x, jnp.float32)["w"]
        np.testing.assert_allclose(grads["w"], want, rtol=1e-2, atol=1e-2 * float(
            jnp.max(jnp.abs(want))))
        assert not np.array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
        params = new_params
        scales.append(float(state.scale))
    assert scales == [2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 11]
    assert int(state.skipped_steps) == 0 and int(state.good_steps) == 1


def test_scale_stays_within_bounds():
    state = ls.dynamic_scale(4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    for finite, want in [(False, 2.0), (False, 2.0), (True, 4.0), (True, 8.0), (True, 8.0)]:
        state = ls.update(state, jnp.asarray(finite))
        assert float(state.scale) == want


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_bfloat16_skip_policy_counts_skipped_steps(poison):
    rng = np.random.default_rng(2)
    params, batch = _setup(rng)
    state = ls.for_compute_dtype("bfloat16")
    assert not state.dynamic and float(state.scale) == 1.0
    bad = batch().at[int(rng.integers(32)), int(rng.integers(16))].set(poison)
    for i, (x, skipped) in enumerate([(batch(), 0), (bad, 1), (batch(), 1), (bad, 2)]):
        new_params, state = bf16_step(params, state, x)
        assert int(state.skipped_steps) == skipped, i
        assert float(state.scale) == 1.0
        moved = not np.array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
        assert moved == (x is not bad), i
        params = new_params
