"""Optimizers: `make_optimizer(cfg)` returns (AdamW as an optax transform, or 1-bit Adam;
learning-rate schedule)."""

from dsjax.optim.factory import decay_mask, make_optimizer, make_schedule
from dsjax.optim.onebit import OneBitAdam, OneBitAdamState, onebit_adam

__all__ = ["OneBitAdam", "OneBitAdamState", "decay_mask", "make_optimizer", "make_schedule",
           "onebit_adam"]
