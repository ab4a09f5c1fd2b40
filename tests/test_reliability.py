"""Reliability (docs/reliability.md), driven through real `launch.py` processes: preemption by
signal and by time budget, kill -9 in the middle of a checkpoint save, corrupted checkpoints, and
exact resume, each compared with one uninterrupted run of the same config."""

import json
import os
import shutil
import signal
import subprocess

import pytest

import launching
from conftest import ROOT, TINY_FLAGS, file_digests, run_launch, shared_run
from dsjax import checkpoint as ckpt

STEPS = 24
# Pinned mesh: the comparisons below are bit-for-bit, which holds on one mesh and one CPU.
# Every checkpoint is kept: the continuations below start from the reference's step 8.
FLAGS = {"train.steps": STEPS, "checkpoint.every": 4, "checkpoint.keep": 10,
         "metrics.profile_every": 0, "mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1,
         "train.eval_every": 0, "train.sample_tokens": 0, "metrics.tensorboard": False}


def _start(workdir, overrides=None, extra=(), stderr=subprocess.PIPE):
    return launching.start(workdir, {**FLAGS, **(overrides or {})}, extra=extra, stderr=stderr)


@pytest.fixture
def reference():
    """The uninterrupted run every interrupted one must reproduce (made once per session)."""
    workdir, _ = shared_run("reliability", FLAGS)
    losses = launching.losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return workdir, losses


