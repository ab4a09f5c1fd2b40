"""Dropless MoE at the cost of the tokens routed: sorted rows and grouped GEMMs (docs/moe.md).

The one idea: the A = T * k (token, expert) assignments are laid out as rows sorted by expert, and
each projection is one grouped GEMM, row block g times expert g's weight; no [E, C, D] buffer
exists. Two grouped GEMMs:
- `ragged`: `jax.lax.ragged_dot` over exactly A rows with per-expert group sizes (rows past the
  groups come out zero). It is exact-size only where the backend has a grouped kernel: JAX
  lowers it on CPU (and, reportedly, on CUDA) to a dense product masked per group, E times the
  work, with an [E, rows, D] masked copy of the input.
- `padded`: each expert's rows padded to a multiple of `tile`, at most A + E * (tile - 1) rows,
  one dense [tile, D] x [D, F] GEMM per tile that holds rows, in a loop with a hand-written VJP
  (the weight gradient accumulates in place, per expert; no per-tile copy of a weight is kept).
Letters: see dsjax/model/__init__.py; A assignments, M rows of the grouped layout, G groups.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from dsjax import fp8
from dsjax.config.validate import MOE_IMPLS
from dsjax.sharding import varying_axes

GROUPED = ("ragged", "padded")  # the dropless grouped members of MOE_IMPLS
CPU_TILE = 32  # padded rows per tile on XLA:CPU: within 1.08x of the routed rows at V2-Lite
DEVICE_TILE = 128  # on accelerators: a GEMM tile's rows


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """`auto`: `ragged` where `ragged_dot` has a grouped kernel (TPU), else `padded`."""
    assert impl in MOE_IMPLS, impl
    if impl != "auto":
        return impl
    return "ragged" if (backend or jax.default_backend()) == "tpu" else "padded"


def resolve_tile(tile: int, backend: str | None = None) -> int:
    """`model.moe_tile` 0: `CPU_TILE` on CPU, `DEVICE_TILE` elsewhere."""
    if tile:
        return tile
    return CPU_TILE if (backend or jax.default_backend()) == "cpu" else DEVICE_TILE


def layout_rows(assignments: int, groups: int, tile: int | None) -> int:
    """Rows of the grouped layout: exactly `assignments` (ragged), or the padded static bound
    A + G * (tile - 1), rounded up to whole tiles."""
    if tile is None:
        return assignments
    return math.ceil((assignments + groups * (tile - 1)) / tile) * tile


class Layout(NamedTuple):
    """Where each assignment's row goes. `row` [A]: its row (`rows` for an assignment of no
    group, which scatters and gathers drop); `sizes` [G]: rows per group; `tile_group` [M/tile]:
    each tile's group and `used_tiles` []: the tiles that hold rows (padded only, else None)."""
    row: jax.Array
    sizes: jax.Array
    tile_group: jax.Array | None
    used_tiles: jax.Array | None
    rows: int


