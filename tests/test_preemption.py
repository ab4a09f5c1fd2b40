"""Stop conditions (dsjax/runtime/preemption.py): a second SIGTERM exits at once even while the
main thread is blocked inside a device call, where Python cannot run a signal handler."""

import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

# A step that blocks the main thread in the runtime until the process ends: a device loop whose
# condition stays true (the carry grows to inf, and inf > -1), waited on.
_BLOCKED_STEP = """
import sys, time
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from jax import lax
from dsjax.runtime.preemption import StopConditions
step = jax.jit(lambda x: lax.while_loop(lambda c: c > -1.0, lambda c: c * 1.0000001 + 1e-9, x))
step.lower(jnp.float32(1.0)).compile()
with StopConditions():
    print("in the step", flush=True)
    float(step(jnp.float32(1.0)))
"""


def _wait_for(predicate, proc, timeout=60.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None and time.monotonic() < end, "gave up waiting"
        time.sleep(0.05)


def test_second_signal_exits_while_the_main_thread_waits_on_the_device(tmp_path):
    err_path = tmp_path / "stderr"
    with open(err_path, "w", encoding="utf-8") as err, subprocess.Popen(
            [sys.executable, "-c", _BLOCKED_STEP.format(root=ROOT)], stdout=subprocess.PIPE,
            stderr=err, text=True, env={**os.environ, "XLA_FLAGS": ""}) as proc:
        try:
            assert proc.stdout.readline().strip() == "in the step"
            # A head start into the device call; the assertions below do not depend on it.
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            # The first signal is noticed while blocked (the watcher thread prints it).
            _wait_for(lambda: "SIGTERM received" in err_path.read_text(), proc, timeout=10)
            proc.send_signal(signal.SIGTERM)
            # A hang guard, not a measurement: the step never returns, so only the watcher
            # thread can end the process (it exits in well under a second).
            code = proc.wait(timeout=120)
        finally:
            proc.kill()
    assert code == 128 + signal.SIGTERM, err_path.read_text()[-2000:]
    assert "second signal (SIGTERM): exiting now" in err_path.read_text()
