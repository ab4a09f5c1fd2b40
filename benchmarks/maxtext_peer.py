"""MaxText as a peer of `benchmarks/peers.py`: its own trainer on the config's model shapes.

MaxText (PyPI `maxtext`) needs Python 3.12 and a newer JAX than dsjax's, so it runs in a virtual
environment of its own outside the repository (default ~/.cache/dsjax/maxtext-venv), created and
filled on first use. It trains in one subprocess, `maxtext.trainers.pre_train.train` with
`hardware=cpu`, `dataset_type=synthetic`, `remat_policy=none`, float32, on one CPU device. The
process is paused (SIGSTOP) between its rounds, so it alternates with the in-process trainers
like they alternate with each other, compiles once, and its final loss is after the same number
of steps as theirs. A round's step time is read from MaxText's own per-step log lines, stamped
on arrival: the wall time between consecutive "completed step" lines, none of which spans a
pause.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

MAXTEXT_VERSION = "0.2.5"
DEFAULT_VENV = os.path.expanduser("~/.cache/dsjax/maxtext-venv")
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+).*?\bloss: ([0-9.naif]+)")
STARTUP_TIMEOUT_S = 900  # install excluded: import, init, compile and the first step


class MaxTextError(RuntimeError):
    """MaxText could not be installed or run; the message says which and how to fix it."""


def _runs_312(path: str) -> bool:
    """Whether `path` starts and is Python 3.12: a pyenv shim on PATH exists for every version
    pyenv has, and fails unless that version is the active one."""
    out = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                         capture_output=True, text=True, check=False)
    return out.returncode == 0 and out.stdout.strip() == "True"


def find_python312(explicit: str | None = None) -> str:
    """A Python 3.12 interpreter: `explicit`, else python3.12 on PATH, else pyenv's."""
    candidates = [explicit] if explicit else (
        [shutil.which("python3.12")]
        + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))))
    for path in candidates:
        if path and os.path.exists(path) and _runs_312(path):
            return path
    raise MaxTextError("MaxText needs Python 3.12 and none was found (python3.12 on PATH, or "
                       "~/.pyenv/versions/3.12*): pass --maxtext-python /path/to/python3.12")


def _installed_version(venv: str) -> str | None:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    out = subprocess.run([python, "-c", "import importlib.metadata as m; "
                          "print(m.version('maxtext'))"], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_venv(venv: str = DEFAULT_VENV, python: str | None = None) -> str:
    """The venv's interpreter, after creating the venv and installing MaxText if needed.

    MaxText's wheel declares its dependencies only under extras (tpu, cuda12, ...); `tpu` is the
    set without CUDA wheels, and its libtpu stays unused with JAX_PLATFORMS=cpu."""
    if _installed_version(venv) == MAXTEXT_VERSION:
        return os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        print(f"peers: creating {venv} for MaxText {MAXTEXT_VERSION} (once)", flush=True)
        subprocess.run([find_python312(python), "-m", "venv", venv], check=True)
    print(f"peers: installing maxtext[tpu]=={MAXTEXT_VERSION} into {venv} (several minutes, "
          f"once)", flush=True)
    pip = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q",
                          f"maxtext[tpu]=={MAXTEXT_VERSION}"], check=False)
    if pip.returncode or _installed_version(venv) != MAXTEXT_VERSION:
        raise MaxTextError(f"pip could not install maxtext[tpu]=={MAXTEXT_VERSION} into {venv} "
                           f"(exit {pip.returncode}); remove the folder to start over")
    return os.path.join(venv, "bin", "python")