def sort_rows(group_A: jax.Array, groups: int, tile: int | None) -> Layout:
    """Rows sorted by group, assignments of one group in their original order. `group_A` in
    [0, groups]; `groups` itself marks an assignment that belongs to no group (an empty
    receive slot under expert parallelism)."""
    A = group_A.shape[0]
    rows = layout_rows(A, groups, tile)
    order = jnp.argsort(group_A, stable=True)
    sorted_at = jnp.zeros((A,), jnp.int32).at[order].set(jnp.arange(A, dtype=jnp.int32))
    sizes = jnp.zeros((groups + 1,), jnp.int32).at[group_A].add(1)[:groups]
    starts = jnp.cumsum(sizes) - sizes
    valid = group_A < groups
    g = jnp.minimum(group_A, groups - 1)
    within = sorted_at - starts[g]
    if tile is None:
        return Layout(jnp.where(valid, sorted_at, rows), sizes, None, None, rows)
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(padded)
    row = jnp.where(valid, ends[g] - padded[g] + within, rows)
    tile_starts = jnp.arange(rows // tile, dtype=jnp.int32) * tile
    # The group whose padded rows hold the tile's start (a count, not jnp.searchsorted, which
    # fails to trace inside a pipeline's shard_map in jax 0.10.2).
    tile_group = jnp.sum(ends[None, :] <= tile_starts[:, None], axis=1, dtype=jnp.int32)
    return Layout(row, sizes, jnp.minimum(tile_group, groups - 1), ends[-1] // tile, rows)


def to_rows(x_AD: jax.Array, layout: Layout) -> jax.Array:
    """[A, D] assignments -> [M, D] rows (padding rows zero). A scatter, not a gather of x: a
    gather of a sharded token axis fails XLA's SPMD partitioner inside a pipeline's shard_map."""
    rows = jnp.zeros((layout.rows, x_AD.shape[-1]), x_AD.dtype)
    return rows.at[layout.row].set(x_AD, mode="drop")


def from_rows(y_MD: jax.Array, layout: Layout) -> jax.Array:
    """[M, D] rows -> [A, D] assignments (zero for an assignment of no group)."""
    return y_MD.at[layout.row].get(mode="fill", fill_value=0)


# ---------------------------------------------------------------------------------------------
# The padded grouped GEMM: one tile GEMM per loop step, with its own VJP.

def _varying_like(a: jax.Array, *others: jax.Array) -> jax.Array:
    """`a` varying over every manual mesh axis any of `others` varies over (inside a
    shard_map, a loop's carry must keep one type through the loop)."""
    axes = set().union(*map(varying_axes, others)) - varying_axes(a)
    return lax.pcast(a, tuple(sorted(axes)), to="varying") if axes else a


def _tile_loop(layout_tiles: int, used: jax.Array, body, init, unroll: bool):
    """body(i, carry) over the tiles that hold rows: [0, used) (a while loop: a tile past the
    rows costs nothing, which matters for expert parallelism's receive slots), or, unrolled,
    over all `layout_tiles` (so that `cost_analysis` counts the static bound; benchmarks)."""
    if unroll:
        return lax.fori_loop(0, layout_tiles, body, init, unroll=True)
    return lax.fori_loop(0, used, body, init)


def _group_amax(a_MX: jax.Array, tile_group: jax.Array, groups: int) -> jax.Array:
    """Per group, the largest |value| of its rows [G] (its tiles' amaxes, max-combined)."""
    tiles = fp8.amax(a_MX.reshape(tile_group.shape[0], -1), axis=1)
    return jnp.zeros((groups,), jnp.float32).at[tile_group].max(tiles)


class _Operand(NamedTuple):
    """The weight as the tile GEMMs read it, and what the backward keeps of the forward: the
    weight in x's dtype (or e4m3 with fp8), per-expert scales of x and w and the observed
    amaxes [G, 2] (fp8; zeros otherwise). Never the float32 parameter itself: under a layer
    scan a residual is stacked per layer, and the float32 experts are twice the bf16 copy."""
    w: jax.Array
    sx: jax.Array
    sw: jax.Array
    seen: jax.Array


def _operand(x_MD, w_GDF, tile_group, meta_scale, recipe) -> _Operand:
    """fp8: each expert's scales from the delayed state where it has one (`fp8.pick_scale`),
    else from the amax of the expert's rows and of its weight."""
    G = w_GDF.shape[0]
    if not recipe:
        zeros = jnp.zeros((G,), jnp.float32)
        return _Operand(w_GDF.astype(x_MD.dtype), zeros, zeros, jnp.zeros((G, 2), jnp.float32))
    seen = jnp.stack([_group_amax(x_MD, tile_group, G), fp8.amax(w_GDF, axis=(1, 2))], axis=1)
    sx = fp8.pick_scale(meta_scale[:, fp8.X], seen[:, 0], fp8.E4M3, recipe)
    sw = fp8.pick_scale(meta_scale[:, fp8.W], seen[:, 1], fp8.E4M3, recipe)
    return _Operand(fp8.quantize(w_GDF, sw[:, None, None], fp8.E4M3), sx, sw, seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def tiled_matmul(x_MD: jax.Array, w_GDF: jax.Array, tile_group: jax.Array, used: jax.Array,
                 meta_scale: jax.Array, meta_amax: jax.Array, unroll: bool = False,
                 recipe: str | None = None) -> jax.Array:
    """[M, D] rows x per-tile weights w[tile_group] -> [M, F] (rows of tiles >= `used`
    zero). The weight gradient accumulates in float32, per expert in place, and returns in w's
    dtype. `recipe` ('current' or 'delayed'; None: no fp8): fp8 GEMMs with one scale per
    expert and tensor, as the capacity buffers' per-expert `fp8_einsum` (e4m3 operands, e5m2
    output gradients; current scales from the amax of the expert's rows). `meta_scale`,
    `meta_amax` [G, 3]: the delayed state's scales and amax leaf (`fp8.Fp8Meta` rows X, W, G;
    zeros otherwise); the observed amaxes leave as the amax leaf's cotangent."""
    operand = _operand(x_MD, w_GDF, tile_group, meta_scale, recipe)
    return _tiled_forward(x_MD, operand, tile_group, used, unroll, recipe)


def _tiled_forward(x_MD, op: _Operand, tile_group, used, unroll, recipe):
    n = tile_group.shape[0]
    tile = x_MD.shape[0] // n

    def step(i, y_MF):
        g = tile_group[i]
        x_tD = lax.dynamic_slice_in_dim(x_MD, i * tile, tile)
        w_DF = lax.dynamic_index_in_dim(op.w, g, keepdims=False)
        if recipe:
            y_tF = fp8.scaled_gemm(fp8.quantize(x_tD, op.sx[g], fp8.E4M3), w_DF, (1,), (0,),
                                   op.sx[g] * op.sw[g], x_MD.dtype)
        else:
            y_tF = jnp.dot(x_tD, w_DF, preferred_element_type=x_MD.dtype)
        return lax.dynamic_update_slice_in_dim(y_MF, y_tF.astype(x_MD.dtype), i * tile, 0)

    y0 = jnp.zeros((x_MD.shape[0], op.w.shape[-1]), x_MD.dtype)
    return _tile_loop(n, used, step, _varying_like(y0, x_MD, op.w, tile_group, used), unroll)


def _tiled_fwd(x_MD, w_GDF, tile_group, used, meta_scale, meta_amax, unroll, recipe):
    op = _operand(x_MD, w_GDF, tile_group, meta_scale, recipe)
    dtype_of_w = jnp.zeros((0,), w_GDF.dtype)  # the cotangent's dtype, as an array
    return (_tiled_forward(x_MD, op, tile_group, used, unroll, recipe),
            (x_MD, op, tile_group, used, meta_scale, meta_amax, dtype_of_w))


def _tiled_bwd(unroll, recipe, res, dy_MF):
    x_MD, op, tile_group, used, meta_scale, meta_amax, dtype_of_w = res
    n = tile_group.shape[0]
    tile = x_MD.shape[0] // n
    dy_MF = dy_MF.astype(x_MD.dtype)
    if recipe:
        seen_g = _group_amax(dy_MF, tile_group, op.w.shape[0])
        sg = fp8.pick_scale(meta_scale[:, fp8.G], seen_g, fp8.E5M2, recipe)

    def step(i, carry):
        dx_MD, dw_GDF = carry
        g = tile_group[i]
        x_tD = lax.dynamic_slice_in_dim(x_MD, i * tile, tile)
        dy_tF = lax.dynamic_slice_in_dim(dy_MF, i * tile, tile)
        w_DF = lax.dynamic_index_in_dim(op.w, g, keepdims=False)
        if recipe:  # the forward's quantised x, recomputed from the same scale
            xq = fp8.quantize(x_tD, op.sx[g], fp8.E4M3)
            gq = fp8.quantize(dy_tF, sg[g], fp8.E5M2)
            dx_tD = fp8.scaled_gemm(gq, w_DF, (1,), (1,), sg[g] * op.sw[g], x_MD.dtype)
            dw_DF = fp8.scaled_gemm(xq, gq, (0,), (0,), op.sx[g] * sg[g], jnp.float32)
        else:
            dx_tD = jnp.dot(dy_tF, w_DF.T, preferred_element_type=x_MD.dtype)
            dw_DF = jnp.dot(x_tD.T, dy_tF, preferred_element_type=jnp.float32)
        return (lax.dynamic_update_slice_in_dim(dx_MD, dx_tD.astype(x_MD.dtype), i * tile, 0),
                lax.dynamic_update_index_in_dim(dw_GDF, dw_GDF[g] + dw_DF, g, 0))

    others = (x_MD, dy_MF, op.w, tile_group, used)
    init = (_varying_like(jnp.zeros_like(x_MD), *others),
            _varying_like(jnp.zeros(op.w.shape, jnp.float32), *others))
    dx_MD, dw_GDF = _tile_loop(n, used, step, init, unroll)
    # The observed amaxes leave only where there is a delayed state to take them (the stand-in
    # zeros of the other recipes may be typed invariant inside a shard_map, the amaxes not).
    observed = None
    if recipe == "delayed":
        observed = lax.convert_element_type(
            jnp.concatenate([op.seen, seen_g[:, None]], axis=1), meta_amax.dtype)
    return dx_MD, dw_GDF.astype(dtype_of_w.dtype), None, None, None, observed


tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(x_MD: jax.Array, w_GDF: jax.Array, layout: Layout, *, unroll: bool = False,
                   recipe: str | None = None, meta: fp8.Fp8Meta | None = None) -> jax.Array:
    """Rows of group g times w[g]: `ragged_dot` (layout without tiles) or the padded tile loop
    (the one with fp8: `ragged_dot`'s fp8 backward is not written). `meta`: the delayed
    recipe's per-expert state ([G, ...] leaves)."""
    if layout.tile_group is None:
        assert recipe is None, "fp8 grouped GEMMs need moe_impl='padded'"
        return lax.ragged_dot(x_MD, w_GDF.astype(x_MD.dtype), layout.sizes,
                              preferred_element_type=x_MD.dtype)
    if meta is None:
        meta_scale = meta_amax = jnp.zeros((w_GDF.shape[0], 3), jnp.float32)
    else:
        meta_scale, meta_amax = lax.stop_gradient(meta.scale), meta.amax
    return tiled_matmul(x_MD, w_GDF, layout.tile_group, layout.used_tiles, meta_scale,
                        meta_amax, unroll, recipe)


class Grouped(NamedTuple):
    """How a layer runs its grouped GEMMs."""
    impl: str  # ragged | padded (resolved: not auto)
    tile: int  # padded: rows per tile (resolved: not 0)
    unroll: bool = False  # padded: unroll the tile loop (benchmarks count its FLOPs so)
    fp8: tuple[str | None, ...] = (None, None, None)  # gate, up, down: fp8 recipe or None
    exchange: str = "static"  # expert parallelism's transport (dsjax/model/moe_exchange.py)

    def layout(self, group_A: jax.Array, groups: int) -> Layout:
        return sort_rows(group_A, groups, self.tile if self.impl == "padded" else None)


def grouped_swiglu(x_MD: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   layout: Layout, how: Grouped, metas: dict[str, fp8.Fp8Meta]) -> jax.Array:
    """Each row through its expert's SwiGLU: down(silu(x gate) * (x up)). Padding rows stay
    zero (silu(0) * 0 = 0), so they add nothing to any gradient. `metas`: delayed fp8 state by
    projection name ({} otherwise)."""
    dtype = x_MD.dtype
    recipes = dict(zip(("gate", "up", "down"), how.fp8))
    mm = lambda name, x, w: grouped_matmul(x, w, layout, unroll=how.unroll, recipe=recipes[name],
                                           meta=metas.get(name))
    gate_MF = mm("gate", x_MD, w_gate)
    up_MF = mm("up", x_MD, w_up)
    hidden_MF = checkpoint_name(jax.nn.silu(gate_MF) * up_MF, "mlp_hidden")
    return mm("down", hidden_MF.astype(dtype), w_down)


def routed(x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array, w_gate: jax.Array,
           w_up: jax.Array, w_down: jax.Array, how: Grouped,
           metas: dict[str, fp8.Fp8Meta] | None = None) -> jax.Array:
    """sum_k weight_k * expert_k(x), all experts local: sort, grouped SwiGLU, gather back."""
    K = experts_TK.shape[1]
    layout = how.layout(experts_TK.reshape(-1), w_gate.shape[0])
    x_MD = to_rows(jnp.repeat(x_TD, K, axis=0), layout)
    y_MD = checkpoint_name(grouped_swiglu(x_MD, w_gate, w_up, w_down, layout, how, metas or {}),
                           "moe_routed")
    return weighted_sum(from_rows(y_MD, layout), weights_TK)


def weighted_sum(y_AD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """sum_k weight_k * y[token, k]: the assignments' outputs [T * k, D], in token order, back
    to tokens [T, D]."""
    T, K = weights_TK.shape
    y_TKD = y_AD.reshape(T, K, y_AD.shape[-1])
    return jnp.einsum("TKD,TK->TD", y_TKD, weights_TK.astype(y_TKD.dtype))
