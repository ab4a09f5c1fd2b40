"""Named XLA flag profiles (`mesh.xla_profile`), appended to XLA_FLAGS before JAX starts.

The one idea: XLA reads XLA_FLAGS once, when the first backend is created, so a profile has to
be in the environment before anything touches a device; `launch.py` calls `apply` right after
the config is parsed and before `jax.distributed` / the first device query, and `train.run`
writes what was in effect (`record`) into config.json.

The "overlap" profile is what the recipe calls "asynchronous all-reduce": XLA's latency-hiding
scheduler plus the collective pipeliner, so the data-parallel gradient reductions and the tensor
all-reduces of layer i overlap the compute of layers i+1 / i-1 (the layers are a `lax.scan`,
i.e. a while loop that the pipeliner can move collectives across). Its effect shows in the
`comm_fraction` metric (metrics.profile_every) of a multi-GPU run: the share of the step during
which only communication runs.

All flags are `xla_gpu_*`. Their names were checked against the installed jaxlib (0.10.2): the
CPU client parses them (it shares the one DebugOptions flag table) and ignores them, so a
profile costs nothing on CPU; a name XLA does not know is fatal at backend creation ("Unknown
flag in XLA_FLAGS"), e.g. the removed `xla_gpu_enable_async_all_reduce` (collectives are async
by default since 2024). A newer jaxlib that drops one of these names fails the same way, naming
it: update the table.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from dsjax.errors import unknown_choice

MIB = 2**20

# profile -> ((flag, value, why), ...). One table; add a profile here and nowhere else.
PROFILES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "none": (),
    "overlap": (
        ("xla_gpu_enable_latency_hiding_scheduler", "true",
         "schedule each async collective's start early and its done late, around independent "
         "compute, using a cost model of both (the core of compute/communication overlap)"),
        ("xla_gpu_enable_highest_priority_async_stream", "true",
         "run collectives on a high-priority CUDA stream so GEMM kernels do not starve them"),
        ("xla_gpu_enable_pipelined_all_reduce", "true",
         "collective pipeliner: move a scanned layer's all-reduce into the next loop iteration "
         "so it overlaps that layer's compute (tensor-parallel and gradient all-reduces)"),
        ("xla_gpu_enable_pipelined_all_gather", "true",
         "same for all-gathers (ZeRO-3 / mesh.fsdp parameter gathers: prefetch layer i+1's "
         "weights during layer i)"),
        ("xla_gpu_enable_pipelined_reduce_scatter", "true",
         "same for reduce-scatters (mesh.fsdp gradient reduce-scatters)"),
        ("xla_gpu_enable_while_loop_double_buffering", "true",
         "unroll the layer scan by two so pipelined collectives get a buffer of their own "
         "instead of waiting on the previous iteration's"),
        ("xla_gpu_all_reduce_combine_threshold_bytes", str(128 * MIB),
         "combine small all-reduces (one per parameter) into up to 128 MiB: fewer NCCL launches, "
         "each at full bandwidth"),
        ("xla_gpu_all_gather_combine_threshold_bytes", str(128 * MIB),
         "the same for all-gathers"),
        ("xla_gpu_reduce_scatter_combine_threshold_bytes", str(128 * MIB),
         "the same for reduce-scatters"),
    ),
}


def flags(profile: str) -> list[str]:
    """The `--name=value` flags of `profile` (a key of PROFILES)."""
    if profile not in PROFILES:
        raise ValueError(unknown_choice("XLA flag profile", profile, PROFILES))
    return [f"--{name}={value}" for name, value, _ in PROFILES[profile]]


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def apply(profile: str, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Appends `profile`'s flags to XLA_FLAGS; returns the flags added.

    A flag the user already set in XLA_FLAGS keeps the user's value. Must run before JAX creates
    a backend (XLA reads XLA_FLAGS once); later it changes nothing, which `record` will show.
    """
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "").split()
    present = {_name(f) for f in current}
    added = [f for f in flags(profile) if _name(f) not in present]
    if added:
        env["XLA_FLAGS"] = " ".join(current + added)
    return added


def record(profile: str, environ: Mapping[str, str] | None = None) -> dict:
    """What config.json records: the profile, which of its flags XLA_FLAGS holds (with the value
    in effect), which it lacks (the run did not go through `launch.py`), and XLA_FLAGS itself."""
    env = os.environ if environ is None else environ
    current = {_name(f): f for f in env.get("XLA_FLAGS", "").split()}
    wanted = [_name(f) for f in flags(profile)]
    return {"profile": profile,
            "applied": [current[n] for n in wanted if n in current],
            "missing": [n for n in wanted if n not in current],
            "XLA_FLAGS": env.get("XLA_FLAGS", "")}


def summary(profile: str) -> str:
    """One start-of-run log line: the profile, and whether this backend uses its flags."""
    import jax  # pylint: disable=g-import-not-at-top  (after the backend started)

    if not PROFILES[profile]:
        return f"XLA flag profile {profile!r}: XLA's defaults"
    rec = record(profile)
    platform = jax.default_backend()
    effect = "" if platform == "gpu" else f"; no effect on {platform}: every flag is xla_gpu_*"
    missing = f", {len(rec['missing'])} not in XLA_FLAGS" if rec["missing"] else ""
    return (f"XLA flag profile {profile!r}: {len(rec['applied'])} flags in XLA_FLAGS{missing}"
            f"{effect}")
