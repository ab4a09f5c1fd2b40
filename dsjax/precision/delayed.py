"""Delayed scaling across a precision switch: a projection that enters or leaves fp8 starts its
amax history afresh.

The one idea: while a projection runs outside fp8 its history only records zeros, and what it
held from before is stale; restarted (history, scale and amax all zero), its first fp8 step uses
current scaling (`fp8.pick_scale`'s first-step guard) and the history refills from there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dsjax import fp8
from dsjax.model.layers import policy_name


def restart(meta: Any, cells: list[tuple[int, str]], ranges: dict[str, tuple[int, int]]
            ) -> Any:
    """`meta` (the train state's fp8_meta) with the `Fp8Meta` of each (layer, projection) in
    `cells` restarted. `ranges`: each scanned stack's [first, end) layers (model._stacks())."""
    def one(path, m):
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[0] not in ranges:
            return m
        lo, hi = ranges[keys[0]]
        rows = [layer - lo for layer, name in cells
                if lo <= layer < hi and name == policy_name(keys[-1])]
        if not rows:
            return m
        rows = jnp.asarray(rows)
        return fp8.Fp8Meta(*(a.at[rows].set(0) for a in (m.amax_history, m.scale, m.amax)))

    return jax.tree_util.tree_map_with_path(one, meta,
                                            is_leaf=lambda n: isinstance(n, fp8.Fp8Meta))
