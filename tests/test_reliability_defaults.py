"""Reliability on the configs users get, not only the flat AdamW float32 mesh of
test_reliability.py: cpu_tiny's pipelined (2, 2, 2) mesh with the 1f1b schedule, and
`h100_fp8.py:smoke` (fp8, 1-bit Adam, adaptive batch, 1f1b). Each is interrupted the hard ways
(kill -9 in the middle of a checkpoint save, SIGTERM, a damaged newest checkpoint resumed with
--allow_fallback) and must reproduce its uninterrupted run's losses bit for bit; the smoke run's
resumes cross its 1-bit refresh step and its batch-size change."""

import json
import os
import shutil
import signal

import pytest

import launching
import references
from conftest import read_records, run_launch, shared_run

CASES = {
    # cpu_tiny's own mesh and schedule (TINY_FLAGS' 2 layers: one per stage), AdamW.
    "pipelined": ("configs/cpu_tiny.py", {**references.QUIET, "train.steps": 10,
                                          "checkpoint.every": 2}),
    # The smoke model, shared with test_onebit_train (references.SMOKE).
    "smoke": (references.SMOKE_CONFIG, references.SMOKE),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request):
    """(case name, config, flags, the uninterrupted run's workdir and {step: loss})."""
    config, flags = CASES[request.param]
    workdir, _ = shared_run(request.param, flags, config=config)
    losses = launching.losses(workdir)
    assert sorted(losses) == list(range(1, flags["train.steps"] + 1))
    return request.param, config, flags, workdir, losses


def test_the_reference_runs_cross_what_the_resumes_must_reproduce(reference):
    """The uninterrupted runs hold what the other tests resume across: the pipelined mesh and
    1f1b schedule; for the smoke run, compressed steps, refresh steps and a batch change."""
    name, _, _, workdir, _ = reference
    records = read_records(workdir)
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert (cfg["mesh"]["data"], cfg["mesh"]["tensor"], cfg["mesh"]["pipeline"]) == (2, 2, 2)
    assert cfg["pipeline"]["schedule"] == "1f1b"
    if name == "smoke":
        assert [r["onebit_compressed"] for r in records] == [0, 0, 1, 1, 0, 1, 1, 0]
        assert [r["batch_size"] for r in records] == [8] * 4 + [16] * 4


def test_kill_9_mid_save_then_sigterm_then_resume_reproduces_the_run(reference, tmp_path):
    name, config, flags, _, want = reference
    workdir = str(tmp_path / "run")
    # 1. Checkpoint every step; kill -9 while one is being written, after two complete ones.
    proc = launching.start(workdir, {**flags, "checkpoint.every": 1}, config=config)
    launching.wait_for(lambda: launching.saving(workdir), proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    last = launching.complete_steps(workdir)[-1]
    assert 2 <= last < 5, last  # before the smoke run's refresh step and batch change
    # 2. Resume; SIGTERM two steps later: the step in flight finishes, then a checkpoint.
    proc = launching.start(workdir, flags, config=config)
    launching.wait_for(lambda: launching.logged_steps(workdir) >= last + 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "a checkpoint save that never finished" in out, out[-2000:]
    assert f"resumed from step {last}" in out and "SIGTERM received" in err, (out[-1500:],
                                                                               err[-1500:])
    stopped = launching.complete_steps(workdir)[-1]
    assert last < stopped < flags["train.steps"]
    # 3. Resume to the end: every step's loss equals the uninterrupted run's, bit for bit.
    proc = run_launch(workdir, flags, config=config, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step {stopped}" in proc.stdout
    assert launching.losses(workdir) == want, name


def test_damaged_newest_checkpoint_falls_back_and_reproduces_the_run(reference, tmp_path):
    name, config, flags, ref_dir, want = reference
    workdir = str(tmp_path / "run")
    shutil.copytree(ref_dir, workdir)
    steps = launching.complete_steps(workdir)
    assert steps[-2:] == [flags["train.steps"] - 2, flags["train.steps"]], steps
    target = launching.tamper(os.path.join(workdir, "checkpoints", str(steps[-1])), "flip")
    proc = run_launch(workdir, flags, config=config, timeout=900)
    assert proc.returncode == 2 and "is corrupt" in proc.stderr and target in proc.stderr, (
        proc.stderr[-3000:])
    assert launching.complete_steps(workdir) == steps  # nothing moved without the flag
    proc = launching.start(workdir, flags, config=config, extra=["--allow_fallback"])
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from step {steps[-2]}" in out, out[-2000:]
    assert [m.split("-")[0] for m in os.listdir(os.path.join(workdir, "checkpoints.corrupt"))
            ] == [str(steps[-1])]
    assert launching.losses(workdir) == want, name  # the re-run steps (a refresh: 8) reproduce
