"""What the loop reports beside the loss: memory, device utilisation, communication share,
energy per sample."""

from __future__ import annotations

import os
from typing import Any

import jax

from dsjax import metrics as mx
from dsjax.metrics import trace
from dsjax.train.step import TrainState
from dsjax.train.trainer import Trainer


class Observer:
    """Memory, device utilisation and communication share for the run's records.

    Memory: the allocator's peak where the device keeps statistics (GPU), else the compiled step's
    `memory_analysis()` (measured once per step function). Communication share: every
    `metrics.profile_every` steps one step runs under `jax.profiler` (trace in tensorboard/), and
    its collective time over device time is reported until the next trace; that step is left out
    of the step-time median. Utilisation: NVML where present, absent (not 0) elsewhere.
    """

    def __init__(self, trainer: Trainer, workdir: str):
        self.trainer = trainer
        self.every = trainer.cfg.metrics.profile_every
        self.logdir = os.path.join(workdir, "tensorboard")
        self.device = trainer.mesh.local_devices[0]  # addressable by this process
        self.memory: dict[str, Any] = {}
        self.compiled_memory: dict[Any, dict[str, Any]] = {}
        self.comm: dict[str, Any] = {}
        self.untimed: set[int] = set()
        self.energy_mark: tuple[float, int, int] | None = None  # (joules, samples, tokens) seen

    def measure_memory(self, state: TrainState, batch: dict[str, jax.Array]) -> None:
        reading = mx.memory_reading(self.device)
        if reading["peak_bytes"] is None:  # no allocator statistics: ask the compiler, once
            program = self.trainer.program_for(state, batch)  # compiled once per shape anyway
            if id(program) not in self.compiled_memory:
                self.compiled_memory[id(program)] = mx.memory_reading(self.device, program)
            reading = self.compiled_memory[id(program)]
        self.memory = reading

    def profile_due(self, step_idx: int) -> bool:
        # Never the first step of a process: it would trace compilation.
        return bool(self.every) and step_idx > 0 and (step_idx + 1) % self.every == 0

    def traced_step(self, step_idx: int, state: TrainState, batch: dict[str, jax.Array]):
        hlo = self.trainer.program_for(state, batch).as_text()
        (state, m), run_dir = trace.trace_step(self.trainer.step, state, batch,
                                                   logdir=self.logdir, hlo_text=hlo)
        share = trace.comm_share(run_dir)
        self.comm = {"comm_fraction": share["comm_fraction"],
                     "exposed_comm_fraction": share["exposed_comm_fraction"]}
        self.untimed.add(step_idx)
        mx.log(f"profiled step {step_idx + 1}: communication {100 * share['comm_fraction']:.1f}% "
               f"of device time ({100 * share['exposed_comm_fraction']:.1f}% not overlapped; "
               f"{', '.join(sorted(share['kinds'])) or 'no collectives'}); trace in "
               f"{run_dir}")
        return state, m

    def readings(self) -> dict[str, Any]:
        out = dict(self.comm)
        if self.memory.get("peak_bytes") is not None:
            out["mem_bytes"] = self.memory["peak_bytes"]
        util = mx.device_utilisation(self.device)
        if util is not None:
            out["device_utilisation"] = util
        return out

    def energy(self, samples: int, tokens: int) -> dict[str, float]:
        """{"joules_per_sample", "joules_per_token"} since the previous call: NVML's energy
        counters of this process's GPUs, scaled by the process count (every process runs an
        equal share of the global batch), over the samples and tokens trained meanwhile
        (`samples`, `tokens`: totals so far). Empty on CPU, and at the first call."""
        joules = mx.energy_joules(self.trainer.mesh.local_devices)
        if joules is None:
            return {}
        mark, self.energy_mark = self.energy_mark, (joules, samples, tokens)
        if mark is None or samples <= mark[1]:
            return {}
        used = (joules - mark[0]) * jax.process_count()
        return {"joules_per_sample": used / (samples - mark[1]),
                "joules_per_token": used / (tokens - mark[2])}

    def summary(self) -> dict[str, Any]:
        return {"mem_bytes": self.memory.get("peak_bytes"),
                "mem_source": self.memory.get("source"), **self.comm}
