"""The training objective: next-token cross-entropy over weighted positions, and the unpipelined
model seen as a loss.

The one idea: the loop never asks whether the model is pipelined. `ModelLoss` (here) and
`dsjax.pipeline.Pipelined` expose the same `loss_and_aux(params, batch, fp8_meta, seed)`, and
`TrainState.objective` holds one of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dsjax import fp8
from dsjax.model.batch import media_args
from dsjax.model.chunked_loss import chunked_cross_entropy, output_logits

AUX = "aux"  # the collection MoE/MTP models sow their auxiliary losses and expert loads into


def weighted_cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array,
                           weights_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted next-token NLL in nats, sum of weights); logits in float32."""
    logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    # A one-hot contraction rather than take_along_axis: it stays a fused reduction when the vocab
    # axis is sharded over `tensor`.
    target_logit_BS = jnp.sum(logits_BSV * jax.nn.one_hot(targets_BS, logits_BSV.shape[-1],
                                                          dtype=logits_BSV.dtype), axis=-1)
    nll_BS = (logz_BS - target_logit_BS) * weights_BS
    return jnp.sum(nll_BS), jnp.sum(weights_BS)


def head_nll(x_BSD: jax.Array, head_DV: jax.Array, targets_BS: jax.Array,
             weights_BS: jax.Array, *, dtype: Any, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The output head on final-normed x [B, S, D] and its (summed weighted NLL, weight sum):
    over sequence chunks of `chunk` positions (`model.loss_chunk`), or with 0 from the whole
    [B, S, V] logits."""
    if chunk:
        return chunked_cross_entropy(x_BSD, head_DV, targets_BS, weights_BS, dtype=dtype,
                                     chunk=chunk)
    return weighted_cross_entropy(output_logits(x_BSD, head_DV, dtype), targets_BS, weights_BS)


def model_variables(params: Any, fp8_meta: Any = None) -> dict[str, Any]:
    """The variables `model.apply` takes: the params, and delayed fp8 scaling state if any."""
    variables = {"params": params}
    if fp8_meta:
        variables[fp8.META_COLLECTION] = fp8_meta
    return variables


@dataclasses.dataclass(frozen=True)
class ModelLoss:
    """An unpipelined `Transformer` as a loss. Calling it is `model.apply` (evaluation,
    generation), as for `Pipelined`."""
    model: Any  # dsjax.model.decoder.Transformer

    def __call__(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs)

    def nll_sum(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
                ) -> tuple[jax.Array, jax.Array]:
        """Sum of next-token NLL over weighted positions, and the weight sum (no MTP heads)."""
        x_BSD, head_DV = self.model.apply(model_variables(params, fp8_meta), batch["inputs"],
                                          batch["positions"], batch["segment_ids"],
                                          head_inputs=True, **media_args(batch))
        return self._head_nll(x_BSD, head_DV, batch)

    def loss_and_aux(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None,
                     seed: Any = 1.0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(mean next-token NLL over weighted positions, the weight sum, the model's auxiliary
        terms): for MoE/MTP models (DeepSeek-V2/V3) "aux_loss" (to add to the NLL: balance and
        MTP losses, weighted), "moe_load" [MoE layers, E] and "mtp_loss"; {} for dense models.
        `seed`, the float16 loss scale the caller's backward starts from, is for objectives
        that differentiate themselves (`Pipelined`'s 1F1B); `jax.grad` applies it here."""
        del seed
        (x_BSD, head_DV), sown = self.model.apply(
            model_variables(params, fp8_meta), batch["inputs"], batch["positions"],
            batch["segment_ids"], batch["targets"], batch["weights"], head_inputs=True,
            mutable=[AUX], **media_args(batch))
        total, count = self._head_nll(x_BSD, head_DV, batch)
        aux = {key: values[0] for key, values in sown.get(AUX, {}).items()}  # sow keeps tuples
        return total / jnp.maximum(count, 1.0), count, aux

    def _head_nll(self, x_BSD, head_DV, batch):
        return head_nll(x_BSD, head_DV, batch["targets"], batch["weights"],
                        dtype=self.model.dtype, chunk=self.model.cfg.loss_chunk)


def objective_value(nll: jax.Array, aux: dict[str, jax.Array]) -> jax.Array:
    """THE training objective, what every step differentiates: the NLL term plus the model's
    auxiliary losses (MoE balance, MTP, weighted; none for dense models)."""
    return nll + aux.get("aux_loss", 0.0)


def weigh_aux(aux: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    """A part's auxiliary terms weighted like its NLL (`weight`: its share of the tokens, or
    its token count): the losses scale, expert loads are counts and add up unweighted."""
    return {k: v if k == "moe_load" else v * weight for k, v in aux.items()}


def loss_fn(params: Any, objective: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
            ) -> tuple[jax.Array, jax.Array]:
    """`objective_value` of a batch (mean next-token NLL over weighted positions plus the
    auxiliary losses), and the weight sum. `objective`: a `ModelLoss` or a `Pipelined`."""
    loss, count, aux = objective.loss_and_aux(params, batch, fp8_meta)
    return objective_value(loss, aux), count
