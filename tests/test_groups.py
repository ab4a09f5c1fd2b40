"""dsjax/optim/groups.py: parameter groups, and frozen groups that stay bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dsjax.config import ConfigError, trainable_groups
from dsjax.optim.groups import group_of, only_trainable, stop_frozen, trainable_mask


def _params(rng):
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return {"vision_tower": {"patch": f(4, 3), "blocks": {"w": f(2, 3, 3)}},
            "projector": {"w1": f(3, 5), "b1": f(5)},
            "embedding": f(7, 5), "layers": {"attn": {"q": f(2, 5, 5)}}, "lm_head": f(5, 7)}


def test_groups_are_decided_by_the_top_level_name():
    assert [group_of(n) for n in ("vision_tower", "projector", "embedding", "moe_layers")] == [
        "vision", "projector", "lm", "lm"]
    mask = trainable_mask(_params(np.random.default_rng(0)), ("projector",))
    assert jax.tree.leaves(mask["projector"]) == [True, True]
    assert not any(jax.tree.leaves(mask["vision_tower"]) + jax.tree.leaves(mask["layers"]))


def test_trainable_parses_all_a_list_and_names_a_bad_group():
    assert trainable_groups("all") == ("vision", "projector", "lm")
    assert trainable_groups(" lm , projector") == ("projector", "lm")
    with pytest.raises(ConfigError, match=r"train.trainable: unknown parameter group 'tower'"):
        trainable_groups("projector,tower")


def test_frozen_groups_get_no_update_and_keep_zero_moments_and_the_rest_is_plain_adamw():
    rng = np.random.default_rng(1)
    params = _params(rng)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    # The train step's stop_frozen makes the frozen groups' gradients zero.
    grads = jax.grad(lambda p: sum(jnp.vdot(g, x) for g, x in zip(
        jax.tree.leaves(grads), jax.tree.leaves(stop_frozen(p, ("projector",))))))(params)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    tx = only_trainable(inner, ("projector",))
    state = tx.init(params)
    for _ in range(2):  # two steps: the second reads the first's moments
        updates, state = tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        for name in ("vision_tower", "embedding", "layers", "lm_head"):
            for a, b in zip(jax.tree.leaves(new[name]), jax.tree.leaves(params[name])):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    # Reference: adamw (and clipping by the norm of the projector's gradient alone) run on the
    # projector subtree by itself.
    ref_state = inner.init(params["projector"])
    ref_params = params["projector"]
    for _ in range(2):
        ref_updates, ref_state = inner.update(grads["projector"], ref_state, ref_params)
        ref_new = optax.apply_updates(ref_params, ref_updates)
    for a, b in zip(jax.tree.leaves(new["projector"]), jax.tree.leaves(ref_new)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The frozen groups' moments stay at their initial zeros; the projector's moved.
    adam = state[0][1][0]
    for moments in (adam.mu, adam.nu):
        for name in ("vision_tower", "embedding", "layers", "lm_head"):
            assert not any(np.any(np.asarray(m)) for m in jax.tree.leaves(moments[name]))
        assert all(np.all(np.asarray(m) != 0) for m in jax.tree.leaves(moments["projector"]))


def test_stop_frozen_zeroes_the_frozen_gradients_and_keeps_values():
    params = _params(np.random.default_rng(2))
    loss = lambda p: sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(p))
    grads = jax.grad(lambda p: loss(stop_frozen(p, ("vision", "lm"))))(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["projector"]))
    np.testing.assert_allclose(np.asarray(grads["embedding"]), np.cos(params["embedding"]),
                               rtol=1e-6)
    same = stop_frozen(params, ("lm",))
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