def overrides(cfg: Any, steps: int, outdir: str, schedule_steps: int) -> list[str]:
    """MaxText key=value arguments for dsjax config `cfg`'s model, batch and optimizer: `steps`
    to run, the learning-rate schedule over `schedule_steps` as dsjax's."""
    m, o = cfg.model, cfg.optim
    return [f"{k}={v}" for k, v in dict(
        run_name="dsjax_peer", base_output_directory=outdir, hardware="cpu",
        skip_jax_distributed_system="true", dataset_type="synthetic", steps=steps,
        per_device_batch_size=cfg.data.global_batch, max_target_length=cfg.data.seq_len,
        base_emb_dim=m.hidden_size, base_num_query_heads=m.num_heads,
        base_num_kv_heads=m.num_kv_heads, head_dim=m.resolved_head_dim, base_mlp_dim=m.mlp_dim,
        base_num_decoder_layers=m.num_layers, vocab_size=m.vocab_size,
        normalization_layer_epsilon=m.norm_eps, rope_max_timescale=int(m.rope_theta),
        logits_via_embedding="false", dtype="float32", weight_dtype="float32",
        remat_policy="none", enable_dropout="false", enable_checkpointing="false",
        learning_rate=o.lr, adam_b1=o.b1, adam_b2=o.b2, adam_eps=o.eps,
        adam_weight_decay=o.weight_decay, gradient_clipping_threshold=o.clip_norm or 0.0,
        learning_rate_schedule_steps=schedule_steps, learning_rate_final_fraction=o.min_lr_ratio,
        warmup_steps_fraction=min(o.warmup_steps / schedule_steps, 1.0),
        log_period=10**6, enable_tensorboard="false").items()]


class MaxTextRunner:
    """One paused-between-rounds MaxText training process; `run(n)` as peers.py's runners."""

    def __init__(self, cfg: Any, total_steps: int, venv: str = DEFAULT_VENV,
                 python: str | None = None, workdir: str = "/tmp/dsjax_maxtext_peer"):
        self.name = "maxtext"
        interpreter = ensure_venv(venv, python)
        pkg = subprocess.run([interpreter, "-c", "import maxtext, os, jax; print(os.path.dirname("
                              "maxtext.__file__)); print(jax.__version__)"],
                             capture_output=True, text=True, check=True).stdout.split()
        self.jax_version = pkg[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")  # one CPU device, no TPU probe
        # Each round runs one untimed step more than it counts (the one across the pause), and
        # on a loaded machine several more land before SIGSTOP does (a full test suite once
        # needed 28 step lines of a 26-step cap at 12 ms a step). The cap is only a bound: the
        # process is paused between rounds and ended after the last one.
        argv = [interpreter, "-u", "-m", "maxtext.trainers.pre_train.train",
                os.path.join(pkg[0], "configs", "base.yml"),
                *overrides(cfg, 10 * total_steps + 100, workdir, total_steps)]
        self.lines: list[tuple[float, int, float, float]] = []  # (arrival, step, s, loss)
        self.log: list[str] = []
        self.cond = threading.Condition()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_for(1, STARTUP_TIMEOUT_S)
        self.startup_s = self.lines[0][0] - t0  # import, init, compile, first step
        self.done, self.rounds = 1, []
        self._signal(signal.SIGSTOP)

    @property
    def losses(self) -> list[float]:
        """The loss of every counted step, in step order (as the other runners')."""
        by_step = {step: loss for _, step, _, loss in self.lines}
        return [by_step[i] for i in range(self.done) if i in by_step]

    def _read(self) -> None:
        for line in self.proc.stdout:
            hit = STEP_LINE.search(line)
            with self.cond:
                self.log = (self.log + [line])[-40:]
                if hit:
                    self.lines.append((time.perf_counter(), int(hit[1]), float(hit[2]),
                                       float(hit[3])))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def _wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.lines) < count:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise MaxTextError("MaxText stopped before step "
                                       f"{count - 1} (exit {self.proc.returncode}); its last "
                                       "output:\n" + "".join(self.log[-15:]))
                self.cond.wait(1.0)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def run(self, n: int) -> float:
        """Seconds for n steps: resumes the process for n + 1 step lines, then pauses it again.
        The first line's interval spans the pause, so the n after it are timed."""
        first = len(self.lines)
        self._signal(signal.SIGCONT)
        self._wait_for(first + n + 1, 60 + 60 * n)
        self._signal(signal.SIGSTOP)
        stamps = [t for t, *_ in self.lines[first:first + n + 1]]
        self.done += n
        return stamps[-1] - stamps[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)


def main() -> None:  # pragma: no cover - `python benchmarks/maxtext_peer.py`: install only
    print(ensure_venv(*(sys.argv[1:2] or [DEFAULT_VENV])))


if __name__ == "__main__":
    main()
