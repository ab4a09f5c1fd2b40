"""The speed term of `fp8.select=auto` (GPU only): each distinct projection shape timed as an fp8
GEMM and in the compute dtype, forward and backward, on the device; fp8 is kept only where it is
faster. Small K or N, or a quantisation that costs more than the GEMM saves, keep bf16.

The one idea: a projection's shape is the same in every layer, so one timing per projection
name decides for the whole stack, once per run. On CPU fp8 is emulated and its time means
nothing: the term is off there (`Selector` logs so).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dsjax import fp8
from dsjax.model.layers import ROUTED_EXPERTS, policy_name

REPEATS = 5


def _timed(fn: Callable, *args: Any) -> float:
    """The fastest of REPEATS runs of a compiled `fn`, in seconds (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def time_projection(tokens: int, k: int, n: int, dtype: Any, recipe: str) -> tuple[float, float]:
    """(fp8 seconds, `dtype` seconds) of one [tokens, k] x [k, n] projection's forward and
    backward (output and both gradients), on the default device."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (tokens, k), dtype)
    w = 0.02 * jax.random.normal(keys[1], (k, n), jnp.float32)
    dy = jax.random.normal(keys[2], (tokens, n), dtype)
    recipe = "current" if recipe == "delayed" else recipe

    def grads(matmul):
        return jax.jit(lambda x, w, dy: jax.vjp(matmul, x, w)[1](dy))
    in_fp8 = grads(lambda x, w: fp8.fp8_einsum("nk,kf->nf", x, w, recipe=recipe, out_dtype=dtype))
    plain = grads(lambda x, w: jnp.einsum("nk,kf->nf", x, w.astype(dtype)))
    return _timed(in_fp8, x, w, dy), _timed(plain, x, w, dy)


def slower_in_fp8(times: dict[str, tuple[float, float]]) -> set[str]:
    """The projections whose fp8 time is not below their compute-dtype time."""
    return {name for name, (t_fp8, t_other) in times.items() if t_fp8 >= t_other}


def projection_shapes(params: Any, matmuls: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{projection: (K, N)} from the first stack's weights: a weight [layers, in..., out...]
    contracts its first dim after layers (the output projection "o", [layers, H, K, D], its
    first two); routed experts are left out. MLA's q and k take their first factor's shape."""
    stack = params.get("layers", params.get("moe_layers", {}))
    out: dict[str, tuple[int, int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stack)[0]:
        keys = [str(getattr(p, "key", p)) for p in path]
        name = policy_name(keys[-1])
        if (name in matmuls and name not in out and len(leaf.shape) >= 3
                and ROUTED_EXPERTS not in keys[:-1]):
            shape = leaf.shape[1:]
            contracted = 2 if name == "o" else 1
            out[name] = (math.prod(shape[:contracted]), math.prod(shape[contracted:]))
    return out
