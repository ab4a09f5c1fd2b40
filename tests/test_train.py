"""End to end through `launch.py`: the run directory, resume, eval, and the stop conditions."""

import json
import re
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, TINY_FLAGS, random_batch, read_records, run_launch, shared_run
from dsjax import config as config_lib
from dsjax.train import build_trainer

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "step_ms",
               "mfu", "batch_size"}
SUMMARY_KEYS = {"config", "mesh", "param_count", "steps", "final_train_loss", "eval_loss",
                "eval_bits_per_byte", "median_tokens_per_sec", "median_step_ms", "mfu"}


@pytest.fixture
def finished_run():
    """(workdir, stdout) of a cpu_tiny run, made once per session; tests only read it (the eval
    tests, which rewrite summary.json, copy it)."""
    return shared_run("train-contract", {"metrics.profile_every": 3,  # step 3 profiled
                                         "metrics.cost_per_gpu_hour": 2.5})


def test_run_directory_contract(finished_run):
    workdir, stdout = finished_run
    records = read_records(workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        assert all(np.isfinite(r[k]) for k in METRIC_KEYS)
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["mem_bytes"] > 0 for r in records)  # CPU: from the compiled step's analysis
    # The traced step all-reduces gradients over `data`: communication is part of device time.
    assert "comm_fraction" not in records[1] and 0 < records[2]["comm_fraction"] < 1
    # Energy: a CPU has no counter, so the fields are absent, not zero. Cost: $2.5 per device-
    # hour for cpu_tiny's 8 devices at the record's tokens/s.
    for r in records:
        assert "joules_per_sample" not in r and "joules_per_token" not in r
        assert r["cost_per_mtok"] == pytest.approx(2.5 * 8 / 3600 / r["tokens_per_sec"] * 1e6)
    assert os.path.isdir(os.path.join(workdir, "tensorboard", "plugins", "profile"))
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert summary["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2, "context": 1}  # its own
    assert summary["steps"] == 4 and summary["final_train_loss"] == records[-1]["loss"]
    assert 0 < summary["eval_bits_per_byte"] < 10
    assert "joules_per_sample" not in summary
    assert summary["cost_per_mtok"] == pytest.approx(
        float(np.median([r["cost_per_mtok"] for r in records])))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model"]["hidden_size"] == 64
    # listdir order is arbitrary; the profiled step's trace also put plugins/ there.
    events = [n for n in os.listdir(os.path.join(workdir, "tensorboard"))
              if n.startswith("events.out.tfevents")]
    assert events
    with open(os.path.join(workdir, "tensorboard", events[0]), "rb") as f:
        blob = f.read()
    for key in METRIC_KEYS - {"step"}:
        assert f"train/{key}".encode() in blob, key
    # the default sampling (train.sample_*), named on the sample line
    assert "held-out: loss" in stdout and "sample (temperature 0.8, top-p 0.9):" in stdout
    assert "ETA" in stdout


def test_resumed_run_continues_with_the_same_losses(finished_run, tmp_path):
    workdir, _ = finished_run
    resumed = str(tmp_path / "b")
    shutil.copytree(os.path.join(workdir, "checkpoints", "2"),
                    os.path.join(resumed, "checkpoints", "2"))
    proc = run_launch(resumed, {"metrics.profile_every": 3})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 2" in proc.stdout
    first, second = read_records(workdir), read_records(resumed)
    assert [r["step"] for r in second] == [3, 4]
    # Same mesh, same CPU, same data position: bit-for-bit.
    assert [r["loss"] for r in second] == [r["loss"] for r in first[2:]]


def test_eval_mode_restores_the_final_checkpoint(finished_run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(finished_run[0], workdir)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        trained = json.load(f)
    proc = run_launch(workdir, mode="eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        evaluated = json.load(f)
    # The same params on the same batches: only the compiled program differs.
    assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)
    assert "held-out: loss" in proc.stdout


def test_eval_on_another_mesh_gives_the_same_loss(finished_run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(finished_run[0], workdir)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        trained = json.load(f)
    # Written by a 2-stage pipeline, evaluated unpipelined: the sharding changes, the values not.
    proc = run_launch(workdir, {"mesh.data": 8, "mesh.tensor": 1, "mesh.pipeline": 1}, mode="eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        evaluated = json.load(f)
    assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)


def test_non_finite_loss_stops_the_run_without_a_checkpoint(tmp_path):
    workdir = str(tmp_path / "nan")
    proc = run_launch(workdir, {"model.init_std": 1e30})  # logits overflow to inf on step 1
    assert proc.returncode == 2
    assert "non-finite loss or gradient at step 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    ckpt_dir = os.path.join(workdir, "checkpoints")
    assert not os.path.isdir(ckpt_dir) or not [d for d in os.listdir(ckpt_dir) if d.isdigit()]


def test_mesh_that_does_not_match_the_devices_is_one_clear_line(tmp_path):
    proc = run_launch(str(tmp_path / "bad"), {"mesh.data": 4, "pipeline.microbatches": 2},
                      xla_flags="--xla_force_host_platform_device_count=8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("dsjax: error: mesh: data*tensor*pipeline*context = 4*2*2*1 = 16 must equal the "
            "device count 8") in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flag, field", [
    ({"mesh.data": 3}, "data.global_batch"),
    ({"model.num_heads": 3, "model.num_kv_heads": 3, "model.hidden_size": 66}, "model.num_heads"),
    ({"data.source": "prepared"}, "data.path"),
])
def test_bad_config_is_one_clear_line(tmp_path, flag, field):
    proc = run_launch(str(tmp_path / "bad"), flag)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"dsjax: error: {field}" in proc.stderr, proc.stderr[-2000:]


def test_train_step_with_non_finite_gradient_leaves_state_unchanged():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"),
                          dict(TINY_FLAGS))
    trainer = build_trainer(cfg)
    state = trainer.init()
    before = jax.device_get(state.params)
    batch = random_batch(np.random.default_rng(0), 8, 32)
    batch["weights"] = batch["weights"] * np.float32("nan")
    state, m = trainer.step(state, trainer.device_batch(batch))
    assert not bool(m["finite"])
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert jnp.isfinite(m["lr"])


def test_a_step_that_cannot_fit_stops_before_allocating(tmp_path):
    """The compiled first step's predicted bytes per device against the device's memory (here
    batch.device_memory_gb = 1 KiB, below the tiny model's own state): one line with both
    figures and what would make it fit, exit 2, and no checkpoint, metrics or state written."""
    workdir = str(tmp_path / "w")
    proc = run_launch(workdir, {"batch.device_memory_gb": 2 ** -20, "mesh.data": 4,
                                "mesh.pipeline": 1})  # unpipelined: micro-batch 1 is allowed
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"dsjax: error: memory: the train step needs [\d.]+ MiB per device "
                        r"\(state \+ temporaries, from the compiled program\) but a device has "
                        r"0\.000977 MiB \(batch\.device_memory_gb\); nothing was allocated\. "
                        r"To fit: remat\.policy=full, .*mesh\.fsdp=True.*", line), line
    assert float(re.search(r"needs ([\d.]+) MiB", line)[1]) > 0.1  # the state alone is more
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "0"))
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
