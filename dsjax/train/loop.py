"""The training loop: `run` trains a config in a run directory, resuming from its newest intact
checkpoint, then evaluates and writes the summary.

The one idea: the host never waits for the step it just dispatched. It reads step n-1's metrics
after dispatching step n, and drains the pending step before a checkpoint, so no checkpoint is
ever written for a step whose loss was not seen to be finite.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np

from dsjax import checkpoint as ckpt
from dsjax import evaluate, sharding
from dsjax import metrics as mx
from dsjax.batching import Batcher
from dsjax.config import Config
from dsjax.config import warnings as config_warnings
from dsjax.data import SampleStream, mixed_stream
from dsjax.data.splits import Splits, data_splits, media_reading
from dsjax.errors import TrainingError
from dsjax.pipeline import bubble_fraction
from dsjax.precision import Selector
from dsjax.precision.report import write_report
from dsjax.runtime import xla_flags
from dsjax.runtime.preemption import StopConditions
from dsjax.train import resume as resume_lib
from dsjax.train.observer import Observer
from dsjax.train.step import nonfinite_groups
from dsjax.train.trainer import build_trainer, check_fits


PRECISION = "precision"  # the checkpoint data item's entry of fp8.select=auto's state


def check_workdir(workdir: str) -> None:
    """Fails early, in one line, if the run directory cannot be created or written."""
    probe = os.path.join(workdir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(workdir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise TrainingError(f"--workdir {workdir}: not a writable directory ({e.strerror or e})"
                            ) from None


def _train_stream(cfg: Config, splits: Splits, vision: Any, prefetch_rows: int) -> SampleStream:
    """The training rows: one token split, or (data.mix, or a vision model) the weighted mixture
    of its sources, multimodal ones packed with their images (dsjax.data.mixture)."""
    if not splits.mixed and vision is None:
        return SampleStream(splits.train, cfg.data.seq_len, cfg.train.seed, jax.process_index(),
                            jax.process_count(), prefetch=cfg.data.prefetch,
                            prefetch_rows=prefetch_rows, legacy_batch=cfg.data.global_batch)
    paths = {name: train for name, train, _ in splits.sources} or {"data": splits.train}
    return mixed_stream(paths, cfg.data.mix or "data:1", cfg.data.seq_len, cfg.train.seed,
                        **media_reading(cfg, vision), process_index=jax.process_index(),
                        process_count=jax.process_count(), prefetch=cfg.data.prefetch,
                        prefetch_rows=prefetch_rows)


def _save(checkpointer: ckpt.Checkpointer, step: int, state: Any, batcher: Batcher,
          trainer: Any, selector: Selector | None) -> None:
    data_state = batcher.get_state()
    if selector is not None:  # fp8.select=auto: the map, its hysteresis and spike windows
        data_state[PRECISION] = selector.get_state()
    resume_lib.save(checkpointer, step, state, data_state, trainer.mesh, trainer.cfg.model)


class StepReader:
    """The host's side of each step, read one step after it was dispatched: its time, whether
    it was finite (skip it or stop the run), the batch controller's reading, and every
    `train.log_every` steps its metrics.jsonl record (built by the `Observer`)."""

    def __init__(self, cfg: Config, start: int, batcher: Batcher, observer: Observer,
                 writer: Any, checkpoint_dir: str, selector: Selector | None = None):
        self.cfg, self.start = cfg, start
        self.selector = selector
        self.batcher, self.observer, self.writer = batcher, observer, writer
        self.checkpoint_dir = checkpoint_dir
        self.saved = start  # the step of the newest checkpoint
        self.skips_in_a_row = 0
        self.samples = self.tokens = 0  # global-batch samples and tokens trained in this run
        self.times: list[float] = []  # step times of one batch shape: compiled steps left out
        self.shape: tuple | None = None  # (batch, accum) whose step times `times` holds
        self.last = time.perf_counter()

    def mark(self) -> None:
        """Times the next step from now (after a profiled step, whose time is not counted)."""
        self.last = time.perf_counter()

    def typical(self, window: int, default: float) -> float:
        """The median of the last `window` step times (`default` before any)."""
        return float(np.median(self.times[-window:])) if self.times else default

    def read(self, step_idx: int, m: dict[str, Any]) -> None:
        m = jax.device_get(m)
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        self._check_finite(step_idx, m)
        timed = step_idx > self.start and step_idx not in self.observer.untimed  # compile/trace
        if self.shape != (m["batch_size"], m["accum_steps"]):  # a new shape (may compile)
            self.shape, timed = (m["batch_size"], m["accum_steps"]), False
            self.times.clear()
        if timed:
            self.times.append(dt)
        self.batcher.observe(m, 1000 * dt if timed else None)  # adaptive batch size: the reading
        if self.selector is not None:
            self.selector.observe(step_idx, m)  # a layer's gradient-norm spike
        self.samples += m["batch_size"]
        self.tokens += m["batch_size"] * self.cfg.data.seq_len
        done, steps = step_idx + 1, self.cfg.train.steps
        if done % self.cfg.train.log_every == 0 or done == steps:
            typical = self.typical(50, dt)
            record = self.observer.record(m, done, typical,
                                          self.batcher.record_fields(m, step_idx),
                                          self.samples, self.tokens)
            if self.selector is not None:
                record.update(self.selector.record_fields())
            self.writer.write(record, eta_s=typical * (steps - done))

    def _check_finite(self, step_idx: int, m: dict[str, Any]) -> None:
        """Counts a non-finite step as skipped, or stops the run (train.nonfinite, and at most
        train.max_consecutive_skips in a row; float16 always skips: its loss scale backs off)."""
        if bool(m["finite"]):
            self.skips_in_a_row = 0
            return
        t = self.cfg.train
        skipping = t.nonfinite == "skip" or t.compute_dtype == "float16"
        self.skips_in_a_row += 1
        if not skipping or self.skips_in_a_row > t.max_consecutive_skips:
            why = (f"{self.skips_in_a_row} consecutive non-finite steps" if skipping else
                   "train.nonfinite='stop'")
            raise TrainingError(
                f"non-finite loss or gradient at step {step_idx + 1} (loss={float(m['loss'])}"
                f", grad_norm={float(m['grad_norm'])}, {why}; {nonfinite_groups(m)}); "
                f"stopping without writing a checkpoint. The last checkpoint in "
                f"{self.checkpoint_dir} (step {self.saved}) is intact; lower optim.lr or check "
                f"the data.")
        mx.log(f"skipped step {step_idx + 1}: non-finite loss or gradient (loss scale was "
               f"{float(m['loss_scale']):g}; {int(m['skipped_steps'])} skipped so far; "
               f"{nonfinite_groups(m)})")


def run(cfg: Config, workdir: str, *, allow_fallback: bool = False, max_runtime_s: float = 0.0
        ) -> dict[str, Any]:
    """Trains `cfg` in `workdir` (resuming from its latest intact checkpoint), evaluates, writes
    summary. SIGTERM/SIGINT or `max_runtime_s` end it early: checkpoint, no eval, and the returned
    summary has `stopped_early` (docs/reliability.md). `allow_fallback`: a corrupt newest
    checkpoint is moved aside and the previous one resumed, instead of stopping."""
    check_workdir(workdir)
    trainer = build_trainer(cfg)
    attention_impl = trainer.model.attention_impl(cfg.data.seq_len)  # "auto" resolved
    mx.log(f"dsjax: config {cfg.name} | mesh {sharding.describe(trainer.mesh)} | "
           f"{trainer.param_count:,} params | compute {cfg.train.compute_dtype} | "
           f"attention {attention_impl} | "
           f"devices {jax.device_count()} x {jax.devices()[0].device_kind}")
    for line in config_warnings(cfg):
        mx.log(f"warning: {line}")

    splits = data_splits(cfg, workdir)
    # The stream is read by a global sample cursor, the batch shape chosen per step.
    largest = max(cfg.batch.sizes(cfg.data.global_batch))
    stream = _train_stream(cfg, splits, trainer.model.vision,
                           max(cfg.data.prefetch, 1) * largest // jax.process_count())
    batcher = Batcher(trainer, stream, log=mx.log)
    selector = Selector(trainer, mx.log) if cfg.fp8.select == "auto" else None

    checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.keep,
                                     cfg.checkpoint.async_save, log=mx.log,
                                     train_layout=resume_lib.train_layout(cfg))
    # Before anything is allocated: the first step's program (compiled once, used by the run)
    # must fit in device memory.
    # (fp8.select=auto: after the first probe chose the map, see below.)
    first = checkpointer.usable_step(allow_fallback) or 0
    if selector is None:
        check_fits(trainer, batcher.plan(batcher.controller.size), trainer.phase_at(first))
    state, start, data_state = resume_lib.resume(checkpointer, trainer.init(), trainer.mesh,
                                                 cfg.model, allow_fallback, mx.log)
    if data_state is not None and PRECISION in data_state:
        if selector is not None:
            selector.set_state(data_state[PRECISION])
            state = selector.apply(trainer, state)
        else:
            mx.log(f"warning: checkpoint step {start}: its automatic precision map is not "
                   f"used (fp8.select='policy'): the run follows fp8.matmuls / fp8.layers")
        data_state = {k: v for k, v in data_state.items() if k != PRECISION}
    if data_state is not None and "batch" in data_state:
        # The controller keeps a saved state only under the policy that wrote it; else it says
        # why it starts fresh. The batcher then takes the cursor and the controller's state.
        fresh = batcher.controller.set_state(data_state["batch"])
        if fresh:
            mx.log(f"warning: checkpoint step {start}: {fresh}")
        data_state = {**data_state, "batch": batcher.controller.get_state()}
    if data_state is not None:
        batcher.set_state(data_state)  # the cursor, and the batch-size controller
    if start is None and cfg.checkpoint.init_from:
        state = resume_lib.with_initial_weights(state, cfg.checkpoint.init_from, cfg.model)
        mx.log(f"initialised weights from {cfg.checkpoint.init_from}")
    start = start or 0
    batcher.step = start
    # Only now, with the checkpoint accepted: a refused resume leaves the run's files as they were.
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            # Beside the sections: the XLA flags in effect (launch.py applied mesh.xla_profile).
            json.dump({**cfg.to_dict(), "xla_flags": xla_flags.record(cfg.mesh.xla_profile)},
                      f, indent=2, sort_keys=True)
        if trainer.model.vision is not None:
            # What dsjax.convert exports a vision model with (the meta holds the LM's).
            trainer.model.vision.save(checkpointer.directory)

    writer = mx.MetricsWriter(workdir, cfg.train.steps, cfg.metrics.tensorboard)
    observer = Observer(trainer, workdir)
    mx.log(f"MFU is relative to {observer.peak_total:.3g} FLOP/s ({observer.peak_source}); "
           f"{observer.flops_per_token:.3g} model FLOPs/token")

    reader = StepReader(cfg, start, batcher, observer, writer, checkpointer.directory, selector)
    pending = None  # (step index, device metrics) of the step dispatched last
    stopped = None  # why the run ended before train.steps
    done = start
    try:
        with StopConditions(max_runtime_s, log=mx.log) as stops:  # signal handlers until the end
            for step_idx in range(start, cfg.train.steps):
                stopped = stops.should_stop(step_idx, reader.typical(20, 0.0))
                if stopped:
                    break
                host_batch, shape = batcher.next_batch()
                batch = trainer.device_batch(host_batch)
                if selector is not None:
                    spent = sum(selector.seconds.values())
                    state = selector.before_step(step_idx, trainer, state, batch)
                    if sum(selector.seconds.values()) > spent:
                        observer.untimed.add(step_idx)  # a probe or a compile, not the step
                    if step_idx == start:
                        check_fits(trainer, shape, trainer.phase_at(step_idx))
                if (step_idx + 1) % cfg.train.log_every == 0 or step_idx + 1 == cfg.train.steps:
                    observer.measure_memory(state, batch)  # read by this step's record
                if observer.profile_due(step_idx):
                    if pending is not None:
                        reader.read(*pending)
                        pending = None
                    state, m = observer.traced_step(step_idx, state, batch)
                    reader.mark()
                else:
                    state, m = trainer.step(state, batch)
                m.update(batcher.record(shape))  # host values: batch shape, memory, compilations
                if pending is not None:
                    reader.read(*pending)
                pending = (step_idx, m)
                done = step_idx + 1
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0
                        and done < cfg.train.steps):
                    reader.read(*pending)  # never checkpoint a step whose loss we have not seen
                    pending = None
                    _save(checkpointer, done, state, batcher, trainer, selector)
                    reader.saved = done
                if (cfg.train.eval_every and done % cfg.train.eval_every == 0
                        and done < cfg.train.steps):
                    ev = evaluate.evaluate_params(trainer, state.params, splits, cfg)
                    writer.write_eval(done, ev)
                    mx.log(f"eval at step {done}: loss {ev['eval_loss']:.4f}")
            if pending is not None:
                reader.read(*pending)
            if done > reader.saved:  # the end of training, or the step an early stop finished
                _save(checkpointer, done, state, batcher, trainer, selector)
                reader.saved = done
    finally:
        trainer.programs.close()
        checkpointer.close()
        writer.close()
    saved = reader.saved
    if stopped:
        mx.log(f"stopped early at step {saved} of {cfg.train.steps} ({stopped}): checkpoint "
               f"written to {checkpointer.directory}; run the same command to resume")
        mx.update_summary(workdir, {"stopped_early": stopped, "steps_done": saved,
                                    **({} if selector is None else selector.summary())})
        return {"stopped_early": stopped, "steps_done": saved}

    history = writer.history
    summary = {
        "config": cfg.name, "mesh": sharding.describe(trainer.mesh),
        "param_count": trainer.param_count, "steps": cfg.train.steps,
        "final_train_loss": history[-1]["loss"] if history else None,
        "median_tokens_per_sec": mx.median_of(history, "tokens_per_sec"),
        "median_step_ms": mx.median_of(history, "step_ms"),
        "mfu": mx.median_of(history, "mfu"), "mfu_peak_source": observer.peak_source,
        **{k: mx.median_of(history, k) for k in ("joules_per_sample", "joules_per_token",
                                                 "cost_per_mtok")
           if any(k in r for r in history)},
        "flops_per_token": observer.flops_per_token, "attention_impl": attention_impl,
        "pipeline_bubble": bubble_fraction(cfg.pipeline.schedule, cfg.mesh.pipeline,
                                           cfg.pipeline.microbatches, cfg.pipeline.repeats,
                                           moe=cfg.model.n_routed_experts > 0),
        **observer.summary(),
        **batcher.summary(),
    }
    if selector is not None:
        summary.update(selector.summary())
        if jax.process_index() == 0:
            write_report(workdir, selector)
        for line in selector.describe():
            mx.log(f"precision: {line}")
    mx.update_summary(workdir, summary)
    results = evaluate.evaluate_and_report(trainer, state.params, splits, cfg, workdir)
    writer_eval = {k: v for k, v in results.items() if isinstance(v, float)}
    mx.log("summary: " + ", ".join(f"{k}={v:.4g}" for k, v in writer_eval.items()))
    summary.update(results)
    return summary


def run_eval(cfg: Config, workdir: str, allow_fallback: bool = False) -> dict[str, Any]:
    """`--mode eval`: restores the latest intact checkpoint in `workdir` (onto this config's
    mesh); a corrupt one is an error unless `allow_fallback` (then the previous one is used)."""
    trainer = build_trainer(cfg)
    params = ckpt.restore_params(workdir, trainer.abstract_state().params, cfg.model,
                                 allow_fallback=allow_fallback, log=mx.log)
    if cfg.fp8.select == "auto":  # evaluate in the precision the run trained in last
        layers = mx.update_summary(workdir, {}).get("precision_layers")
        if layers:
            trainer.switch_precision(layers, trainer.abstract_state())
            mx.log(f"precision: evaluating with the run's map {layers} (summary.json)")
        else:
            mx.log("warning: fp8.select=auto but summary.json records no precision map: "
                   "evaluating with every fp8.matmuls projection in fp8")
    splits = data_splits(cfg, workdir)
    return evaluate.evaluate_and_report(trainer, params, splits, cfg, workdir)
