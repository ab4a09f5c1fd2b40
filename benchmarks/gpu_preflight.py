"""The GPU MFU run's preflight: seconds, before anything large compiles, it checks that this
machine is the one the run was prepared for, and records what it is.

It reads nvidia-smi's device and memory, the JAX and jaxlib versions, the device kind and memory
JAX sees, the cuDNN version, and proves that the exact XLA_FLAGS of the run start a process on
the GPU (this process inherits them and runs one tiny jitted op). Anything wrong stops the run:
the last line printed is `preflight failed: WHAT` and the exit status is 1. `--preset smoke` (the
CPU dry run) needs no GPU: it skips nvidia-smi with the reason recorded and accepts a CPU.

  python benchmarks/gpu_preflight.py --record OUT/gpu_mfu.json [--preset smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_record  # noqa: E402  (benchmarks/gpu_record.py)

NVIDIA_SMI_TIMEOUT_S = 5


class PreflightError(Exception):
    """What is wrong with this machine for the run, in one line."""


def nvidia_smi(gpu: bool) -> dict[str, Any]:
    """nvidia-smi's name, memory and driver of the first GPU; skipped (with why) off GPU."""
    if shutil.which("nvidia-smi") is None:
        if gpu:
            raise PreflightError("nvidia-smi: not found on PATH (no NVIDIA driver?)")
        return {"skipped": "smoke preset: no nvidia-smi on this machine"}
    query = "name,memory.total,memory.used,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise PreflightError(f"nvidia-smi: no answer in {NVIDIA_SMI_TIMEOUT_S} s") from e
    if out.returncode != 0 or not out.stdout.strip():
        if gpu:
            raise PreflightError(f"nvidia-smi: exit {out.returncode}: "
                                 f"{(out.stderr or out.stdout).strip()[:200]}")
        return {"skipped": f"smoke preset: nvidia-smi exit {out.returncode}"}
    name, total, used, driver = (f.strip() for f in out.stdout.splitlines()[0].split(","))
    return {"name": name, "memory_total": total, "memory_used": used, "driver": driver,
            "gpus": len(out.stdout.strip().splitlines())}


def cudnn_version() -> int | None:
    """The cuDNN version jaxlib loaded (e.g. 91400), None where there is none (CPU)."""
    try:
        from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return None if cuda_versions is None else int(cuda_versions.cudnn_get_version())


def jax_process(gpu: bool) -> dict[str, Any]:
    """Starts JAX under this process's XLA_FLAGS and runs one jitted op on the first device."""
    import jax  # pylint: disable=import-outside-toplevel  (after the cheap nvidia-smi check)
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import jaxlib  # pylint: disable=import-outside-toplevel

    try:
        device = jax.devices()[0]
    except RuntimeError as e:
        raise PreflightError(f"JAX could not start a backend: {str(e).splitlines()[0][:200]}")
    if gpu and device.platform != "gpu":
        raise PreflightError(f"JAX's first device is {device.platform} ({device.device_kind}), "
                             f"not a GPU: is this the jax-cuda image?")
    got = float(jax.jit(lambda x: (x + 1).sum())(jnp.ones((8,), jnp.float32)))
    if got != 16.0:
        raise PreflightError(f"a jitted x + 1 summed to {got}, not 16, under XLA_FLAGS")
    stats = device.memory_stats() or {}
    cudnn = cudnn_version() if device.platform == "gpu" else None
    if gpu and not cudnn:
        raise PreflightError("cuDNN: jaxlib reports no cuDNN version")
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": device.platform,
            "device_kind": device.device_kind, "devices": jax.device_count(),
            "device_bytes_limit": stats.get("bytes_limit"), "cudnn_version": cudnn,
            "xla_flags_started_a_process": True}


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--record", required=True, help="gpu_mfu.json")
    parser.add_argument("--preset", choices=("gpu", "smoke"), default="gpu")
    args = parser.parse_args(argv)
    gpu = args.preset == "gpu"
    t0 = time.perf_counter()
    gpu_record.stub(args.record, "preflight", vars(args))
    row: dict[str, Any] = {"xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        row["nvidia_smi"] = nvidia_smi(gpu)
        row.update(jax_process(gpu))
    except PreflightError as e:
        row.update(status="failed", error=str(e), seconds=time.perf_counter() - t0)
        gpu_record.put_row(args.record, "preflight", row)
        print(f"preflight failed: {e}")
        sys.exit(1)
    row.update(status="finished", seconds=time.perf_counter() - t0)
    gpu_record.put_row(args.record, "preflight", row)
    print(" ".join(f"{k}={row[k]}" for k in ("device_kind", "device_bytes_limit", "jax", "jaxlib",
                                              "cudnn_version", "seconds")))
    return row


if __name__ == "__main__":
    main()
