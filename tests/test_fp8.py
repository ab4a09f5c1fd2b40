"""dsjax.fp8: exactness against the float32 emulation and an independent NumPy/ml_dtypes
reference of the recipes, error against unquantised float32, the rowwise recipe, delayed-scaling
state, what XLA is handed (StableHLO, dot counts derived from the config), and a Linen
integration. Every RNG is seeded."""

import collections
import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import in_default_xla
from dsjax import fp8
from dsjax.metrics import gemms
from dsjax.metrics.hlo import computations_in_loops

# The projections of dsjax/model/layers.py, with distinct dim sizes so that a wrong transpose in
# the backward bookkeeping is a shape error or a large numerical error, never hidden by symmetry.
EQUATIONS = {
    "BSD,DHK->BSHK": ((2, 8, 48), (48, 4, 16)),
    "BSD,DNK->BSNK": ((2, 8, 48), (48, 2, 16)),
    "BSHK,HKD->BSD": ((2, 8, 4, 16), (4, 16, 48)),
    "BSD,DF->BSF": ((2, 8, 48), (48, 80)),
    "BSF,FD->BSD": ((2, 8, 80), (80, 48)),
}


def normal(rng, shape, std=1.0, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape) * std, dtype)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fp8_vjp(eq, x, w, dy, **kw):
    """(y, dx, dw) through the custom VJP, jitted like a train step would."""
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum(eq, x, w, **kw), x, w)
        return (y,) + vjp(dy)
    return jax.jit(run)(x, w, dy)


def reference_vjp(eq, x, w, dy):
    y, vjp = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x, w)
    return (y,) + vjp(dy)


def stale_meta(x, w, dy, factors=(1.5, 0.8, 2.0)):
    """Delayed-scaling state as if earlier steps had seen amaxes `factors` times this step's
    (0.8 on w: some of w saturates, as delayed scaling does when a tensor grows)."""
    seen = jnp.stack([fp8.amax(x), fp8.amax(w), fp8.amax(dy)]) * jnp.asarray(factors)
    return fp8.update_meta(fp8.init_meta(16), seen)


# ---------------------------------------------------------------------------------------------
# An independent reference, written from the recipes' definitions (docs/fp8.md) in NumPy with
# ml_dtypes' fp8 casts: it shares no code with dsjax.fp8 (`emulate_einsum` reuses its
# quantisation, scales and transposes, so those are checked against themselves above).

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def ref_current_scale(amax, fmt):
    """s = amax / fp8_max (1 where amax is 0), in float32. Rounded as dsjax documents it
    (`current_scale`: times the float32 reciprocal, one rounding the same under jit and
    eagerly): two roundings, within two ulps of the quotient (asserted)."""
    amax = np.asarray(amax, np.float32)
    fp8_max = FORMATS[fmt][1]
    s = np.where(amax > 0, amax * np.float32(1.0 / fp8_max), np.float32(1.0)).astype(np.float32)
    quotient = np.where(amax > 0, amax.astype(np.float64) / fp8_max, 1.0)
    assert np.all(np.abs(s - quotient) <= 2 * np.spacing(s)), (s, quotient)
    return s


def ref_delayed_scale(history, fmt, margin=0.0):
    """s = max(amax history) / fp8_max * 2**margin; 0 (no history yet) for an all-zero one."""
    top = np.max(np.asarray(history, np.float32), axis=-1)
    s = (top * np.float32(1.0 / FORMATS[fmt][1]) * np.float32(2.0 ** margin)).astype(np.float32)
    return np.where(top > 0, s, np.float32(0.0))


def ref_quantize(a, s, fmt):
    """a / s in float32, saturated to the format's range, then cast (round to nearest even)."""
    dtype, fp8_max = FORMATS[fmt]
    return np.clip(np.asarray(a, np.float32) / s, -fp8_max, fp8_max).astype(dtype)


