"""What the loop reports: each logged step's metrics.jsonl record (loss, throughput, MFU, and
beside them memory, device utilisation, communication share, energy per sample, MoE loads)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from dsjax import metrics as mx
from dsjax.metrics import trace
from dsjax.model.preference import METRICS as DPO_METRICS
from dsjax.train.step import TrainState
from dsjax.train.trainer import Trainer


def moe_record(m: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl fields of a MoE/MTP model ({} for dense): per-expert load of each MoE layer
    (share of its assignments; MTP blocks last), its max relative to even, aux and MTP losses."""
    out = {}
    if "expert_load" in m:
        out["expert_load"] = np.round(np.asarray(m["expert_load"], np.float64), 4).tolist()
        out["expert_load_max"] = float(m["expert_load_max"])
    for key in ("aux_loss", "mtp_loss"):
        if key in m:
            out[key] = float(np.mean(m[key]))
    return out


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
        cfg = trainer.cfg
        self.seq_len = cfg.data.seq_len
        self.cost_per_gpu_hour = cfg.metrics.cost_per_gpu_hour
        # MFU: model FLOPs per token over the devices' peak (datasheet, or measured on CPU).
        self.flops_per_token = mx.flops_per_token(cfg.model, cfg.data.seq_len, cfg.vision)
        if cfg.train.task == "dpo":  # no MTP modules run, and the reference's forward pass
            # adds a third to the policy's forward + backward (dsjax/model/preference.py)
            self.flops_per_token = 4 / 3 * mx.flops_per_token(
                dataclasses.replace(cfg.model, num_mtp_layers=0), cfg.data.seq_len, cfg.vision)
        peak, self.peak_source = mx.peak_flops_per_device(cfg.metrics.peak_flops_per_device)
        self.peak_total = peak * jax.device_count()
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

    def record(self, m: dict[str, Any], step: int, typical_s: float,
               batch_fields: dict[str, Any], samples: int, tokens: int) -> dict[str, Any]:
        """The metrics.jsonl record of `step` (1-based) from its host metrics `m`: throughput
        and MFU at the typical step time `typical_s`, the batcher's `batch_fields`, this
        observer's readings, energy since the last record (`samples`, `tokens`: totals so far),
        cost, 1-bit Adam's phase, MoE loads, images per second and DPO's reward statistics."""
        tps = m["batch_size"] * self.seq_len / typical_s
        record = {"step": step, "loss": float(m["loss"]), "lr": float(m["lr"]),
                  "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tps,
                  "samples_per_sec": m["batch_size"] / typical_s,
                  "step_ms": 1000 * typical_s, "mfu": tps * self.flops_per_token / self.peak_total,
                  "loss_scale": float(m["loss_scale"]),
                  "skipped_steps": int(m["skipped_steps"])}
        record.update(batch_fields)
        record.update(self.readings())
        record.update(self.energy(samples, tokens))
        if self.cost_per_gpu_hour > 0:
            record["cost_per_mtok"] = mx.cost_per_million_tokens(
                self.cost_per_gpu_hour, jax.device_count(), tps)
        if "onebit_compressed" in m:
            record["onebit_compressed"] = int(m["onebit_compressed"])
        record.update(moe_record(m))
        record.update({k: float(m[k]) for k in DPO_METRICS if k in m})  # train.task='dpo'
        if "images" in m:  # images and video frames the step read
            record["images_per_sec"] = float(m["images"]) / typical_s
        return record

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
