"""Optimizers: `make_optimizer(cfg)` returns (optax transform, learning-rate schedule)."""

from dsjax.optim.factory import decay_mask, make_optimizer, make_schedule

__all__ = ["decay_mask", "make_optimizer", "make_schedule"]
