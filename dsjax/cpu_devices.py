"""Simulated CPU devices: must be configured before the first `import jax`.

On a CPU-only machine the mesh needs `--xla_force_host_platform_device_count=N` in XLA_FLAGS. The
flag only affects the host (CPU) platform, so setting it on a GPU machine changes nothing there.
"""

import os
import sys

_FLAG = "--xla_force_host_platform_device_count"


def ensure_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices unless XLA_FLAGS already says how many."""
    if "jax" in sys.modules:
        return  # too late to change; the mesh check will report a device-count mismatch
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
