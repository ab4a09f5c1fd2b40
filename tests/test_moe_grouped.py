"""Dropless MoE with sorted rows and grouped GEMMs (dsjax/model/moe_grouped.py) against a plain
per-token loop in NumPy (float64: each token through each of its k experts, the gradients
written out by hand), with and without expert parallelism on 8 devices, under extreme
imbalance; then in the model against the capacity buffers' dropless path."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax import config as config_lib
from dsjax.errors import ConfigError
from dsjax.fp8_policy import Fp8Policy
from dsjax.model import moe_exchange, moe_grouped
from dsjax.model.moe import MoE, capacity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, D, F, E, K = 32, 8, 6, 8, 2


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def per_token_loop(x, experts, weights, w_gate, w_up, w_down, cot):
    """y, sum(y * cot) with y_t = sum_k w_tk SwiGLU_{e_tk}(x_t), and its gradients with respect
    to x, the routing weights and the three expert weights, one token and one choice at a time."""
    x, weights, w_gate, w_up, w_down, cot = (np.asarray(a, np.float64) for a in
                                             (x, weights, w_gate, w_up, w_down, cot))
    y, grads = np.zeros_like(x), [np.zeros_like(a) for a in (x, weights, w_gate, w_up, w_down)]
    gx, gw, gg, gu, gd = grads
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = experts[t, k]
            g, u = x[t] @ w_gate[e], x[t] @ w_up[e]
            h = g * _sigmoid(g) * u
            out = h @ w_down[e]
            y[t] += weights[t, k] * out
            gw[t, k] = cot[t] @ out
            dy = weights[t, k] * cot[t]
            gd[e] += np.outer(h, dy)
            dh = w_down[e] @ dy
            dsilu = _sigmoid(g) * (1 + g * (1 - _sigmoid(g)))
            dg, du = dh * u * dsilu, dh * g * _sigmoid(g)
            gg[e] += np.outer(x[t], dg)
            gu[e] += np.outer(x[t], du)
            gx[t] += w_gate[e] @ dg + w_up[e] @ du
    return y, np.sum(y * cot), grads


def _problem(routing):
    rng = np.random.default_rng(0)
    f32 = lambda a: a.astype(np.float32)
    arrays = (f32(rng.normal(size=(T, D))), f32(rng.uniform(0.1, 1, size=(T, K))),
              f32(0.3 * rng.normal(size=(E, D, F))), f32(0.3 * rng.normal(size=(E, D, F))),
              f32(0.3 * rng.normal(size=(E, F, D))))
    experts = {
        "random": np.stack([rng.permutation(E)[:K] for _ in range(T)]),
        "one_expert": np.full((T, K), 3),  # all T * K assignments to expert 3
        "two_of_eight": rng.integers(0, 2, size=(T, K)),  # six experts get no token
    }[routing].astype(np.int32)
    return experts, arrays, f32(rng.normal(size=(T, D)))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` as its documentation states it, from all_gathers (XLA:CPU
    cannot run the collective): sender s's rows [input_offsets[me], + send_sizes[me]) of its
    operand land at output_offsets[me] of my output (recv_sizes, my count of each sender's
    rows, is implied by the senders' send_sizes)."""
    del recv_sizes
    me, W, N = lax.axis_index(axis_name), lax.axis_size(axis_name), operand.shape[0]
    operands = lax.all_gather(operand, axis_name)
    ins, sends, outs = (lax.all_gather(a, axis_name)[:, me]
                        for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(N)
    for s in range(W):
        dst = jnp.where(rows < sends[s], outs[s] + rows, output.shape[0])  # past the end: none
        output = output.at[dst].set(operands[s][jnp.minimum(ins[s] + rows, N - 1)], mode="drop")
    return output


@pytest.mark.parametrize("expert_parallel", [False, "static", "ragged"],
                         ids=["local", "ep8", "ep8-ragged-exchange"])
@pytest.mark.parametrize("routing", ["random", "one_expert", "two_of_eight"])
@pytest.mark.parametrize("impl", ["ragged", "padded"])
def test_grouped_rows_equal_the_per_token_loop(impl, routing, expert_parallel, monkeypatch):
    """Loss and every gradient to 1e-5 (relative to the gradient's largest entry). ep8: 8
    devices, one expert each; with all assignments on expert 3, device 3 receives every row.
    The ragged exchange runs on an emulation of its collective (its offsets are what is
    tested; the collective itself needs a GPU or TPU)."""
    experts, (x, weights, w_gate, w_up, w_down), cot = _problem(routing)
    _, ref_loss, ref_grads = per_token_loop(x, experts, weights, w_gate, w_up, w_down, cot)
    monkeypatch.setattr(moe_exchange, "ragged_all_to_all", emulated_ragged_all_to_all)

    def routed(x, experts, weights, w_gate, w_up, w_down):
        if not expert_parallel:
            return moe_grouped.routed(x, experts, weights, w_gate, w_up, w_down,
                                      moe_grouped.Grouped(impl, 4))
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        how = moe_grouped.Grouped(impl, 4, exchange=expert_parallel)
        body = lambda *a: moe_exchange.exchange("data", *a, E, how)
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 6, out_specs=P("data"),
                             check_vma=False)(x, experts, weights, w_gate, w_up, w_down)

    def loss(x, weights, w_gate, w_up, w_down):
        return jnp.sum(routed(x, experts, weights, w_gate, w_up, w_down) * cot)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=range(5)))(
        x, weights, w_gate, w_up, w_down)
    # float32 against float64: measured <= 5e-7 relative in every case.
    np.testing.assert_allclose(float(value), ref_loss, rtol=1e-5)
    for name, g, r in zip(("x", "weights", "gate", "up", "down"), grads, ref_grads):
        err = np.max(np.abs(np.asarray(g, np.float64) - r)) / np.max(np.abs(r))
        assert err < 1e-5, (name, err)


