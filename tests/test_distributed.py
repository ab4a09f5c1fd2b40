"""Multi-process runs (dsjax/runtime/distributed.py): settings detection, and 2 real processes on
localhost that train the same losses as 1 process and leave a checkpoint a 1-process eval reads."""

import dataclasses
import json
import os
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY_FLAGS, child_env, read_records, run_launch, session_stdlib_corpus
from dsjax import config as config_lib
from dsjax import sharding
from dsjax.runtime import distributed, xla_flags
from dsjax.config import ConfigError
from dsjax.sharding import MESH_AXES

SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[003-004]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_detect_single_process_by_default():
    assert distributed.detect(environ={}) is None
    # A one-task SLURM job (sbatch without srun -n) is a single process too.
    assert distributed.detect(environ={**SLURM, "SLURM_NTASKS": "1"}) is None


def test_detect_order_flags_env_slurm():
    env = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
           **SLURM}
    flags = distributed.detect("h1:99", 2, 1, environ=env)
    assert (flags.coordinator, flags.num_processes, flags.process_id, flags.source) == (
        "h1:99", 2, 1, "flags")
    from_env = distributed.detect(environ=env)
    assert (from_env.coordinator, from_env.num_processes, from_env.process_id,
            from_env.source) == ("h0:1234", 4, 3, "env")
    slurm = distributed.detect(environ=SLURM)
    assert (slurm.num_processes, slurm.source) == (2, "slurm")


@pytest.mark.parametrize("args,env,match", [
    (("h:1", 2, None), {}, "go together"),
    (("h:1", 2, 2), {}, "process_id 2"),
    (("nohost", 2, 0), {}, "HOST:PORT"),
    ((None, None, None), {"JAX_NUM_PROCESSES": "2"}, "only JAX_NUM_PROCESSES"),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two",
                          "JAX_PROCESS_ID": "0"}, "integers"),
])
def test_detect_rejects_incomplete_settings(args, env, match):
    with pytest.raises(ConfigError, match=match):
        distributed.detect(*args, environ=env)


def test_layout_of_a_single_process_mesh():
    mesh = jax.make_mesh((4, 2, 1, 1), MESH_AXES, devices=jax.devices()[:8])
    text = sharding.describe_layout(mesh)
    assert "over 1 process(es)" in text and "process 0: 8 devices" in text
    assert sharding.tensor_groups_local(mesh)


def _launch_processes(workdir, flags, num_processes, logdir, timeout_s=240, while_running=None):
    """Runs `num_processes` launch.py processes against one coordinator; returns their logs.
    `while_running(procs)` is called every 0.1 s until they end (e.g. to send a signal).

    Fails (never hangs) if any process exits non-zero or the group outlives `timeout_s`; every
    process still running is killed on the way out.
    """
    import portpicker

    port = portpicker.pick_unused_port()
    env = child_env()
    procs, logs = [], []
    try:
        for i in range(num_processes):
            cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"--workdir={workdir}",
                   f"--coordinator=localhost:{port}", f"--num_processes={num_processes}",
                   f"--process_id={i}"] + [f"--config.{k}={v}" for k, v in flags.items()]
            logs.append(os.path.join(logdir, f"process{i}.log"))
            with open(logs[-1], "w", encoding="utf-8") as out:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i = failed[0]
                pytest.fail(f"process {i} exited {procs[i].returncode}:\n{_tail(logs[i])}")
            if time.monotonic() > deadline:
                pytest.fail(f"processes still running after {timeout_s} s:\n{_tail(logs[0])}")
            if while_running is not None:
                while_running(procs)
            time.sleep(0.1)
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{_tail(logs[i])}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [open(path, encoding="utf-8").read() for path in logs]


def _tail(path, chars=4000):
    with open(path, encoding="utf-8") as f:
        return f.read()[-chars:]