def test_time_budget_then_sigterm_then_resume_reproduces_the_run(reference, tmp_path):
    _, want = reference
    workdir = str(tmp_path / "run")
    # 1. A 1-second budget: the first step (compilation) already uses it up.
    proc = _start(workdir, extra=["--max_runtime=1s"])
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped early at step" in out and "max_runtime 1s reached" in out, out[-2000:]
    stopped_at = launching.complete_steps(workdir)[-1]
    assert 1 <= stopped_at < STEPS
    # 2. Resume; SIGTERM after a few more steps: the step in flight finishes, then a checkpoint.
    proc = _start(workdir)
    launching.wait_for(lambda: launching.logged_steps(workdir) >= stopped_at + 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err and "stopped early at step" in out, (out[-1500:], err[-1500:])
    second_stop = launching.complete_steps(workdir)[-1]
    assert stopped_at < second_stop < STEPS
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["steps_done"] == second_stop
    # 3. Resume to the end: every step's loss equals the uninterrupted run's, bit for bit.
    proc = run_launch(workdir, FLAGS, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step {second_stop}" in proc.stdout
    assert launching.losses(workdir) == want


def test_second_signal_exits_at_once_and_the_last_checkpoint_survives(reference, tmp_path):
    _, want = reference
    workdir = str(tmp_path / "run")
    err_path = str(tmp_path / "stderr.txt")
    with open(err_path, "w", encoding="utf-8") as err_file:
        proc = _start(workdir, stderr=err_file)
        launching.wait_for(lambda: len(launching.complete_steps(workdir)) >= 1
                           and launching.logged_steps(workdir) >= 6, proc)
        proc.send_signal(signal.SIGTERM)
        # Signals that arrive together are delivered once: the second goes once the first is
        # handled (the trainer is then finishing its step, with a checkpoint to write).
        launching.wait_for(
            lambda: "SIGTERM received" in open(err_path, encoding="utf-8").read(), proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=900)
    err = open(err_path, encoding="utf-8").read()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "second signal (SIGTERM): exiting now" in err
    steps = launching.complete_steps(workdir)
    assert steps and all(ckpt.verify(os.path.join(workdir, "checkpoints", str(s))) is None
                         for s in steps)
    proc = run_launch(workdir, FLAGS, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert launching.losses(workdir) == want


def test_kill_9_during_a_checkpoint_save_resumes_from_the_last_complete_one(reference, tmp_path):
    _, want = reference
    workdir = str(tmp_path / "run")
    ckpt_dir = os.path.join(workdir, "checkpoints")

    proc = _start(workdir, {"checkpoint.every": 1})
    launching.wait_for(lambda: launching.saving(workdir), proc)
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(ckpt_dir) if ckpt.TMP_SUFFIX in n]
    assert left, "the kill was meant to land mid-save"
    last = launching.complete_steps(workdir)[-1]
    proc = run_launch(workdir, FLAGS, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a checkpoint save that never finished" in proc.stdout, proc.stdout[-2000:]
    assert f"resumed from step {last}" in proc.stdout
    assert not [n for n in os.listdir(ckpt_dir) if ckpt.TMP_SUFFIX in n]
    assert launching.losses(workdir) == want


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_checkpoint_stops_unless_fallback_is_allowed(reference, tmp_path, how):
    ref_dir, want = reference
    workdir = str(tmp_path / "run")
    shutil.copytree(ref_dir, workdir)
    last = launching.complete_steps(workdir)[-1]
    assert last == STEPS
    # Damage the newest checkpoint of the finished run: eval and resume refuse it; with
    # --allow_fallback the run retrains the last 4 steps from the previous checkpoint.
    target = launching.tamper(os.path.join(workdir, "checkpoints", str(last)), how)
    proc = run_launch(workdir, FLAGS, mode="eval")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint step {last}" in proc.stderr and target in proc.stderr, proc.stderr
    assert f"--allow_fallback to use step {last - 4}" in proc.stderr
    proc = run_launch(workdir, FLAGS)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint step {last}" in proc.stderr and "is corrupt" in proc.stderr
    assert target in proc.stderr and "--allow_fallback" in proc.stderr
    # Nothing moved or deleted without the flag.
    assert launching.complete_steps(workdir)[-1] == last
    proc = _start(workdir, extra=["--allow_fallback"])
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from step {last - 4}" in out, out[-2000:]
    moved = os.listdir(os.path.join(workdir, "checkpoints.corrupt"))
    assert [m.split("-")[0] for m in moved] == [str(last)]  # set aside, not deleted
    assert launching.losses(workdir) == want  # the re-run steps reproduce the reference exactly


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 1, 1)])
def test_checkpoint_of_one_mesh_restores_evaluates_and_trains_on_another(tmp_path, shape):
    import jax
    import numpy as np

    from conftest import random_batch
    from dsjax import config as config_lib
    from dsjax import sharding
    from dsjax.train import build_trainer, train_extras, with_restored

    def trainer_on(data, tensor, pipeline):
        cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {
            **TINY_FLAGS, "mesh.data": data, "mesh.tensor": tensor, "mesh.pipeline": pipeline,
            "pipeline.microbatches": 2 if pipeline > 1 else 1})
        n = data * tensor * pipeline
        return build_trainer(cfg, sharding.make_mesh(cfg, devices=jax.devices()[:n]))

    rng = np.random.default_rng(7)
    batches = [random_batch(rng, 8, 32) for _ in range(2)]
    source = trainer_on(4, 2, 1)
    state = source.init()
    state, _ = source.step(state, source.device_batch(batches[0]))
    saver = ckpt.Checkpointer(str(tmp_path / "ck"), async_save=True)
    saver.save(1, state.params, train_extras(state), None, source.cfg.model)
    saver.close()
    saved, step = jax.device_get(state.params), int(state.step)
    _, want = source.step(state, source.device_batch(batches[1]))  # donates `state`

    target = trainer_on(*shape)
    fresh = target.init(seed=123)  # different values: restoring must overwrite all of them
    reader = ckpt.Checkpointer(str(tmp_path / "ck"))
    params, extras, _ = reader.restore(reader.usable_step(), fresh.params, train_extras(fresh),
                                       target.cfg.model)
    reader.close()
    restored = with_restored(fresh, extras, None).replace(params=params,
                                                          step=jax.numpy.asarray(step))
    for got, ref, leaf in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(saved),
                              jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, ref)  # values identical; only the layout changed
        assert leaf.sharding.mesh.devices.shape == (*shape, 1)  # context 1
    _, got = target.step(restored, target.device_batch(batches[1]))
    # Another mesh reduces in another order: float32 rounding, not bit equality.
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)
    assert float(got["grad_norm"]) == pytest.approx(float(want["grad_norm"]), rel=1e-4)


# ---------------------------------------------------------------------------------------------
# A checkpoint of another config: supported continuations, and a mismatch that stops. None of
# them may move or change a checkpoint file (docs/reliability.md, "Config changes").


