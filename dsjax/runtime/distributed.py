"""Multi-process runs: find out whether this process is one of N, and join the others.

The one idea: every process runs the same program on its own devices, and `jax.distributed`
turns them into one global device list, so the mesh, the jitted step and the checkpoints are
written once for any number of processes. What the environment must say, first match wins:
  1. explicit `--coordinator HOST:PORT --num_processes N --process_id I` (launch.py flags);
  2. JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (Kubernetes, hand launches);
  3. SLURM under `srun` with SLURM_NTASKS > 1 (jax's own SlurmCluster detection fills in all
     three: coordinator = first node of SLURM_STEP_NODELIST, port from SLURM_JOB_ID).
Otherwise the run is single-process and nothing is initialised.

Nothing here may touch devices before `jax.distributed.initialize`: the first device query fixes
the backend to this process's devices only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from dsjax.errors import DistributedError
from dsjax.runtime.cpu_devices import ensure_cpu_devices

# What jax.distributed.SlurmCluster needs; SLURM_STEP_NODELIST only exists inside `srun`.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands. `coordinator`/`process_id` None: jax detects them (SLURM)."""
    num_processes: int
    process_id: int | None
    coordinator: str | None
    source: str  # "flags", "env" or "slurm"


def detect(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None, environ: Mapping[str, str] | None = None
           ) -> Cluster | None:
    """The multi-process setting flags or environment describe; None for a single process."""
    env = os.environ if environ is None else environ
    given = (coordinator, num_processes, process_id)
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise DistributedError("--coordinator, --num_processes and --process_id go together; "
                                   f"got {coordinator!r}, {num_processes!r}, {process_id!r}")
        return _checked(Cluster(num_processes, process_id, coordinator, "flags"))
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    present = [n for n in names if env.get(n)]
    if present:
        if len(present) != len(names):
            raise DistributedError(f"{', '.join(names)} go together; only {', '.join(present)} "
                                   "is set")
        try:
            count, index = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except ValueError as e:
            raise DistributedError(
                f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers: {e}") from e
        return _checked(Cluster(count, index, env["JAX_COORDINATOR_ADDRESS"], "env"))
    if all(n in env for n in _SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1:
        return Cluster(int(env["SLURM_NTASKS"]), None, None, "slurm")
    return None


def _checked(cluster: Cluster) -> Cluster:
    if cluster.num_processes < 1 or not 0 <= cluster.process_id < cluster.num_processes:
        raise DistributedError(f"process_id {cluster.process_id} must be in [0, num_processes "
                               f"{cluster.num_processes})")
    if ":" not in (cluster.coordinator or ""):
        raise DistributedError(f"coordinator {cluster.coordinator!r} must be HOST:PORT")
    return cluster


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_devices: int | None = None) -> bool:
    """Joins the other processes when flags or environment say there are any; True if it did.

    `local_devices`: simulated CPU devices for *this* process (ignored when XLA_FLAGS already
    sets a count, or when jax was imported already). Call before anything touches devices.
    """
    cluster = detect(coordinator, num_processes, process_id)
    if local_devices:
        ensure_cpu_devices(local_devices)
    if cluster is None or cluster.num_processes == 1:
        return False
    import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS is final)

    # CPU cross-process collectives need an implementation; gloo ships with jaxlib (the default
    # in jax 0.10, set anyway so an older default of "none" cannot turn it into a hang).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cluster.source == "slurm":
        jax.distributed.initialize(cluster_detection_method="slurm")
    else:
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                                   cluster_detection_method="deactivate")
    return True


def process_count(coordinator: str | None = None, num_processes: int | None = None,
                  process_id: int | None = None) -> int:
    """How many processes the run will have, known before jax is imported."""
    cluster = detect(coordinator, num_processes, process_id)
    return 1 if cluster is None else cluster.num_processes
