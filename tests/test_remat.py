"""Recomputation policies: same gradients, measured memory/FLOPs trade-off, patterns, planner."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, random_batch, tiny
from dsjax import config as config_lib
from dsjax import remat, remat_plan, sharding
from dsjax.config import ConfigError
from dsjax.model import Transformer
from dsjax.model.loss import ModelLoss, loss_fn

TINY = tiny({"model.num_layers": 4, "model.vocab_size": 256, "data.seq_len": 128,
             "data.global_batch": 4, "mesh.data": 1, "mesh.tensor": 1, "mesh.pipeline": 1})
POLICIES = ["full", "dots", "dots_no_batch", "attention_core", "names:mlp_hidden,attn_out",
            "offload:mlp_hidden"]


def _cfg(**extra):
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **extra})


@pytest.fixture(scope="module")
def one_device_mesh():
    return sharding.make_mesh(_cfg(), jax.devices()[:1])


def _grads(policies, params, batch):
    model = Transformer(_cfg().model, layer_policies=policies)
    return jax.jit(jax.grad(lambda p: loss_fn(p, ModelLoss(model), batch)[0]))(params)


def test_gradients_are_equal_across_policies_and_patterns():
    cfg = _cfg()
    L = cfg.model.num_layers
    model = Transformer(cfg.model)
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x,
                          model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"],
                          is_leaf=lambda x: hasattr(x, "value"))
    batch = {k: jnp.asarray(v) for k, v in random_batch(np.random.default_rng(0), 2, 32,
                                                                vocab=256).items()}
    reference = _grads(("none",) * L, params, batch)
    variants = [(p,) * L for p in POLICIES]
    variants += [remat.layer_policies("full", "every_2", L), ("full", "dots", "none", "full")]
    for policies in variants:
        got = _grads(policies, params, batch)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
            assert np.all(np.isfinite(a))
            # Recomputation replays the same float32 ops; only XLA's fusion order may differ, so
            # compare each tensor's relative (Frobenius) error.
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-6, policies


def test_scanned_memory_orders_none_dots_full_and_flops_the_other_way(one_device_mesh):
    cfg = _cfg()
    none, dots, full = (remat_plan.measure(cfg, one_device_mesh, p, "all")
                        for p in ("none", "dots", "full"))
    assert none.temp_bytes > dots.temp_bytes > full.temp_bytes, (none, dots, full)
    assert none.flops < dots.flops < full.flops, (none, dots, full)
    # full recomputation replays each block's forward once: about +1/3 of a fwd+bwd step.
    assert 1.15 < full.flops / none.flops < 1.45


def test_layer_pattern_recomputes_exactly_the_named_layers():
    assert remat.layer_policies("full", "every_2", 6) == ("none", "full") * 3
    assert remat.layer_policies("dots", "every_3", 6) == ("none", "none", "dots") * 2
    assert remat.group_pattern(("none", "full") * 3) == ("none", "full")
    assert remat.group_pattern(("full", "none", "none", "full")) == ("full", "none", "none", "full")
    cfg = _cfg()
    model = Transformer(cfg.model, layer_policies=("none", "full", "none", "full"))
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, tokens))(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 2  # 2 groups of (none, full)
    body = scans[0].params["jaxpr"].jaxpr
    remats = [e for e in body.eqns if "remat" in e.primitive.name or "checkpoint" in e.primitive.name]
    assert len(remats) == 1  # only the second layer of each group is wrapped


def test_every_2_memory_lies_between_none_and_full(one_device_mesh):
    cfg = _cfg()
    none = remat_plan.measure(cfg, one_device_mesh, "none", "all")
    half = remat_plan.measure(cfg, one_device_mesh, "full", "every_2")
    full = remat_plan.measure(cfg, one_device_mesh, "full", "all")
    assert full.temp_bytes < half.temp_bytes < none.temp_bytes
    assert none.flops < half.flops < full.flops


# A subset of the planner's candidates, measured (and cached) by the tests above: keeps CI short.
CANDIDATES = (("none", "all"), ("dots", "all"), ("full", "every_2"), ("full", "all"))


def test_auto_picks_none_with_room_and_recomputes_when_tight(one_device_mesh):
    cfg = _cfg(**{"remat.policy": "auto", "remat.memory_budget_gb": 1000.0})
    choose = lambda c: remat_plan.choose(c, one_device_mesh, log=lambda _: None,
                                         candidates=CANDIDATES)
    policy, layers, rows = choose(cfg)
    assert (policy, layers) == ("none", "all")
    static = remat_plan.static_bytes_per_device(cfg, one_device_mesh)
    smallest = min(r.temp_bytes for r in rows)
    none = next(r for r in rows if r.policy == "none")
    tight = (static + (smallest + none.temp_bytes) / 2) / 2 ** 30
    tight_cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat,
                                                                   memory_budget_gb=tight))
    policy, layers, _ = choose(tight_cfg)
    assert policy != "none"
    chosen = next(r for r in rows if (r.policy, r.layers) == (policy, layers))
    assert chosen.temp_bytes + static <= tight * 2 ** 30
    impossible = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat,
                                                                    memory_budget_gb=1e-6))
    with pytest.raises(ConfigError, match="^remat.memory_budget_gb: no policy fits"):
        choose(impossible)


@pytest.mark.parametrize("overrides, message", [
    ({"remat.policy": "sometimes"}, r"^remat\.policy: unknown policy 'sometimes'; valid: none, "
                                    r"full, dots, dots_no_batch, attention_core"),
    ({"remat.policy": "names:mlp_hiden"}, r"^remat\.policy: .*unknown tensors \['mlp_hiden'\]"),
    ({"remat.policy": "full", "remat.layers": "every_0"}, r"^remat\.layers: "),
    ({"remat.policy": "full", "remat.layers": "full,none"}, r"^remat\.layers: the explicit list"),
])
def test_bad_policies_list_the_valid_ones(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**overrides)


@pytest.mark.parametrize("name, where", [("kv_latent", "MLA.__call__"),
                                         ("moe_routed", "MoE._dense")])
def test_mla_and_moe_tags_are_policy_names_that_change_what_is_saved(name, where):
    """`remat.policy=names:<tag>` is accepted for the tags MLA and MoE blocks carry, and saves
    exactly that tensor of a block that `full` recomputes."""
    import contextlib  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {
        **TINY, "model.num_kv_heads": 4, "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
        "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
        "model.moe_intermediate_size": 16, "model.expert_parallel": False,
        "remat.policy": f"names:{name}"})
    assert cfg.remat.policy == f"names:{name}"
    model = Transformer(cfg.model)
    block = model._block(((), ()), moe=True)  # no fp8  # pylint: disable=protected-access
    x = jax.random.normal(jax.random.key(0), (2, 8, cfg.model.hidden_size))
    pos, seg = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)
    variables = block.init(jax.random.key(1), x, pos, seg)

    def saved(policy):
        _, checkpoint_policy = remat.checkpoint_policy(policy)
        f = jax.checkpoint(lambda v, x: jnp.sum(block.apply(v, x, pos, seg)[0] ** 2),
                           policy=checkpoint_policy)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(f, variables, x)
        return [line for line in out.getvalue().splitlines() if " named " in line]

    assert saved("full") == []
    got = saved(cfg.remat.policy)
    assert len(got) == 1 and f"named '{name}'" in got[0] and where in got[0], got
