"""The run's metric writers: console progress, metrics.jsonl, TensorBoard, summary.json."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Any

import jax


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Writes logged steps to the console, `metrics.jsonl` and TensorBoard (process 0 only).

    On a terminal the console gets a live progress bar (step, loss, tokens/s, MFU, ETA) under the
    scrolling log lines; piped to a file it gets the lines alone.
    """

    def __init__(self, workdir: str, total_steps: int, tensorboard: bool = True,
                 live: bool | None = None):
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self.history: list[dict[str, Any]] = []
        self._jsonl = None
        self._tb = None
        self._live = None
        if not self.enabled:
            return
        if sys.stdout.isatty() if live is None else live:
            from rich.progress import BarColumn, Progress, TextColumn
            self._live = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                  TextColumn("{task.fields[stats]}"))
            self._task = self._live.add_task("train", total=total_steps, stats="compiling...")
            self._live.start()
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # writes event files without TensorFlow
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, record: dict[str, Any], eta_s: float | None = None) -> None:
        self.history.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
            self._tb.flush()
        line = (f"step {record['step']:>6}/{self.total_steps} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_sec']:,.0f} tok/s | {record['step_ms']:.0f} ms/step | "
                f"MFU {100 * record['mfu']:.1f}%")
        if "dpo_reward_accuracy" in record:  # train.task='dpo'
            line += (f" | reward acc {record['dpo_reward_accuracy']:.2f} margin "
                     f"{record['dpo_reward_margin']:.3f}")
        if eta_s is not None:
            line += f" | ETA {format_duration(eta_s)}"
        if self._live is None:
            print(line, flush=True)
            return
        self._live.console.print(line)
        self._live.update(self._task, completed=record["step"], stats=(
            f"loss {record['loss']:.4f} | {record['tokens_per_sec']:,.0f} tok/s | "
            f"MFU {100 * record['mfu']:.1f}%" +
            (f" | ETA {format_duration(eta_s)}" if eta_s is not None else "")))

    def write_eval(self, step: int, values: dict[str, float]) -> None:
        if self.enabled and self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"eval/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def median_of(history: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in history if key in r and r[key] is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def update_summary(workdir: str, values: dict[str, Any]) -> dict[str, Any]:
    """Merges `values` into `summary.json` (process 0 only); returns the merged summary."""
    path = os.path.join(workdir, "summary.json")
    summary = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    summary.update(values)
    if jax.process_index() == 0:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    return summary


def log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stdout, flush=True)