def ref_gemm(a, la, b, lb, lo, fmt_a, fmt_b, recipe, scales=(None, None)):
    """One fp8 GEMM `la,lb->lo` of float32 operands: quantised with `scales` (per-tensor, as
    given; None: current scaling) or, rowwise, one current scale per index of each operand's
    dims this GEMM does not contract. Returns (float64 value of the float32 result that exact
    arithmetic would give, float64 bound on its float32 accumulation error)."""
    contracted = set(la) & set(lb) - set(lo)
    quantised = []
    for t, lt, fmt, s in ((a, la, fmt_a, scales[0]), (b, lb, fmt_b, scales[1])):
        t = np.asarray(t, np.float32)
        if recipe == "rowwise":
            axes = tuple(i for i, c in enumerate(lt) if c in contracted)
            s = ref_current_scale(np.max(np.abs(t), axis=axes, keepdims=True), fmt)
        elif s is None:
            s = ref_current_scale(np.max(np.abs(t)), fmt)
        q = ref_quantize(t, s, fmt).astype(np.float64)
        kept = "".join(c for c in lt if c not in contracted)
        quantised.append((q, np.squeeze(s, axis=tuple(i for i, c in enumerate(lt)
                                                      if c in contracted)) if s.ndim else s,
                          kept))
    (qa, sa, ka), (qb, sb, kb) = quantised
    # Products of fp8 values are exact in float64; their sums are too for e4m3 x e4m3 (a 51-bit
    # span at most), and within 2**-53 relative for e5m2 x e4m3, far inside the bound below.
    exact = np.einsum(f"{la},{lb}->{lo}", qa, qb)
    magnitude = np.einsum(f"{la},{lb}->{lo}", np.abs(qa), np.abs(qb))
    k = int(np.prod([a.shape[la.index(c)] for c in contracted]))
    # The dequantisation factor, as a float32 product (s_a s_b), per output element.
    dims = lambda t, lt, kept: [t.shape[lt.index(c)] for c in kept]
    factor = np.einsum(f"{ka},{kb}->{lo}",
                       np.broadcast_to(np.asarray(sa, np.float32), dims(a, la, ka)),
                       np.broadcast_to(np.asarray(sb, np.float32), dims(b, lb, kb)))
    factor = factor.astype(np.float64)
    value = exact * factor
    # Any float32 summation order of k terms errs by at most k * 2**-24 * sum |terms|; the
    # rescale and the output cast round once more (2**-24 relative each).
    bound = k * 2.0 ** -24 * magnitude * factor + 2.0 ** -23 * np.abs(value)
    return value, bound


def reference_fp8_vjp(eq, x, w, dy, recipe, meta=None, margin=0.0):
    """(y, dx, dw) of an fp8 einsum by the recipe: forward e4m3 x e4m3, dx = g . w and
    dw = g . x with g in e5m2 and x, w in e4m3; each as (value, error bound). "delayed": the
    scales must be the definition's of meta's history (with `margin`)."""
    xs, rest = eq.split(",")
    ws, ys = rest.split("->")
    if recipe == "delayed":
        # meta's scales, where they exist (checked against their history); else current.
        scale = np.asarray(meta.scale, np.float32)
        history = np.asarray(meta.amax_history, np.float32)
        np.testing.assert_array_equal(scale, np.concatenate(
            [ref_delayed_scale(history[:2], "e4m3", margin),
             ref_delayed_scale(history[2:], "e5m2", margin)]))
        fallback = [ref_current_scale(np.max(np.abs(np.asarray(t, np.float32))), f)
                    for t, f in ((x, "e4m3"), (w, "e4m3"), (dy, "e5m2"))]
        sx, sw, sg = (s if s > 0 else f for s, f in zip(scale, fallback))
    else:
        sx = sw = sg = None
    y = ref_gemm(x, xs, w, ws, ys, "e4m3", "e4m3", recipe, (sx, sw))
    dx = ref_gemm(dy, ys, w, ws, xs, "e5m2", "e4m3", recipe, (sg, sw))
    dw = ref_gemm(x, xs, dy, ys, ws, "e4m3", "e5m2", recipe, (sx, sg))
    return y, dx, dw


def assert_matches_reference(eq, got, reference, extra_rel=0.0):
    """Every element of fp8_einsum's (y, dx, dw) within the reference's float32 accumulation
    bound (plus `extra_rel` of its value: a narrower output dtype's rounding)."""
    for name, g, (value, bound) in zip(("y", "dx", "dw"), got, reference):
        g = np.asarray(g, np.float64)
        assert g.shape == value.shape, (eq, name, g.shape, value.shape)
        err = np.abs(g - value)
        worst = np.max(err / (bound + extra_rel * np.abs(value) + 1e-300))
        assert worst <= 1.0, (eq, name, worst, np.max(err))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_matches_float32_emulation_exactly(recipe):
    # On CPU XLA upcasts fp8 operands to float32 and runs the float32 GEMM; products of fp8
    # values are exact in float32 and the emulation uses the same dimension numbers (same
    # summation order), so any difference is a bug in the fp8 path, not rounding.
    rng = np.random.default_rng(100)
    cases = {}
    for eq, (xs, ws) in EQUATIONS.items():
        x, w = normal(rng, xs), normal(rng, ws, 0.05)
        dy = normal(rng, jax.eval_shape(lambda: jnp.einsum(eq, x, w)).shape, 1e-3)
        meta = stale_meta(x, w, dy) if recipe == "delayed" else None
        cases[eq] = (x, w, dy, meta)

    @jax.jit  # one program for all equations: one compile
    def both(cases):
        out = {}
        for eq, (x, w, dy, meta) in cases.items():
            y, vjp = jax.vjp(lambda x, w: fp8.fp8_einsum(eq, x, w, recipe=recipe, meta=meta),
                             x, w)
            out[eq] = ((y,) + vjp(dy),
                       fp8.emulate_einsum(eq, x, w, dy, recipe=recipe, meta=meta))
        return out

    for eq, (got, want) in both(cases).items():
        for g, e in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=eq)
        # ...and neither is trivially the unquantised product.
        x, w = cases[eq][:2]
        assert rel_err(got[0], jnp.einsum(eq, x, w)) > 1e-3, eq
        # Both agree with the independent reference: its scales, formats and transposes.
        x, w, dy, meta = cases[eq]
        assert_matches_reference(eq, got, reference_fp8_vjp(eq, x, w, dy, recipe, meta))


