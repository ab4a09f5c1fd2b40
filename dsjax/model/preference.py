"""Direct preference optimisation (DPO; Rafailov et al. 2023, eq. 7): the sequence log-probs of
packed preference pairs, and the loss against a frozen reference policy.

The one idea: a preference row packs whole pairs, segment 2j-1 the chosen and segment 2j the
rejected sequence (prompt + reply) of pair j, 0 padding, with weight 1 on exactly the reply
targets. A sequence's log-prob is then one segment sum of weight x log p(target) along the row,
and the head runs as it does for the next-token loss (in `model.loss_chunk` chunks, per-token NLL
out instead of their sum), so no logits beyond the loss's own [B, c, V] chunk ever exist. The
reference's log-probs come from the frozen starting weights outside the gradient
(`with_reference`) and ride in the batch. Shape letters beyond the package legend: P pair slots
per row (S // 2), G segment ids per row (0 .. 2P).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dsjax.model.batch import media_args
from dsjax.model.chunked_loss import chunked_token_nll, output_logits
from dsjax.model.loss import AUX, model_variables

# The frozen reference's sequence log-probs [B, P], added to a batch by `with_reference`.
REFERENCE_KEYS = ("ref_chosen_logp", "ref_rejected_logp")
# What a DPO step reports, each a mean over the batch's pairs (metrics.jsonl, the console).
METRICS = ("dpo_reward_accuracy", "dpo_reward_margin", "dpo_chosen_logp", "dpo_rejected_logp")


class Pairs(NamedTuple):
    """Per pair slot of each row: the chosen and rejected sequence log-probs, and whether the
    row holds that pair."""
    chosen_BP: jax.Array
    rejected_BP: jax.Array
    present_BP: jax.Array  # bool


def token_logps(x_BSD: jax.Array, head_DV: jax.Array, targets_BS: jax.Array, *, dtype: Any,
                chunk: int) -> jax.Array:
    """log p(target) [B, S] float32 at each position, from final-normed x and the head: over
    sequence chunks of `chunk` positions (`model.loss_chunk`), or with 0 from whole logits."""
    if chunk:
        return -chunked_token_nll(x_BSD, head_DV, targets_BS, dtype=dtype, chunk=chunk)
    logits_BSV = output_logits(x_BSD, head_DV, dtype)
    # A one-hot contraction, as weighted_cross_entropy: fused when the vocab is over `tensor`.
    target_BS = jnp.sum(logits_BSV * jax.nn.one_hot(targets_BS, logits_BSV.shape[-1],
                                                    dtype=logits_BSV.dtype), axis=-1)
    return target_BS - jax.nn.logsumexp(logits_BSV, axis=-1)


def _segment_sums(values_BS: jax.Array, segment_ids_BS: jax.Array) -> jax.Array:
    """[B, G] sums of `values` per segment id 0 .. 2P of each row. A segment holds at least one
    position, so a row of S positions holds at most S // 2 whole pairs."""
    G = 2 * (segment_ids_BS.shape[-1] // 2) + 1
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=G))(values_BS,
                                                                            segment_ids_BS)


def _present(segment_ids_BS: jax.Array) -> jax.Array:
    """[B, P] bool: the row holds both sequences of pair slot p."""
    size_BG = _segment_sums(jnp.ones(segment_ids_BS.shape, jnp.float32), segment_ids_BS)
    return (size_BG[:, 1::2] > 0) & (size_BG[:, 2::2] > 0)


def pair_logps(logp_BS: jax.Array, weights_BS: jax.Array, segment_ids_BS: jax.Array) -> Pairs:
    """Each pair's chosen (segment 2j-1) and rejected (2j) sequence log-prob: the sum of
    weight x log p(target) over the segment's positions."""
    sums_BG = _segment_sums(logp_BS * weights_BS, segment_ids_BS)
    return Pairs(sums_BG[:, 1::2], sums_BG[:, 2::2], _present(segment_ids_BS))


def pair_count(segment_ids: jax.Array) -> jax.Array:
    """The pairs of a whole batch ([B, S], or [k, B/k, S] with accumulation), float32: what the
    DPO loss is a mean over."""
    return jnp.sum(_present(segment_ids.reshape(-1, segment_ids.shape[-1])), dtype=jnp.float32)