def test_padded_layout_puts_each_group_in_whole_tiles():
    """Group sizes 5, 0, 3 (and one assignment of no group) with tile 4: groups start at
    rows 0 and 8, each tile names its group, the stray assignment lands past the last row."""
    group = jnp.array([2, 0, 0, 3, 0, 2, 0, 0, 2], jnp.int32)  # 3 = no group
    layout = moe_grouped.sort_rows(group, 3, 4)
    assert layout.rows == 20  # ceil((9 + 3 * 3) / 4) tiles of 4
    np.testing.assert_array_equal(layout.sizes, [5, 0, 3])
    np.testing.assert_array_equal(layout.row, [8, 0, 1, 20, 2, 9, 3, 4, 10])
    np.testing.assert_array_equal(layout.tile_group, [0, 0, 2, 2, 2])
    assert int(layout.used_tiles) == 3  # tiles 3 and 4 hold no row: the loop stops before them


def test_unrolled_tiles_equal_the_loop():
    """The benchmarks' unrolled form (every tile of the static bound, counted by
    cost_analysis) computes what the loop over used tiles does, gradients included."""
    experts, (x, weights, w_gate, w_up, w_down), cot = _problem("random")

    def loss(unroll, *args):
        how = moe_grouped.Grouped("padded", 4, unroll)
        return jnp.sum(moe_grouped.routed(args[0], experts, *args[1:], how) * cot)

    args = (x, weights, w_gate, w_up, w_down)
    loop = jax.value_and_grad(lambda *a: loss(False, *a), argnums=range(5))(*args)
    unrolled = jax.value_and_grad(lambda *a: loss(True, *a), argnums=range(5))(*args)
    for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# In the model.

def _moe(impl, factor=0.0):
    return MoE(num_experts=E, experts_per_token=K, expert_dim=F, n_shared=0, n_group=1,
               topk_group=1, routed_scaling_factor=1.0, scoring="sigmoid",
               norm_topk_prob=True, capacity_factor=factor, expert_parallel=False,
               init_std=0.3, impl=impl, tile=4, exchange="static")


