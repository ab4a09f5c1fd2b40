"""benchmarks/compare.py and benchmarks/peers.py, run in-process on a few steps: the table, the
JSON contract and the plots (the numbers themselves belong to benchmarks/results/)."""

import json
import math
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare  # noqa: E402  pylint: disable=wrong-import-position
import peers  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.slow
def test_compare_smoke_configs(tmp_path, capsys):
    out = tmp_path / "compare"
    # The CPU default pair (h100_bf16:smoke vs h100_fp8:smoke); 2 timed steps each, in rounds
    # of one, after the warmup that compiles 1-bit Adam's compressed step too.
    compare.main(["--steps", "2", "--round", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    for label in ("samples/s", "ms/step", "MFU", "GPU utilisation", "memory / device",
                  "communication share"):
        assert label in printed, label
    with open(out / "compare.json", encoding="utf-8") as f:
        result = json.load(f)
    base, cand = result["baseline"], result["candidate"]
    assert base["config"] == "configs/h100_bf16.py:smoke"
    assert cand["compute_dtype"] == "fp8"
    for side in (base, cand):
        assert set(compare.FIGURES) <= set(side)
        assert side["samples_per_sec"] > 0 and side["step_ms"] > 0 and 0 < side["mfu"] < 1
        assert side["samples_per_sec"] == pytest.approx(8 / (side["step_ms"] / 1000))
        assert side["mem_bytes"] > 0 and side["mem_source"].startswith("compiled")
        # Data- and tensor-parallel steps on 8 devices: all-reduces were traced.
        assert 0 < side["comm_fraction"] < 1 and "all-reduce" in side["comm_kinds_us"]
        assert side["device_utilisation"] is None  # CPU: absent, not zero
        assert len(side["rounds_step_ms"]) == 2
        assert all(math.isfinite(h["loss"]) for h in side["history"])
    # Both sides saw the same steps; warmup covers 1-bit Adam's switch (freeze_step = 4).
    assert [h["step"] for h in base["history"]] == [h["step"] for h in cand["history"]]
    assert result["warmup_steps"] == 5 and len(base["history"]) == 5 + 2
    assert set(result["change_pct"]) == set(compare.FIGURES)
    for key, change in result["change_pct"].items():
        assert change == pytest.approx(100 * (cand[key] - base[key]) / base[key]), key

    import matplotlib.image as mpimg  # pylint: disable=import-outside-toplevel
    for name in ("loss_vs_step.png", "loss_vs_time.png", "throughput.png"):
        path = out / name
        assert os.path.getsize(path) > 5_000, name
        image = mpimg.imread(path)
        # Curves, axes and labels, not a blank canvas.
        assert image.ndim == 3 and len(np.unique(image.reshape(-1, image.shape[-1]),
                                                 axis=0)) > 10, name
    assert os.path.isdir(out / base["profile"])


def test_compare_accepts_override_syntax():
    cfg = compare._load("configs/h100_fp8.py:smoke|optim.name=adamw|train.seed=3")
    assert cfg.optim.name == "adamw" and cfg.train.seed == 3
    assert compare.warmup_steps(cfg) == 1
    onebit = compare._load("configs/h100_fp8.py:smoke")
    assert compare.warmup_steps(onebit) == onebit.optim.freeze_step + 1


@pytest.mark.slow
def test_peers_tiny(tmp_path, capsys):
    out = tmp_path / "peers.json"
    tiny = ("configs/cpu_tiny.py|model.num_layers=2|model.hidden_size=64|model.num_heads=4"
            "|model.num_kv_heads=2|model.mlp_dim=128|data.seq_len=32|data.global_batch=8")
    peers.main(["--config", tiny, "--steps", "2", "--round", "1", "--warmup", "1",
                "--out", str(out)])
    assert "transformers" in capsys.readouterr().out
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    for key in ("dsjax_tokens_per_sec", "dsjax_mesh_tokens_per_sec",
                "transformers_tokens_per_sec"):
        assert result[key] > 0, key
    assert result["ratio"] == pytest.approx(result["dsjax_tokens_per_sec"] /
                                            result["transformers_tokens_per_sec"])
    assert result["model"]["hidden_size"] == 64 and result["model"]["num_kv_heads"] == 2
    assert result["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2}
    # Both trained the same model from random init for 3 steps: still near ln(512) = 6.2, and
    # finite (a diverged or NaN trainer fails).
    for loss in result["final_loss"].values():
        assert 0 < loss < 1.2 * math.log(512)
