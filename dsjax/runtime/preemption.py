"""When to stop early: SIGTERM/SIGINT and a wall-clock budget, agreed by every process.

The one idea: a signal only sets a flag. The training loop asks `should_stop()` between steps, so
the step in flight finishes, the loop writes a checkpoint and the process exits 0 (SLURM, Kubernetes
and spot-instance reclaimers send SIGTERM and wait a grace period). A second signal means "now":
the process exits at once with 128 + signum, even while the main thread waits inside a device call
(Python runs signal handlers only between bytecodes, so the count is kept by a watcher thread
woken through `signal.set_wakeup_fd`). That cannot damage the last complete checkpoint: Orbax
writes a step under a temporary name and renames it when complete (see checkpoint.py).

With several processes the decision must be the same on all of them, at the same step, or the
next collective hangs. Each process publishes its flag for every step in the `jax.distributed`
key-value store and reads everyone's before deciding (host-side only: no device sync).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
KV_TIMEOUT_MS = 600_000  # a peer that does not publish its flag for 10 minutes has died


def parse_duration(text: str) -> float:
    """'3600', '90s', '45m', '2h', '1h30m' -> seconds. Raises ValueError naming the input."""
    text = text.strip().lower()
    if not text:
        raise ValueError("empty duration")
    try:
        return float(text)
    except ValueError:
        pass
    total, number = 0.0, ""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    for ch in text:
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total, number = total + float(number) * units[ch], ""
        else:
            raise ValueError(f"cannot read {text!r} as a duration (e.g. 3600, 90m, 2h, 1h30m)")
    if number:
        raise ValueError(f"cannot read {text!r} as a duration: {number!r} has no unit")
    return total


class StopConditions:
    """Signals and the run's time budget. Use as a context manager around the training loop."""

    def __init__(self, max_runtime_s: float = 0.0, log=print):
        self.max_runtime_s = max_runtime_s
        self.log = log
        self.start = time.monotonic()
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._client = None
        self._process_id, self._process_count = 0, 1
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopConditions:
        if threading.current_thread() is threading.main_thread():  # handlers: main thread only
            for sig in SIGNALS:
                # The Python-level handler does nothing: it only replaces the default action
                # (terminate). The watcher counts the signals, main thread blocked or not.
                self._previous[sig] = signal.signal(sig, lambda signum, frame: None)
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._pipe = (read_fd, write_fd)
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                                             name="dsjax-signals")
            self._watcher.start()
        import jax  # local: keeps parse_duration importable before jax is configured
        self._process_id, self._process_count = jax.process_index(), jax.process_count()
        if self._process_count > 1:
            from jax._src import distributed  # the coordination service's key-value store
            self._client = distributed.global_state.client
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._pipe[1])  # the watcher's read returns b"": it ends
            self._watcher.join(timeout=5)
            os.close(self._pipe[0])
            self._pipe = None

    def _watch(self, read_fd: int) -> None:
        """Runs in its own thread: one byte per delivered signal (its number)."""
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            os.write(2, f"dsjax: {name} received: finishing this step, then writing a checkpoint "
                        f"and exiting (send it again to exit at once)\n".encode())
            return
        os.write(2, f"dsjax: second signal ({name}): exiting now without a checkpoint; the last "
                    f"complete checkpoint is intact\n".encode())
        os._exit(128 + signum)

    def local_reason(self, step_seconds: float) -> str | None:
        """Why this process wants to stop before the next step (None: carry on)."""
        if self.signal_name:
            return self.signal_name
        elapsed = time.monotonic() - self.start
        # Stop when the next step would not finish inside the budget.
        if self.max_runtime_s and elapsed + step_seconds >= self.max_runtime_s:
            return f"max_runtime {self.max_runtime_s:g}s reached ({elapsed:.0f}s elapsed)"
        return None

    def should_stop(self, step: int, step_seconds: float = 0.0) -> str | None:
        """The reason to stop before running `step`, identical on every process, or None."""
        reason = self.local_reason(step_seconds)
        if self._client is None:
            return reason
        key = f"dsjax/stop/{step}/"
        self._client.key_value_set(key + str(self._process_id), reason or "")
        reasons = [self._client.blocking_key_value_get(key + str(p), KV_TIMEOUT_MS)
                   for p in range(self._process_count)]
        if self._process_id == 0 and step > 1:  # nobody reads the previous step's keys again
            self._client.key_value_delete(f"dsjax/stop/{step - 1}")
        named = [f"process {p}: {r}" for p, r in enumerate(reasons) if r]
        return "; ".join(named) if named else None
