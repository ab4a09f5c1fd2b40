"""The training state and the module-level pure `train_step`.

The one idea: a step never commits anything non-finite. A non-finite loss or gradient leaves
params, optimizer state and fp8 state as they were (so nothing non-finite can be checkpointed)
and reports `finite = False`; the host decides whether to stop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dsjax import fp8
from dsjax.batching import accumulate, scale_updates
from dsjax.config.sections import TRAINABLE_GROUPS
from dsjax.model import moe
from dsjax.model.loss import objective_value, weigh_aux
from dsjax.model.preference import METRICS as DPO_METRICS
from dsjax.model.preference import PreferenceLoss, pair_count
from dsjax.optim import OneBitAdam
from dsjax.optim import loss_scale as ls
from dsjax.optim.groups import stop_frozen


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: ls.LossScale  # float16: dynamic scale; otherwise fixed 1, counts skipped steps
    fp8_meta: Any  # delayed fp8 scaling state ({} otherwise): never seen by the optimizer
    objective: Any = struct.field(pytree_node=False)  # ModelLoss, or Pipelined (mesh.pipeline > 1)
    tx: optax.GradientTransformation | OneBitAdam = struct.field(pytree_node=False)
    lr_fn: Callable = struct.field(pytree_node=False)
    fp8_margin: float = struct.field(pytree_node=False, default=0.0)
    router_bias_speed: float = struct.field(pytree_node=False, default=0.0)  # MoE sigmoid
                            # routers: aux-loss-free bias step after each step (DeepSeek-V3)
    trainable: tuple[str, ...] = struct.field(pytree_node=False, default=TRAINABLE_GROUPS)
                            # parameter groups that learn (train.trainable, dsjax.optim.groups)
    layer_norms: bool = struct.field(pytree_node=False, default=False)  # metrics carry each
                            # layer's gradient norm (fp8.select=auto's spike rule reads them)
    ref_params: Any = None  # train.task='dpo': the frozen reference policy, the run's starting
                            # params (never updated, no optimizer state); None otherwise


def finite_by_group(grads: Any) -> dict[str, jax.Array]:
    """{"layers/mlp/up": all finite?} per gradient leaf: what a non-finite report names."""
    def name(path):
        return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return {name(path): jnp.all(jnp.isfinite(g))
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


def layer_grad_norms(grads: Any, per_worker: Any = None) -> jax.Array | None:
    """[L]: each decoder layer's gradient norm (the scanned stacks, in layer order); None for a
    params tree without them. `per_worker`: a tree of bools like `grads`, True where a leaf
    carries a leading axis of the data-parallel workers' own gradients (1-bit Adam): their root
    mean square. `fp8.select=auto` demotes a layer whose norm spikes."""
    names = [k for k in ("layers", "moe_layers") if isinstance(grads, dict) and k in grads]
    if not names:
        return None
    squares = []
    for name in names:
        leaves = jax.tree.leaves(grads[name])
        workers = (jax.tree.leaves(per_worker[name]) if per_worker is not None
                   else [False] * len(leaves))
        total = 0.0
        for g, w in zip(leaves, workers):
            sq = jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1 + w, g.ndim)))
            total = total + (jnp.mean(sq, axis=0) if w else sq)
        squares.append(total)
    return jnp.sqrt(jnp.concatenate(squares))


def nonfinite_groups(metrics: dict[str, Any]) -> str:
    """The host's one-line account of which parameter groups had non-finite gradients."""
    bad = [k for k, ok in sorted(metrics.get("grad_finite", {}).items()) if not bool(ok)]
    if not bad:
        return "every gradient is finite: the loss itself is not"
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return f"non-finite gradients in {', '.join(bad[:6])}{more}"


