"""`Pipelined`: a `Transformer` trained through a pipeline schedule over the "pipeline" mesh axis.

The one idea: it exposes the same `loss_and_aux(params, batch, fp8_meta)` as
`dsjax.model.loss.ModelLoss`, so the train step never asks whether the model is pipelined; the
schedule (gpipe, circular, 1f1b or interleaved_1f1b) is chosen here. See docs/pipeline.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dsjax.config import PipelineConfig
from dsjax.config.sections import HAND_BACKWARD_SCHEDULES
from dsjax.errors import ConfigError
from dsjax.model.decoder import Transformer, mtp_weights
from dsjax.pipeline.gpipe import forward_pipeline
from dsjax.pipeline.one_f_one_b import one_f_one_b_loss
from dsjax.pipeline.stages import StagedModel, aux_terms


@dataclasses.dataclass(frozen=True)
class Pipelined(StagedModel):
    """`TrainState.objective` when mesh.pipeline > 1. Calling it is the unpipelined
    `model.apply` (evaluation, generation); `loss_and_aux` is the pipelined loss, differentiable
    with `jax.grad`. Call both under the mesh (`sharding.activate`)."""

    # mesh.fsdp: the params' shardings without `data` ((treedef, specs), hashable: this is a
    # static field of the train state); the pipeline gathers them once per step.
    gathered: tuple | None = None

    def __call__(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs)

    def gather(self, params: Any) -> Any:
        """With mesh.fsdp: `params` all-gathered over `data` (each stage's weights whole,
        still split over the stages and `tensor`), before the schedule's shard_map. XLA's SPMD
        partitioner fails on data-sharded weights inside it; outside it the gather is one
        all-gather per step, and the gradients come back through it summed over `data` and
        sliced to the fsdp sharding (an all-reduce and a slice in the CPU HLO)."""
        if self.gathered is None:
            return params
        treedef, specs = self.gathered
        leaves = jax.tree.leaves(params)
        return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(p, s)
                                            for p, s in zip(leaves, specs)])

    def loss_and_aux(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None,
                     seed: Any = 1.0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(mean next-token NLL, weight sum, auxiliary terms), like `ModelLoss.loss_and_aux`. A MoE
        model's terms are the unpipelined model's for the whole batch: "aux_loss" = alpha x the
        balance loss summed over layers (each layer's mean over rows: the mean over microbatches
        of their row means) and "moe_load" [L, E] (assignment counts summed over microbatches).
        gpipe/circular: `jax.grad` differentiates each term. The 1F1B schedules differentiate
        the training objective NLL + aux_loss as one inside the schedule: the returned NLL
        carries that whole gradient and aux_loss none, so any function of their sum (the
        training objective) has the exact gradient, but not the NLL alone. `seed`: the cotangent
        the caller differentiates the objective with (the float16 loss scale); the 1F1B
        schedules start their own backward from it."""
        rows = batch["inputs"].shape[0]
        if rows % self.microbatches:  # e.g. a dynamic batch size (dsjax/batching/) off the grid
            raise ConfigError(f"pipeline.microbatches: a batch of {rows} rows does not split "
                              f"into {self.microbatches} microbatches")
        count = jnp.sum(batch["weights"])
        # Each MTP module's loss is its mean over the whole batch's valid positions: [n].
        mtp_count = jnp.sum(mtp_weights(batch["weights"], self.model.cfg.num_mtp_layers,
                                           self.model.seq_layout(batch["weights"].shape[-1])),
                            axis=(1, 2))
        micro = _microbatches(batch, self.microbatches)
        params = self.gather(params)
        if self.schedule in HAND_BACKWARD_SCHEDULES:
            nll, aux = one_f_one_b_loss(self, params, fp8_meta or {}, micro, count, mtp_count,
                                        seed)
            return nll, count, aux
        total, balance, load_LE, mtp = forward_pipeline(self, params, fp8_meta or {}, micro)
        return (total / jnp.maximum(count, 1.0), count,
                aux_terms(self, balance, load_LE, mtp, mtp_count))


def make(model: Transformer, cfg: PipelineConfig, stages: int, typed: bool) -> Pipelined:
    """The `Pipelined` model for `cfg` (the validated pipeline section) over `stages` stages.
    Expert parallelism makes it untyped: the MoE all-to-all's own shard_map (manual over `data`,
    unchecked) nests inside the stages' and hands back cotangents without the `pipeline`
    variance a typed outer shard_map expects (the gradients are the same either way)."""
    if model.cfg.is_moe and model.cfg.expert_parallel:
        typed = False
    return Pipelined(model, stages, cfg.schedule, cfg.microbatches, cfg.repeats, typed)


def _microbatches(batch: dict[str, jax.Array], M: int) -> dict[str, jax.Array]:
    """[B, ...] -> [M, B/M, ...] for every array of the batch (token arrays and media);
    microbatch m = rows m, M + m, ... (keeps the rows' sharding)."""
    def split(a):
        return jnp.swapaxes(a.reshape(a.shape[0] // M, M, *a.shape[1:]), 0, 1)
    return {k: split(a) for k, a in batch.items()}
