"""Activation recomputation policies for the scanned decoder block.

The spine offers `none` (save everything) and `full` (save nothing, recompute the block in the
backward pass). Selective policies and per-layer patterns build on `block_policy` (issue #5).
"""

from __future__ import annotations

from typing import Callable

import jax

_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def block_policy(name: str) -> tuple[bool, Callable | None]:
    """(whether to wrap the block in `jax.checkpoint`, the policy to pass it)."""
    if name not in _POLICIES:
        raise ValueError(f"remat.policy: unknown policy {name!r}; valid: {', '.join(_POLICIES)}")
    return name != "none", _POLICIES[name]
