"""1-bit Adam: the compressed all-reduce and the optimizer steps against a NumPy transcription
of DeepSpeed's algorithm, error feedback, the warmup against optax, the hierarchical and the
tensor-parallel layouts, the bytes on the wire in the compiled HLO, and convergence on a noisy
least-squares problem. Then inside dsjax's training: the warmup against the AdamW train step,
the bytes of the compiled compressed train step, h100_fp8.py:smoke, and resuming (same mesh:
bit-exact; another data size: errors reset). 8 simulated CPU devices; NumPy references float64."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from conftest import FLAT_MESH, ROOT, TINY_FLAGS, random_batch, read_records, run_launch
from dsjax import batching, sharding
from dsjax import config as config_lib
from dsjax import metrics as mx
from dsjax.metrics import gemms
from dsjax.checkpoint import Checkpointer
from dsjax.train import build_trainer
from dsjax.train import resume as resume_lib
from dsjax.optim.compressed_allreduce import compressed_allreduce, pad_multiple, plan_buckets
from dsjax.optim.onebit import OneBitAdam, onebit_adam

W = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), axis_types=(AxisType.Auto,))


# ------------------------------------------------------------------ NumPy reference (DeepSpeed)

def np_compressed_allreduce(x, worker_error, server_error):
    """DeepSpeed's NcclBackend.compressed_allreduce for all workers at once, in float64.

    x, worker_error: [W, n]; server_error: [W, n/W]. Returns (mean [n], worker_error, server_error).
    """
    x = x.astype(np.float64) + worker_error
    w, n = x.shape
    chunk = n // w
    scale = np.linalg.norm(x, axis=1) / np.sqrt(n)                    # [W]
    bits = x >= 0
    new_worker_error = x - scale[:, None] * np.where(bits, 1.0, -1.0)
    # Phase 1: worker j receives the packed bits of chunk j from every worker i.
    packed = np.packbits(bits.reshape(w, w, chunk), axis=2)            # [from i, chunk j, c/8]
    server_x = np.empty((w, chunk))
    for j in range(w):
        signs = np.unpackbits(packed[:, j], axis=1) * 2.0 - 1.0        # [from i, chunk]
        server_x[j] = (signs * (scale[:, None] / w)).sum(0) + server_error[j]
    server_scale = np.linalg.norm(server_x, axis=1) / np.sqrt(chunk)   # [W]
    server_bits = server_x >= 0
    new_server_error = server_x - server_scale[:, None] * np.where(server_bits, 1.0, -1.0)
    # Phase 2: everyone gathers every server's packed chunk and scale.
    gathered = np.packbits(server_bits, axis=1)
    mean = ((np.unpackbits(gathered, axis=1) * 2.0 - 1.0) * server_scale[:, None]).reshape(n)
    return mean, new_worker_error, new_server_error


def _allreduce_fn(mesh):
    """jit(shard_map(compressed_allreduce)) on stacked [W, ...] inputs; mean stacked per worker."""
    def f(x, we, se):
        mean, we, se = compressed_allreduce(x[0], we[0], se[0], "data")
        return mean[None], we[None], se[None]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 3,
                                 out_specs=(P("data"),) * 3))


def test_compressed_allreduce_matches_deepspeed_numpy(mesh):
    rng = np.random.default_rng(1)
    n = pad_multiple(W) * 37                         # 2368: chunks of 296 = 37 bytes of bits
    x = rng.normal(size=(W, n)).astype(np.float32) + rng.normal(size=(1, n)).astype(np.float32)
    we = (0.3 * rng.normal(size=(W, n))).astype(np.float32)
    se = (0.3 * rng.normal(size=(W, n // W))).astype(np.float32)
    mean, new_we, new_se = jax.device_get(_allreduce_fn(mesh)(x, we, se))
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


# ---------------------------------------------------------------------------------- optimizer

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


def _params(rng):
    return {"dense": {"kernel": rng.normal(size=(24, 40)).astype(np.float32),
                      "bias": rng.normal(size=(40,)).astype(np.float32)},
            "norm": {"scale": (1 + 0.1 * rng.normal(size=(24,))).astype(np.float32)},
            "embed": rng.normal(size=(50, 24)).astype(np.float32)}


def _dyadic_grads(rng, params, steps):
    """[steps, W, ...] per-worker gradients that are multiples of 2^-10 below 1 in magnitude: any
    sum of 8 of them, and the mean, is exact in float32 in any order, so the pmean inside
    shard_map and np.mean agree bit for bit and the comparison isolates the Adam arithmetic."""
    return jax.tree.map(
        lambda p: (rng.integers(-1023, 1024, size=(steps, W) + p.shape) / 1024.0
                   ).astype(np.float32), params)


def _step_fn(mesh, opt: OneBitAdam, compressed: bool, params_like):
    """jit(shard_map(update + apply)) taking per-worker gradients stacked on a leading W axis."""
    pspecs = jax.tree.map(lambda _: P(), params_like)
    sspecs = opt.state_specs(pspecs)
    update = opt.compressed_update if compressed else opt.warmup_update

    def step(grads_w, state, params):
        local = jax.tree.map(lambda g: g[0], grads_w)
        updates, state = update(local, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), sspecs, pspecs),
                                 out_specs=(pspecs, sspecs)))


def _init_fn(mesh, opt: OneBitAdam, params_like):
    pspecs = jax.tree.map(lambda _: P(), params_like)
    return jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(pspecs,),
                                 out_specs=opt.state_specs(pspecs)))


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_warmup_equals_optax_adam_exactly(mesh, weight_decay):
    rng = np.random.default_rng(3)
    params = _params(rng)
    steps = 5
    grads = _dyadic_grads(rng, params, steps)
    schedule = optax.linear_schedule(1e-2, 2e-3, steps)  # pins the step count the lr sees
    mask = lambda p: {k: jax.tree.map(lambda _: k != "norm", v) for k, v in p.items()}
    opt = onebit_adam(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=weight_decay,
                      weight_decay_mask=mask, freeze_step=steps, bias_correction=True)
    ref = (optax.adamw(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=weight_decay, mask=mask)
           if weight_decay else optax.adam(schedule, b1=0.8, b2=0.95, eps=1e-6))

    step = _step_fn(mesh, opt, False, params)
    state = _init_fn(mesh, opt, params)(params)
    ref_step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
        *ref.update(g, s, p)))
    p_ours, p_ref, s_ref = params, params, ref.init(params)
    for t in range(steps):
        assert not opt.uses_compression(int(state.count))
        g_t = jax.tree.map(lambda g: g[t], grads)
        p_ours, state = step(g_t, state, p_ours)
        p_ref, s_ref = ref_step(jax.tree.map(lambda g: g.mean(0), g_t), s_ref, p_ref)
    assert opt.uses_compression(int(state.count))
    # Same float32 operations in the same order on the same (exact) mean gradient. Not bit for
    # bit: XLA's CPU backend contracts `a*b + c*d` into one fused multiply-add and which product
    # it fuses depends on the surrounding fusion (checked: ours is fma(b2, v, (1-b2) g^2), optax's
    # fma(1-b2, g^2, b2 v)), so v drifts by an ulp per step (measured <= 4 after 5 steps). It
    # reaches the params at a relative ~1e-6 of an update (~lr): far below 1e-6 absolute, which is
    # 2 ulp of the largest parameter (|p| < 4). A wrong step count in the lr schedule or the bias
    # correction, or a missing pmean, moves params by >= 1e-4.
    ulps = lambda a, b: np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=8)
    jax.tree.map(ulps, state.mu, s_ref[0].mu)
    jax.tree.map(ulps, state.nu, s_ref[0].nu)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p_ours, p_ref)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p_ours),
                                                              jax.tree.leaves(params)))
    assert moved > 1e-3  # the comparison is not between two unchanged copies


@pytest.mark.parametrize("compress, refresh, tuned", [
    ("momentum", 0, False), ("update", 0, False), ("update", 2, False), ("update", 2, True),
    ("update", 0, True)])
def test_deepspeed_steps_match_numpy(mesh, compress, refresh, tuned):
    """Warmup then compressed steps, bias_correction=False and one bucket per tensor: DeepSpeed's
    OnebitAdam.step transcribed in NumPy, with the reference all-reduce above. "update" sends
    m_i / (sqrt(v) + eps) through the same all-reduce and multiplies the mean back. `refresh`
    (refresh_every): every 2nd step after the freeze is an exact Adam step that updates v, with
    the error buffers carried across it. `tuned`: dsjax's refresh_catchup (a refresh folds g^2
    in with weight 1 - b2^2) and update_bound (what the workers send and the update clipped to
    Adam's bound after the freeze); the gradients grow 20x at the freeze so that the clip
    bites."""
    rng = np.random.default_rng(4)
    params = _params(rng)
    warm, comp = 3, 3 if not refresh else 5
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.01
    boost = np.where(np.arange(warm + comp) < warm, 1.0, 20.0 if tuned else 1.0)
    grads = jax.tree.map(lambda p: (rng.normal(size=(warm + comp, W) + p.shape) * boost.reshape(
        (-1,) + (1,) * (p.ndim + 1))).astype(np.float32), params)
    opt = onebit_adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, freeze_step=warm,
                      bucket_bytes=0, compress=compress, refresh_every=refresh,
                      refresh_catchup=tuned, update_bound=tuned)
    bound = opt.adam_bound() if tuned else np.inf  # 10.5 for (0.9, 0.99)
    clipped = 0
    phases = [opt.uses_compression(t) for t in range(warm + comp)]
    assert phases == [False] * warm + ([True] * comp if not refresh else
                                       [True, False, True, False, True])
    warm_step = _step_fn(mesh, opt, False, params)
    comp_step = _step_fn(mesh, opt, True, params)
    state = _init_fn(mesh, opt, params)(params)
    worker_errors = jax.tree.leaves(state.worker_error)       # one bucket per tensor
    assert [e.shape for e in worker_errors] == [
        (W, -(-x.size // 64) * 64) for x in jax.tree.leaves(params)]

    leaves, treedef = jax.tree.flatten(params)
    p_np = [x.astype(np.float64) for x in leaves]
    m_np = [np.zeros_like(x) for x in p_np]
    v_np = [np.zeros_like(x) for x in p_np]
    we_np = [np.zeros((W, e.shape[1])) for e in worker_errors]
    se_np = [np.zeros((W, e.shape[1])) for e in jax.tree.leaves(state.server_error)]
    g_leaves = jax.tree.leaves(grads)
    p_ours = params
    for t in range(warm + comp):
        compressed = opt.uses_compression(int(state.count))
        assert compressed == phases[t]
        g_t = jax.tree.map(lambda g: g[t], grads)
        p_ours, state = (comp_step if compressed else warm_step)(g_t, state, p_ours)
        for i, g in enumerate(g_leaves):
            g_w = g[t].astype(np.float64)                               # [W, ...]
            if not compressed:
                m_np[i] = b1 * m_np[i] + (1 - b1) * g_w.mean(0)
                w2 = b2 ** refresh if tuned and t >= warm else b2
                v_np[i] = w2 * v_np[i] + (1 - w2) * g_w.mean(0) ** 2
            else:
                denom = (np.sqrt(v_np[i]) + eps) if compress == "update" else 1.0
                local = ((b1 * m_np[i] + (1 - b1) * g_w) / denom).reshape(W, -1)
                clipped += int(np.sum(np.abs(local) > bound))
                local = np.clip(local, -bound, bound)
                pad = we_np[i].shape[1] - local.shape[1]
                local = np.concatenate([local, np.zeros((W, pad))], axis=1)
                mean, we_np[i], se_np[i] = np_compressed_allreduce(local, we_np[i], se_np[i])
                m_np[i] = mean[:m_np[i].size].reshape(m_np[i].shape) * denom
            upd = m_np[i] / (np.sqrt(v_np[i]) + eps)
            if t >= warm:
                clipped += int(np.sum(np.abs(upd) > bound))
                upd = np.clip(upd, -bound, bound)
            p_np[i] = p_np[i] - lr * (upd + wd * p_np[i])
    assert (clipped > 0) == tuned, clipped  # the bound bit (only) where it is on
    ours = jax.tree.leaves(p_ours)
    # float32 against float64: params (|p| < 4, ulp 4.8e-7) within a few ulps (measured 4.8e-7);
    # momenta and errors (O(1), ulp ~1e-7) likewise (measured 9e-8). A wrong sign, bucket or
    # an unfrozen v moves a parameter by ~lr = 1e-2 and a momentum by ~0.1.
    # `tuned`: the boosted steps take |p| to ~7 (ulp 4.8e-7 up to 4, 9.5e-7 above), so a few ulps
    # of the value (measured 3.6e-6 at 3.6); a wrong clip or refresh weight moves ~lr * bound.
    for got, want in zip(ours, p_np):
        np.testing.assert_allclose(got, want, rtol=1e-6 if tuned else 0, atol=2e-6)
    for got, want in zip(jax.tree.leaves(state.mu), m_np):  # `tuned`: |m| up to ~7, as above
        np.testing.assert_allclose(got, want, rtol=1e-6 if tuned else 0, atol=1e-6)
    for got, want in zip(jax.tree.leaves(state.worker_error), we_np):
        # "update": the errors are of m / sqrt(v), O(10) here; the same ulps relative to them.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, np.abs(want).max()))
    # v stayed frozen through the compressed steps (and moved in the refresh steps, as in the
    # reference). Its float32 error: the mean of 8 O(1)
    # gradients is off by ~1e-7 absolute, moving v by <= 2 (1 - b2) |g| 1e-7 ~ 1e-9 per step;
    # an unfrozen v would move by (1 - b2) g^2 ~ 1e-2.
    # `tuned`: 20x gradients make the mean's float32 error 20x larger (~2.4e-6 absolute), so
    # v's up to 2 (1 - b2^2) |g| 2.4e-6 ~ 1e-7 (measured 2.6e-8).
    for got, want in zip(jax.tree.leaves(state.nu), v_np):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 if tuned else 1e-9)


def test_update_space_keeps_small_v_coordinates_near_exact_adam(mesh):
    """One tensor, two kinds of coordinate: half with gradients ~1 and half ~1e-3 (an embedding's
    frequent and rare rows), so their frozen v differ by 1e6. Compressing the momentum gives
    every coordinate the same magnitude (the RMS, set by the large half), which over the small
    half's sqrt(v) is a step ~1000x its Adam step; compressing m / sqrt(v) does not. Both are
    compared with frozen-v Adam on the exact mean momentum, in NumPy."""
    rng = np.random.default_rng(21)
    params = {"embed": np.zeros((16, 24), np.float32)}
    warm, comp, lr, b1, b2, eps = 4, 6, 1e-2, 0.9, 0.95, 1e-8
    size = np.where(np.arange(16) < 8, 1.0, 1e-3)[:, None].astype(np.float32)
    grads = (rng.normal(size=(warm + comp, W, 16, 24)) * size).astype(np.float32)
    g_mean = grads.astype(np.float64).mean(1)
    # Exact Adam without bias correction (live v in warmup, then v frozen), params from 0.
    p_exact, m, v = np.zeros((16, 24)), np.zeros((16, 24)), np.zeros((16, 24))
    for t in range(warm + comp):
        m = b1 * m + (1 - b1) * g_mean[t]
        if t < warm:
            v = b2 * v + (1 - b2) * g_mean[t] ** 2
        p_exact -= lr * m / (np.sqrt(v) + eps)
    error = {}
    for compress in ("momentum", "update"):
        opt = onebit_adam(lr, b1=b1, b2=b2, eps=eps, freeze_step=warm, bucket_bytes=0,
                          compress=compress)
        steps = {c: _step_fn(mesh, opt, c, params) for c in (False, True)}
        state, p = _init_fn(mesh, opt, params)(params), params
        for t in range(warm + comp):
            p, state = steps[opt.uses_compression(int(state.count))]({"embed": grads[t]}, state, p)
        # per row half: the largest distance from exact Adam, in units of one Adam step (lr)
        dist = np.abs(np.asarray(p["embed"], np.float64) - p_exact) / lr
        error[compress] = (dist[:8].max(), dist[8:].max())
    # Momentum space: the small half is off by hundreds of Adam steps (measured 528; the large
    # half 6.9). Update space: both halves within some ten steps (measured 9.7 and 12.9): what
    # 1-bit compression with error feedback costs any coordinate after 6 steps.
    assert error["momentum"][1] > 100, error
    assert error["update"][1] < error["momentum"][1] / 20, error
    assert max(error["update"]) < 30, error


@pytest.mark.parametrize("b1, b2", [(0.9, 0.95), (0.9, 0.999), (0.8, 0.99)])
def test_exact_adam_never_reaches_the_update_bound(b1, b2):
    """update_bound clips m / sqrt(v) after the freeze to `adam_bound()`; exact Adam must never
    get there, or the clip would change Adam itself. Heavy-tailed (Cauchy) gradients and the
    worst constant-sign decaying sequences g_t = r^t (which come closest) over 2000 steps."""
    opt = onebit_adam(1e-3, b1=b1, b2=b2, update_bound=True)
    rng = np.random.default_rng(3)
    g = np.concatenate([rng.standard_cauchy((2000, 500)),
                        np.linspace(0.5, 0.9999, 100)[None, :] ** np.arange(2000)[:, None]], 1)
    m, v, worst = np.zeros(g.shape[1]), np.zeros(g.shape[1]), 0.0
    for g_t in g:
        m, v = b1 * m + (1 - b1) * g_t, b2 * v + (1 - b2) * g_t ** 2
        worst = max(worst, float(np.max(np.abs(m) / np.sqrt(np.maximum(v, 1e-300)))))
    # The tight bound (Cauchy-Schwarz) is (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)); the
    # geometric sequences reach ~94% of it, and adam_bound is above it.
    tight = (1 - b1) / np.sqrt((1 - b2) * (1 - b1 ** 2 / b2))
    assert 0.9 * tight < worst <= tight <= opt.adam_bound(), (worst, tight, opt.adam_bound())
    with pytest.raises(ValueError, match="b1 < sqrt"):
        onebit_adam(1e-3, b1=0.99, b2=0.95, update_bound=True)


def test_coordinates_without_gradient_stay_put(mesh):
    """An embedding row no token used before the freeze has v = 0 exactly; its 1-bit momentum
    is still +-scale, which over sqrt(0) + eps would move it by lr * scale / eps (~1e5 here) per
    step. Compressed steps leave it where it is; every other row moves."""
    rng = np.random.default_rng(12)
    params = {"embed": rng.normal(size=(16, 24)).astype(np.float32)}
    grads = rng.normal(size=(4, W, 16, 24)).astype(np.float32)
    grads[:, :, 3] = 0.0                                  # row 3: no gradient, ever
    opt = onebit_adam(1e-2, freeze_step=2, bucket_bytes=1 << 20)
    state = _init_fn(mesh, opt, params)(params)
    steps = {c: _step_fn(mesh, opt, c, params) for c in (False, True)}
    p = params
    for t in range(4):
        p, state = steps[opt.uses_compression(int(state.count))]({"embed": grads[t]}, state, p)
    assert opt.uses_compression(2) and int(state.count) == 4
    assert np.abs(np.asarray(state.mu["embed"][3])).max() > 0     # the estimate is not 0 ...
    np.testing.assert_array_equal(p["embed"][3], params["embed"][3])  # ... but nothing moved
    moved = np.abs(np.asarray(p["embed"]) - params["embed"]).max(axis=1)
    assert (np.delete(moved, 3) > 1e-3).all()


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


def test_misuse_is_named(mesh):
    """Already-reduced gradients (no pcast) and params split over "data" fail with a message."""
    opt = onebit_adam(1e-3, freeze_step=0)
    params = {"w": np.ones((8, 8), np.float32)}
    state = _init_fn(mesh, opt, params)(params)

    def step(p, s):  # gradient of a replicated param without pcast: jax.grad psums it
        g = jax.grad(lambda p, x: jnp.sum(p["w"] * x))(p, jax.lax.axis_index("data") * 1.0)
        return opt.compressed_update(g, s, p)[1]
    sspecs = opt.state_specs({"w": P()})
    with pytest.raises(ValueError, match=r"gradient \['w'\] is not per-worker.*pcast"):
        jax.shard_map(step, mesh=mesh, in_specs=(P(), sspecs), out_specs=sspecs)(params, state)
    with pytest.raises(ValueError, match="replicated.*fsdp"):
        opt.state_specs({"w": P("data", None)})


# ---------------------------------------------------------------------- bytes in compiled HLO

def test_compressed_step_sends_under_a_thirtieth(mesh):
    rng = np.random.default_rng(6)
    params = {"w1": rng.normal(size=(256, 128)).astype(np.float32),
              "b1": rng.normal(size=(128,)).astype(np.float32),
              "w2": rng.normal(size=(128, 256)).astype(np.float32),
              "embed": rng.normal(size=(512, 64)).astype(np.float32)}
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    opt = onebit_adam(1e-3, freeze_step=0, bucket_bytes=160 * 1024)
    grads = jax.tree.map(lambda p: np.broadcast_to(p, (W,) + p.shape), params)
    state = _init_fn(mesh, opt, params)(params)
    assert len(jax.tree.leaves(state.worker_error)) == 3     # the buckets are really several

    def sent(compressed):
        hlo = _step_fn(mesh, opt, compressed, params).lower(grads, state, params).compile()
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


# ------------------------------------------------------------------------------- end to end

def test_noisy_least_squares_converges_like_adam(mesh):
    """Online least squares, each worker drawing its own fresh minibatches: 1-bit Adam (exact
    warmup, then compressed) ends as close to the solution as exact Adam after as many steps."""
    d_in, d_out, rows, noise = 32, 16, 16, 0.5
    rng = np.random.default_rng(8)
    w_true = rng.normal(size=(d_in, d_out)).astype(np.float32)
    b_true = rng.normal(size=(d_out,)).astype(np.float32)
    params = {"w": (0.1 * rng.normal(size=(d_in, d_out))).astype(np.float32),
              "b": np.zeros((d_out,), np.float32)}
    pspecs = jax.tree.map(lambda _: P(), params)
    # Freeze once the loss has flattened (paper §3: v must have stabilised). Freezing at step
    # 100, still ~10x above the floor, measured 1.2-3.8x Adam's final excess over 5 seeds: the
    # sign-compressed momentum moves each coordinate by at most lr * scale / sqrt(v) per step.
    warm, total, chunk, tail = 200, 500, 50, 100
    # DeepSpeed's defaults (no bias correction, b2=0.999); w and b share one bucket.
    opt = onebit_adam(1e-2, freeze_step=warm, bucket_bytes=1 << 20)
    sspecs = opt.state_specs(pspecs)

    def make_steps(update):
        """`chunk` steps of one phase in one program; the host picks the phase per chunk."""
        def steps(params, state, key):
            def body(carry, t):
                params, state = carry
                k = jax.random.fold_in(jax.random.fold_in(key, t), jax.lax.axis_index("data"))
                x = jax.random.normal(k, (rows, d_in))
                y = x @ w_true + b_true + noise * jax.random.normal(jax.random.fold_in(k, 1),
                                                                    (rows, d_out))
                # Replicated params made device-varying so that jax.grad gives this worker's
                # own gradient instead of inserting an all-reduce (DESIGN invariant 3).
                local = jax.lax.pcast(params, "data", to="varying")
                grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(local)
                updates, state = update(grads, state, params)
                params = optax.apply_updates(params, updates)
                # Expected loss minus the noise floor noise^2, per output.
                excess = (jnp.sum((params["w"] - w_true) ** 2)
                          + jnp.sum((params["b"] - b_true) ** 2)) / d_out
                return (params, state), excess
            (params, state), excess = jax.lax.scan(body, (params, state), jnp.arange(chunk))
            return params, state, excess
        return jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=(pspecs, sspecs, P()),
                                     out_specs=(pspecs, sspecs, P())))

    warm_steps, comp_steps = make_steps(opt.warmup_update), make_steps(opt.compressed_update)

    def train(one_bit):
        p, s, excess = params, _init_fn(mesh, opt, params)(params), []
        for c in range(total // chunk):
            use = one_bit and opt.uses_compression(int(s.count))
            p, s, e = (comp_steps if use else warm_steps)(p, s, jax.random.key(c))
            excess.append(np.asarray(e))
        assert int(s.count) == total
        # Mean over the last `tail` steps: the constant-lr iterate jitters around its floor.
        return float(np.concatenate(excess)[-tail:].mean())

    initial = float((np.sum((params["w"] - w_true) ** 2) + np.sum(b_true ** 2)) / d_out)
    adam, onebit = train(False), train(True)
    print(f"excess loss: initial {initial:.3f}, Adam {adam:.5f}, 1-bit Adam {onebit:.5f}")
    # Both fit: the excess falls > 1000x from ~34 to the lr-noise floor (~0.0045).
    assert adam < 1e-3 * initial and onebit < 1e-3 * initial
    # Same floor: 0.97-1.04x Adam's over 6 seeds. A mis-scaled or mis-routed reduction
    # diverges; the algorithm's details are pinned by test_deepspeed_steps_match_numpy.
    assert onebit < 1.25 * adam


# ------------------------------------------------------------------ in dsjax's train step

def _tiny_cfg(config="configs/cpu_tiny.py", **overrides):
    flags = {**TINY_FLAGS, **FLAT_MESH, "train.steps": 10, "optim.name": "onebit_adam",
             **overrides}
    return config_lib.load(os.path.join(ROOT, config), flags)


def test_trainer_warmup_is_adamw_then_compressed_sends_a_thirtieth():
    """Through `build_trainer` on mesh (data 4, tensor 2): the warmup steps are dsjax's AdamW
    `train_step` (same schedule, clipping, weight-decay mask; bias correction on, as optax), the
    host switches to the compressed program at freeze_step, the loss keeps falling on a repeated
    batch, and the compiled compressed step sends <= 1/30 of a float32 all-reduce over `data`."""
    freeze = 3
    # clip_norm 0.5 < the gradient norms here (~0.95 at init): clipping is part of the comparison.
    common = {"optim.freeze_step": freeze, "optim.bias_correction": True, "optim.clip_norm": 0.5}
    trainer = build_trainer(_tiny_cfg(**common))
    adamw = build_trainer(_tiny_cfg(**common, **{"optim.name": "adamw"}))
    batch = random_batch(np.random.default_rng(11), 8, 32)
    state, ref = trainer.init(), adamw.init()
    first = jax.device_get(state.params)
    metrics, ref_metrics = [], []
    for _ in range(freeze):
        state, m = trainer.step(state, trainer.device_batch(batch))
        ref, m_ref = adamw.step(ref, adamw.device_batch(batch))
        metrics.append(jax.device_get(m))
        ref_metrics.append(jax.device_get(m_ref))
    ours, theirs = jax.device_get(state.params), jax.device_get(ref.params)
    # The same float32 operations on the same mean gradient, reduced in another order (a pmean of
    # per-worker gradients vs GSPMD's partial sums). Each of the 3 steps rounds p - update once,
    # so a reordered gradient can leave a param 1 ulp off per step: 4 ulps of max(|p0|, |p|)
    # (params <= ~1.01: 4.8e-7). Adam's m/sqrt(v) takes the gradients' ~1e-6 relative
    # reordering error into the update: 3 steps x lr 3e-3 x 1e-6 ~ 1e-8 more. Measured:
    # bit-identical on a 2-core AVX-512 EPYC, 1 ulp (1.0056920 vs 1.0056919) in 1 of 128
    # elements on an AVX-512/AMX Xeon. A wrong lr step, missing clip, bias correction or
    # weight-decay mask moves a parameter by >= 1e-5.
    for a, b, p0 in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), jax.tree.leaves(first)):
        ulp = np.spacing(np.maximum(np.abs(p0), np.abs(b)).astype(np.float32))
        np.testing.assert_array_less(np.abs(a - b), 4 * ulp + 1e-8)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ours),
                                                              jax.tree.leaves(first)))
    assert moved > 1e-3  # not two unchanged copies
    for m, m_ref in zip(metrics, ref_metrics):
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-6)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-6)
        assert m["tokens"] == m_ref["tokens"] and int(m["onebit_compressed"]) == 0
    assert max(float(m["grad_norm"]) for m in metrics) > 0.5  # the clip was active

    for _ in range(4):
        state, m = trainer.step(state, trainer.device_batch(batch))
        metrics.append(jax.device_get(m))
    assert [int(m["onebit_compressed"]) for m in metrics] == [0] * freeze + [1] * 4
    losses = [float(m["loss"]) for m in metrics]
    assert all(np.isfinite(losses)) and int(state.step) == freeze + 4
    assert losses[-1] < losses[freeze] < losses[0], losses

    # Bytes on the wire, from the compiled programs; 'data' is mesh axis 0.
    with sharding.activate(trainer.mesh, trainer.rules):
        hlo = {name: fn.lower(state, trainer.device_batch(batch)).compile().as_text()
               for name, fn in (("warmup", trainer.jitted(0)),
                                ("compressed", trainer.jitted(1)))}
    ops = {k: mx.axis_collectives(v, trainer.mesh, "data") for k, v in hlo.items()}
    sent = {k: sum(c.sent_bytes() for c in v) for k, v in ops.items()}
    grad_bytes = 4 * sum(math.prod(p.sharding.shard_shape(p.shape))
                         for p in jax.tree.leaves(state.params))
    allreduce = 2 * (4 - 1) / 4 * grad_bytes
    # The warmup all-reduces the whole float32 gradient over `data` (so the parser sees it) ...
    assert sent["warmup"] == pytest.approx(allreduce, rel=1e-3)
    # ... the compressed step keeps only scalar all-reduces (loss, token count, norm) ...
    assert max(c.result_bytes for c in ops["compressed"] if c.op == "all-reduce") <= 16
    # ... and sends packed signs and scales: 1/32 plus per-bucket scales and padding, one bucket
    # per tensor (measured 1/31.3).
    print(f"data-parallel bytes per device: warmup {sent['warmup']:.0f}, compressed "
          f"{sent['compressed']:.0f} (1/{sent['warmup'] / sent['compressed']:.1f})")
    assert sent["compressed"] <= allreduce / 30


def test_mtp_loss_is_trained_and_logged_in_both_phases():
    """An MTP model (DeepSeek-V3 §2.2) under 1-bit Adam: each worker adds its rows' weighted MTP
    loss to its objective, so the warmup steps equal AdamW's `train_step` (whose objective has
    it) and the metrics carry `mtp_loss` in both phases. Without the MTP term the MTP modules'
    params would not move at all and the comparison would fail."""
    common = {"optim.freeze_step": 2, "optim.bias_correction": True,
              "model.num_mtp_layers": 1, "model.mtp_loss_weight": 0.5}
    trainer = build_trainer(_tiny_cfg(**common))
    adamw = build_trainer(_tiny_cfg(**common, **{"optim.name": "adamw"}))
    # One document per row: every worker holds as many MTP targets as the others, so the
    # token-weighted mean of the workers' MTP losses is the batch's.
    batch = random_batch(np.random.default_rng(12), 8, 32, docs_per_row=1)
    state, ref = trainer.init(), adamw.init()
    first = jax.device_get(state.params)
    for _ in range(2):
        state, m = trainer.step(state, trainer.device_batch(batch))
        ref, m_ref = adamw.step(ref, adamw.device_batch(batch))
        np.testing.assert_allclose(np.asarray(m["mtp_loss"]), np.asarray(m_ref["mtp_loss"]),
                                   rtol=1e-5)
        assert float(m["aux_loss"]) == pytest.approx(float(m_ref["aux_loss"]), rel=1e-5)
    ours, theirs = jax.device_get(state.params), jax.device_get(ref.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), ours, theirs)
    moved = np.abs(ours["mtp_eh_proj"] - first["mtp_eh_proj"]).max()
    assert moved > 1e-3  # lr 3e-3 Adam steps on the MTP projection
    state, m = trainer.step(state, trainer.device_batch(batch))
    assert int(m["onebit_compressed"]) == 1 and np.all(np.isfinite(np.asarray(m["mtp_loss"])))


def _snapshot(state):
    """What the refresh test compares, on the host (the step donates the state it is given)."""
    opt = state.opt_state
    return jax.device_get({"step": state.step, "params": state.params, "count": opt.count,
                           "mu": opt.mu, "nu": opt.nu, "worker_error": opt.worker_error,
                           "server_error": opt.server_error})


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_refresh_step_runs_exact_and_resumes_bit_exactly_across_it(tmp_path):
    """optim.refresh_every (on by default) through `build_trainer`: freeze after 2 steps, every
    3rd step after it exact. The refresh step (step 5) runs the exact program, moves v (which the
    compressed steps around it leave frozen) and leaves the error buffers, which the compressed
    step after it uses, as they were. A run checkpointed after step 4 and resumed (the next step
    the refresh) continues bit for bit like the uninterrupted one: loss, params, optimizer state
    and error buffers after the refresh and the compressed steps after it."""
    cfg = _tiny_cfg(**{"optim.freeze_step": 2, "optim.refresh_every": 3})
    trainer = build_trainer(cfg)
    steps, interrupt, refresh = 7, 4, 5  # refresh: the 1-based step that is exact
    assert [trainer.phase_at(s) for s in range(steps)] == [0, 0, 1, 1, 0, 1, 1]
    rng = np.random.default_rng(13)
    batches = [random_batch(rng, 8, 32) for _ in range(steps)]

    state = trainer.init()
    snaps, metrics = [_snapshot(state)], []
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False,
                                log=lambda _: None, train_layout=resume_lib.train_layout(cfg))
    for t in range(steps):
        state, m = trainer.step(state, trainer.device_batch(batches[t]))
        metrics.append(jax.device_get(m))
        snaps.append(_snapshot(state))
        if t + 1 == interrupt:
            resume_lib.save(checkpointer, interrupt, state, {"cursor": interrupt}, trainer.mesh,
                            cfg.model)
    assert [int(m["onebit_compressed"]) for m in metrics] == [0, 0, 1, 1, 0, 1, 1]
    assert all(np.isfinite(float(m["loss"])) for m in metrics)
    assert [int(s["count"]) for s in snaps] == list(range(steps + 1))
    # snaps[k]: after k steps. v moves in the exact steps (1, 2 and the refresh 5) only; the
    # error buffers move in the compressed steps (3, 4, 6, 7) only, so the refresh keeps them
    # for step 6; m moves in every step, the params in every step but the first (the
    # schedule's lr starts at 0).
    for k in range(1, steps + 1):
        before, after = snaps[k - 1], snaps[k]
        exact = k <= 2 or k == refresh
        assert _same(before["nu"], after["nu"]) != exact, k
        assert _same(before["worker_error"], after["worker_error"]) == exact, k
        assert _same(before["server_error"], after["server_error"]) == exact, k
        assert not _same(before["mu"], after["mu"]), k
        assert _same(before["params"], after["params"]) == (k == 1), k

    # Interrupted after step 4 (a fresh initialised state, as a new process has), resumed.
    resumed, start, data_state = resume_lib.resume(checkpointer, trainer.init(), trainer.mesh,
                                                   cfg.model, False, lambda _: None)
    checkpointer.close()
    assert (start, data_state) == (interrupt, {"cursor": interrupt})
    assert _same(_snapshot(resumed), snaps[interrupt])
    for t in range(interrupt, steps):
        resumed, m = trainer.step(resumed, trainer.device_batch(batches[t]))
        m = jax.device_get(m)
        # Same programs, same inputs on the same CPU: equal to the last bit.
        assert int(m["onebit_compressed"]) == int(metrics[t]["onebit_compressed"])
        assert float(m["loss"]) == float(metrics[t]["loss"]), t + 1
        assert float(m["grad_norm"]) == float(metrics[t]["grad_norm"]), t + 1
    final = _snapshot(resumed)
    jax.tree.map(np.testing.assert_array_equal, final, snaps[steps])


# The h100_fp8.py:smoke model (run_launch starts from the tiny one), freezing after 2 of 6 steps,
# every 3rd step after the freeze exact (so step 5 refreshes v), and checkpointing at 4, in the
# compressed phase. The batch grows 8 -> 16 from step 5 (the config's patience and cooldown).
# Sampling and the CPU peak measurement are off: neither is under test here, both cost compile
# time.
SMOKE = {"model.hidden_size": 128, "model.num_kv_heads": 4, "model.mlp_dim": 256,
         "data.seq_len": 64, "train.steps": 6, "optim.freeze_step": 2,
         "optim.refresh_every": 3, "checkpoint.every": 4, "train.sample_tokens": 0,
         "metrics.peak_flops_per_device": 1e12}


def _resume_from_step_4(source, workdir, overrides=None):
    shutil.copytree(os.path.join(source, "checkpoints", "4"),
                    os.path.join(workdir, "checkpoints", "4"))
    proc = run_launch(workdir, {**SMOKE, **(overrides or {})}, config="configs/h100_fp8.py:smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 4" in proc.stdout
    return proc, read_records(workdir)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One uninterrupted run through launch.py (the resume tests compare against it)."""
    workdir = str(tmp_path_factory.mktemp("onebit") / "smoke")
    proc = run_launch(workdir, SMOKE, config="configs/h100_fp8.py:smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


@pytest.mark.slow
def test_h100_fp8_smoke_trains_with_everything_on(smoke_run):
    workdir, proc = smoke_run
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert (cfg["optim"]["name"], cfg["train"]["compute_dtype"], cfg["fp8"]["recipe"],
            cfg["remat"]["policy"], cfg["mesh"]["fsdp"]) == (
                "onebit_adam", "fp8", "current", "attention_core", False)
    assert (cfg["mesh"]["data"], cfg["mesh"]["tensor"], cfg["mesh"]["pipeline"]) == (2, 2, 2)
    assert cfg["pipeline"]["schedule"] == "1f1b" and cfg["batch"]["policy"] == "adaptive"
    records = read_records(workdir)
    # Warmup (steps 1-2), compressed (3-4), the refresh (5: exact, after freeze_step 2, as
    # optim.refresh_every 3 puts it), compressed again (6).
    assert cfg["optim"]["freeze_step"] == 2 and cfg["optim"]["refresh_every"] == 3
    assert [r["onebit_compressed"] for r in records] == [0, 0, 1, 1, 0, 1]
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)), losses
    # From ~6.24 (uniform over 512) to ~4 in 6 steps at lr 3e-3; the compressed steps keep it
    # falling (measured 6.24, 6.24, 5.70, 5.12, 4.38, 3.98).
    assert losses[-1] < losses[2] < losses[0] - 0.3, losses
    assert "held-out: loss" in proc.stdout

    # The adaptive batch size changed once, 8 -> 16 rows from step 5, with accumulation.
    assert [(r["batch_size"], r["accum_steps"]) for r in records] == [(8, 2)] * 4 + [(16, 4)] * 2
    change = [c for r in records for c in r.get("batch_changes") or []]
    assert [(c["old"], c["new"], c["step"]) for c in change] == [(8, 16, 4)], change
    assert "batch size 8 -> 16 from step 5" in proc.stdout
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert [(c["old"], c["new"]) for c in summary["batch_changes"]] == [(8, 16)]
    # Every (phase, shape) the run compiled ran: the refresh at 16 rows is the exact program.
    used = {(b["phase"], b["accum_steps"]) for b in summary["batch_shapes"] if b["used"]}
    assert used == {(0, 2), (1, 2), (0, 4), (1, 4)}, summary["batch_shapes"]

    # fp8 dots in every step program the run used, rebuilt from the config it wrote: each fp8
    # projection (fp8.matmuls) is an e4m3 x e4m3 dot forward and two e5m2 x e4m3 dots backward
    # (dgrad, wgrad) in the one stage body each pipeline stage runs; the 1f1b schedule
    # recomputes the forward, so that count is a lower bound.
    raw = {k: v for k, v in cfg.items() if k != "xla_flags"}
    trainer = build_trainer(config_lib.from_config_dict(raw))
    projections = len(trainer.cfg.fp8.matmuls.split(","))
    assert projections == 7
    for phase, accum in sorted(used):
        shape = batching.Shape(4 * accum, accum, 2)  # 4 rows per micro-step
        with sharding.activate(trainer.mesh, trainer.rules):
            text = trainer.programs.jitted(phase, shape).lower(
                trainer.abstract_state(), batching.abstract_batch(
                    trainer.batch_shardings, shape, trainer.cfg.data.seq_len)).as_text()
        dots = gemms.dot_general_dtypes(text)
        forward = dots.count(("f8E4M3FN", "f8E4M3FN", "f32"))
        backward = dots.count(("f8E5M2", "f8E4M3FN", "f32"))
        print(f"phase {phase}, accumulation {accum}: {forward} fp8 forward dots, {backward} "
              f"backward, {len(dots) - forward - backward} others")
        assert forward >= projections and backward == 2 * projections, (phase, accum, dots)
        assert all(not d[0].startswith("f8") and not d[1].startswith("f8")
                   for d in dots if d not in (("f8E4M3FN", "f8E4M3FN", "f32"),
                                              ("f8E5M2", "f8E4M3FN", "f32"))), dots


