"""Where each token of a row sits when the sequence is split over the `context` mesh axis.

The one idea: with mesh.context = C, a row of S tokens is stored in *layout order* and the mesh
gives device d the d-th of C equal slices of it. `contiguous` is the natural order (device d holds
tokens [d S/C, (d+1) S/C)); under causal attention the last device then does C times the work of
the first. `zigzag` cuts the row into 2C chunks and gives device d chunks d and 2C-1-d, so every
device holds one early and one late chunk and does the same work. The host writes batches in
layout order (`to_layout`); the model reads token indices from `Layout.indices` and shifts along
the natural order with `Layout.ahead` (MTP). Everything that sums over tokens (the loss, the MoE
balance terms, metrics) does not care about the order. Details: docs/context.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Layout:
    """The order of a row split over `parts` devices (1: not split, the natural order)."""
    parts: int = 1
    kind: str = "zigzag"  # model.context_layout: zigzag | contiguous

    @property
    def chunks(self) -> int:
        """Equal chunks a row is cut into: 2 per device for zigzag, else 1."""
        return self.parts * (2 if self.kind == "zigzag" and self.parts > 1 else 1)

    @property
    def permutes(self) -> bool:
        """Whether layout order differs from the natural order (zigzag over 2+ devices)."""
        return self.chunks != self.parts

    def order(self, seq_len: int) -> np.ndarray:
        """[S] int: the natural index of the token at each layout position."""
        c = seq_len // self.chunks
        if not self.permutes:
            return np.arange(seq_len)
        chunk_ids = [g for d in range(self.parts) for g in (d, 2 * self.parts - 1 - d)]
        return np.concatenate([np.arange(g * c, (g + 1) * c) for g in chunk_ids])

    def indices(self, seq_len: int, device: jax.Array) -> jax.Array:
        """[S / parts] int32: the natural indices of the tokens `device` (traced, e.g. an
        axis_index) holds, increasing."""
        c = seq_len // self.chunks
        local = jnp.arange(c, dtype=jnp.int32)
        if not self.permutes:
            return device * c + local
        return jnp.concatenate([device * c + local, (2 * self.parts - 1 - device) * c + local])

    def ahead(self, a_BS: jax.Array, k: int) -> jax.Array:
        """In layout order, the entry k tokens later in the natural order (0 past the row): the
        layout form of a[:, i + k]. Static indices: one gather (an all-gather of the small
        [B, S] array when the row is split)."""
        S = a_BS.shape[1]
        if not self.permutes:
            return jnp.pad(a_BS[:, k:], ((0, 0), (0, k)))
        order = self.order(S)
        where = np.argsort(order)  # layout position of each natural index
        target = order + k
        valid = target < S
        source = np.where(valid, where[np.minimum(target, S - 1)], 0)
        out = jnp.take(a_BS, jnp.asarray(source, jnp.int32), axis=1)
        return jnp.where(jnp.asarray(valid)[None], out, jnp.zeros((), a_BS.dtype))


def row_layout(parts: int, kind: str, seq_len: int) -> Layout:
    """The layout of a traced row of `seq_len` tokens with the sequence split over `parts`
    devices: natural (`Layout()`) when it is not split, and for the short dummy rows parameter
    init traces, which no layout splits (data.seq_len is checked to split)."""
    layout = Layout(parts, kind)
    return Layout() if parts == 1 or seq_len % layout.chunks else layout


def natural_order(x: jax.Array, layout: Layout, axis: int = 1) -> jax.Array:
    """A whole row in layout order -> natural order along `axis`, by slices and a flip (no
    gather: no index arrays to keep for the backward)."""
    if not layout.permutes:
        return x
    C, S = layout.parts, x.shape[axis]
    halves = x.reshape(*x.shape[:axis], C, 2, S // (2 * C), *x.shape[axis + 1:])
    first, second = (lax.index_in_dim(halves, h, axis + 1, keepdims=False) for h in (0, 1))
    return jnp.concatenate([first, jnp.flip(second, axis)], axis).reshape(x.shape)


def layout_order(x: jax.Array, layout: Layout, axis: int = 1) -> jax.Array:
    """`natural_order`'s inverse: a whole row in natural order -> layout order."""
    if not layout.permutes:
        return x
    C, S = layout.parts, x.shape[axis]
    chunks = x.reshape(*x.shape[:axis], 2 * C, S // (2 * C), *x.shape[axis + 1:])
    early = lax.slice_in_dim(chunks, 0, C, axis=axis)
    late = jnp.flip(lax.slice_in_dim(chunks, C, 2 * C, axis=axis), axis)
    return jnp.stack([early, late], axis + 1).reshape(x.shape)


def to_layout(a: np.ndarray, layout: Layout) -> np.ndarray:
    """A host array [..., S] in natural order -> layout order (the batch the mesh splits)."""
    if not layout.permutes:
        return a
    return np.take(a, layout.order(a.shape[-1]), axis=-1)


def from_layout(a: np.ndarray, layout: Layout) -> np.ndarray:
    """`to_layout`'s inverse, for results read back per token."""
    if not layout.permutes:
        return a
    return np.take(a, np.argsort(layout.order(a.shape[-1])), axis=-1)