def test_bfloat16_operands_and_output():
    rng = np.random.default_rng(101)
    eq = "BSD,DF->BSF"
    x, w = normal(rng, (2, 8, 48), dtype=jnp.bfloat16), normal(rng, (48, 80), 0.05)
    dy = normal(rng, (2, 8, 80), dtype=jnp.bfloat16)
    got = fp8_vjp(eq, x, w, dy, out_dtype=jnp.bfloat16)
    # Eagerly, not jitted: the scales must not depend on how XLA fuses them.
    want = fp8.emulate_einsum(eq, x, w, dy, out_dtype=jnp.bfloat16)
    assert [a.dtype for a in got] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    # The reference on the same (bfloat16-exact) values. y and dx come out of a GEMM that
    # writes bfloat16 and a bfloat16 multiply by the rounded scale: three roundings of unit
    # 2**-8 (on dw, float32, that slack is unused).
    assert_matches_reference(eq, got, reference_fp8_vjp(eq, x, w, dy, "current"),
                             extra_rel=3 * 2.0 ** -8)


def test_delayed_scales_come_from_the_history_with_a_per_row_fallback():
    """Two committed steps of history with a margin; the gradient row never saw an amax, so it
    falls back to current scaling while x and w use their history (w saturates)."""
    rng = np.random.default_rng(111)
    eq = "BSD,DHK->BSHK"
    x, w = normal(rng, (2, 8, 48)), normal(rng, (48, 4, 16), 0.05)
    dy = normal(rng, (2, 8, 4, 16), 1e-3)
    seen = np.asarray([1.5 * np.max(np.abs(x)), 0.4 * np.max(np.abs(w)), 0.0], np.float32)
    meta = fp8.update_meta(fp8.init_meta(16), jnp.asarray(0.5 * seen), margin=1.0)
    meta = fp8.update_meta(meta, jnp.asarray(seen), margin=1.0)
    np.testing.assert_array_equal(np.asarray(meta.amax_history)[:, :3],
                                  np.stack([seen, 0.5 * seen, 0 * seen], axis=1))
    # The state's scales are the definition's: 2**margin max(history) / fp8_max, 0 for g.
    history = np.asarray(meta.amax_history)
    np.testing.assert_array_equal(np.asarray(meta.scale), np.concatenate(
        [ref_delayed_scale(history[:2], "e4m3", 1.0), ref_delayed_scale(history[2:], "e5m2", 1.0)]))
    assert float(meta.scale[fp8.G]) == 0
    assert np.max(np.abs(np.asarray(w))) / float(meta.scale[fp8.W]) > 448  # w saturates
    got = fp8_vjp(eq, x, w, dy, recipe="delayed", meta=meta)
    assert_matches_reference(eq, got, reference_fp8_vjp(eq, x, w, dy, "delayed", meta, 1.0))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_error_against_unquantised_float32(recipe):
    # e4m3 keeps 3 mantissa bits (relative rounding error <= 2**-4, RMS ~2.5% across a binade),
    # e5m2 keeps 2 (<= 2**-3, RMS ~5%). Forward: two e4m3 operands, ~3.5-4% Frobenius error on
    # N(0, 1) 256x256 inputs -> bound 6e-2. Gradients: e5m2 x e4m3, ~5.5-6% -> bound 8e-2.
    rng = np.random.default_rng(102)
    x, w, dy = (normal(rng, (256, 256)) for _ in range(3))
    meta = None
    if recipe == "delayed":  # history from an earlier step with fresh N(0, 1) tensors
        meta = stale_meta(*(normal(rng, (256, 256)) for _ in range(3)), factors=(1, 1, 1))
    got = fp8_vjp("MK,KN->MN", x, w, dy, recipe=recipe, meta=meta)
    want = reference_vjp("MK,KN->MN", x, w, dy)
    errs = [rel_err(g, e) for g, e in zip(got, want)]
    assert errs[0] < 6e-2, errs
    assert max(errs[1:]) < 8e-2, errs