def test_no_token_is_dropped_when_every_token_picks_one_expert():
    """A router bias that sends every token to experts 0 and 1: capacity_factor 1.25 keeps
    ceil(1.25 * 64 * 2 / 8) = 20 of each expert's 64 assignments; ragged and padded keep all
    of them, equal to the per-token loop on the same routing."""
    B, S = 2, 32
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, D)), jnp.float32)
    params = nn.unbox(_moe("padded").init(jax.random.key(0), x)["params"])
    params = {**params, "router_bias": params["router_bias"].at[:2].set(1e3)}
    assert capacity(B * S, K, E, 1.25) == 20
    outputs = {}
    for impl, factor in (("ragged", 0.0), ("padded", 0.0), ("capacity", 1.25)):
        y, stats = _moe(impl, factor).apply({"params": params}, x)
        outputs[impl] = np.asarray(y).reshape(B * S, D)
        np.testing.assert_array_equal(stats["load"], [B * S, B * S] + [0] * (E - 2))
    logits = np.asarray(x).reshape(B * S, D) @ np.asarray(params["router"], np.float64)
    scores = _sigmoid(logits[:, :2])
    weights = scores / scores.sum(axis=1, keepdims=True)
    experts = np.tile([[0, 1]], (B * S, 1))
    ref = per_token_loop(np.asarray(x).reshape(B * S, D), experts, weights, params["gate"],
                         params["up"], params["down"], np.zeros((B * S, D)))[0]
    for impl in ("ragged", "padded"):
        np.testing.assert_allclose(outputs[impl], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    kept = np.abs(outputs["capacity"] - ref).max(axis=1) < 1e-4 * np.abs(ref).max()
    assert kept.sum() == 20  # the first 20 tokens; the other 44 lost both assignments


MOE_FLAGS = {"model.num_layers": 3, "model.hidden_size": 64, "model.mlp_dim": 128,
             "model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16,
             "model.qk_rope_head_dim": 8, "model.v_head_dim": 16,
             "model.moe_intermediate_size": 32, "data.seq_len": 32, "data.global_batch": 8}


@pytest.mark.parametrize("overrides, field", [
    ({"model.moe_impl": "grouped"}, "model.moe_impl"),
    ({"model.moe_impl": "padded", "model.capacity_factor": 1.25}, "model.capacity_factor"),
    ({"model.moe_impl": "ragged", "train.compute_dtype": "fp8"}, "model.moe_impl"),
    ({"model.moe_impl": "auto", "train.compute_dtype": "fp8", "fp8.recipe": "rowwise"},
     "fp8.recipe"),
    ({"model.moe_tile": -1}, "model.moe_tile"),
    ({"model.moe_exchange": "nccl"}, "model.moe_exchange"),
    ({"model.moe_exchange": "ragged"}, "model.moe_exchange"),  # with moe_impl capacity
])
def test_invalid_moe_impl_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {**MOE_FLAGS, **overrides})


def test_delayed_fp8_elsewhere_composes_with_grouped_experts():
    """The delayed recipe for attention only (gate, up, down left out of fp8.matmuls) loads."""
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {
        **MOE_FLAGS, "model.moe_impl": "ragged", "train.compute_dtype": "fp8",
        "fp8.recipe": "delayed", "fp8.matmuls": "q,k,v,o"})
    assert cfg.model.moe_impl == "ragged"


FP8_EXPERTS = {"train.compute_dtype": "fp8", "fp8.matmuls": "gate,up,down",
               "fp8.other_dtype": "float32"}


@pytest.mark.parametrize("impl, expert_parallel, fp8", [
    ("ragged", False, False), ("padded", True, True)],
    ids=["ragged-dense-fallback", "padded-ep-fp8"])
