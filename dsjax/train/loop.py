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
from dsjax.runtime import xla_flags
from dsjax.runtime.preemption import StopConditions
from dsjax.train import resume as resume_lib
from dsjax.train.observer import Observer
from dsjax.train.step import nonfinite_groups
from dsjax.train.trainer import build_trainer, check_fits


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
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            # Beside the sections: the XLA flags in effect (launch.py applied mesh.xla_profile).
            json.dump({**cfg.to_dict(), "xla_flags": xla_flags.record(cfg.mesh.xla_profile)},
                      f, indent=2, sort_keys=True)

    splits = data_splits(cfg, workdir)
    # The stream is read by a global sample cursor, the batch shape chosen per step.
    largest = max(cfg.batch.sizes(cfg.data.global_batch))
    stream = _train_stream(cfg, splits, trainer.model.vision,
                           max(cfg.data.prefetch, 1) * largest // jax.process_count())
    batcher = Batcher(trainer, stream, log=mx.log)

    checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.keep,
                                     cfg.checkpoint.async_save, log=mx.log,
                                     train_layout=resume_lib.train_layout(cfg))
    if trainer.model.vision is not None and jax.process_index() == 0:
        # What dsjax.convert exports a vision model's checkpoint with (the meta holds the LM's).
        trainer.model.vision.save(checkpointer.directory)
    # Before anything is allocated: the first step's program (compiled once, used by the run)
    # must fit in device memory.
    first = checkpointer.usable_step(allow_fallback) or 0
    check_fits(trainer, batcher.plan(batcher.controller.size), trainer.phase_at(first))
    state, start, data_state = resume_lib.resume(checkpointer, trainer.init(), trainer.mesh,
                                                 cfg.model, allow_fallback, mx.log)
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
        params = ckpt.restore_params(cfg.checkpoint.init_from, state.params, cfg.model)
        state = state.replace(params=params)
        mx.log(f"initialised weights from {cfg.checkpoint.init_from}")
    start = start or 0
    batcher.step = start

    flops_tok = mx.flops_per_token(cfg.model, cfg.data.seq_len, cfg.vision)
    peak, peak_source = mx.peak_flops_per_device(cfg.metrics.peak_flops_per_device)
    peak_total = peak * jax.device_count()
    writer = mx.MetricsWriter(workdir, cfg.train.steps, cfg.metrics.tensorboard)
    mx.log(f"MFU is relative to {peak_total:.3g} FLOP/s ({peak_source}); "
           f"{flops_tok:.3g} model FLOPs/token")

    observer = Observer(trainer, workdir)

    def save(step: int) -> None:
        resume_lib.save(checkpointer, step, state, batcher.get_state(), trainer.mesh, cfg.model)

    pending = None  # (step index, device metrics) of the step dispatched last
    saved = start or 0  # the step of the newest checkpoint
    stopped = None  # why the run ended before train.steps
    skips_in_a_row = [0]
    last_time = time.perf_counter()
    step_times: list[float] = []
    shape_timed = [None]  # (batch, accum) whose step times `step_times` holds
    seen = [0, 0]  # global-batch samples and tokens trained in this run (energy per sample)

    def drain(item) -> None:
        nonlocal last_time
        step_idx, m = item
        m = jax.device_get(m)
        now = time.perf_counter()
        dt, last_time = now - last_time, now
        if not bool(m["finite"]):
            skipping = cfg.train.nonfinite == "skip" or cfg.train.compute_dtype == "float16"
            skips_in_a_row[0] += 1
            if not skipping or skips_in_a_row[0] > cfg.train.max_consecutive_skips:
                why = (f"{skips_in_a_row[0]} consecutive non-finite steps" if skipping else
                       "train.nonfinite='stop'")
                raise TrainingError(
                    f"non-finite loss or gradient at step {step_idx + 1} (loss={float(m['loss'])}"
                    f", grad_norm={float(m['grad_norm'])}, {why}; {nonfinite_groups(m)}); "
                    f"stopping without writing a checkpoint. The last checkpoint in "
                    f"{checkpointer.directory} (step {saved}) is intact; lower optim.lr or check "
                    f"the data.")
            mx.log(f"skipped step {step_idx + 1}: non-finite loss or gradient (loss scale was "
                   f"{float(m['loss_scale']):g}; {int(m['skipped_steps'])} skipped so far; "
                   f"{nonfinite_groups(m)})")
        else:
            skips_in_a_row[0] = 0
        timed = step_idx > start and step_idx not in observer.untimed  # compile / profiler
        if shape_timed[0] != (m["batch_size"], m["accum_steps"]):  # a new shape (may compile)
            shape_timed[0], timed = (m["batch_size"], m["accum_steps"]), False
            step_times.clear()
        if timed:
            step_times.append(dt)
        batcher.observe(m, 1000 * dt if timed else None)  # adaptive batch size: the reading
        seen[0] += m["batch_size"]
        seen[1] += m["batch_size"] * cfg.data.seq_len
        done = step_idx + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps:
            typical = float(np.median(step_times[-50:])) if step_times else dt
            tps = m["batch_size"] * cfg.data.seq_len / typical
            record = {"step": done, "loss": float(m["loss"]), "lr": float(m["lr"]),
                      "grad_norm": float(m["grad_norm"]), "tokens_per_sec": tps,
                      "samples_per_sec": m["batch_size"] / typical,
                      "step_ms": 1000 * typical, "mfu": tps * flops_tok / peak_total,
                      "loss_scale": float(m["loss_scale"]),
                      "skipped_steps": int(m["skipped_steps"])}
            record.update(batcher.record_fields(m, step_idx))
            record.update(observer.readings())
            record.update(observer.energy(*seen))
            if cfg.metrics.cost_per_gpu_hour > 0:
                record["cost_per_mtok"] = mx.cost_per_million_tokens(
                    cfg.metrics.cost_per_gpu_hour, jax.device_count(), tps)
            if "onebit_compressed" in m:
                record["onebit_compressed"] = int(m["onebit_compressed"])
            record.update(moe_record(m))
            if "images" in m:  # images and video frames the step read
                record["images_per_sec"] = float(m["images"]) / typical
            writer.write(record, eta_s=typical * (cfg.train.steps - done))

    stops = StopConditions(max_runtime_s, log=mx.log).__enter__()  # signal handlers until the end
    done = start
    try:
        for step_idx in range(start, cfg.train.steps):
            typical = float(np.median(step_times[-20:])) if step_times else 0.0
            stopped = stops.should_stop(step_idx, typical)
            if stopped:
                break
            host_batch, shape = batcher.next_batch()
            batch = trainer.device_batch(host_batch)
            if (step_idx + 1) % cfg.train.log_every == 0 or step_idx + 1 == cfg.train.steps:
                observer.measure_memory(state, batch)  # read by this step's record
            if observer.profile_due(step_idx):
                if pending is not None:
                    drain(pending)
                    pending = None
                state, m = observer.traced_step(step_idx, state, batch)
                last_time = time.perf_counter()
            else:
                state, m = trainer.step(state, batch)
            m.update(batcher.record(shape))  # host values: batch shape, memory, compilations
            if pending is not None:
                drain(pending)
            pending = (step_idx, m)
            done = step_idx + 1
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.steps:
                drain(pending)  # never checkpoint a step whose loss we have not seen
                pending = None
                save(done)
                saved = done
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                ev = evaluate.evaluate_params(trainer, state.params, splits, cfg)
                writer.write_eval(done, ev)
                mx.log(f"eval at step {done}: loss {ev['eval_loss']:.4f}")
        if pending is not None:
            drain(pending)
        if done > saved:  # the end of training, or the step an early stop finished
            save(done)
            saved = done
    finally:
        stops.__exit__()
        trainer.programs.close()
        checkpointer.close()
        writer.close()
    if stopped:
        mx.log(f"stopped early at step {saved} of {cfg.train.steps} ({stopped}): checkpoint "
               f"written to {checkpointer.directory}; run the same command to resume")
        mx.update_summary(workdir, {"stopped_early": stopped, "steps_done": saved})
        return {"stopped_early": stopped, "steps_done": saved}

    history = writer.history
    summary = {
        "config": cfg.name, "mesh": sharding.describe(trainer.mesh),
        "param_count": trainer.param_count, "steps": cfg.train.steps,
        "final_train_loss": history[-1]["loss"] if history else None,
        "median_tokens_per_sec": mx.median_of(history, "tokens_per_sec"),
        "median_step_ms": mx.median_of(history, "step_ms"),
        "mfu": mx.median_of(history, "mfu"), "mfu_peak_source": peak_source,
        **{k: mx.median_of(history, k) for k in ("joules_per_sample", "joules_per_token",
                                                 "cost_per_mtok")
           if any(k in r for r in history)},
        "flops_per_token": flops_tok, "attention_impl": attention_impl,
        "pipeline_bubble": bubble_fraction(cfg.pipeline.schedule, cfg.mesh.pipeline,
                                           cfg.pipeline.microbatches, cfg.pipeline.repeats,
                                           moe=cfg.model.n_routed_experts > 0),
        **observer.summary(),
        **batcher.summary(),
    }
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
    splits = data_splits(cfg, workdir)
    return evaluate.evaluate_and_report(trainer, params, splits, cfg, workdir)