def test_rowwise_beats_per_tensor_on_an_outlier_column():
    # One weight output column 1e5x larger. e4m3 spans 2**-9..448 (about 2e5), so per-tensor
    # scaling pushes every other column into the subnormals (1e4x costs a little, 1e5x ~35%
    # error); per-column scales (rowwise on w's free dim) do not notice.
    rng = np.random.default_rng(103)
    x, w = normal(rng, (256, 256)), normal(rng, (256, 256))
    col = int(rng.integers(256))
    w = w.at[:, col].multiply(1e5)
    keep = np.arange(256) != col
    want = np.asarray(x @ w)[:, keep]
    errs = {r: rel_err(np.asarray(fp8.fp8_einsum("MK,KN->MN", x, w, recipe=r))[:, keep], want)
            for r in ("current", "rowwise")}
    assert errs["rowwise"] < 6e-2, errs  # the same bound as for outlier-free inputs
    assert errs["current"] > 3 * errs["rowwise"], errs


# ---------------------------------------------------------------------------------------------
# Delayed-scaling state.

def test_history_rolls_newest_first_and_scale_follows_its_max():
    rng = np.random.default_rng(104)
    obs = rng.uniform(0.5, 8.0, (5, 3)).astype(np.float32)
    meta = fp8.init_meta(4)
    for o in obs:
        meta = fp8.update_meta(meta, jnp.asarray(o))
    np.testing.assert_array_equal(np.asarray(meta.amax_history), obs[::-1][:4].T)
    limits = np.array([448.0, 448.0, 57344.0], np.float32)
    # The oldest observation has left the history: the scale ignores it. rtol 2.4e-7: the scale
    # is a product with a rounded reciprocal, two float32 roundings against numpy's one.
    np.testing.assert_allclose(meta.scale, obs[1:].max(0) / limits, rtol=2.4e-7)
    np.testing.assert_array_equal(meta.amax, obs[-1])
    doubled = fp8.update_meta(meta, jnp.asarray(obs[-1]), margin=1.0)
    np.testing.assert_allclose(doubled.scale, 2 * obs[2:].max(0) / limits, rtol=2.4e-7)


@pytest.mark.parametrize("bad", [np.inf, np.nan, -np.inf])
def test_non_finite_amax_keeps_the_old_scale(bad):
    rng = np.random.default_rng(105)
    meta = fp8.update_meta(fp8.init_meta(8), jnp.asarray(rng.uniform(1, 4, 3), jnp.float32))
    obs = jnp.asarray([bad, *rng.uniform(1, 4, 2)], jnp.float32)
    new = fp8.update_meta(meta, obs)
    np.testing.assert_array_equal(new.scale[0], meta.scale[0])
    np.testing.assert_array_equal(new.amax_history[0], meta.amax_history[0])
    np.testing.assert_array_equal(new.amax_history[1:, 0], obs[1:])  # other rows move on


def test_first_step_falls_back_to_current_scaling():
    rng = np.random.default_rng(106)
    eq = "BSD,DF->BSF"
    x, w = normal(rng, (2, 8, 48)), normal(rng, (48, 80), 0.05)
    dy = normal(rng, (2, 8, 80), 1e-6)  # small gradients: all below e5m2's 2**-16 ~ 1.5e-5
    fresh = fp8.init_meta(16)
    got = fp8_vjp(eq, x, w, dy, recipe="delayed", meta=fresh)
    current = fp8_vjp(eq, x, w, dy, recipe="current")
    for g, c in zip(got, current):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
    # Without the guard (a scale of 1, the usual initial value) e5m2 flushes them all to zero.
    unguarded = fresh.replace(scale=jnp.ones((3,), jnp.float32))
    _, dx, dw = fp8_vjp(eq, x, w, dy, recipe="delayed", meta=unguarded)
    assert not np.any(np.asarray(dx)) and not np.any(np.asarray(dw))


def _twice(x, w, c1, c2):
    """Uses one matmul's meta twice in a step, like a layer repeated across microbatches."""
    def loss(meta):
        y1 = fp8.fp8_einsum("MK,KN->MN", x, w, recipe="delayed", meta=meta)
        y2 = fp8.fp8_einsum("MK,KN->MN", 3 * x, w, recipe="delayed", meta=meta)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)
    return loss


