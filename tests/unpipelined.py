"""The "matches the unpipelined model" harness the pipeline tests share: a function of
(objective, params, batch) run on the trainer's mesh with the pipelined objective, and again on
one device with the plain decoder (`ModelLoss`) and the same weights, and gradients compared per
tensor by relative Frobenius norm."""

import functools

import jax
import numpy as np

from dsjax import sharding
from dsjax.model.loss import ModelLoss, loss_fn


def loss_and_grads(objective, params, batch):
    """(loss, gradients of the loss) under `objective`."""
    return jax.value_and_grad(lambda p: loss_fn(p, objective, batch)[0])(params)


def objective_and_aux(objective, params, batch):
    """((loss + aux_loss, (loss, aux)), gradients of loss + aux_loss): a MoE model's objective."""
    def total(p):
        loss, _, aux = objective.loss_and_aux(p, batch)
        return loss + aux["aux_loss"], (loss, aux)
    return jax.value_and_grad(total, has_aux=True)(params)


def pipelined_and_plain(trainer, state, host_batch, fn=loss_and_grads, objective=None):
    """(fn on the mesh with `objective` (default: the state's pipelined one), fn on one device
    with the plain decoder), both on the host. The same weights: the reference reads them back."""
    objective = objective or state.objective
    with sharding.activate(trainer.mesh, trainer.rules):
        got = jax.jit(functools.partial(fn, objective))(state.params,
                                                        trainer.device_batch(host_batch))
    params = jax.device_get(state.params)
    want = jax.jit(functools.partial(fn, ModelLoss(state.objective.model)))(params, host_batch)
    return jax.device_get(got), jax.device_get(want)


def assert_grads_match(grads, ref_grads, rtol=1e-5, floor=0.0):
    """Each gradient tensor within `rtol` of the reference's in relative Frobenius norm (float32
    reordering only: a wrong stage order, a lost microbatch or a double-counted replicated
    gradient moves it by O(1)). `floor`: a share of the whole gradient's norm below which a
    tensor's own norm is not the scale (a key bias, whose true gradient is 0, is rounding noise)."""
    scale = np.sqrt(sum(np.sum(np.square(r)) for r in jax.tree.leaves(ref_grads)))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(ref_grads)):
        rel = np.linalg.norm(g - r) / max(np.linalg.norm(r), floor * scale)
        assert rel < rtol, (jax.tree_util.keystr(path), rel)