def dpo_loss(policy: Pairs, ref_chosen_BP: jax.Array, ref_rejected_BP: jax.Array, beta: float
             ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(mean over the present pairs of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))),
    the pair count, `METRICS`): the implicit reward of a sequence is beta (pi - ref), accuracy the
    share of pairs whose chosen reward is strictly above the rejected one (so 0 at the start,
    where policy = reference), margin the mean reward difference."""
    present_BP = policy.present_BP
    pairs = jnp.sum(present_BP, dtype=jnp.float32)
    chosen_BP = beta * (policy.chosen_BP - ref_chosen_BP)
    rejected_BP = beta * (policy.rejected_BP - ref_rejected_BP)
    z_BP = chosen_BP - rejected_BP

    def mean(v_BP):
        return jnp.sum(jnp.where(present_BP, v_BP, 0.0)) / jnp.maximum(pairs, 1.0)

    metrics = {"dpo_reward_accuracy": mean((z_BP > 0).astype(jnp.float32)),
               "dpo_reward_margin": mean(z_BP),
               "dpo_chosen_logp": mean(policy.chosen_BP),
               "dpo_rejected_logp": mean(policy.rejected_BP)}
    return mean(-jax.nn.log_sigmoid(z_BP)), pairs, jax.lax.stop_gradient(metrics)


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """An unpipelined `Transformer` as the DPO objective (`TrainState.objective` for
    train.task='dpo'), with `ModelLoss`'s `loss_and_aux(params, batch, fp8_meta, seed)`. Its
    batches carry the reference's sequence log-probs (`with_reference`)."""
    model: Any  # dsjax.model.decoder.Transformer
    beta: float  # train.dpo_beta

    def __call__(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs)

    def sequence_logps(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
                       ) -> tuple[Pairs, dict[str, jax.Array]]:
        """(the pairs' sequence log-probs under `params`, the model's auxiliary terms as
        `ModelLoss` gives them). MTP modules do not run: they would learn the rejected replies."""
        (x_BSD, head_DV), sown = self.model.apply(
            model_variables(params, fp8_meta), batch["inputs"], batch["positions"],
            batch["segment_ids"], head_inputs=True, mutable=[AUX], **media_args(batch))
        logp_BS = token_logps(x_BSD, head_DV, batch["targets"], dtype=self.model.dtype,
                              chunk=self.model.cfg.loss_chunk)
        aux = {key: values[0] for key, values in sown.get(AUX, {}).items()}  # sow keeps tuples
        cfg = self.model.cfg
        if "moe_load" in aux and cfg.num_mtp_layers:
            # The MTP modules' MoE blocks route nothing here; the step's router-bias update
            # reads one row of loads per MoE layer, theirs included (moe.BIAS_STACKS). Zero
            # loads are even: their biases stay.
            idle_LE = jnp.zeros((cfg.num_mtp_layers, aux["moe_load"].shape[-1]),
                                aux["moe_load"].dtype)
            aux["moe_load"] = jnp.concatenate([aux["moe_load"], idle_LE])
        return pair_logps(logp_BS, batch["weights"], batch["segment_ids"]), aux

    def with_reference(self, ref_params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None
                       ) -> dict[str, jax.Array]:
        """`batch` with the frozen reference's sequence log-probs (`REFERENCE_KEYS`), which no
        gradient ever reaches."""
        ref, _ = self.sequence_logps(jax.lax.stop_gradient(ref_params), batch, fp8_meta)
        return {**batch, REFERENCE_KEYS[0]: jax.lax.stop_gradient(ref.chosen_BP),
                REFERENCE_KEYS[1]: jax.lax.stop_gradient(ref.rejected_BP)}

    def loss_and_aux(self, params: Any, batch: dict[str, jax.Array], fp8_meta: Any = None,
                     seed: Any = 1.0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(mean DPO loss over the batch's pairs, the pair count, the model's auxiliary terms
        and `METRICS`). `seed` as for `ModelLoss` (`jax.grad` applies it)."""
        del seed
        policy, aux = self.sequence_logps(params, batch, fp8_meta)
        loss, pairs, metrics = dpo_loss(policy, batch[REFERENCE_KEYS[0]],
                                        batch[REFERENCE_KEYS[1]], self.beta)
        return loss, pairs, {**aux, **metrics}