def test_repeated_use_combines_amax_by_maximum():
    rng = np.random.default_rng(107)
    x, w, c1, c2 = (normal(rng, (32, 48)), normal(rng, (48, 16)), normal(rng, (32, 16)),
                    normal(rng, (32, 16), 5.0))
    meta = fp8.update_meta(fp8.init_meta(8), jnp.asarray([1.0, 1.0, 1.0]))
    loss = _twice(x, w, c1, c2)
    want = [3 * fp8.amax(x), fp8.amax(w), jnp.maximum(fp8.amax(c1), fp8.amax(c2))]
    grads = jax.jit(jax.grad(lambda m: loss(fp8.with_max_grad(m))))(meta)
    np.testing.assert_array_equal(grads.amax, jnp.stack(want))
    assert grads.amax.dtype == jnp.float32
    # Plain autodiff would add the two uses' amaxes: the reason for `with_max_grad`.
    summed = jax.jit(jax.grad(loss))(meta).amax
    np.testing.assert_allclose(summed[0], 4 * fp8.amax(x), rtol=1e-6)
    # Across separate grad calls (microbatches), `combine` takes the maximum.
    other = grads.replace(amax=grads.amax * jnp.asarray([0.5, 2.0, 1.0]))
    np.testing.assert_array_equal(fp8.combine(grads, other).amax,
                                  grads.amax * jnp.asarray([1.0, 2.0, 1.0]))
    committed = fp8.commit(meta, grads)
    np.testing.assert_array_equal(committed.amax_history[:, 0], grads.amax)


class _Block(nn.Module):
    """One fp8 projection with delayed scaling, shaped for `nn.scan`."""
    features: int

    @nn.compact
    def __call__(self, x_BSD, _):
        w_DF = self.param("w", nn.initializers.normal(0.05), (x_BSD.shape[-1], self.features))
        meta = fp8.meta_variable(self, "proj", history_len=8)
        y = fp8.fp8_einsum("BSD,DF->BSF", x_BSD, w_DF, recipe="delayed", meta=meta)
        return x_BSD + y, None


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x_BSD):
        stack = nn.scan(_Block, variable_axes={"params": 0, fp8.META_COLLECTION: 0},
                        split_rngs={"params": True}, in_axes=nn.broadcast, length=2)
        return stack(x_BSD.shape[-1], name="layers")(x_BSD, None)[0]


def test_linen_meta_collection_round_trip():
    """The integration the train step uses: meta in its own collection, scanned per layer,
    the layer applied twice per step; grads w.r.t. params and meta; commit the meta."""
    rng = np.random.default_rng(108)
    model = _Stack()
    x = normal(rng, (2, 8, 32))
    variables = model.init(jax.random.key(int(rng.integers(1 << 30))), x)
    params, meta = variables["params"], variables[fp8.META_COLLECTION]
    assert meta["layers"]["proj"].amax_history.shape == (2, 3, 8)  # layers, rows, history

    def loss_fn(params, meta, x):
        v = {"params": params, fp8.META_COLLECTION: fp8.with_max_grad(meta)}
        return jnp.sum(model.apply(v, x) ** 2) + jnp.sum(model.apply(v, 0.5 * x) ** 2)

    @jax.jit
    def step(params, meta, x):
        grads, meta_grads = jax.grad(loss_fn, argnums=(0, 1))(params, meta, x)
        return grads, fp8.commit(meta, meta_grads)

    grads, meta1 = step(params, meta, x)
    seen = meta1["layers"]["proj"]
    # Layer 0 sees x (amax max(x, 0.5x) = amax(x)); its weight amax is its own.
    np.testing.assert_array_equal(seen.amax[0, fp8.X], fp8.amax(x))
    np.testing.assert_array_equal(seen.amax[:, fp8.W],
                                  fp8.amax(params["layers"]["w"], axis=(1, 2)))
    assert np.all(np.asarray(seen.scale) > 0) and np.all(np.isfinite(np.asarray(seen.scale)))
    np.testing.assert_array_equal(seen.amax_history[..., 1:], 0.0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    _, meta2 = step(params, meta1, x)
    np.testing.assert_array_equal(meta2["layers"]["proj"].amax_history[..., 1],
                                  seen.amax_history[..., 0])


def test_sharding_does_not_change_the_math():
    # Per-tensor amax of a sharded tensor is a global max (GSPMD inserts the all-reduce), so
    # the forward is bit-identical; dw contracts over the sharded batch, whose partial sums are
    # added in another order: float32 rounding, 1e-6 relative.
    rng = np.random.default_rng(109)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    eq = "BSD,DF->BSF"
    x, w, dy = normal(rng, (8, 4, 48)), normal(rng, (48, 80), 0.05), normal(rng, (8, 4, 80))
    single = fp8_vjp(eq, x, w, dy)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    sharded = fp8_vjp(eq, put(x, P("data")), put(w, P(None, "tensor")),
                      put(dy, P("data", None, "tensor")))
    np.testing.assert_array_equal(np.asarray(sharded[0]), np.asarray(single[0]))
    for s, g in zip(sharded[1:], single[1:]):
        np.testing.assert_allclose(np.asarray(s), np.asarray(g), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# What XLA is handed.

def test_stablehlo_feeds_fp8_operands_to_dot_general():
    rng = np.random.default_rng(110)
    x, w = normal(rng, (2, 8, 48), dtype=jnp.bfloat16), normal(rng, (48, 80))
    c = normal(rng, (2, 8, 80))

    def loss(x, w):
        y = fp8.fp8_einsum("BSD,DF->BSF", x, w, out_dtype=jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) * c)

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = gemms.dot_general_dtypes(text)
    # Each GEMM writes its consumer's dtype: the bfloat16 activation and its gradient, and a
    # float32 weight gradient (it is accumulated).
    assert sorted(dots) == sorted([("f8E4M3FN", "f8E4M3FN", "bf16"),  # forward
                                   ("f8E5M2", "f8E4M3FN", "bf16"),  # dx = g . w
                                   ("f8E5M2", "f8E4M3FN", "f32")]), dots  # dw = g . x
    fwd = gemms.dot_general_dtypes(jax.jit(loss).lower(x, w).as_text())
    assert fwd == [("f8E4M3FN", "f8E4M3FN", "bf16")], fwd


def test_dot_general_dtypes_reads_plain_dots_too():
    text = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8), jnp.bfloat16),
                                             jnp.ones((8, 2), jnp.bfloat16)).as_text()
    assert gemms.dot_general_dtypes(text) == [("bf16", "bf16", "bf16")]