@pytest.mark.slow
def test_resume_in_the_compressed_phase_is_bit_exact(smoke_run, tmp_path):
    workdir, _ = smoke_run
    proc, records = _resume_from_step_4(workdir, str(tmp_path / "resumed"))
    assert "warning" not in proc.stdout
    # Same mesh, same CPU, same data position, and the error buffers restored: step 5's update
    # uses them, so step 6's loss would differ if they had been reset.
    assert [r["step"] for r in records] == [5, 6]
    assert [r["loss"] for r in records] == [r["loss"] for r in read_records(workdir)[4:]]


@pytest.mark.slow
def test_resume_on_another_data_size_resets_the_errors(smoke_run, tmp_path):
    workdir, _ = smoke_run
    resumed = str(tmp_path / "data8")
    proc, records = _resume_from_step_4(workdir, resumed, {"mesh.data": 4, "mesh.tensor": 1})
    assert ("warning: checkpoint step 4 was written with mesh.data 2, this run has mesh.data 4; "
            "1-bit Adam's error buffers restart from zero") in proc.stdout, proc.stdout
    assert [r["step"] for r in records] == [5, 6]
    assert all(np.isfinite(r["loss"]) for r in records)
    # Step 5's loss comes from the restored params. Not to float32 rounding: fp8 current scaling
    # takes each worker's amax, and 8 workers of 1 row quantise otherwise than 4 of 2 (measured
    # 4.6708 vs 4.6716); wrong params would be off by > 0.5 (step 4's loss is 5.52).
    assert records[0]["loss"] == pytest.approx(read_records(workdir)[4]["loss"], abs=0.05)
    # The run went on and checkpointed its own layout: 8 workers' rows.
    checkpointer = Checkpointer(os.path.join(resumed, "checkpoints"))
    layout = checkpointer.step_meta(6)["errors_layout"]
    checkpointer.close()
    assert layout["mesh"]["data"] == 4 and all(shape[0] == 4 for shape in layout["shapes"])
