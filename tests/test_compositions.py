"""Features that once did not combine, each trained for 3 steps by `python launch.py` on the
simulated CPU devices their mesh needs, as a user runs them. Their equality tests (loss and gradients
against the reference without the other feature) are beside each feature's own tests:
tests/test_pipeline.py (fsdp, dense fallback, float16 and fp8 layers under the schedules),
tests/test_onebit_moe.py, tests/test_moe.py (delayed fp8 experts)."""

import glob
import os

import numpy as np
import pytest

from conftest import read_records, run_launch

PIPELINE = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "pipeline.schedule": "1f1b",
            "pipeline.microbatches": 2, "metrics.profile_every": 0, "train.steps": 3}
MOE = {"model.num_layers": 5, "model.num_kv_heads": 4}  # cpu_moe: 1 dense + 4 MoE blocks


@pytest.mark.parametrize("config, flags", [
    # FSDP inside each stage, with fp8 except the first layer (the split respects stages).
    # In the fp8 cases step 3 runs under the profiler, which saves the compiled program beside
    # its trace.
    ("configs/cpu_tiny.py", {**PIPELINE, "model.num_layers": 4, "mesh.fsdp": True,
                             "train.compute_dtype": "fp8", "fp8.keep_first_layers": 1,
                             "metrics.profile_every": 3}),
    # float16 with dynamic loss scaling through 1f1b's own backward.
    ("configs/cpu_tiny.py", {**PIPELINE, "model.num_layers": 4,
                             "train.compute_dtype": "float16"}),
    # 1-bit Adam (exact, then compressed) on a MoE model whose experts and dense prefix block
    # run delayed-scaling fp8, in 1f1b stages.
    ("configs/cpu_moe.py", {**PIPELINE, **MOE, "optim.name": "onebit_adam",
                            "optim.freeze_step": 1, "train.compute_dtype": "fp8",
                            "fp8.recipe": "delayed", "metrics.profile_every": 3}),
    # Everything h100_fp8.py:smoke turns on (fp8, 1-bit Adam, adaptive batch, accumulation,
    # attention_core remat, 1f1b on (2, 2, 2)) with the sequence split over context 2: 16
    # simulated devices. Against the same run at context 1, measured: losses within 1.2e-6
    # relative in the exact-Adam steps, 6e-5 by step 4 (fp8 rounding steps and 1-bit signs
    # amplify summation-order differences; the float32 equalities are in test_context.py).
    ("configs/h100_fp8.py:smoke", {"mesh.context": 2, "train.steps": 3, "optim.freeze_step": 1,
                                   "train.compute_dtype": "fp8", "optim.name": "onebit_adam",
                                   "metrics.profile_every": 3, "train.log_every": 1}),
], ids=["fsdp-fp8-keep-first-1f1b", "float16-1f1b", "onebit-moe-delayed-fp8-1f1b",
        "smoke-context-2"])
def test_composition_trains_three_steps_in_launch(tmp_path, config, flags):
    workdir = str(tmp_path / "run")
    proc = run_launch(workdir, flags, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(workdir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records), records
    if flags["train.compute_dtype"] == "fp8":
        # fp8 was on: the compiled step rounds operands to float8 (XLA:CPU then computes the dot
        # in float32, but the casts to f8e4m3fn stay: they are what changes the numbers).
        [hlo] = glob.glob(os.path.join(workdir, "tensorboard", "**", "hlo.txt"), recursive=True)
        with open(hlo, encoding="utf-8") as f:
            assert "f8e4m3fn" in f.read()
    if flags["train.compute_dtype"] == "float16":
        # Dynamic loss scaling ran: it starts at train.loss_scale_init (2**15) and halves at each
        # skipped step; it doubles only after train.loss_scale_growth (2000) good ones.
        assert all(r["loss_scale"] == 2.0 ** 15 / 2 ** r["skipped_steps"] for r in records)
    if flags.get("optim.name") == "onebit_adam":
        # Exact Adam for optim.freeze_step = 1 step, then the compressed reduction.
        assert [r["onebit_compressed"] for r in records] == [0, 1, 1], records
