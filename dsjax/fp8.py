"""FP8 matmuls: an fp8 `dot_general` with a hand-written VJP, three scaling recipes, the
delayed-scaling state.

The one idea: operands are cast to fp8 *before* `lax.dot_general`, which receives fp8 tensors and
emits the consumer's dtype; the dequantisation scale is a scalar multiply on that result, a
pattern XLA's GPU gemm rewriter turns into one cuBLASLt fp8 GEMM on Hopper. docs/fp8.md has the
formats, the recipes and how the delayed-scaling state leaves through autodiff. Which matmuls of
which layers run in fp8 is the precision policy's (fp8_policy.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.linen.fp8_ops import fp32_max_grad
from jax import lax
from jax.ad_checkpoint import checkpoint_name


E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RECIPES = ("current", "delayed", "rowwise")
META_COLLECTION = "fp8_meta"
DEFAULT_HISTORY = 1024
FP8_RESIDUAL = "fp8_residual"
X, W, G = 0, 1, 2  # rows of the delayed-scaling state
_ROW_DTYPES = (E4M3, E4M3, E5M2)


def fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


# ---------------------------------------------------------------------------------------------
# Quantisation (shared by the fp8 path and the emulation: the tests compare the GEMMs, not this).

def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """x / scale, saturated to the format's range, cast to fp8. NaN stays NaN (e4m3fn has no inf,
    so an unsaturated overflow would also become NaN)."""
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def amax(x: jax.Array, axis: Any = None) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=axis).astype(jnp.float32)


def current_scale(amax_: jax.Array, dtype: Any) -> jax.Array:
    """amax / fp8_max; 1 for an all-zero tensor. An infinite amax gives an infinite scale and NaN
    values downstream, on purpose: an overflow must reach the skip-step check, not be clipped."""
    # A multiply by a constant, not a division: XLA may fuse a division differently under jit
    # than eagerly, and then the same call would round its scale two ways.
    return jnp.where(amax_ > 0, amax_ * (1.0 / fp8_max(dtype)), 1.0).astype(jnp.float32)


def quantize_rows(x: jax.Array, reduce_axes: tuple[int, ...], dtype: Any
                  ) -> tuple[jax.Array, jax.Array]:
    """Current scaling with one scale per index of the axes *not* in `reduce_axes`; returns the
    fp8 tensor and the scales with `reduce_axes` removed."""
    scale = current_scale(amax(x, axis=reduce_axes), dtype)
    return quantize(x, jnp.expand_dims(scale, reduce_axes), dtype), scale


def _outer(a: jax.Array, b: jax.Array) -> jax.Array:
    """a[i..., None...] * b[None..., j...]: per-row x per-column scales of a GEMM output."""
    return a.reshape(a.shape + (1,) * b.ndim) * b


# ---------------------------------------------------------------------------------------------
# Dimension bookkeeping: an einsum with no batch dims is one dot_general plus transposes.

@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one fp8 matmul (hashable: a `custom_vjp` nondiff argument)."""
    x_contract: tuple[int, ...]  # paired with w_contract, position by position
    w_contract: tuple[int, ...]
    x_free: tuple[int, ...]
    w_free: tuple[int, ...]
    out_perm: tuple[int, ...]  # natural (x_free + w_free) -> requested output order
    dx_perm: tuple[int, ...]  # (x_free + x dims paired with sorted w_contract) -> x order
    dw_perm: tuple[int, ...]  # (w_free + w dims paired with sorted x_contract) -> w order
    recipe: str
    out_dtype: Any
    x_dtype: Any
    w_dtype: Any
    amax_dtype: Any
    prepared: bool = False  # w arrives quantised too (an `Fp8Weight`)


def _make_spec(x: jax.Array, w: jax.Array, x_contract, w_contract, out_perm, recipe, out_dtype,
               amax_dtype, prepared: bool = False) -> _Spec:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES}")
    x_contract, w_contract = tuple(x_contract), tuple(w_contract)
    x_free = tuple(i for i in range(x.ndim) if i not in x_contract)
    w_free = tuple(j for j in range(w.ndim) if j not in w_contract)
    pair_w = dict(zip(w_contract, x_contract))  # w dim -> its x partner
    pair_x = dict(zip(x_contract, w_contract))
    dx_axes = list(x_free) + [pair_w[j] for j in sorted(w_contract)]
    dw_axes = list(w_free) + [pair_x[i] for i in sorted(x_contract)]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    return _Spec(x_contract, w_contract, x_free, w_free, tuple(out_perm),
                 tuple(int(i) for i in np.argsort(dx_axes)),
                 tuple(int(i) for i in np.argsort(dw_axes)), recipe, out_dtype, x.dtype, w.dtype,
                 amax_dtype, prepared)


