"""Training: the pure steps (step, onebit_step), the `Trainer` and its one compile path (trainer),
state <-> checkpoint (resume), the loop (loop) and what it reports besides the loss (observer).
`dsjax.train.run(cfg, workdir)` trains a config; `run_eval` evaluates a
checkpoint (`--mode eval`), with `dsjax.evaluate` one floor below."""

from dsjax.train.loop import check_workdir, run, run_eval
from dsjax.train.observer import moe_record
from dsjax.train.onebit_step import onebit_step
from dsjax.train.resume import errors_layout, onebit_errors, train_extras, with_restored
from dsjax.train.step import (TrainState, finish_step, finite_by_group, nonfinite_groups,
                              train_step)
from dsjax.train.trainer import Trainer, build_trainer

__all__ = ["Trainer", "TrainState", "build_trainer", "check_workdir", "errors_layout",
           "finish_step", "finite_by_group", "moe_record", "nonfinite_groups", "onebit_errors",
           "onebit_step", "run", "run_eval", "train_extras", "train_step", "with_restored"]
