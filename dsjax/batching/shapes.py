"""Batch shapes: one global batch realised as micro-batches x accumulation x data replicas.

The one idea: in JAX every batch shape is its own compiled program, so a global batch G is
realised as G = micro_batch (rows per replica per micro-step) x accum_steps x mesh.data, and a
step's input is [accum_steps, G / accum_steps, S] (a 2-D [G, S] batch when accum_steps = 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsjax.model.batch import abstract_arrays


@dataclasses.dataclass(frozen=True)
class Shape:
    """One realisation of a global batch: batch = micro_batch x accum_steps x data."""
    batch: int  # global rows per optimizer step
    accum_steps: int  # micro-batches summed by one step
    data: int  # data-parallel replicas

    @property
    def micro_batch(self) -> int:
        """Rows per data-parallel replica per micro-step."""
        return self.batch // (self.accum_steps * self.data)

    @property
    def rows(self) -> int:
        """Global rows of one micro-batch."""
        return self.batch // self.accum_steps


def lr_scale(batch: int, reference: int, rule: str) -> float:
    """The learning-rate multiplier for `batch` rows against `reference`: 1, B/B0 or sqrt(B/B0)."""
    ratio = batch / reference
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def step_sharding(base: NamedSharding, accumulating: bool) -> NamedSharding:
    """The sharding of one batch array: `base` ([B, ...], B over `data`), with a leading
    unsharded micro-batch axis when `accumulating` ([k, B/k, ...])."""
    return NamedSharding(base.mesh, P(None, *base.spec)) if accumulating else base


def host_layout(host_batch: dict[str, np.ndarray], accum_steps: int, workers: int
                ) -> dict[str, np.ndarray]:
    """This process's [R, S] rows -> [k, R/k, S] for k accumulation steps over its `workers`
    data-parallel shards. Without accumulation worker w holds rows [w R/W, (w+1) R/W); here
    micro-batch i holds each worker's i-th stretch of those same rows, so every worker sums
    exactly the rows it would have had (1-bit Adam compresses per worker: its result depends on
    it). k = 1 keeps [R, S]."""
    if accum_steps == 1:
        return host_batch
    out = {}
    for key, v in host_batch.items():
        m = v.shape[0] // (workers * accum_steps)
        per_worker = v.reshape(workers, accum_steps, m, *v.shape[1:])
        out[key] = per_worker.swapaxes(0, 1).reshape(accum_steps, workers * m, *v.shape[1:])
    return out


def abstract_batch(batch_shardings: dict[str, NamedSharding], shape: Shape, seq_len: int,
                   media: dict[str, tuple[tuple[int, ...], Any]] | None = None
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """A step's input for `shape` as abstract arrays with their shardings (for lowering): [B, S]
    token arrays, and per `media` key (dsjax.model.batch.media_layout) [B, *dims] of its dtype;
    with accumulation [k, B/k, ...]."""
    accumulating = shape.accum_steps > 1
    lead = (shape.accum_steps, shape.rows) if accumulating else (shape.batch,)
    return abstract_arrays({k: step_sharding(s, accumulating) for k, s in batch_shardings.items()},
                           lead, seq_len, media)


def batch_shape(batch: dict[str, Any], data: int) -> Shape:
    """The `Shape` of a device or host batch."""
    dims = batch["inputs"].shape
    return Shape(dims[0], 1, data) if len(dims) == 2 else Shape(dims[0] * dims[1], dims[0], data)
