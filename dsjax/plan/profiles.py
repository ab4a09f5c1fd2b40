"""Device profiles the planner predicts step times over: datasheet figures for GPUs, and a
profile of this machine's simulated CPU devices measured on the spot (docs/planner.md)."""

from __future__ import annotations

import dataclasses
import math
import time

from dsjax.errors import ConfigError, unknown_choice
from dsjax.metrics.flops import PEAK_BF16


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One device kind, per device. Link bandwidths are what one device sends per second."""
    name: str
    peak_flops: float  # dense bf16 (GPU) or float32 (CPU) FLOP/s
    fp8_flops: float  # dense fp8 FLOP/s (0: no fp8 GEMMs)
    hbm_bytes: float  # memory a plan must fit in
    hbm_bw: float  # memory bandwidth, bytes/s
    intra_bw: float  # bytes/s over links inside a host (NVLink)
    inter_bw: float  # bytes/s across hosts (InfiniBand / RoCE, per GPU)
    devices_per_host: int
    collective_s: float  # fixed cost of one collective (launch + synchronisation)
    kernel_s: float  # fixed cost of one kernel (launch, or an XLA:CPU thunk)
    overlap: float  # share of data-parallel traffic hidden behind the backward (0..1)
    update_s: float  # seconds of the optimizer update per parameter a device holds
    shared_cores: bool  # devices share one host's cores (simulated): idle ticks cost nothing,
                        # replicated work costs every device's share
    source: str

    def flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" and self.fp8_flops else self.peak_flops


_GB = 1e9
# An Adam update reads the parameter, its gradient and both moments and writes three back.
UPDATE_BYTES = 7 * 4
# Datasheets: H100 SXM5 (989 TFLOP/s bf16, 1979 fp8, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900
# GB/s both directions), H200 (the H100's compute, 141 GB HBM3e at 4.8 TB/s), A100 SXM 80 GB
# (312 TFLOP/s bf16, no fp8, 2.04 TB/s, NVLink 3 at 600 GB/s); one 400 Gb/s (H100, H200) or
# 200 Gb/s (A100) NIC per GPU between hosts.
PROFILES = {
    "h100": DeviceProfile("h100", PEAK_BF16["H100"], 2 * PEAK_BF16["H100"], 80 * _GB,
                          3.35e12, 450 * _GB, 50 * _GB, 8, 20e-6, 4e-6, 0.9,
                          UPDATE_BYTES / 3.35e12, False, "H100 SXM5 datasheet"),
    "h200": DeviceProfile("h200", PEAK_BF16["H200"], 2 * PEAK_BF16["H200"], 141 * _GB,
                          4.8e12, 450 * _GB, 50 * _GB, 8, 20e-6, 4e-6, 0.9,
                          UPDATE_BYTES / 4.8e12, False, "H200 SXM datasheet"),
    "a100": DeviceProfile("a100", PEAK_BF16["A100"], 0.0, 80 * _GB, 2.04e12, 300 * _GB,
                          25 * _GB, 8, 20e-6, 4e-6, 0.9, UPDATE_BYTES / 2.04e12, False,
                          "A100 SXM 80 GB datasheet"),
}
DEVICES = tuple(PROFILES) + ("cpu",)


def profile(name: str, devices: int = 8, memory_gb: float = 0.0) -> DeviceProfile:
    """The profile called `name` (h100, h200, a100, or cpu: measured now on `devices` simulated
    devices, which must exist). `memory_gb` overrides the memory a plan must fit in."""
    if name not in DEVICES:
        raise ConfigError(unknown_choice("--device", name, list(DEVICES), "--device"))
    found = measure_cpu(devices) if name == "cpu" else PROFILES[name]
    if memory_gb:
        found = dataclasses.replace(found, hbm_bytes=memory_gb * _GB)
    return found


def default_hosts(devices: int, name: str) -> int:
    """Hosts `devices` devices of profile `name` fill: 8 GPUs per host; simulated CPU devices
    are one host."""
    return 1 if name == "cpu" else max(devices // PROFILES[name].devices_per_host, 1)


def for_device_kind(kind: str) -> str:
    """The profile name of a JAX `device_kind` ("NVIDIA H100 80GB HBM3" -> h100), cpu for CPUs."""
    for name in PROFILES:
        if name.upper() in kind.upper():
            return name
    if "cpu" in kind.lower():
        return "cpu"
    raise ConfigError(f"plan: no device profile for {kind!r} (known: {', '.join(DEVICES)})")


def _best(fn, repeats: int = 7) -> float:
    import jax  # pylint: disable=import-outside-toplevel
    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(devices: int) -> DeviceProfile:
    """This host's simulated devices, measured: a float32 matmul on each device at once (they
    share the cores), a copy's bandwidth, a psum's cost at 4 bytes and at 4 MiB, and one tiny
    kernel's. Memory to fit: the host's RAM shared by the devices."""
    import os  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=C0415

    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    split = NamedSharding(mesh, P("d"))
    n = 256
    mats = jax.device_put(jnp.ones((devices * n, n), jnp.float32), split)
    matmul = jax.jit(lambda a: jnp.einsum("dij,djk->dik", a.reshape(devices, n, n),
                                          a.reshape(devices, n, n)).reshape(devices * n, n),
                     out_shardings=split)
    peak = 2 * n ** 3 / _best(lambda: matmul(mats))
    words = 1 << 20  # 4 MiB per device
    big = jax.device_put(jnp.ones((devices * words,), jnp.float32), split)
    copy = jax.jit(lambda a: a * 2.0, out_shardings=split)
    bw = 2 * 4 * words / _best(lambda: copy(big))  # read + write
    small = jax.device_put(jnp.ones((devices,), jnp.float32), split)

    def looped(body, x, n):  # n dependent iterations of `body` inside one program
        return jax.jit(jax.shard_map(lambda a: jax.lax.fori_loop(0, n, lambda i, v: body(v), a),
                                     mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)

    def per_iteration(body, x):  # one iteration's cost, the program's own overhead removed
        return max(_best(lambda: looped(body, x, 257)) - _best(lambda: looped(body, x, 1)),
                   0.0) / 256

    def psum(a, scale):  # (its result is the same on every device; the loop carry varies)
        return jax.lax.pcast(jax.lax.psum(a, "d") * scale, "d", to="varying")

    latency = per_iteration(lambda a: psum(a, 0.5), small)
    per_byte = max(per_iteration(lambda a: psum(a, 0.125), big) - latency,
                   1e-12) / (2 * 4 * words * (devices - 1) / devices)
    kernel = per_iteration(lambda a: jnp.sin(a), small)
    update = _update_s(split, words)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceProfile("cpu", peak, 0.0, ram / devices, bw, 1 / per_byte, 1 / per_byte,
                         devices, latency, kernel, 0.0, update, True,
                         f"measured on this host's {devices} simulated CPU devices "
                         f"({os.cpu_count()} cores)")


def _update_s(split, words: int) -> float:
    """Seconds per parameter of an AdamW update with global-norm clipping (the optimizer's
    chain, dsjax/optim/factory.py), each device updating `words` parameters at once."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    params = jax.device_put(jnp.ones((split.mesh.size * words,), jnp.float32), split)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(p, g, s):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return _best(lambda: step(params, params, state)) / words