def test_grouped_model_trains_like_the_dropless_capacity_buffers(impl, expert_parallel, fp8):
    """configs/cpu_moe.py shrunk (MLA, 1 dense + 2 MoE blocks, MTP, 4 x 2 mesh): two steps with
    grouped GEMMs (and the MoE remat names saved) against the [E, tokens, D] buffers, both
    dropless: the same losses and loads, the second step after both gradients' updates. `fp8`:
    the experts' GEMMs in fp8 on both sides (current scaling per expert)."""
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel
    from conftest import random_batch  # pylint: disable=import-outside-toplevel

    runs = {}
    for overrides in ({"model.moe_impl": "capacity"},
                      {"model.moe_impl": impl, "remat.policy": "names:moe_routed,kv_latent"}):
        trainer = build_trainer(config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {
            **MOE_FLAGS, "model.expert_parallel": expert_parallel, "optim.warmup_steps": 1,
            **(FP8_EXPERTS if fp8 else {}), **overrides}))
        state, losses, loads = trainer.init(), [], []
        for seed in range(2):
            batch = random_batch(np.random.default_rng(seed), 8, 32, vocab=512)
            state, m = trainer.step(state, trainer.device_batch(batch))
            losses.append(float(m["loss"]))
            loads.append(np.asarray(m["expert_load"]))
        runs[overrides["model.moe_impl"]] = losses, loads
    # Each row's dot products are the same; measured equal to the last bit (fp8 too), allowed
    # 1e-5.
    np.testing.assert_allclose(runs[impl][0], runs["capacity"][0], rtol=1e-5)
    np.testing.assert_allclose(runs[impl][1], runs["capacity"][1], atol=1e-6)
    assert runs[impl][0][1] != runs[impl][0][0]


def test_fp8_experts_scale_per_expert_like_the_capacity_buffers():
    """gate, up, down as fp8 GEMMs with current scaling: the padded tile loop (scales from the
    amax of each expert's rows) against the capacity buffers' per-expert `fp8_einsum` (from the
    amax of each expert's slots, the same values and zeros). Output and gradients agree to
    float32 summation order, far closer than either is to float32 experts."""
    B, S = 2, 32
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, S, D)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(3).normal(size=(B, S, D)), jnp.float32)
    policy = Fp8Policy(matmuls=("gate", "up", "down"))
    params = nn.unbox(_moe("padded").init(jax.random.key(1), x)["params"])

    def run(impl, fp8_policy):
        def loss(params, x):
            y, _ = _moe(impl).clone(fp8_policy=fp8_policy).apply({"params": params}, x)
            return jnp.sum(y * cot)
        value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        del grads["router_bias"]  # no gradient reaches it
        return {"loss": value, "x": dx, **grads}

    padded, buffers, exact = run("padded", policy), run("capacity", policy), run("padded", None)
    assert sorted(padded) == ["down", "gate", "loss", "router", "up", "x"]
    for name, b in buffers.items():
        b = np.asarray(b)
        diff = np.linalg.norm(np.asarray(padded[name]) - b) / np.linalg.norm(b)
        quantisation = np.linalg.norm(np.asarray(exact[name]) - b) / np.linalg.norm(b)
        # Measured: diff <= 7e-8, quantisation 0.03 (loss) to 0.12 (down's gradient).
        assert diff < 1e-5 and quantisation > 1e-2, (name, diff, quantisation)


def test_ragged_exchange_on_cpu_says_it_needs_a_gpu():
    experts, (x, weights, w_gate, w_up, w_down), _ = _problem("random")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    how = moe_grouped.Grouped("padded", 4, exchange="ragged")
    body = lambda *a: moe_exchange.exchange("data", *a, E, how)
    with pytest.raises(NotImplementedError, match="model.moe_exchange='ragged' needs a GPU"):
        jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 6, out_specs=P("data"),
                      check_vma=False)(x, experts, weights, w_gate, w_up, w_down)
