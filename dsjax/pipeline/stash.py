"""A stage's `jax.vjp` carried from its forward tick to its backward tick, so that 1F1B runs each
stage forward once.

`jax.vjp` returns the pullback as a pytree whose leaves are the residuals the backward needs
(what `remat.policy` saves inside the stage). `Residuals` sorts those leaves once per step: the
ones that depend on the microbatch (its activations, its token ids) are stashed per microbatch
in the schedule's ring of slots; the ones that depend only on the stage's params (each layer's
weights, their casts and fp8 quantisations) are computed once, outside the tick loop, and every
backward tick shares them. See docs/pipeline.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
# Dead-code elimination of a jaxpr: which inputs an output needs, through scans and conds. The
# public API has no equivalent; it has kept this signature since JAX 0.4.
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr, dce_jaxpr

# fn(consts, inputs, aux) -> out: differentiated w.r.t. consts (the params, the same for
# every microbatch) and inputs (the microbatch's activations); aux (its positions, segment ids,
# token ids) is not differentiated.
StageFn = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Residuals:
    """How one stage function's pullback splits into stashed and shared residuals."""
    treedef: Any                    # the pullback's pytree structure
    stashed: tuple[bool, ...]       # per leaf: depends on the microbatch, so it is stashed
    shared: tuple[Any, ...]         # the other leaves' values, in leaf order
    avals: tuple[Any, ...]          # every leaf's ShapeDtypeStruct (checked at each forward)

    @property
    def stash_shapes(self) -> list[jax.ShapeDtypeStruct]:
        """One microbatch's stashed leaves."""
        return [a for a, s in zip(self.avals, self.stashed) if s]

    @property
    def shared_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [a for a, s in zip(self.avals, self.stashed) if not s]

    def forward(self, fn: StageFn, consts: Any, inputs: Any, aux: Any) -> tuple[Any, list]:
        """(fn's output, the leaves to stash for this microbatch's backward)."""
        out, pullback = jax.vjp(lambda c, i: fn(c, i, aux), consts, inputs)
        leaves = jax.tree.leaves(pullback)
        got = tuple(_aval(x) for x in leaves)
        if got != self.avals:  # the plan was traced from the same function: a bug if it differs
            diff = [(i, a, b) for i, (a, b) in enumerate(zip(got, self.avals)) if a != b]
            raise AssertionError(f"stage residuals changed between traces ({len(got)} leaves, "
                                 f"planned {len(self.avals)}): (leaf, now, planned) {diff}")
        return out, [x for x, s in zip(leaves, self.stashed) if s]

    def at(self, i: jax.Array) -> "Residuals":
        """Chunk i's plan, of one `stack`ed from several chunks' (the shared leaves differ)."""
        return dataclasses.replace(self, shared=tuple(
            lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in self.shared))

    def backward(self, stashed: list, cotangent: Any) -> Any:
        """The (consts, inputs) cotangents of the microbatch whose `forward` stashed `stashed`."""
        stashed_it, shared_it = iter(stashed), iter(self.shared)
        leaves = [next(stashed_it) if s else next(shared_it) for s in self.stashed]
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)


def plan(fn: StageFn, consts: Any, inputs: Any, aux: Any) -> Residuals:
    """Trace fn's pullback once and sort its residual leaves. Call it where consts hold this
    step's values (before the schedule's scan): the shared leaves are computed from them here.
    `inputs` and `aux` only give shapes (any one microbatch's values)."""
    treedef = []

    def residuals(consts, inputs, aux):
        _, pullback = jax.vjp(lambda c, i: fn(c, i, aux), consts, inputs)
        leaves, tree = jax.tree.flatten(pullback)
        treedef.append(tree)
        return leaves

    closed = jax.make_jaxpr(residuals)(consts, inputs, aux)
    # Constants (values closed over from this step) become leading inputs, shared like consts.
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    args = [*closed.consts, *jax.tree.leaves(consts), *jax.tree.leaves((inputs, aux))]
    n_shared_args = len(closed.consts) + len(jax.tree.leaves(consts))
    n_out = len(jaxpr.outvars)
    stashed = []
    for i in range(n_out):
        _, used = dce_jaxpr(jaxpr, [j == i for j in range(n_out)])
        stashed.append(any(used[n_shared_args:]))
    shared_jaxpr, used = dce_jaxpr(jaxpr, [not s for s in stashed])
    shared = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(shared_jaxpr, []))(
        *[a for a, u in zip(args, used) if u])
    return Residuals(treedef[0], tuple(stashed), tuple(shared),
                     tuple(_aval(v.aval) for v in jaxpr.outvars))


def stack(plans: list[Residuals]) -> Residuals:
    """The plans of one function on several chunks of layers (each its own params), as one whose
    shared leaves are stacked [chunks, ...]: pick a chunk's with `Residuals.at`. The stashed
    leaves are the same for every chunk, so one ring holds them all."""
    first = plans[0]
    for i, p in enumerate(plans[1:], 1):
        if (p.stashed, p.avals) != (first.stashed, first.avals):  # same function, same shapes
            raise AssertionError(f"chunk {i}'s residuals differ from chunk 0's")
    return dataclasses.replace(first, shared=tuple(
        jnp.stack(leaves) for leaves in zip(*(p.shared for p in plans))))


def ring_shapes(shapes: list[jax.ShapeDtypeStruct], slots: int) -> list[jax.ShapeDtypeStruct]:
    """The stash: `slots` microbatches' copies [slots, ...] of each stashed leaf."""
    return [jax.ShapeDtypeStruct((slots, *s.shape), s.dtype) for s in shapes]


def put(ring: list[jax.Array], leaves: list[jax.Array], slot: jax.Array) -> list[jax.Array]:
    """The stash with one microbatch's leaves written to `slot`."""
    return [lax.dynamic_update_index_in_dim(r, x, slot, 0) for r, x in zip(ring, leaves)]


def take(ring: list[jax.Array], slot: jax.Array) -> list[jax.Array]:
    """One microbatch's leaves, from `slot`."""
    return [lax.dynamic_index_in_dim(r, slot, 0, keepdims=False) for r in ring]


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
