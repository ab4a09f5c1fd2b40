"""dsjax/pipeline/stash.py: a pullback split into per-microbatch and shared residuals gives the
gradients of `jax.vjp` itself, and stashes nothing that depends on the weights alone."""

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.pipeline import stash


def _layers(w_LDD, x_BD, aux):
    """Two scanned layers whose weights are cast to bfloat16 (as a bf16 model's are) and a
    per-row scale from `aux` (as positions or segment ids enter a stage)."""
    def body(x_BD, w_DD):
        h_BD = jnp.tanh(x_BD.astype(jnp.bfloat16) @ w_DD.astype(jnp.bfloat16))
        return h_BD.astype(jnp.float32) * aux[:, None], None
    y_BD, _ = jax.lax.scan(body, x_BD, w_LDD)
    return y_BD, None


def test_shared_leaves_are_the_weights_and_gradients_match_vjp():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(2, 16, 16)) / 4, jnp.float32)
    xs = [jnp.asarray(rng.normal(size=(4, 16)), jnp.float32) for _ in range(2)]
    auxs = [jnp.asarray(rng.uniform(0.5, 1.5, size=(4,)), jnp.float32) for _ in range(2)]
    ct = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)

    res = stash.plan(_layers, w, xs[0], auxs[0])
    # The bf16 weights [2, 16, 16] are shared (computed once); every stashed leaf depends on
    # the rows: none has the weights' shape.
    assert any(a.shape == (2, 16, 16) for a in res.shared_avals), res.avals
    assert res.stash_shapes and all(s.shape != (2, 16, 16) for s in res.stash_shapes)
    # Two microbatches forward, then their backwards from the stash (in flight together).
    kept = [res.forward(_layers, w, x, a)[1] for x, a in zip(xs, auxs)]
    for x, a, leaves in zip(xs, auxs, kept):
        got_dw, got_dx = res.backward(leaves, (ct, None))
        _, pullback = jax.vjp(lambda w, x: _layers(w, x, a), w, x)
        want_dw, want_dx = pullback((ct, None))
        np.testing.assert_allclose(got_dw, want_dw, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got_dx, want_dx, rtol=1e-6, atol=1e-7)


def test_ring_slots_hold_each_microbatch_apart():
    shapes = [jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)]
    ring = [jnp.zeros(s.shape, s.dtype) for s in stash.ring_shapes(shapes, 3)]
    assert [r.shape for r in ring] == [(3, 3), (3, 2)]
    ring = stash.put(ring, [jnp.ones(3), jnp.full(2, 7, jnp.int32)], jnp.int32(1))
    ring = stash.put(ring, [jnp.full(3, 2.0), jnp.full(2, 5, jnp.int32)], jnp.int32(2))
    one, two = stash.take(ring, jnp.int32(1)), stash.take(ring, jnp.int32(2))
    np.testing.assert_array_equal(one[0], np.ones(3))
    np.testing.assert_array_equal(two[1], np.full(2, 5))
    np.testing.assert_array_equal(stash.take(ring, jnp.int32(0))[0], np.zeros(3))
