"""The uninterrupted runs that tests in more than one file compare against, each trained once
per test session (conftest.shared_run) instead of once per file and xdist worker."""

from conftest import shared_run

# What a reference run leaves out: none of it is compared, all of it costs compile time.
QUIET = {"metrics.profile_every": 0, "train.eval_every": 0, "train.sample_tokens": 0,
         "metrics.tensorboard": False}

# `h100_fp8.py:smoke` (fp8, 1-bit Adam, adaptive batch, 1f1b on (2, 2, 2)) at a CPU size: exact
# Adam for 2 steps, then compressed, every 3rd step after the freeze exact (steps 5 and 8
# refresh v); the batch grows 8 -> 16 from step 5 (the config's patience and cooldown).
# Checkpoints 4, 6 and 8 are kept: 4 is in the compressed phase, before the refresh and the
# batch change. The CPU peak measurement is off (a fixed peak): it is not under test.
SMOKE_CONFIG = "configs/h100_fp8.py:smoke"
SMOKE = {**QUIET, "model.hidden_size": 128, "model.num_kv_heads": 4, "model.mlp_dim": 256,
         "data.seq_len": 64, "train.steps": 8, "optim.freeze_step": 2, "optim.refresh_every": 3,
         "checkpoint.every": 2, "metrics.peak_flops_per_device": 1e12}


def smoke():
    """(workdir, stdout) of the smoke run."""
    return shared_run("smoke", SMOKE, config=SMOKE_CONFIG)
