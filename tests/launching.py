"""Driving real `launch.py` processes the way a scheduler or a user would: start one in the
background, wait for something on disk, read back what it logged and which checkpoints are
complete, and damage a checkpoint. Shared by the reliability tests."""

import json
import os
import subprocess
import sys
import time

from conftest import ROOT, child_env, launch_flags
from dsjax import checkpoint as ckpt


def start(workdir, flags, config="configs/cpu_tiny.py", extra=(), stderr=subprocess.PIPE):
    """`launch.py` in the background with TINY_FLAGS under `flags`; returns the Popen."""
    flags = launch_flags(config, flags)
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"--config={config}",
           f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in flags.items()] + list(extra)
    env = child_env()
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)


def wait_for(predicate, proc, timeout=600):
    """Polls `predicate` every 2 ms; AssertionError if `proc` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early (rc {proc.returncode}): "
                                 f"{proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.002)


def losses(workdir):
    """{step: loss}; a step run twice (before a crash and after the resume) keeps its last."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
    return out


def logged_steps(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def complete_steps(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def saving(workdir, complete=2):
    """True while a step directory is being written, after at least `complete` complete ones."""
    d = os.path.join(workdir, "checkpoints")
    names = os.listdir(d) if os.path.isdir(d) else []
    return sum(n.isdigit() for n in names) >= complete and any(ckpt.TMP_SUFFIX in n
                                                              for n in names)


def tamper(step_dir, how):
    """Damages the largest params file of a checkpoint: "truncate" halves it, "flip" inverts one
    byte in the middle (same size, different values). Returns its path."""
    files = [os.path.join(r, n) for r, _, names in os.walk(step_dir) for n in names
             if n != ckpt.MANIFEST and "params" in r]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        if how == "truncate":
            f.truncate(os.path.getsize(target) // 2)
        else:
            f.seek(os.path.getsize(target) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return target
