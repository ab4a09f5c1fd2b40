"""The training loop's view of dynamic batching: which shape the next step has, its host batch
read at the sample stream's cursor, the adaptive controller's readings, and the records."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np

from dsjax.batching.controller import Change, Controller
from dsjax.batching.programs import Programs, plan_micro_batch
from dsjax.batching.shapes import Shape, host_layout
from dsjax.metrics.memory import device_memory_bytes, format_bytes, memory_stats


class Batcher:
    """Connects the controller, the compiled programs and the sample stream for `train.run`.

    Per step the loop calls `next_batch()` (the host batch of the next shape, read at the
    stream's cursor), runs it with `trainer.step`, and after reading the step's metrics calls
    `observe` (adaptive). `get_state()` is what the checkpoint's `data` item holds: the stream
    cursor and the controller.
    """

    def __init__(self, trainer: Any, stream: Any, log: Callable[[str], None] = print):
        cfg = trainer.cfg
        self.cfg = cfg.batch
        self.data = cfg.mesh.data
        self.workers = max(self.data // jax.process_count(), 1)  # data shards of this process
        self.seq_len = cfg.data.seq_len
        self.stream = stream
        self.trainer = trainer
        self.phase_at = trainer.phase_at  # THE phase rule (1-bit Adam's optimizer decides)
        self.log = log
        self.capacity = device_memory_bytes(trainer.mesh.local_devices[0],
                                            self.cfg.device_memory_gb)
        self.budget = self.cfg.mem_fraction * self.capacity
        self.device = trainer.mesh.local_devices[0]
        self._plans: dict[int, Shape] = {}
        self._calibration = 1.0  # measured peak / predicted, where the device reports a peak
        self._largest_run = 0
        self.step = 0  # batches made so far = the next step's index (run() sets it on resume)
        self._changes_reported = 0
        ladder = self.cfg.sizes(cfg.data.global_batch)
        start = cfg.data.global_batch
        self.controller = Controller(self.cfg, ladder, start, self._predicted_fraction,
                                     self._prefetch)
        if self.cfg.policy == "ramp":
            self.controller.size = self.controller.ramp_size(0)

    @property
    def programs(self) -> Programs:
        """The trainer's compiled programs (another set after a precision switch)."""
        return self.trainer.programs

    # -- plans ------------------------------------------------------------------------------
    def plan(self, batch: int) -> Shape:
        """The shape of global batch `batch`: `batch.micro_batch`, or the largest micro-batch
        predicted to fit the budget (compiles candidates; cached)."""
        if batch not in self._plans:
            per_replica = batch // self.data
            if self.cfg.micro_batch:
                micro, nbytes, fits = self.cfg.micro_batch, None, True
            else:
                phase = self.phase_at(self.step)
                micro, nbytes, fits = plan_micro_batch(
                    per_replica, lambda m: self.programs.predict(
                        Shape(batch, per_replica // m, self.data), phase), self.budget)
            shape = Shape(batch, per_replica // micro, self.data)
            if not fits:
                self.log(f"warning: batch {batch}: even micro-batch 1 is predicted at "
                         f"{format_bytes(nbytes)}, over the budget {format_bytes(self.budget)} "
                         f"(batch.mem_fraction x device memory)")
            elif nbytes is not None:
                self.log(f"batch {batch}: micro-batch {micro} x {shape.accum_steps} accumulation "
                         f"x {self.data} data-parallel, predicted {nbytes / 2**30:.2f} GiB of a "
                         f"{self.budget / 2**30:.2f} GiB budget ({self.programs.compilations} "
                         f"programs compiled so far)")
            self._plans[batch] = shape
        return self._plans[batch]

    def _prefetch(self, batch: int) -> None:
        # The earliest step the switch can apply to: after the streak (adaptive) or within the
        # lookahead (ramp). If 1-bit Adam changes phase before then, compile when it is needed.
        c = self.controller
        ahead = self.cfg.patience if self.cfg.policy == "ramp" else max(
            self.cfg.patience - 1, self.cfg.cooldown + 1 - c.since_change, 0)
        phase = self.phase_at(self.step + ahead)
        if phase != self.phase_at(self.step):
            return
        shape = self._plans.get(batch)
        if shape is None and (self.cfg.micro_batch or math.isinf(self.budget)):
            shape = self.plan(batch)  # no compilation needed to plan
        if shape is not None:
            self.programs.prefetch(shape, phase)
        # else: planning compiles; the decision point plans (and waits) when it needs the shape

    def _predicted_fraction(self, batch: int) -> float | None:
        if math.isinf(self.capacity):
            return None
        shape = self.plan(batch)
        return (self.programs.predict(shape, self.phase_at(self.step)) *
                self._calibration / self.capacity)

    # -- the loop ---------------------------------------------------------------------------
    def shape(self) -> Shape:
        """The shape of the next step (ramp: from the tokens the stream has yielded)."""
        if self.cfg.policy == "ramp":
            tokens = self.stream.cursor * self.seq_len
            ahead = self.cfg.patience * self.controller.size * self.seq_len
            change = self.controller.update_ramp(self.step, tokens, ahead)
            self._report(change)
        return self.plan(self.controller.size)

    def next_batch(self) -> tuple[dict[str, np.ndarray], Shape]:
        """The next step's host batch (this process's rows of the stream, micro-batch first)."""
        shape = self.shape()
        rows = self.stream.take(shape.batch)
        self.step += 1
        return host_layout(rows, shape.accum_steps, self.workers), shape

    def observe(self, fields: dict[str, Any], step_ms: float | None) -> None:
        """One finished step's reading (`fields`: its `record`; step time None if untimed).
        Memory: the program's prediction, scaled by how far the device's measured peak has
        exceeded predictions (where the device reports a peak)."""
        predicted = fields.get("predicted_mem_bytes")
        self._calibrate(predicted)
        fraction = (None if predicted is None or math.isinf(self.capacity) else
                    predicted * self._calibration / self.capacity)
        # The step after the one in flight is the next batch this object makes.
        self._report(self.controller.observe(self.step, fraction, step_ms))

    def _calibrate(self, predicted: int | None) -> None:
        # The allocator's peak is a lifetime peak: attribute it only to the largest program run.
        stats = memory_stats(self.device)
        if not predicted or not stats or "peak_bytes_in_use" not in stats:
            return
        if predicted >= self._largest_run:
            self._largest_run = predicted
            self._calibration = max(1.0, stats["peak_bytes_in_use"] / predicted)

    def _report(self, change: Change | None) -> None:
        if change is None:
            return
        if change.new == change.old:
            self.log(f"batch size stays {change.old}: {change.reason}")
            return
        shape = self.plan(change.new)
        self.log(f"batch size {change.old} -> {change.new} from step {change.step + 1} "
                 f"(micro-batch {shape.micro_batch} x {shape.accum_steps} accumulation x "
                 f"{self.data} data-parallel): {change.reason}")

    def record(self, shape: Shape) -> dict[str, Any]:
        """A dispatched step's batch fields (host values, carried with its metrics)."""
        key = (self.programs.last_phase, shape.accum_steps, shape.rows)
        out = {"batch_size": shape.batch, "micro_batch": shape.micro_batch,
               "accum_steps": shape.accum_steps, "compilations": self.programs.compilations}
        if key in self.programs.memory:
            out["predicted_mem_bytes"] = self.programs.memory[key]
        return out

    def record_fields(self, fields: dict[str, Any], step_idx: int) -> dict[str, Any]:
        """The batch part of step `step_idx`'s metrics.jsonl record: its `record`, the changes
        that took effect since the last record (with reasons), and measured peak / predicted
        where the device has a peak."""
        out = {k: fields[k] for k in ("batch_size", "micro_batch", "accum_steps",
                                      "predicted_mem_bytes", "compilations") if k in fields}
        changes = self.controller.changes
        new = [c for c in changes[self._changes_reported:] if c.step <= step_idx]
        self._changes_reported += len(new)
        if new:
            out["batch_changes"] = [dataclasses.asdict(c) for c in new]
        if self._largest_run:
            out["mem_peak_over_predicted"] = self._calibration
        return out

    def summary(self) -> dict[str, Any]:
        """For summary.json: every change, the compilations, and each compiled shape (phase,
        accumulation, micro-batch rows, predicted bytes, whether a step ran it: a prefetched
        size whose streak broke, or a planning candidate, was compiled but not run)."""
        return {"batch_changes": [dataclasses.asdict(c) for c in self.controller.changes],
                "compilations": self.programs.compilations,
                "batch_shapes": [{"phase": p, "accum_steps": k, "rows": r,
                                  "predicted_mem_bytes": self.programs.memory.get((p, k, r)),
                                  "used": (p, k, r) in self.programs.used}
                                 for p, k, r in self.programs.shapes()]}

    # -- checkpointing ----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The checkpoint's `data` item: {"cursor": samples consumed, "batch": controller}."""
        return {**self.stream.get_state(), "batch": self.controller.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)
        if "batch" in state:
            self.controller.set_state(state["batch"])
            self._changes_reported = len(self.controller.changes)