def _transpose(a: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    return a if perm == tuple(range(a.ndim)) else jnp.transpose(a, perm)


def _gemm(a: jax.Array, b: jax.Array, a_contract, b_contract, out: Any = jnp.float32
          ) -> jax.Array:
    """fp8 x fp8 -> `out` (float32 accumulation inside the GEMM either way). The explicit
    element type matters: without it the result is fp8."""
    return lax.dot_general(a, b, ((tuple(a_contract), tuple(b_contract)), ((), ())),
                           precision=lax.Precision.DEFAULT, preferred_element_type=out)


def _gemm_emulated(a: jax.Array, b: jax.Array, a_contract, b_contract, out: Any = jnp.float32
                   ) -> jax.Array:
    """The same GEMM on upcast operands in float32 (fp8 values are exact in float32), rounded
    once to `out`."""
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           ((tuple(a_contract), tuple(b_contract)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32).astype(out)


def scaled_gemm(a: jax.Array, b: jax.Array, a_contract, b_contract, scale: jax.Array,
                out: Any, gemm=_gemm) -> jax.Array:
    """(a . b) * scale with a scalar `scale`, written in `out`: a GEMM that emits `out` itself
    and a multiply in `out`, the pattern cuBLASLt takes whole (the scalar becomes its scale
    operand, the narrow output comes from its epilogue). A float32 output stays float32 all the
    way; a narrower one rounds the GEMM result and the scale to it before the multiply."""
    out = jnp.dtype(out)
    if out == jnp.float32:
        return gemm(a, b, a_contract, b_contract) * scale
    return gemm(a, b, a_contract, b_contract, out) * scale.astype(out)


# ---------------------------------------------------------------------------------------------
# The custom VJP. `scale` and `amax` are the delayed-scaling inputs (constants otherwise); the
# gradient of `amax` carries the observed amaxes out of the backward pass.

def pick_scale(meta_scale: jax.Array, observed: jax.Array, dtype: Any, recipe: str) -> jax.Array:
    fresh = current_scale(observed, dtype)
    if recipe == "current":
        return fresh
    return jnp.where(meta_scale > 0, meta_scale, fresh)  # first-step guard


def _forward(spec: _Spec, x, w, scale, prepared=None, gemm=_gemm):
    if spec.recipe == "rowwise":
        xq, sx = quantize_rows(x, spec.x_contract, E4M3)
        wq, sw = quantize_rows(w, spec.w_contract, E4M3)
        y = gemm(xq, wq, spec.x_contract, spec.w_contract) * _outer(sx, sw)
        # Backward operands, scaled along the dims the backward GEMMs keep.
        xq_t, sx_t = quantize_rows(x, spec.x_free, E4M3)
        wq_t, sw_t = quantize_rows(w, spec.w_free, E4M3)
        res = (xq_t, sx_t, wq_t, sw_t, scale[G], jnp.zeros((2,), jnp.float32))
    elif prepared is not None:  # w quantised ahead (`prepare_weight`): the same values
        seen = jnp.stack([amax(x), prepared.amax])
        sx = pick_scale(scale[X], seen[X], E4M3, spec.recipe)
        xq, wq, sw = quantize(x, sx, E4M3), prepared.q, prepared.scale
    else:
        seen = jnp.stack([amax(x), amax(w)])
        sx = pick_scale(scale[X], seen[X], E4M3, spec.recipe)
        sw = pick_scale(scale[W], seen[W], E4M3, spec.recipe)
        xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    if spec.recipe != "rowwise":
        y = scaled_gemm(xq, wq, spec.x_contract, spec.w_contract, sx * sw, spec.out_dtype,
                        gemm)
        res = (xq, sx, wq, sw, scale[G], seen)
    res = tuple(checkpoint_name(r, FP8_RESIDUAL) for r in res)
    return _transpose(y, spec.out_perm).astype(spec.out_dtype), res


def _fp8_matmul_fwd(spec: _Spec, x, w, scale, amax_in, prepared):
    del amax_in  # only its gradient matters
    return _forward(spec, x, w, scale, prepared)


def _backward(spec: _Spec, res, dy, gemm=_gemm):
    xq, sx, wq, sw, g_meta_scale, seen = res
    dy = _transpose(dy, tuple(int(i) for i in np.argsort(spec.out_perm)))
    n_xf = len(spec.x_free)
    dy_x = tuple(range(n_xf))  # dy dims that belong to x (its rows)
    dy_w = tuple(range(n_xf, dy.ndim))  # dy dims that belong to w (its columns)
    if spec.recipe == "rowwise":
        gq_x, sg_x = quantize_rows(dy, dy_w, E5M2)
        gq_w, sg_w = quantize_rows(dy, dy_x, E5M2)
        dx = gemm(gq_x, wq, dy_w, spec.w_free) * _outer(sg_x, sw)
        dw = gemm(gq_w, xq, dy_x, spec.x_free) * _outer(sg_w, sx)
        seen_g = jnp.zeros((1,), jnp.float32)
    else:
        seen_g = amax(dy)[None]
        sg = pick_scale(g_meta_scale, seen_g[0], E5M2, spec.recipe)
        gq = quantize(dy, sg, E5M2)
        # dx goes on in the activations' dtype; dw stays float32 (it is accumulated).
        dx = scaled_gemm(gq, wq, dy_w, spec.w_free, sg * sw, spec.x_dtype, gemm)
        dw = gemm(gq, xq, dy_x, spec.x_free) * (sg * sx)
    dx = _transpose(dx, spec.dx_perm).astype(spec.x_dtype)
    dw = _transpose(dw, spec.dw_perm).astype(spec.w_dtype)
    return dx, dw, jnp.concatenate([seen, seen_g])


def _fp8_matmul_bwd(spec: _Spec, res, dy):
    dx, dw, observed = _backward(spec, res, dy)
    # The weight's gradient goes to w; a prepared copy is a constant (made under
    # stop_gradient), so its cotangent is zero.
    zero = jnp.zeros((), jnp.float32)
    d_prepared = Fp8Weight(jnp.zeros(dw.shape, E4M3), zero, zero) if spec.prepared else None
    return (dx, dw, jnp.zeros((3,), jnp.float32),
            lax.convert_element_type(observed, spec.amax_dtype), d_prepared)


def _fp8_matmul_impl(spec: _Spec, x, w, scale, amax_in, prepared):
    del amax_in
    return _forward(spec, x, w, scale, prepared)[0]


_fp8_matmul = jax.custom_vjp(_fp8_matmul_impl, nondiff_argnums=(0,))
_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _meta_inputs(recipe: str, meta: Fp8Meta | None) -> tuple[jax.Array, jax.Array]:
    if recipe == "delayed":
        if meta is None:
            raise ValueError("fp8 recipe 'delayed' needs `meta` (an Fp8Meta for this matmul)")
        return lax.stop_gradient(meta.scale), meta.amax
    if meta is not None:
        raise ValueError(f"fp8 recipe {recipe!r} is stateless; pass meta=None")
    return jnp.zeros((3,), jnp.float32), jnp.zeros((3,), jnp.float32)


def fp8_dot_general(x: jax.Array, w: jax.Array,
                    contracting_dims: tuple[tuple[int, ...], tuple[int, ...]], *,
                    recipe: str = "current", out_dtype: Any = None,
                    meta: Fp8Meta | None = None) -> jax.Array:
    """`lax.dot_general(x, w, (contracting_dims, ((), ())))` in fp8; output dims are x's free
    dims then w's, in `out_dtype` (default x.dtype); `meta` only with recipe "delayed"."""
    scale, amax_in = _meta_inputs(recipe, meta)
    n_out = x.ndim + w.ndim - 2 * len(contracting_dims[0])
    spec = _make_spec(x, w, contracting_dims[0], contracting_dims[1], range(n_out), recipe,
                      out_dtype, amax_in.dtype)
    return _fp8_matmul(spec, x, w, scale, amax_in, None)


def parse_einsum(eq: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """"BSD,DHK->BSHK" -> (x contracting dims, paired w contracting dims, output permutation of
    the natural dot_general order). Only plain matmuls: no batch dims, no single-operand sums."""
    m = re.fullmatch(r"\s*(\w+)\s*,\s*(\w+)\s*->\s*(\w*)\s*", eq)
    if m is None:
        raise ValueError(f"fp8 einsum {eq!r}: expected 'xdims,wdims->outdims'")
    xs, ws, out = m.groups()
    for name, s in (("x", xs), ("w", ws), ("output", out)):
        if len(set(s)) != len(s):
            raise ValueError(f"fp8 einsum {eq!r}: repeated letter in the {name} dims")
    batch = set(xs) & set(ws) & set(out)
    if batch:
        raise ValueError(f"fp8 einsum {eq!r}: batch dims {sorted(batch)} are not supported")
    contract = [c for c in xs if c in ws]
    natural = [c for c in xs if c not in contract] + [c for c in ws if c not in contract]
    if sorted(natural) != sorted(out):
        raise ValueError(f"fp8 einsum {eq!r}: output must hold exactly the uncontracted dims "
                         f"{''.join(natural)}")
    return (tuple(xs.index(c) for c in contract), tuple(ws.index(c) for c in contract),
            tuple(natural.index(c) for c in out))


def fp8_einsum(eq: str, x: jax.Array, w: jax.Array, *, recipe: str = "current",
               out_dtype: Any = None, meta: Fp8Meta | None = None,
               prepared: Fp8Weight | None = None) -> jax.Array:
    """Drop-in for `jnp.einsum(eq, x, w)` on projections ("BSD,DHK->BSHK", "BSHK,HKD->BSD", ...):
    fp8 GEMMs forward and backward. Pass the float32 param as `w` (quantising it directly skips a
    bf16 rounding); `out_dtype` defaults to x.dtype; `meta` only with recipe "delayed";
    `prepared`: w already quantised by `prepare_weight` (same values), not with "rowwise"."""
    x_contract, w_contract, out_perm = parse_einsum(eq)
    scale, amax_in = _meta_inputs(recipe, meta)
    if prepared is not None and recipe == "rowwise":
        raise ValueError("fp8 recipe 'rowwise' quantises w along two axes; it takes no "
                         "prepared weight")
    spec = _make_spec(x, w, x_contract, w_contract, out_perm, recipe, out_dtype, amax_in.dtype,
                      prepared is not None)
    return _fp8_matmul(spec, x, w, scale, amax_in, prepared)


@struct.dataclass
class Fp8Weight:
    """A weight quantised ahead of its matmuls (`prepare_weight`), so that a stack of layers is
    quantised once before the layer loop, and with it once per optimizer step."""
    q: jax.Array  # e4m3 values
    scale: jax.Array  # f32[lead dims]: the dequantisation scale
    amax: jax.Array  # f32[lead dims]: the weight's amax (delayed scaling records it)


WEIGHTS_COLLECTION = "fp8_weights"  # the prepared weights a layer reads beside its params


def prepare_weight(w: jax.Array, recipe: str, lead: int = 0,
                   meta_scale: jax.Array | None = None) -> Fp8Weight:
    """`w` quantised as `fp8_einsum` would quantise it, one per-tensor scale per index of its
    `lead` leading dims (a stack of layers: 1). `meta_scale` [lead dims]: the delayed recipe's W
    scale. The result is a constant: gradients reach the weight through `fp8_einsum`'s `w`."""
    if recipe not in ("current", "delayed"):
        raise ValueError(f"fp8 recipe {recipe!r}: only per-tensor recipes prepare weights")
    w = lax.stop_gradient(w)
    seen = amax(w, axis=tuple(range(lead, w.ndim)))
    meta_scale = jnp.zeros_like(seen) if meta_scale is None else lax.stop_gradient(meta_scale)
    scale = pick_scale(meta_scale, seen, E4M3, recipe)
    return Fp8Weight(quantize(w, scale.reshape(scale.shape + (1,) * (w.ndim - lead)), E4M3),
                     scale, seen)


# ---------------------------------------------------------------------------------------------
# Delayed-scaling state.

@struct.dataclass
class Fp8Meta:
    """Delayed-scaling state of one matmul; rows X, W, G. Under `nn.scan` every leaf gains a
    leading layers dim; the functions below broadcast over leading dims."""
    amax_history: jax.Array  # f32[..., 3, H]; index 0 is the newest step
    scale: jax.Array  # f32[..., 3]; 0 = no history yet -> current scaling
    amax: jax.Array  # f32[..., 3]; last committed observation. Its *gradient* is this step's.


def init_meta(history_len: int = DEFAULT_HISTORY) -> Fp8Meta:
    return Fp8Meta(amax_history=jnp.zeros((3, history_len), jnp.float32),
                   scale=jnp.zeros((3,), jnp.float32), amax=jnp.zeros((3,), jnp.float32))


def meta_variable(module: nn.Module, name: str, history_len: int = DEFAULT_HISTORY) -> Fp8Meta:
    """The `Fp8Meta` called `name` of a Linen module, in the `fp8_meta` collection."""
    return module.variable(META_COLLECTION, name, init_meta, history_len).value


def _is_meta(node: Any) -> bool:
    return isinstance(node, Fp8Meta)


def _f32(a: jax.Array) -> jax.Array:
    return a if a.dtype == jnp.float32 else lax.convert_element_type(a, jnp.float32)


def update_meta(meta: Fp8Meta, observed: jax.Array, margin: float = 0.0) -> Fp8Meta:
    """Rolls `observed` ([..., 3] amaxes) into the history and recomputes the scales from the
    history's maximum. A non-finite observation (an overflowed step, or -inf: unused this step)
    leaves that row's history and scale as they were; an all-zero history keeps scale 0."""
    observed = _f32(observed)
    ok = jnp.isfinite(observed)
    rolled = jnp.concatenate([observed[..., None], meta.amax_history[..., :-1]], axis=-1)
    history = jnp.where(ok[..., None], rolled, meta.amax_history)
    top = jnp.max(history, axis=-1)
    inv_limits = jnp.asarray([1.0 / fp8_max(d) for d in _ROW_DTYPES], jnp.float32)
    fresh = top * inv_limits * (2.0 ** margin)
    scale = jnp.where(ok & (top > 0), fresh, meta.scale)
    return Fp8Meta(history, scale, jnp.where(ok, observed, meta.amax))


def commit(meta_tree: Any, meta_grads: Any, margin: float = 0.0) -> Any:
    """The new fp8_meta collection: every `Fp8Meta` updated with the amaxes that `jax.grad`
    returned as its `amax` gradient. Write this into the state; never give it to the optimizer."""
    return jax.tree.map(lambda m, g: update_meta(m, g.amax, margin), meta_tree, meta_grads,
                        is_leaf=_is_meta)


def with_max_grad(meta_tree: Any) -> Any:
    """Call inside the differentiated function, before the model reads the collection: repeated
    uses of one `Fp8Meta` then combine their observed amaxes by maximum instead of by sum."""
    return jax.tree.map(
        lambda m: m.replace(amax=lax.convert_element_type(m.amax, fp32_max_grad)), meta_tree,
        is_leaf=_is_meta)


def combine(meta_grads_a: Any, meta_grads_b: Any) -> Any:
    """Max-combines two meta gradients (e.g. of two microbatches) before `commit`."""
    return jax.tree.map(
        lambda a, b: a.replace(amax=jnp.maximum(_f32(a.amax), _f32(b.amax))), meta_grads_a,
        meta_grads_b, is_leaf=_is_meta)


# ---------------------------------------------------------------------------------------------
# Test and benchmark helpers.

def emulate_einsum(eq: str, x: jax.Array, w: jax.Array, dy: jax.Array, *,
                   recipe: str = "current", out_dtype: Any = None, meta: Fp8Meta | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(y, dx, dw) of `fp8_einsum` for output gradient `dy`, in float32 arithmetic: the same
    quantisation and scales, operands upcast, float32 `dot_general`s with the same dimension
    numbers (so the summation order matches too), the same rescale."""
    x_contract, w_contract, out_perm = parse_einsum(eq)
    scale, _ = _meta_inputs(recipe, meta)
    spec = _make_spec(x, w, x_contract, w_contract, out_perm, recipe, out_dtype, jnp.float32)
    y, res = _forward(spec, x, w, scale, gemm=_gemm_emulated)
    dx, dw, _ = _backward(spec, res, dy, gemm=_gemm_emulated)
    return y, dx, dw
