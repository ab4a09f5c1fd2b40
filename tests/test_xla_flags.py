"""XLA flag profiles (dsjax/runtime/xla_flags.py): what `apply` puts in XLA_FLAGS, what config.json
records, and that the installed XLA knows every flag of every profile (an unknown one is fatal)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dsjax import config as config_lib
from dsjax.runtime import xla_flags
from dsjax.config import ConfigError


def test_apply_appends_the_profile_and_keeps_the_users_values():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                        "--xla_gpu_all_reduce_combine_threshold_bytes=1024"}
    added = xla_flags.apply("overlap", env)
    names = [f.split("=")[0] for f in xla_flags.flags("overlap")]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in added
    # The user's combine threshold stays; everything else of the profile is appended once.
    assert [f.split("=")[0] for f in added] == [
        n for n in names if n != "--xla_gpu_all_reduce_combine_threshold_bytes"]
    assert env["XLA_FLAGS"].split()[:2] == ["--xla_force_host_platform_device_count=4",
                                            "--xla_gpu_all_reduce_combine_threshold_bytes=1024"]
    assert xla_flags.apply("overlap", env) == []  # idempotent

    rec = xla_flags.record("overlap", env)
    assert rec["missing"] == [] and len(rec["applied"]) == len(names)
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=1024" in rec["applied"]
    assert xla_flags.record("overlap", {})["missing"] == [n.lstrip("-") for n in names]

    env = {}
    assert xla_flags.apply("none", env) == [] and env == {}


def test_unknown_profile_is_a_config_error():
    with pytest.raises(ConfigError, match="^mesh.xla_profile: unknown profile 'fast'; valid: "
                                          "none, overlap"):
        config_lib.load(f"{ROOT}/configs/cpu_tiny.py", {"mesh.xla_profile": "fast"})


def _start_jax(xla_flags_value):
    code = "import jax; jax.jit(lambda x: x * 2).lower(1.0).compile(); print(jax.devices())"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = xla_flags_value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_installed_xla_knows_every_flag():
    every = [f for name in xla_flags.PROFILES for f in xla_flags.flags(name)]
    proc = _start_jax(" ".join(every))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The check can fail: a flag XLA removed (collectives are async by default) is fatal.
    proc = _start_jax("--xla_gpu_enable_async_all_reduce=true")
    assert proc.returncode != 0 and "Unknown flag in XLA_FLAGS" in proc.stderr