def test_bad_calls_name_the_problem():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="needs `meta`"):
        fp8.fp8_einsum("MK,KN->MN", x, w, recipe="delayed")
    with pytest.raises(ValueError, match="stateless"):
        fp8.fp8_einsum("MK,KN->MN", x, w, meta=fp8.init_meta(4))
    with pytest.raises(ValueError, match="batch dims"):
        fp8.fp8_einsum("BMK,BKN->BMN", jnp.ones((2, 2, 4)), jnp.ones((2, 4, 3)))
    with pytest.raises(ValueError, match="not one of"):
        fp8.fp8_einsum("MK,KN->MN", x, w, recipe="blockwise")


# ---------------------------------------------------------------------------------------------
# The precision policy inside the real train step.

def _train_cfg(**overrides):
    import os
    from conftest import FLAT_MESH, ROOT, TINY_FLAGS
    from dsjax import config as config_lib
    # Unpipelined: fp8.keep_*_layers and float16 loss scaling do not compose with 1f1b stages.
    base = {**TINY_FLAGS, **FLAT_MESH, "model.num_layers": 4, "train.compute_dtype": "fp8",
            "fp8.other_dtype": "float32"}
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**base, **overrides})


def _expected_dots(cfg):
    """(fp8 dots, float32 dots) of one train step's StableHLO, from the config alone. Layers
    keep_first_layers <= i < num_layers - keep_last_layers run `fp8.matmuls` in fp8; the
    decoder scans each contiguous run of same-kind layers with one body (remat "none": one layer
    per body), so a run's dots appear once. Per body: each projection (q, k, v, o, gate, up,
    down) is 3 dots, forward and two gradients (fp8: e4m3 x e4m3, then e5m2 x e4m3 for dx and
    dw), and the attention core 6 (the xla path at this length: QK^T and PV, forward and two
    gradients each); the chunked output head adds 4 float32 dots (forward, the backward's
    recomputed logits, dx, dW); the embedding is a gather."""
    assert cfg.remat.policy == "none", cfg.remat.policy  # recomputation would repeat forwards
    assert cfg.model.loss_chunk > 0 and cfg.data.seq_len < 1024  # chunked head; auto: xla
    L, f = cfg.model.num_layers, cfg.fp8
    n = len([m for m in f.matmuls.split(",") if m.strip()])
    if f.layers:  # a map: one word per layer, "8" per fp8 projection
        per_layer = [word.count("8") for word in f.layers.split(",")]
    else:
        per_layer = [n if f.keep_first_layers <= i < L - f.keep_last_layers else 0
                     for i in range(L)]
    # Contiguous layers that make the same choice share a body (a map's words, else the count).
    keys = f.layers.split(",") if f.layers else per_layer
    fp8_dots, high = 0, 4
    for (_, count), _ in itertools.groupby(zip(keys, per_layer)):
        fp8_dots += 3 * count
        high += 6 + 3 * (7 - count)
    return fp8_dots, high


