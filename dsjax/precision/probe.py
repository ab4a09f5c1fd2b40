"""The probe's own compiled program: one float32 forward and backward of the unpipelined model on
a training micro-batch, every projection in `fp8.matmuls` measured (`fp8_probe`).

The one idea: the probe is a pure function of (params, batch) with its own jit, so it never
touches the training state or the training step's compiled programs; its stats come back as the
gradient of a zero `fp8_probe` collection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import fp8_probe, sharding
from dsjax.fp8_policy import Fp8Policy
from dsjax.model.batch import media_args
from dsjax.model.decoder import Transformer
from dsjax.model.layers import ROUTED_EXPERTS, policy_name, probe_tokens
from dsjax.model.loss import AUX, head_nll, objective_value

STACKS = ("layers", "moe_layers")  # the decoder's scanned stacks, in layer order


def probe_model(model: Transformer, other_dtype: str) -> Transformer:
    """The training model as the probe runs it: float32 everywhere, every layer's projections
    in the policy's matmuls measured, no pipeline or run-time switch."""
    policy = model.fp8_policy
    # "delayed" scales from a history the probe does not read: it measures with current
    # scales (fp8_probe.measure), and so its model carries no fp8_meta.
    recipe = "current" if policy.recipe == "delayed" else policy.recipe
    return model.clone(parent=None, dtype=jnp.float32, fp8_switch=(), fp8_policy=Fp8Policy(
        matmuls=policy.matmuls, recipe=recipe, history=policy.history, probe=other_dtype))


def _probe_loss(model: Transformer, params: Any, tokens: Any, batch: dict[str, jax.Array]
                ) -> jax.Array:
    (x_BSD, head_DV), sown = model.apply(
        {"params": params, fp8_probe.COLLECTION: tokens}, batch["inputs"], batch["positions"],
        batch["segment_ids"], batch["targets"], batch["weights"], head_inputs=True,
        mutable=[AUX], **media_args(batch))
    total, count = head_nll(x_BSD, head_DV, batch["targets"], batch["weights"],
                            dtype=model.dtype, chunk=model.cfg.loss_chunk)
    aux = {key: values[0] for key, values in sown.get(AUX, {}).items()}
    return objective_value(total / jnp.maximum(count, 1.0), aux)


def _probe_step(model: Transformer, params: Any, batch: dict[str, jax.Array]) -> Any:
    tokens = {name: probe_tokens(params[name], model.fp8_policy.matmuls)
              for name in STACKS if name in params}
    return jax.grad(lambda t: _probe_loss(model, params, t, batch))(tokens)


def _stack_leaves(tree: dict) -> list[tuple[int, list[tuple[list[str], Any]]]]:
    """Per scanned stack of `tree`, in layer order: (its layer count, [(key path, leaf)])."""
    out = []
    for name in STACKS:
        if name in tree:
            leaves = [([str(getattr(k, "key", k)) for k in path], value)
                      for path, value in jax.tree_util.tree_flatten_with_path(tree[name])[0]]
            out.append((leaves[0][1].shape[0], leaves))
    return out


def stats_by_layer(grads: dict, matmuls: tuple[str, ...]) -> np.ndarray:
    """[L, len(matmuls), len(STATS)] from the probe's gradient tree: each projection's stats
    (MLA's two factors of q, and of k, combined by maximum), the stacks in layer order."""
    per_stack = []
    for n, leaves in _stack_leaves(grads):
        out = np.zeros((n, len(matmuls), len(fp8_probe.STATS)), np.float64)
        for keys, value in leaves:
            j = matmuls.index(policy_name(keys[-1]))
            out[:, j] = np.maximum(out[:, j], np.asarray(value, np.float64))
        per_stack.append(out)
    return np.concatenate(per_stack)


def flops_weights(params: Any, matmuls: tuple[str, ...], top_k: int, experts: int
                  ) -> np.ndarray:
    """[L, P]: each projection's multiply-adds per token (its weight's size per layer; routed
    experts count top_k / experts of theirs, beside a MoE layer's shared experts)."""
    per_stack = []
    for n, leaves in _stack_leaves(params):
        out = np.zeros((n, len(matmuls)))
        for keys, value in leaves:
            proj = policy_name(keys[-1])
            if proj in matmuls and len(value.shape) >= 3:
                size = float(np.prod(value.shape[1:]))
                if ROUTED_EXPERTS in keys[:-1] and experts:
                    size *= top_k / experts
                out[:, matmuls.index(proj)] += size
        per_stack.append(out)
    return np.concatenate(per_stack)


@dataclasses.dataclass
class Probe:
    """The probe for one trainer's model and mesh: `__call__(params, batch)` -> stats
    [L, P, len(STATS)] as numpy, from the first `rows` rows of `batch`'s first micro-batch."""
    model: Transformer  # the probe model (`probe_model`)
    mesh: Any
    rules: Any
    rows: int = 0  # at most this many rows of the micro-batch (0: all)

    def __post_init__(self):
        self._fn = jax.jit(_probe_step, static_argnums=0)

    def __call__(self, params: Any, batch: dict[str, jax.Array]) -> np.ndarray:
        if batch["inputs"].ndim == 3:  # accumulation: [k, B/k, S] -> the first micro-batch
            batch = {k: v[0] for k, v in batch.items()}
        if self.rows:
            batch = {k: v[:self.rows] for k, v in batch.items()}
        with sharding.activate(self.mesh, self.rules):
            grads = self._fn(self.model, params, batch)
        return stats_by_layer(jax.device_get(grads), self.model.fp8_policy.matmuls)
