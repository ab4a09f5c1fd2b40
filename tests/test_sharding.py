"""Invariant 1: the mesh shape never changes the math."""

import os

import jax
import numpy as np
import pytest

from conftest import ROOT, random_batch
from dsjax import config as config_lib
from dsjax import sharding
from dsjax.train import build_trainer

TINY = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512,
        "data.seq_len": 32, "data.global_batch": 8, "train.steps": 3,
        "optim.warmup_steps": 1, "optim.lr": 1e-2}


def _losses(overrides, devices, batches):
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **overrides})
    trainer = build_trainer(cfg, sharding.make_mesh(cfg, devices))
    state = trainer.init()
    losses = []
    for b in batches:
        state, m = trainer.step(state, trainer.device_batch(b))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("mesh, model", [
    ((4, 2, False), {}),
    ((8, 1, True), {}),
    ((2, 4, True), {"model.num_kv_heads": 4}),  # MHA: kv heads must divide over tensor = 4
], ids=["dp4-tp2", "dp8-fsdp", "dp2-tp4-fsdp"])
def test_sharded_run_matches_single_device(mesh, model):
    data, tensor, fsdp = mesh
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, 8, 32)] * 3  # one batch repeated, so the loss must fall
    single, p1 = _losses({"mesh.data": 1, "mesh.tensor": 1, **model}, jax.devices()[:1], batches)
    sharded, p8 = _losses({"mesh.data": data, "mesh.tensor": tensor, "mesh.fsdp": fsdp, **model},
                          jax.devices(), batches)
    assert single[-1] < single[0] - 1e-3  # it trains
    # float32: only the summation order differs between meshes.
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    # Adam divides by sqrt(v): for an element whose gradient is ~0, float32 rounding of the
    # gradient can flip the update's sign, so a handful of elements may differ by ~lr. Compare
    # whole tensors (relative Frobenius norm; measured <= 1.2e-5 here), which any sharding bug
    # (a wrong head or shard mapping) would move by O(1).
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4


def test_parameters_are_sharded_as_the_rules_say():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"),
                          {**TINY, "mesh.fsdp": True})
    trainer = build_trainer(cfg)
    specs = jax.tree.map(lambda s: tuple(s.spec), trainer.state_shardings.params)
    assert specs["layers"]["attn"]["q"] == (None, "data", "tensor", None)  # [L, D, H, K]
    assert specs["layers"]["mlp"]["down"] == (None, "tensor", "data")        # [L, F, D]
    assert specs["embedding"] == ("tensor", "data")                           # [V, D]
    assert specs["layers"]["attn_norm"]["scale"] in ((None, None), (None,), ())
    mu = trainer.state_shardings.opt_state[1][0].mu  # Adam's first moment mirrors the params
    assert tuple(mu["layers"]["attn"]["q"].spec) == (None, "data", "tensor", None)