@pytest.mark.parametrize("overrides, counts", [
    ({}, (21, 10)),  # one scanned body of 4 fp8 layers
    ({"fp8.matmuls": "gate,up,down", "fp8.keep_first_layers": 1}, (9, 49)),  # 1 float32 + 3
    ({"fp8.keep_last_layers": 2, "fp8.recipe": "delayed"}, (21, 37)),  # 2 fp8 + 2 float32
    # A per-projection map (fp8.layers): 4 distinct layers, 5 + 5 + 0 + 7 fp8 projections.
    ({"fp8.layers": "8888oo8,88o88f8,ooooooo,8888888"}, (51, 61)),
], ids=["all-projections", "mlp-only-first-kept", "last-two-kept-delayed", "layer-map"])
def test_train_step_has_fp8_operands_exactly_where_the_policy_says(overrides, counts):
    import sys
    import os
    from conftest import ROOT
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import fp8_hlo  # the benchmark's counting is what this test pins
    from dsjax import sharding
    from dsjax.train import build_trainer

    cfg = _train_cfg(**overrides)
    # The expected counts come from the config (and, written out, by hand), not from the model.
    assert _expected_dots(cfg) == counts
    trainer = build_trainer(cfg)
    batch = trainer.abstract_batch()
    with sharding.activate(trainer.mesh, trainer.rules):
        text = trainer.jitted(0).lower(trainer.abstract_state(), batch).as_text()
    dots = gemms.dot_general_dtypes(text)
    fp8_dots = [d for d in dots if d[0].startswith("f8") or d[1].startswith("f8")]
    high = [d for d in dots if d not in fp8_dots]
    expected_fp8, expected_high = fp8_hlo.expected_counts(trainer)
    assert len(fp8_dots) == expected_fp8 and len(high) == expected_high, (dots, overrides)
    assert (len(fp8_dots), len(high)) == counts, (dots, overrides)
    # forward e4m3 x e4m3, both backward GEMMs e5m2 x e4m3, always a float32 result
    assert fp8_dots.count(("f8E4M3FN", "f8E4M3FN", "f32")) * 3 == expected_fp8
    assert fp8_dots.count(("f8E5M2", "f8E4M3FN", "f32")) * 3 == 2 * expected_fp8
    assert all(d[0] == d[1] == d[2] == "f32" for d in high)


def test_delayed_scaling_state_trains_outside_the_optimizer():
    from conftest import random_batch
    from dsjax.train import build_trainer

    trainer = build_trainer(_train_cfg(**{"fp8.recipe": "delayed", "fp8.keep_first_layers": 1}))
    state = trainer.init()
    assert not any(isinstance(x, fp8.Fp8Meta) for x in jax.tree.leaves(
        state.opt_state, is_leaf=lambda x: isinstance(x, fp8.Fp8Meta)))
    batch = trainer.device_batch(random_batch(np.random.default_rng(0), 8, 32))
    state, m = trainer.step(state, batch)
    assert bool(m["finite"])
    q = state.fp8_meta["layers"]["attn"]["q"]
    scale = np.asarray(q.scale)  # [layers, (x, w, g)]
    assert np.all(scale[0] == 0)   # layer 0 is kept in float32: its meta never moves
    assert np.all(scale[1:] > 0)   # fp8 layers learnt their scales from the first step
    assert np.all(np.asarray(q.amax_history)[1:, :, 0] > 0)


def test_float16_overflow_halves_the_scale_and_skips_the_step():
    from conftest import random_batch
    from dsjax.train import build_trainer

    trainer = build_trainer(_train_cfg(**{"train.compute_dtype": "float16"}))
    state = trainer.init()
    batch = trainer.device_batch(random_batch(np.random.default_rng(1), 8, 32))
    state, m = trainer.step(state, batch)  # a normal step at the default scale 2**15
    assert bool(m["finite"]) and int(state.step) == 1
    # Inject an overflow: a scale so large the float16 backward pass overflows to inf.
    state = state.replace(loss_scale=state.loss_scale.replace(
        scale=jnp.asarray(2.0 ** 60, jnp.float32)))
    before = jax.device_get(state.params)
    state, m = trainer.step(state, batch)
    assert not bool(m["finite"])
    assert float(state.loss_scale.scale) == 2.0 ** 59 and int(state.loss_scale.skipped_steps) == 1
    assert int(state.step) == 1
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)