@pytest.fixture(scope="module")
def after_step_8(tmp_path_factory):
    """(losses of the uninterrupted reference run, a copy of its run directory as it was after
    step 8: checkpoints 4 and 8, metrics up to step 8)."""
    base, _ = shared_run("reliability", FLAGS)
    want = launching.losses(base)
    assert launching.complete_steps(base) == list(range(4, STEPS + 1, 4))
    template = str(tmp_path_factory.mktemp("continue") / "after8")
    shutil.copytree(base, template)
    for step in range(12, STEPS + 1, 4):
        shutil.rmtree(os.path.join(template, "checkpoints", str(step)))
    path = os.path.join(template, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if json.loads(line).get("step", 0) <= 8]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)
    return want, template


def _continue(template, tmp_path, overrides, extra=()):
    """Runs launch.py on a copy of `template` with `overrides`: (proc, stdout, stderr, workdir,
    checksums of the checkpoints before the run)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(template, workdir)
    before = file_digests(os.path.join(workdir, "checkpoints"))
    proc = _start(workdir, overrides, extra=extra)
    out, err = proc.communicate(timeout=900)
    return proc, out, err, workdir, before


def test_fp8_recipe_change_resumes_with_fresh_fp8_state(after_step_8, tmp_path):
    want, template = after_step_8
    proc, out, err, workdir, before = _continue(
        template, tmp_path, {"train.steps": 12, "train.compute_dtype": "fp8",
                             "fp8.recipe": "delayed"}, extra=["--allow_fallback"])
    assert proc.returncode == 0, err[-3000:]
    assert ("warning: checkpoint step 8: fp8_meta starts fresh: train.compute_dtype changed from "
            "float32 to fp8; fp8.recipe changed from current to delayed (amax histories start "
            "empty)") in out, out[-3000:]
    assert "resumed from step 8" in out
    assert sum("warning" in line for line in out.splitlines()) == 1, out[-3000:]
    assert not os.path.exists(os.path.join(workdir, "checkpoints.corrupt"))
    assert launching.complete_steps(workdir) == [4, 8, 12]
    after = file_digests(os.path.join(workdir, "checkpoints"))
    assert {k: v for k, v in after.items() if k.split(os.sep)[0] in ("4", "8")} == before
    # Step 9's loss is the restored weights' (before any update), in fp8 instead of float32:
    # quantisation error only (measured 0.0002). Fresh weights would be at ~6.3, step 8 is ~4.9.
    assert launching.losses(workdir)[9] == pytest.approx(want[9], abs=0.05)


def test_adamw_to_onebit_adam_carries_the_moments_over(after_step_8, tmp_path):
    want, template = after_step_8
    proc, out, err, workdir, _ = _continue(template, tmp_path, {"optim.name": "onebit_adam",
                                                                "optim.freeze_step": 14})
    assert proc.returncode == 0, err[-3000:]
    assert ("warning: checkpoint step 8: opt_state starts fresh: optim.name changed from adamw "
            "to onebit_adam; Adam's moments (mu, nu) carry over by parameter and its step "
            "counters continue from the checkpoint's step") in out, out[-3000:]
    assert "resumed from step 8" in out
    got = launching.losses(workdir)
    assert got[9] == want[9]  # the restored weights, before any update: bit for bit
    # Steps 9 and 10 update with the carried moments through 1-bit Adam's exact phase (no bias
    # correction, as DeepSpeed): measured 0.0009 and 0.0039 from AdamW's losses at steps 10
    # and 11. With the moments reset to zero the first updates are sign-like and the losses
    # are off by 0.053 and 0.092, so 0.02 tells the two apart.
    assert got[10] == pytest.approx(want[10], abs=0.02)
    assert got[11] == pytest.approx(want[11], abs=0.02)


def test_batch_policy_change_keeps_the_cursor_and_starts_the_controller_fresh(after_step_8,
                                                                                tmp_path):
    want, template = after_step_8
    proc, out, err, workdir, _ = _continue(
        template, tmp_path, {"batch.policy": "adaptive", "batch.ladder": "8,16",
                             "batch.patience": 1, "batch.cooldown": 1})
    assert proc.returncode == 0, err[-3000:]
    assert ("warning: checkpoint step 8: the batch-size controller starts fresh at batch 8: "
            "batch.policy changed from fixed to adaptive (the data cursor is restored)") in out, \
        out[-3000:]
    got = launching.losses(workdir)
    # Same weights, optimizer state and data position, still at batch 8: bit for bit.
    assert (got[9], got[10]) == (want[9], want[10])
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        changes = json.load(f)["batch_changes"]
    assert changes and changes[0]["old"] == 8 and changes[0]["new"] == 16  # adaptive is in effect


def test_an_unsupported_mismatch_stops_in_one_line_and_changes_nothing(after_step_8, tmp_path):
    # optim.clip_norm=0 drops the clipping transform: another optimizer-state tree under the same
    # optim.name, which no continuation covers. --allow_fallback must not set it aside either.
    _, template = after_step_8
    proc, out, err, workdir, before = _continue(template, tmp_path, {"optim.clip_norm": 0},
                                                extra=["--allow_fallback"])
    assert proc.returncode == 2, (out[-2000:], err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    ckpts = os.path.join(workdir, "checkpoints")
    assert lines == [
        f"dsjax: error: checkpoint step 8 in {ckpts} does not match this config (a model or "
        f"optimizer field changed): opt_state/0/0/count is in this run's state but not in the "
        f"checkpoint, and 51 more differences. Nothing was changed. To go on, run with the "
        f"config that wrote it, or start a new --workdir (with "
        f"--config.checkpoint.init_from={ckpts} to take its weights only)"], err[-3000:]
    assert file_digests(ckpts) == before
    assert not os.path.exists(os.path.join(workdir, "checkpoints.corrupt"))


def test_a_shape_difference_is_named_with_both_shapes():
    from dsjax.errors import CheckpointCorrupt, CheckpointError
    from dsjax.train.resume import continuation

    class Leaf:  # what both sides have: a shape
        def __init__(self, *shape):
            self.shape = shape

    mu = ("opt_state", "1", "0", "mu", "layers", "mlp", "up")
    layout = {"optimizer": "adamw", "compute_dtype": "float32"}
    with pytest.raises(CheckpointError) as e:
        continuation({mu: Leaf(6, 256)}, {mu: Leaf(4, 256)}, layout, layout, "checkpoint step 10",
                     "DIR")
    assert not isinstance(e.value, CheckpointCorrupt)
    assert ("opt_state/1/0/mu/layers/mlp/up has shape (6, 256) in the checkpoint, (4, 256) here"
            in str(e.value)) and "init_from=DIR" in str(e.value)


def test_continuation_restores_what_matches_and_names_each_fresh_part():
    from dsjax.train.resume import continuation

    class Leaf:
        def __init__(self, *shape):
            self.shape = shape

    adamw = {("opt_state", "1", "0", "count"): Leaf(), ("opt_state", "1", "2", "count"): Leaf(),
             ("opt_state", "1", "0", "mu", "embedding"): Leaf(8, 4),
             ("opt_state", "1", "0", "nu", "embedding"): Leaf(8, 4)}
    onebit = {("opt_state", "count"): Leaf(), ("opt_state", "mu", "embedding"): Leaf(8, 4),
              ("opt_state", "nu", "embedding"): Leaf(8, 4)}
    scale = {("loss_scale", "scale"): Leaf()}
    fp8 = {("fp8_meta", "layers", "q", "amax_history"): Leaf(3, 16)}
    old = {"optimizer": "adamw", "compute_dtype": "float16", "fp8_recipe": "current"}
    new = {"optimizer": "onebit_adam", "compute_dtype": "fp8", "fp8_recipe": "delayed"}
    sources, counters, notes = continuation({**adamw, **scale}, {**onebit, **scale, **fp8}, old,
                                            new, "checkpoint step 8", "DIR")
    assert sources == {("opt_state", "mu", "embedding"): ("opt_state", "1", "0", "mu", "embedding"),
                       ("opt_state", "nu", "embedding"): ("opt_state", "1", "0", "nu", "embedding")}
    assert counters == [("opt_state", "count")]
    assert [n.split(":")[0] for n in notes] == ["fp8_meta starts fresh", "loss_scale starts fresh",
                                                "opt_state starts fresh"], notes
    assert "train.compute_dtype changed from float16 to fp8" in notes[1]
    # Unchanged settings and trees: everything restores from its own path, nothing is fresh.
    same = {**adamw, **scale}
    assert continuation(same, same, old, old, "", "") == ({p: p for p in same}, [], [])
    # A checkpoint older than the layout record (unknown): matching trees still restore.
    assert continuation(same, same, None, old, "", "")[2] == []