def finish_step(state: TrainState, batch: dict[str, jax.Array], lr_scale: float,
                loss: jax.Array, tokens: jax.Array, aux: dict[str, jax.Array], grads: Any,
                grad_norm: jax.Array, new_params: Any, new_opt_state: Any, meta_grads: Any,
                per_worker: Any = None) -> tuple[TrainState, dict]:
    """Every train step's tail: moves MoE router biases by the expert loads (outside the
    gradient, DeepSeek-V3), applies the results unless the loss or gradient is non-finite, and
    returns the metrics (`grads`: what the non-finite report names, per leaf; `per_worker`:
    see `layer_grad_norms`)."""
    if "moe_load" in aux and state.router_bias_speed:
        new_params = moe.with_updated_router_bias(new_params, state.params, aux["moe_load"],
                                                  state.router_bias_speed)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_meta = fp8.commit(state.fp8_meta, meta_grads, state.fp8_margin) if state.fp8_meta else {}
    params, opt_state, fp8_meta = ls.select(finite, (new_params, new_opt_state, new_meta),
                                            (state.params, state.opt_state, state.fp8_meta))
    new_state = state.replace(step=state.step + finite.astype(state.step.dtype), params=params,
                              opt_state=opt_state, fp8_meta=fp8_meta,
                              loss_scale=ls.update(state.loss_scale, finite))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": state.lr_fn(state.step) * lr_scale,
               "finite": finite, "tokens": tokens, "loss_scale": state.loss_scale.scale,
               "skipped_steps": new_state.loss_scale.skipped_steps,
               "grad_finite": finite_by_group(grads), **moe.load_metrics(aux),
               **{k: aux[k] for k in DPO_METRICS if k in aux}}
    norms = layer_grad_norms(grads, per_worker) if state.layer_norms else None
    if norms is not None:
        metrics["layer_grad_norm"] = norms
    if "image_mask" in batch:  # images and video frames in a vision-language batch
        metrics["images"] = jnp.sum(batch["image_mask"])
    return new_state, metrics


def batch_count(objective: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """What the objective's loss is a mean over, in the whole batch (every micro-batch): the
    preference pairs for DPO, else the weighted target tokens. Each micro-batch's share of the
    batch's mean is its own count over this."""
    if isinstance(objective, PreferenceLoss):
        return jnp.maximum(pair_count(batch["segment_ids"]), 1.0)
    return jnp.maximum(jnp.sum(batch["weights"]), 1.0)


def train_step(state: TrainState, batch: dict[str, jax.Array], lr_scale: float = 1.0
               ) -> tuple[TrainState, dict]:
    """One optimizer step. A non-finite loss or gradient leaves params, optimizer state and fp8
    state as they were (so nothing non-finite can be checkpointed), halves a float16 loss scale,
    and reports `finite = False`; the host decides whether to stop (train.nonfinite).
    `batch`: [B, S] arrays, or [k, B/k, S]: k micro-batches whose gradients are accumulated
    (dsjax.batching), the same update as one [B, S] batch. `lr_scale` multiplies the learning
    rate (bound per batch size by dsjax.batching). DPO (`state.ref_params` set): each
    micro-batch's reference log-probs are computed first, from the frozen reference params."""
    accumulating = batch["inputs"].ndim == 3
    count = batch_count(state.objective, batch)

    def micro_grads(micro):
        if state.ref_params is not None:  # DPO: the reference's log-probs, outside the gradient
            micro = state.objective.with_reference(state.ref_params, micro, state.fp8_meta)

        def scaled_loss(params, fp8_meta):
            loss, tokens, aux = state.objective.loss_and_aux(
                stop_frozen(params, state.trainable), micro, fp8_meta, state.loss_scale.scale)
            if accumulating:  # this micro-batch's share of the whole batch's mean loss
                share = tokens / count  # (DPO: `tokens` counts its pairs)
                loss, aux = loss * share, weigh_aux(aux, share)
            return (ls.scale_loss(state.loss_scale, objective_value(loss, aux)),
                    (loss, tokens, aux))

        (_, sums), (grads, meta_grads) = jax.value_and_grad(
            scaled_loss, argnums=(0, 1), has_aux=True)(state.params, state.fp8_meta)
        return sums, grads, meta_grads

    (loss, tokens, aux), grads, meta_grads = accumulate(micro_grads, batch)
    grads = ls.unscale_grads(state.loss_scale, grads)
    grad_norm = optax.tree.norm(grads)
    updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, scale_updates(updates, lr_scale))
    return finish_step(state, batch, lr_scale, loss, tokens, aux, grads, grad_norm, new_params,
                       new_opt_state, meta_grads)
