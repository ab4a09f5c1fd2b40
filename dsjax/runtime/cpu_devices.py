"""Simulated CPU devices: must be configured before the first `import jax`.

On a CPU-only machine the mesh needs `--xla_force_host_platform_device_count=N` in XLA_FLAGS. The
flag only affects the host (CPU) platform, so setting it on a GPU machine changes nothing there.
"""

import os
import sys

from dsjax.errors import ConfigError

_FLAG = "--xla_force_host_platform_device_count"


def ensure_cpu_devices(count: int, num_processes: int = 1) -> None:
    """Asks XLA for this process's share of `count` CPU devices (the mesh spans `num_processes`
    processes, each simulating count / num_processes) unless XLA_FLAGS already says how many."""
    if count % num_processes:
        raise ConfigError(f"mesh: {count} devices cannot be split evenly over {num_processes} "
                          "processes (set mesh.data, mesh.tensor, mesh.pipeline)")
    count //= num_processes
    if "jax" in sys.modules:
        return  # too late to change; the mesh check will report a device-count mismatch
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