def test_delayed_fp8_run_resumes_with_the_same_losses(tmp_path):
    import json
    import os
    import shutil
    from conftest import FLAT_MESH, run_launch

    flags = {**FLAT_MESH, "train.compute_dtype": "fp8", "fp8.recipe": "delayed",
             "fp8.other_dtype": "float32", "fp8.keep_first_layers": 1, "model.num_layers": 3,
             "remat.policy": "attention_core"}
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    proc = run_launch(full, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(os.path.join(full, "checkpoints", "2"),
                    os.path.join(resumed, "checkpoints", "2"))
    proc = run_launch(resumed, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(workdir):
        with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f)}
    first, second = losses(full), losses(resumed)
    # The amax history is in the checkpoint, so step 3's scales (and losses) are identical.
    assert second == {3: first[3], 4: first[4]}


# ---------------------------------------------------------------------------------------------
# Weights quantised ahead of the layer loop (layers.prepare_fp8_weights).

_QUANTISE = re.compile(r"= (f8e4m3fn\[[\d,]*\])\{[^}]*\} convert\(%clamp")  # fp8.quantize's end


def _quantisations(compiled_hlo: str) -> tuple[collections.Counter, collections.Counter]:
    """(e4m3 quantisations, by shape, in the computations the entry's while loops run; all of
    them) in optimised HLO. A quantisation is fp8.quantize's last op: a clamped value converted
    to e4m3 (the stacked residual buffers' converts are of other ops)."""
    comps, looped = computations_in_loops(compiled_hlo)

    def count(names):
        return collections.Counter(m[1] for c in names for line in comps[c]
                                   for m in [_QUANTISE.search(line)] if m)
    return count(looped), count(comps)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_weights_are_quantised_once_per_step_outside_the_micro_batch_loop(recipe):
    """With accumulation the micro-batches run in a while loop. Each projection's stack of 4
    layers is quantised once, before that loop (XLA hoists the loop-invariant quantisation);
    inside it only activations are quantised. Without the preparation each layer's weight was
    quantised inside the loop, once per micro-batch."""
    from dsjax import batching, sharding
    from dsjax.train import build_trainer

    cfg = _train_cfg(**{"fp8.recipe": recipe})
    trainer = build_trainer(cfg)
    shape = batching.Shape(cfg.data.global_batch, 2, trainer.mesh.shape["data"])
    with sharding.activate(trainer.mesh, trainer.rules):
        hlo = trainer.programs.jitted(0, shape).lower(
            trainer.abstract_state(), batching.abstract_batch(
                trainer.batch_shardings, shape, cfg.data.seq_len)).compile().as_text()
    inside, everywhere = _quantisations(hlo)
    # By hand, per device (tensor 2: 2 of 4 query heads, 1 of 2 kv heads, 64 of 128 MLP):
    # 4 layers x D 64; q [4, 64, 2, 16], k and v [4, 64, 1, 16], o [4, 2, 16, 64], gate and
    # up [4, 64, 64], down [4, 64, 64].
    weights = {"f8e4m3fn[4,64,2,16]": 1, "f8e4m3fn[4,64,1,16]": 2, "f8e4m3fn[4,2,16,64]": 1,
               "f8e4m3fn[4,64,64]": 3}
    assert cfg.mesh.tensor == 2 and cfg.model.num_layers == 4
    assert {k: everywhere[k] for k in weights} == weights, everywhere
    assert not any(shape.startswith("f8e4m3fn[4,") for shape in inside), inside
    assert sum(inside.values()) > 0, inside  # the activations are, per micro-batch


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_prepared_weights_train_bit_for_bit_like_quantising_in_each_matmul(recipe):
    """The preparation changes where the weights are quantised, not the numbers: one training
    step (params, optimizer state, delayed-scaling state) equals the same step with every matmul
    quantising its own weight slice. The two programs fuse differently, so bit for bit holds
    under XLA's default emitters (not the suite's cheaper ones): they run in a process of their
    own."""
    in_default_xla("test_fp8", "prepared_and_per_matmul_steps_are_equal", recipe)


def prepared_and_per_matmul_steps_are_equal(recipe):
    from conftest import random_batch
    from dsjax.model import decoder
    from dsjax.train import build_trainer

    cfg = _train_cfg(**{"fp8.recipe": recipe, "fp8.keep_first_layers": 1})
    batch = random_batch(np.random.default_rng(3), 8, 32)

    def one_step():
        trainer = build_trainer(cfg)
        state, m = trainer.step(trainer.init(), trainer.device_batch(batch))
        return float(m["loss"]), jax.device_get((state.params, state.opt_state, state.fp8_meta))

    prepared = one_step()
    decoder.prepare_fp8_weights = lambda stack, policy: {}  # this process ends after the check
    per_matmul = one_step()
    assert prepared[0] == per_matmul[0]
    for a, b in zip(jax.tree.leaves(prepared[1]), jax.tree.leaves(per_matmul[1])):
        np.testing.assert_array_equal(a, b)
