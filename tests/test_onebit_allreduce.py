"""1-bit Adam's compressed all-reduce: against a NumPy transcription of DeepSpeed's (float64),
error feedback, the bucket plan, the hierarchical and tensor-parallel layouts, and the bytes on the
wire in the compiled HLO. 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from dsjax import metrics as mx
from dsjax.optim.compressed_allreduce import compressed_allreduce, pad_multiple, plan_buckets
from dsjax.optim.onebit import onebit_adam
from onebit_helpers import (W, allreduce_fn, init_fn, mesh,  # noqa: F401 (mesh: a fixture)
                            np_compressed_allreduce, step_fn)


def test_compressed_allreduce_matches_deepspeed_numpy(mesh):
    rng = np.random.default_rng(1)
    n = pad_multiple(W) * 37                         # 2368: chunks of 296 = 37 bytes of bits
    x = rng.normal(size=(W, n)).astype(np.float32) + rng.normal(size=(1, n)).astype(np.float32)
    we = (0.3 * rng.normal(size=(W, n))).astype(np.float32)
    se = (0.3 * rng.normal(size=(W, n // W))).astype(np.float32)
    mean, new_we, new_se = jax.device_get(allreduce_fn(mesh)(x, we, se))
    ref_mean, ref_we, ref_se = np_compressed_allreduce(x, we, se)
    # Every worker holds the same estimate, bit for bit.
    assert (mean == mean[:1]).all()
    # x + worker_error reaches ~5 (float32 ulp 4.8e-7) and the scales are ~1: float32 against
    # the float64 reference differs by about an ulp (measured <= 4.4e-7). A flipped sign or a
    # misrouted chunk would be off by ~2 * scale.
    for got, want in ((mean[0], ref_mean), (new_we, ref_we), (new_se, ref_se)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # The compression is coarse: the one-shot estimate is far from the exact mean, which is
    # what the error feedback below repairs.
    true = (x + we).mean(0)
    assert np.linalg.norm(mean[0] - true) / np.linalg.norm(true) > 0.3    # measured 0.68


def test_error_feedback_recovers_the_mean(mesh):
    """Repeating the reduction of a fixed input: with error feedback the running average of the
    estimates converges to the true mean (error compensation, paper §3-4); resetting the errors
    leaves a fixed bias."""
    rounds = 256
    rng = np.random.default_rng(2)
    n = pad_multiple(W) * 32
    x = (rng.normal(size=(W, n)) + 0.5 * rng.normal(size=(1, n))).astype(np.float32)

    def run(x, feedback):
        def body(carry, _):
            we, se = carry
            mean, we2, se2 = compressed_allreduce(x[0], we, se, "data")
            if not feedback:
                we2, se2 = jnp.zeros_like(we), jnp.zeros_like(se)
            return (we2, se2), mean
        # pcast: the zero errors start identical on every worker but are per-worker state.
        zeros = jax.lax.pcast((jnp.zeros(n), jnp.zeros(n // W)), "data", to="varying")
        _, means = jax.lax.scan(body, zeros, None, length=rounds)
        return means.mean(0)[None]

    errors = {}
    for feedback in (True, False):
        fn = jax.jit(jax.shard_map(lambda x: run(x, feedback), mesh=mesh, in_specs=P("data"),
                                   out_specs=P("data")))
        avg = np.asarray(fn(x))[0]
        true = x.mean(0)
        errors[feedback] = np.linalg.norm(avg - true) / np.linalg.norm(true)
    print(f"relative error of the {rounds}-round average: error feedback {errors[True]:.4f}, "
          f"none {errors[False]:.4f}")
    # With feedback the residual is (final errors) / rounds: O(1/rounds), ~1e-2 here.
    assert errors[True] < 0.03
    # Without it every round returns the same biased estimate (0.70 relative error here).
    assert errors[False] > 0.1
    assert errors[False] > 10 * errors[True]


def test_bucket_plan_groups_limits_and_round_trip():
    rng = np.random.default_rng(10)
    tree = {"a": rng.normal(size=(10, 7)), "b": rng.normal(size=(300,)),
            "c": rng.normal(size=(5,)), "d": rng.normal(size=(40, 3))}
    tree = jax.tree.map(lambda x: x.astype(np.float32), tree)
    groups = ["replicated", "tensor", "replicated", "replicated"]       # leaves a, b, c, d
    plan = plan_buckets(tree, bucket_bytes=400, multiple=64, groups=groups)
    # a + c = 75 floats fit in 400 bytes, d (480 bytes) does not join them; b is in its own group.
    assert plan.buckets == ((0, 2), (3,), (1,))
    assert plan.groups == ("replicated", "replicated", "tensor")
    assert plan.padded == (128, 128, 320)
    buffers = plan.flatten(tree)
    assert [b.shape for b in buffers] == [(128,), (128,), (320,)]
    assert not np.asarray(buffers[0][75:]).any()                      # zero padding
    jax.tree.map(np.testing.assert_array_equal, plan.unflatten(buffers), tree)
    assert plan.by_group(["x", "y", "z"]) == {"replicated": ("x", "y"), "tensor": ("z",)}
    one_per_leaf = plan_buckets(tree, bucket_bytes=0, multiple=64, groups=groups)
    assert len(one_per_leaf.buckets) == 4


def test_hierarchical_matches_reference():
    """fast_axis: exact mean over the node (4 devices), 1-bit across 2 nodes on each 1/4 slice."""
    nodes, local = 2, 4
    mesh2 = jax.make_mesh((nodes, local), ("data", "fast"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(5)
    params = {"a": rng.normal(size=(40, 30)).astype(np.float32),
              "b": rng.normal(size=(30,)).astype(np.float32)}
    opt = onebit_adam(1e-2, freeze_step=0, fast_axis="fast", bucket_bytes=1 << 20)
    pspecs = jax.tree.map(lambda _: P(), params)
    sspecs = opt.state_specs(pspecs)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh2, in_specs=(pspecs,),
                                  out_specs=sspecs))(params)
    # One bucket of 1230 floats padded to L * W * lcm(W, 8) = 64: 1280, each device keeping 1/L.
    n_local = 1280 // local
    assert [e.shape for e in jax.tree.leaves(state.worker_error)] == [(nodes * local, n_local)]
    assert [e.shape for e in jax.tree.leaves(state.server_error)] == [
        (nodes * local, n_local // nodes)]
    grads = jax.tree.map(lambda p: rng.normal(size=(nodes, local) + p.shape).astype(np.float32),
                         params)

    def step(g, state, params):
        _, state = opt.compressed_update(jax.tree.map(lambda x: x[0, 0], g), state, params)
        return state
    new = jax.jit(jax.shard_map(step, mesh=mesh2, in_specs=(P("data", "fast"), sspecs, pspecs),
                                out_specs=sspecs))(grads, state, params)

    # Reference: momentum from zero is (1 - b1) g; flatten each device's [a, b, pad].
    n = n_local * local
    flat = np.concatenate([grads["a"].reshape(nodes, local, -1),
                           grads["b"].reshape(nodes, local, -1)], axis=2) * (1 - 0.9)
    flat = np.concatenate([flat, np.zeros((nodes, local, n - flat.shape[2]))], axis=2)
    node_mean = flat.mean(1)                                    # [nodes, n]
    out = np.empty(n)
    for l in range(local):                                      # slice l: devices (*, l)
        sl = node_mean[:, l * n_local:(l + 1) * n_local]
        out[l * n_local:(l + 1) * n_local], _, _ = np_compressed_allreduce(
            sl, np.zeros_like(sl), np.zeros((nodes, n_local // nodes)))
    want = {"a": out[:1200].reshape(40, 30), "b": out[1200:1230]}
    # Same magnitudes and float32-vs-float64 argument as the flat test.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=0, atol=1e-6), new.mu, want)


def test_tensor_parallel_integration():
    """The integration the train step should copy, on a (data 4, tensor 2) mesh: per-worker
    gradients from a GSPMD model in a shard_map manual over "data" only, then the optimizer in a
    shard_map manual over every axis. Leaves split over "tensor" get their own error group, so
    each tensor shard is compressed with its own scale and replicated leaves stay replicated."""
    w_dp = 4
    mesh2 = jax.make_mesh((w_dp, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(9)
    params = {"w1": rng.normal(size=(16, 32)).astype(np.float32),
              "w2": (0.2 * rng.normal(size=(32, 16))).astype(np.float32),
              "scale": (1 + 0.1 * rng.normal(size=(16,))).astype(np.float32)}
    pspecs = {"w1": P(None, "tensor"), "w2": P("tensor", None), "scale": P()}
    params = jax.device_put(params, jax.tree.map(lambda sp: NamedSharding(mesh2, sp), pspecs))
    x = rng.normal(size=(w_dp * 8, 16)).astype(np.float32)
    y = rng.normal(size=(w_dp * 8, 16)).astype(np.float32)
    opt = onebit_adam(1e-2, freeze_step=0, bucket_bytes=1 << 20)
    sspecs = opt.state_specs(pspecs)

    def loss_fn(p, x, y):
        return jnp.mean(((jax.nn.relu(x @ p["w1"]) @ p["w2"]) * p["scale"] - y) ** 2)

    def local_grads(p, x, y):  # manual over "data"; "tensor" stays with GSPMD
        g = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), x, y)
        return jax.tree.map(lambda a: a[None], g)                 # [1, ...] -> global [W, ...]

    gspecs = jax.tree.map(lambda sp: P("data", *sp), pspecs)

    def update(g, s, p):  # manual over every axis: buckets hold this device's shards
        u, s = opt.compressed_update(jax.tree.map(lambda a: a[0], g), s, p)
        return optax.apply_updates(p, u), s, g

    @jax.jit
    def train_step(p, s, x, y):
        g = jax.shard_map(local_grads, mesh=mesh2, in_specs=(P(), P("data"), P("data")),
                          out_specs=P("data"), axis_names={"data"})(p, x, y)
        return jax.shard_map(update, mesh=mesh2, in_specs=(gspecs, sspecs, pspecs),
                             out_specs=(pspecs, sspecs, gspecs))(g, s, p)

    state = jax.jit(jax.shard_map(opt.init, mesh=mesh2, in_specs=(pspecs,),
                                  out_specs=sspecs))(params)
    # Tensor group: one bucket of this device's w1 and w2 shards, 256 + 256 (a multiple of
    # W*lcm(W,8) = 32), global [W, 2 shards * 512]; replicated group: scale, 16 -> 32.
    assert jax.tree.map(lambda e: e.shape, state.worker_error) == {
        "replicated": ((w_dp, 32),), "tensor": ((w_dp, 2 * 512),)}
    _, new, grads = train_step(params, state, x, y)

    # The gradients are each worker's own, not their mean.
    want = jax.vmap(jax.grad(loss_fn), (None, 0, 0))(
        jax.device_get(params), x.reshape(w_dp, 8, 16), y.reshape(w_dp, 8, 16))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(grads), want)
    # Reference: per tensor shard t, the workers' [w1[:, t], w2[t, :]] (then scale alone) go
    # through the DeepSpeed all-reduce; from zero state the momentum is (1 - b1) g.
    g = jax.tree.map(lambda a: 0.1 * np.asarray(a, np.float64), jax.device_get(grads))
    mu = jax.device_get(new.mu)
    for t in range(2):
        cols = slice(16 * t, 16 * t + 16)
        bucket = np.concatenate([g["w1"][:, :, cols].reshape(w_dp, -1),
                                 g["w2"][:, cols, :].reshape(w_dp, -1)], axis=1)
        mean, _, _ = np_compressed_allreduce(bucket, np.zeros_like(bucket),
                                             np.zeros((w_dp, 512 // w_dp)))
        # Magnitudes ~0.1: a float32 ulp is ~1e-8; a wrong shard or scale is off by ~0.1.
        np.testing.assert_allclose(mu["w1"][:, cols], mean[:256].reshape(16, 16), atol=1e-7)
        np.testing.assert_allclose(mu["w2"][cols, :], mean[256:].reshape(16, 16), atol=1e-7)
    bucket = np.concatenate([g["scale"], np.zeros((w_dp, 16))], axis=1)
    mean, _, _ = np_compressed_allreduce(bucket, np.zeros_like(bucket), np.zeros((w_dp, 8)))
    np.testing.assert_allclose(mu["scale"], mean[:16], atol=1e-7)

    # Only the model's own tensor-parallel all-reduces (groups of 2) remain; the data-parallel
    # traffic is the 1-bit all-to-all / all-gathers over groups of 4.
    ops = mx.hlo_collectives(train_step.lower(params, state, x, y).compile().as_text(), W)
    assert {c.group_size for c in ops if c.op == "all-reduce"} <= {2}
    assert {c.group_size for c in ops if c.op in ("all-to-all", "all-gather")} == {w_dp}
    # ... and the data-parallel ones are exactly those: groups {0, 2, 4, 6}, {1, 3, 5, 7}.
    shape = tuple(mesh2.devices.shape)
    assert {c.op for c in ops if c.spans(shape, 0)} == {"all-to-all", "all-gather"}


def test_compressed_step_sends_under_a_thirtieth(mesh):
    rng = np.random.default_rng(6)
    params = {"w1": rng.normal(size=(256, 128)).astype(np.float32),
              "b1": rng.normal(size=(128,)).astype(np.float32),
              "w2": rng.normal(size=(128, 256)).astype(np.float32),
              "embed": rng.normal(size=(512, 64)).astype(np.float32)}
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    opt = onebit_adam(1e-3, freeze_step=0, bucket_bytes=160 * 1024)
    grads = jax.tree.map(lambda p: np.broadcast_to(p, (W,) + p.shape), params)
    state = init_fn(mesh, opt, params)(params)
    assert len(jax.tree.leaves(state.worker_error)) == 3     # the buckets are really several

    def sent(compressed):
        hlo = step_fn(mesh, opt, compressed, params).lower(grads, state, params).compile()
        ops = mx.hlo_collectives(hlo.as_text(), W)
        return ops, sum(c.sent_bytes() for c in ops)

    warm_ops, warm_sent = sent(False)
    comp_ops, comp_sent = sent(True)
    allreduce = 2 * (W - 1) / W * grad_bytes
    # The parser sees the warmup's float all-reduce of the whole gradient (else the bound below
    # would be vacuous) ...
    assert sum(c.result_bytes for c in warm_ops if c.op == "all-reduce") >= grad_bytes
    assert warm_sent == pytest.approx(allreduce, rel=1e-3)
    # ... and the compressed step keeps no all-reduce at all, only packed signs and scales.
    assert not [c for c in comp_ops if c.op == "all-reduce"], comp_ops
    assert {c.op for c in comp_ops} == {"all-to-all", "all-gather"}
    ratio = comp_sent / allreduce
    print(f"compressed step sends {comp_sent:.0f} B vs {allreduce:.0f} B for a float32 all-reduce"
          f" (ratio 1/{1 / ratio:.1f})")
    assert ratio <= 1 / 30
