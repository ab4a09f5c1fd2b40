"""Parameter groups (`train.trainable`): which top-level params are the vision tower, the
projector and the language model, and a mask of those that learn.

The one idea: a group is decided by a parameter's top-level name alone, here, once. The train step
stops the gradient of a frozen group (its backward is never run) and the optimizer gives it a
zero update, so a frozen parameter and its optimizer moments stay bit for bit as they were
(docs/multimodal.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from dsjax.config.sections import TRAINABLE_GROUPS

# Top-level param names of the vision groups (dsjax.model.vision); every other name is "lm".
GROUP_OF_NAME = {"vision_tower": "vision", "projector": "projector"}


def group_of(top_name: str) -> str:
    """The group of a top-level parameter name."""
    return GROUP_OF_NAME.get(top_name, "lm")


def _top_name(path) -> str:
    key = path[0]
    return str(getattr(key, "key", getattr(key, "name", key)))


def trainable_mask(params: Any, groups: tuple[str, ...]) -> Any:
    """A bool per leaf of `params` (boxed or not): True where its group is in `groups`."""
    groups = set(groups)
    return jax.tree_util.tree_map_with_path(lambda path, _: group_of(_top_name(path)) in groups,
                                            params)


def freezes(groups: tuple[str, ...]) -> bool:
    """Whether `groups` leaves any group frozen."""
    return set(TRAINABLE_GROUPS) - set(groups) != set()


def stop_frozen(params: Any, groups: tuple[str, ...]) -> Any:
    """`params` with the gradient of every frozen group stopped (values unchanged)."""
    if not freezes(groups):
        return params
    return jax.tree.map(lambda p, train: p if train else jax.lax.stop_gradient(p), params,
                        trainable_mask(params, groups))


def only_trainable(tx: optax.GradientTransformation, groups: tuple[str, ...]
                   ) -> optax.GradientTransformation:
    """`tx`, with zero updates for the frozen groups. Their gradients are zero (`stop_frozen`),
    so Adam's moments of a frozen parameter stay at their initial zeros and clipping sees the
    trainable gradients alone; the final mask removes what does not come from the gradient
    (weight decay). The state keeps one layout for every choice of groups (optax's
    multi_transform would drop the frozen moments, at the price of a state whose layout depends
    on train.trainable)."""
    if not freezes(groups):
        return tx

    def zero_frozen(updates, params):
        return jax.tree.map(lambda u, train: u if train else jnp.zeros_like(u), updates,
                            trainable_mask(updates, groups))
    return optax.chain(tx, optax.stateless(zero_frozen))