def test_two_processes_match_one_and_their_checkpoint_evaluates(tmp_path):
    # The session's corpus, built before either run starts.
    corpus = session_stdlib_corpus()
    # The "overlap" XLA profile rides along: its flags are GPU-only, so on CPU the losses must
    # not move, and config.json must record them.
    flags = {**TINY_FLAGS, "train.steps": 3, "checkpoint.every": 0, "data.path": corpus,
             "mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1, "mesh.xla_profile": "overlap"}
    two, one = str(tmp_path / "two"), str(tmp_path / "one")

    logs = _launch_processes(two, flags, 2, str(tmp_path))
    # 2 x 4 simulated devices; process 0 owns data rows 0-1, process 1 rows 2-3, and each
    # `tensor` pair stays inside one process.
    assert "over 2 process(es)" in logs[0] and "process 1: 4 devices" in logs[0]
    assert "tensor groups within one process: yes" in logs[0]
    assert "processes per group along each axis: data 2, tensor 1, pipeline 1" in logs[0]
    n = len(xla_flags.flags("overlap"))
    assert f"XLA flag profile 'overlap': {n} flags in XLA_FLAGS; no effect on cpu" in logs[0]
    assert "held-out: loss" in logs[0] and "held-out: loss" not in logs[1]  # process 0 prints

    proc = run_launch(one, flags, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi, single = read_records(two), read_records(one)
    assert [r["step"] for r in multi] == [1, 2, 3]  # process 0 alone wrote metrics.jsonl
    # Same global batch (rows in another order) and the same program on the same mesh shape;
    # only the order of float32 sums differs.
    np.testing.assert_allclose([r["loss"] for r in multi], [r["loss"] for r in single],
                               rtol=1e-5)
    with open(os.path.join(two, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and summary["final_train_loss"] == multi[-1]["loss"]
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["3"]
    with open(os.path.join(two, "config.json"), encoding="utf-8") as f:
        recorded = json.load(f)
    assert recorded["mesh"]["xla_profile"] == "overlap"
    assert recorded["xla_flags"]["applied"] == xla_flags.flags("overlap")
    assert recorded["xla_flags"]["missing"] == []

    # The checkpoint both processes wrote restores in one process.
    proc = run_launch(two, flags, mode="eval", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(two, "summary.json"), encoding="utf-8") as f:
        evaluated = json.load(f)
    np.testing.assert_allclose(evaluated["eval_loss"], summary["eval_loss"], rtol=1e-5)


def test_a_signal_to_one_process_stops_all_after_the_same_step(tmp_path):
    # SIGTERM reaches process 1 only; process 0 learns of it through the coordination service's
    # key-value store (dsjax/runtime/preemption.py), both finish the same step, write one checkpoint
    # together and exit 0. A disagreement would hang the next collective (the test then fails
    # on its deadline instead).
    import signal

    corpus = session_stdlib_corpus()
    flags = {**TINY_FLAGS, "train.steps": 200, "checkpoint.every": 0, "data.path": corpus,
             "mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1, "metrics.profile_every": 0}
    workdir = str(tmp_path / "run")
    sent = []

    def signal_process_1(procs):
        path = os.path.join(workdir, "metrics.jsonl")
        if not sent and os.path.isfile(path) and len(open(path, encoding="utf-8").readlines()) >= 3:
            procs[1].send_signal(signal.SIGTERM)
            sent.append(time.monotonic())

    logs = _launch_processes(workdir, flags, 2, str(tmp_path), while_running=signal_process_1)
    assert sent, "the run ended before the signal"
    steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
    assert len(steps) == 1 and 3 <= steps[0] < 200, steps
    assert f"stopped early at step {steps[0]} of 200 (process 1: SIGTERM)" in logs[0], (
        logs[0][-2000:])
    assert "SIGTERM received" in logs[1]
    assert "held-out: loss" not in logs[0]  # stopped early: no eval


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What mesh construction and describe_layout read from a device of another process."""
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def _fake_mesh(grid):
    return types.SimpleNamespace(devices=grid, axis_names=MESH_AXES,
                                 shape=dict(zip(MESH_AXES, grid.shape)))


def test_hybrid_mesh_keeps_tensor_groups_inside_a_process():
    # 2 processes x 4 GPUs whose global ids interleave (id = 2 * local + process, as a
    # topology-ordered numbering can): the plain id-ordered mesh pairs process 0's and 1's
    # devices in every tensor group; the hybrid one keeps each pair inside one process.
    devices = [FakeDevice(2 * local + p, p) for p in range(2) for local in range(4)]
    cfg = config_lib.load(f"{ROOT}/configs/cpu_tiny.py", {"mesh.data": 4, "mesh.tensor": 2,
                                                          "mesh.pipeline": 1})
    plain = np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(4, 2, 1, 1)
    assert "tensor groups within one process: NO" in sharding.describe_layout(
        _fake_mesh(plain))

    grid = sharding.mesh_devices(cfg, devices)
    text = sharding.describe_layout(_fake_mesh(grid))
    assert "tensor groups within one process: yes" in text, text
    assert "processes per group along each axis: data 2, tensor 1, pipeline 1, context 1" in text, text
    # process 0 owns data rows 0-1, process 1 rows 2-3 (data = host * 2 + index in the host)
    owner = np.vectorize(lambda d: d.process_index)(grid)
    np.testing.assert_array_equal(owner[:, :, 0, 0], [[0, 0], [0, 0], [1, 1], [1, 1]])
    assert "process 1: 4 devices, id@(data,tensor,pipeline,context): 1@(2,0,0,0), 3@(2,1,0,0)" in text, text
    # With one process per host this is jax's own hybrid layout.
    from jax.experimental import mesh_utils
    expected = mesh_utils.create_hybrid_device_mesh((2, 2, 1, 1), (2, 1, 1, 1), devices,
                                                    process_is_granule=True)
    assert [d.id for d in grid.flat] == [d.id for d in expected.flat]


def test_hosts_of_several_processes_and_the_tensor_limit():
    # 4 processes x 2 GPUs on 2 hosts (mesh.dcn_data = 2): a host is processes {0, 1} or {2, 3},
    # so a tensor group of 4 fits inside a host though not inside a process.
    devices = [FakeDevice(4 * local + p, p) for p in range(4) for local in range(2)]
    cfg = config_lib.load(f"{ROOT}/configs/cpu_tiny.py",
                          {"mesh.data": 2, "mesh.tensor": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2,
                           "model.num_kv_heads": 4})
    grid = sharding.mesh_devices(cfg, devices)
    owner = np.vectorize(lambda d: d.process_index)(grid)
    assert set(owner[0].flat) == {0, 1} and set(owner[1].flat) == {2, 3}
    assert sharding.processes_per_group(_fake_mesh(grid), "tensor") == 2

    # The default (one host per process) cannot hold a tensor group of 4 on 2 GPUs.
    with pytest.raises(ConfigError, match=r"^mesh.tensor: 4 must fit inside one host \(2 dev"):
        sharding.mesh_devices(dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, dcn_data=0)), devices)
    # 3 hosts cannot each hold whole processes of 4.
    with pytest.raises(ConfigError, match="^mesh.dcn_data: dcn_data.dcn_pipeline = 3 hosts"):
        sharding.host_split(dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, dcn_data=3)), 8, 4)
