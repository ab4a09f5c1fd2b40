"""One benchmark configuration per process: the parent starts a worker per configuration and
drives it round by round over a pipe, so each configuration runs with only its own devices,
threads, XLA flags and memory (a peak memory reading is that configuration's, not the process's
highest so far).

The protocol is one JSON line each way. The worker answers its runner's `hello()` once, then for
every `{"method": ..., "args": {...}}` line on stdin the return value of that method. Answers go
to stdout behind PROTOCOL; anything else the worker prints is passed on to the parent's stderr.
Used by peers.py, compare.py and step_time.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

PROTOCOL = "@worker "
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker starts with: the parent's, less a simulated-device count in
    XLA_FLAGS (each worker asks for its own configuration's), and with GPU memory allocated on
    demand unless the user chose otherwise. Two workers share one GPU while they alternate, so
    neither may take 75% of it up front."""
    env = dict(os.environ if environ is None else environ)
    flags = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def serve(runner: Any) -> None:
    """The worker side: answers `runner.hello()`, then each call read from stdin, until stdin
    closes."""
    _answer(runner.hello())
    for line in sys.stdin:
        call = json.loads(line)
        _answer(getattr(runner, call["method"])(**call.get("args", {})))


def _answer(value: Any) -> None:
    print(PROTOCOL + json.dumps(value), flush=True)


class Worker:
    """The parent side: `script argv` started as a worker process; `hello` is its first answer."""

    def __init__(self, script: str, argv: list[str], label: str):
        self.label = label
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=worker_env())
        self.hello = self._read()

    def call(self, method: str, **args: Any) -> Any:
        """Runs `method(**args)` on the worker's runner; returns its answer."""
        self.proc.stdin.write(json.dumps({"method": method, "args": args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> Any:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL):])
            print(line, end="", file=sys.stderr)
        raise RuntimeError(f"the {self.label} worker exited with {self.proc.wait()} (its output "
                           f"is above)")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)
