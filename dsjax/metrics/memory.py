"""Device memory: what a compiled program will need (the one formula), what the device has, and
what its allocator measured; and GPU utilisation."""

from __future__ import annotations

import math
import os
from typing import Any

import jax


def format_bytes(n: float) -> str:
    """2.31 GiB, or 1.98 MiB below a quarter GiB (so a small figure is not printed as 0.00)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.3g} MiB"


def memory_stats(device: Any) -> dict[str, Any] | None:
    """The device allocator's statistics (GPU, TPU), or None where it keeps none (CPU)."""
    return device.memory_stats() if hasattr(device, "memory_stats") else None


def predicted_bytes(compiled: Any) -> int:
    """Per-device bytes a compiled program needs, from `memory_analysis()`: arguments + outputs -
    donated (aliased) + temporaries (an upper bound of XLA's own buffer-assignment peak, which
    not every backend fills in)."""
    a = compiled.memory_analysis()
    return int(a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes +
               a.temp_size_in_bytes)


def device_memory_bytes(device: Any, override_gb: float = 0.0) -> float:
    """Per-device memory: `override_gb` if set, else the allocator's `bytes_limit` where the
    device reports one (GPU, TPU), else infinity (CPU: no limit to fit)."""
    if override_gb:
        return override_gb * 2**30
    stats = memory_stats(device)
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return math.inf


def fit_capacity(device: Any, override_gb: float, local_devices: int) -> tuple[float, str]:
    """(bytes one device may use, where that figure comes from) for the does-it-fit check:
    `device_memory_bytes`, or on a device with no limit (CPU) this host's RAM shared by the
    `local_devices` (simulated) devices of this process."""
    limit = device_memory_bytes(device, override_gb)
    if override_gb:
        return limit, "batch.device_memory_gb"
    if not math.isinf(limit):
        return limit, f"{device.device_kind} allocator limit"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / local_devices, (f"host RAM {ram / 2**30:.1f} GiB shared by {local_devices} "
                                 f"devices")


def memory_reading(device: Any, compiled: Any = None) -> dict[str, Any]:
    """{bytes_in_use, peak_bytes, source} for one device: its allocator's `memory_stats()` where
    it keeps them (GPU, TPU), else the compiled step's `memory_analysis()` per device (temp +
    arguments + outputs - aliased, i.e. donated; a prediction, so in use = peak), else Nones."""
    stats = memory_stats(device)
    if stats and "bytes_in_use" in stats:
        return {"bytes_in_use": int(stats["bytes_in_use"]),
                "peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
                "source": "device memory_stats"}
    if compiled is not None and compiled.memory_analysis() is not None:
        total = predicted_bytes(compiled)
        return {"bytes_in_use": total, "peak_bytes": total,
                "source": "compiled memory_analysis (temp + arguments + outputs - aliased)"}
    return {"bytes_in_use": None, "peak_bytes": None, "source": "unavailable"}


def _nvml_handle(device: Any) -> Any:
    """(pynvml, NVML handle) of a GPU `device`; None off GPU, without `pynvml` (package
    nvidia-ml-py) or when NVML fails."""
    if device.platform != "gpu":
        return None
    try:
        import pynvml  # optional: nvidia-ml-py is not a dependency
    except ImportError:
        return None
    index = device.local_hardware_id if device.local_hardware_id is not None else device.id
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if all(v.isdigit() for v in visible) and index < len(visible):
        # NVML numbers every GPU of the machine; CUDA (and JAX) only the visible ones.
        index = int(visible[index])
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None


def device_utilisation(device: Any = None) -> float | None:
    """NVML's GPU utilisation of `device` (default: the first), as a fraction: the share of its
    last sample period (1/6 s to 1 s) in which any kernel ran. None, not zero, where there is no
    GPU or no `pynvml` (package nvidia-ml-py). Not MFU: one small kernel at a time reads 1.0."""
    nvml = _nvml_handle(jax.devices()[0] if device is None else device)
    if nvml is None:
        return None
    pynvml, handle = nvml
    try:
        return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except pynvml.NVMLError:
        return None


def energy_joules(devices: Any) -> float | None:
    """Energy the GPUs `devices` have used since their driver loaded, summed, in joules (NVML's
    total-energy counter, Volta and later). None, not zero, where any of them is not a GPU with
    that counter: CPUs have no such reading, so the energy fields are absent there."""
    total = 0.0
    for device in devices:
        nvml = _nvml_handle(device)
        if nvml is None:
            return None
        pynvml, handle = nvml
        try:
            total += pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0  # mJ
        except pynvml.NVMLError:
            return None
    return total
