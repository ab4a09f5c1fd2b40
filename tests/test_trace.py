"""dsjax/metrics/trace.py and hlo.py: communication share from a real trace on 8 CPU devices,
the interval arithmetic on a trace whose answer is known, and collective bytes from compiled HLO."""

import glob
import gzip
import json
import os
import shutil

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsjax.metrics import hlo as hlo_lib
from dsjax.metrics import trace

W = 8  # simulated devices (tests/conftest.py)
GRAD = (1024, 1024)  # float32: 4 MiB all-reduced per step, large enough to dominate a trace


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("d",))


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.fixture(scope="module")
def psum_step(mesh):
    """A step shaped like data parallelism: a local matmul per shard and a psum of a buffer."""
    def body(x_bd, w_dd, g):
        return x_bd @ w_dd, jax.lax.psum(g, "d")

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P()),
                               out_specs=(P("d"), P())))
    keys = jax.random.split(jax.random.key(0), 3)
    args = (_put(mesh, jax.random.normal(keys[0], (W * 128, 512)), P("d")),
            _put(mesh, jax.random.normal(keys[1], (512, 512)), P()),
            _put(mesh, jax.random.normal(keys[2], GRAD), P()))
    jax.block_until_ready(fn(*args))  # compile outside the trace
    return fn, args


def test_comm_share_of_a_step_with_an_all_reduce(psum_step, tmp_path):
    fn, args = psum_step
    hlo = fn.lower(*args).compile().as_text()
    (out, total), run_dir = trace.trace_step(fn, *args, logdir=str(tmp_path), hlo_text=hlo)
    # The call's output comes back (the caller keeps training with it).
    assert jnp.allclose(total, W * args[2], rtol=1e-5)
    assert glob.glob(os.path.join(run_dir, "*.xplane.pb"))  # TensorBoard's profile plugin
    assert glob.glob(os.path.join(run_dir, "*.trace.json.gz"))  # Perfetto
    share = trace.comm_share(str(tmp_path))  # the log dir: its latest run is read
    assert share["devices"] == W
    assert 0.0 < share["comm_fraction"] < 1.0, share
    assert set(share["kinds"]) == {"all-reduce"}, share
    assert share["kinds"]["all-reduce"] > 0
    assert 0.0 <= share["exposed_comm_fraction"] <= share["comm_fraction"]
    assert 0.0 <= share["rendezvous_wait_fraction"] <= share["comm_fraction"]
    assert share["device_time_us"] > 0
    # Without the HLO the names alone classify the same ops (JAX calls the op psum_invariant).
    os.remove(os.path.join(run_dir, trace.HLO_FILE))
    assert trace.comm_share(run_dir) == share


def test_comm_share_is_zero_without_collectives(mesh, tmp_path):
    fn = jax.jit(lambda x, w: jnp.tanh(x @ w))
    x = _put(mesh, jax.random.normal(jax.random.key(1), (W * 128, 512)), P("d"))
    w = _put(mesh, jax.random.normal(jax.random.key(2), (512, 512)), P())
    jax.block_until_ready(fn(x, w))
    _, run_dir = trace.trace_step(fn, x, w, logdir=str(tmp_path))
    share = trace.comm_share(run_dir)
    assert share["devices"] == W and share["device_time_us"] > 0
    # Exactly zero, not nearly: no op of this program is a collective.
    assert share["kinds"] == {} and share["comm_fraction"] == 0.0
    assert share["exposed_comm_fraction"] == 0.0


def test_trace_json_and_xplane_give_the_same_answer(psum_step, tmp_path):
    fn, args = psum_step
    _, run_dir = trace.trace_step(fn, *args, logdir=str(tmp_path / "log"))
    only_xplane = tmp_path / "xplane"
    only_xplane.mkdir()
    for path in glob.glob(os.path.join(run_dir, "*.xplane.pb")):
        shutil.copy(path, only_xplane)
    from_json, from_xplane = trace.comm_share(run_dir), trace.comm_share(str(only_xplane))
    assert from_json["kinds"].keys() == from_xplane["kinds"].keys()
    for key in ("comm_fraction", "exposed_comm_fraction", "device_time_us"):
        # The JSON rounds timestamps to nanoseconds, as the xplane stores them.
        assert from_json[key] == pytest.approx(from_xplane[key], rel=1e-6), key


def _write_trace(run_dir, events):
    os.makedirs(run_dir)
    with gzip.open(os.path.join(run_dir, "host.trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": events}, f)
    with open(os.path.join(run_dir, "host.xplane.pb"), "wb"):
        pass


def _op(tid, name, ts, dur, device, **extra):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": name, "device_ordinal": device, **extra}}


def test_interval_arithmetic_on_a_known_trace(tmp_path):
    run_dir = str(tmp_path / "plugins" / "profile" / "run")
    _write_trace(run_dir, [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 9, "ts": 0, "dur": 500, "name": "PjitFunction(step)"},
        # Device 0, thread 1: a loop around a fusion and an all-reduce that waits 30 us.
        _op(1, "while.3", 0, 100, "0"),
        _op(1, "fusion.1", 0, 40, "0"),
        _op(1, "all-reduce.5", 40, 60, "0"),
        {"ph": "X", "pid": 1, "tid": 1, "ts": 40, "dur": 30, "name": "Rendezvous"},
        # Device 0, thread 2: compute overlapping the all-reduce for 20 us.
        _op(2, "fusion.2", 70, 20, "0"),
        # Device 1: compute, then an all-gather nothing overlaps.
        _op(3, "fusion.1", 0, 50, "1"),
        _op(3, "all_gather.2", 50, 10, "1"),
    ])
    share = trace.comm_share(run_dir)
    # Device 0: busy [0, 100] = 100, collective 60, of it 20 overlapped, 30 waiting.
    # Device 1: busy 60, collective 10, exposed 10. The loop encloses ops, so it is not compute.
    assert share["devices"] == 2
    assert share["device_time_us"] == pytest.approx((100 + 60) / 2)
    assert share["comm_fraction"] == pytest.approx(70 / 160)
    assert share["exposed_comm_fraction"] == pytest.approx(50 / 160)
    assert share["rendezvous_wait_fraction"] == pytest.approx(30 / 160)
    assert share["kinds"] == pytest.approx({"all-gather": 5.0, "all-reduce": 30.0})


def test_gpu_trace_counts_device_planes_only(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_trace(run_dir, [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        # The host thread that launches the ops names them too: not device time.
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 300, "name": "all-reduce-start.1",
         "args": {"hlo_op": "all-reduce-start.1"}},
        # Compute stream and the NCCL stream, overlapping for 25 us.
        {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 100, "name": "fusion.4",
         "args": {"hlo_op": "fusion.4"}},
        {"ph": "X", "pid": 7, "tid": 2, "ts": 75, "dur": 50,
         "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
         "args": {"hlo_op": "all-reduce-start.1"}},
    ])
    share = trace.comm_share(run_dir)
    assert share["devices"] == 1 and share["device_time_us"] == pytest.approx(125)
    assert share["comm_fraction"] == pytest.approx(50 / 125)
    assert share["exposed_comm_fraction"] == pytest.approx(25 / 125)
    assert share["kinds"] == pytest.approx({"all-reduce": 50.0})


def test_collective_names():
    cases = {"psum_invariant.7": "all-reduce", "all-reduce.21": "all-reduce",
             "pmax.7": "all-reduce", "all-reduce-start.3": "all-reduce",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "all-reduce",
             "reduce_scatter.7": "reduce-scatter", "psum_scatter": "reduce-scatter",
             "all_gather_invariant": "all-gather", "ncclDevKernel_AllGather_RING_LL": "all-gather",
             "all-to-all": "all-to-all", "ppermute.3": "collective-permute",
             "collective-permute-done": "collective-permute",
             "ynn_fusion": None, "argmax": None, "cumsum.2": None, "reduce_sum": None,
             "wrapped_reduce": None, "dynamic-update-slice_fusion": None}
    assert {name: hlo_lib.collective_kind(name) for name in cases} == cases


def test_collective_bytes_of_compiled_collectives(psum_step, mesh):
    fn, args = psum_step
    nbytes = 4 * GRAD[0] * GRAD[1]
    # Ring all-reduce: each device sends 2 (W-1)/W of the buffer.
    assert hlo_lib.collective_bytes(fn.lower(*args).compile().as_text()) == {
        "all-reduce": 2 * (W - 1) / W * nbytes}

    def body(x):  # x: this device's [R, C] shard
        gathered = jax.lax.all_gather(x, "d", tiled=True)  # [W R, C]
        scattered = jax.lax.psum_scatter(gathered, "d", tiled=True)  # [R, C] from [W R, C]
        swapped = jax.lax.all_to_all(x, "d", 0, 0, tiled=True)  # [R, C]
        shifted = jax.lax.ppermute(x, "d", [(i, (i + 1) % W) for i in range(W)])  # [R, C]
        return scattered + swapped + shifted

    x = _put(mesh, jax.random.normal(jax.random.key(3), (W * 64, 32)), P("d"))
    hlo = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).lower(
        x).compile().as_text()
    shard = 4 * 64 * 32  # bytes of one device's [R, C]
    frac = (W - 1) / W
    assert hlo_lib.collective_bytes(hlo) == pytest.approx({
        "all-gather": frac * W * shard,      # of the gathered buffer
        "reduce-scatter": frac * W * shard,  # of the buffer before scattering
        "all-to-all": frac * shard,
        "collective-permute": shard})


def test_collective_bytes_reads_mesh_axes_replica_groups():
    # GSPMD's collectives in newer XLA name mesh axes instead of listing devices.
    lines = [
        "HloModule jit_step, num_partitions=8",
        "  %all-reduce.21 = f32[256]{0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}, "
        "use_global_device_ids=true, to_apply=%add",
        "  %all-reduce.22 = f32[256]{0} all-reduce(%x), channel_id=2, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) "
        "{'axis_1'}, use_global_device_ids=true, to_apply=%add",
    ]
    # Groups of 4 (data) and of 2 (tensor): 2 (W-1)/W x 1 KiB each.
    assert hlo_lib.collective_bytes("\n".join(lines)) == {
        "all-reduce": 2 * 3 / 4 * 1024 + 2 * 1 / 2 * 1024}
    rewritten = hlo_lib._MESH_GROUPS.sub(hlo_lib._listed_groups, lines[1] + lines[2])
    assert "replica_groups={{0,2,4,6},{1,3,5,7}}" in rewritten
    assert "replica_groups={{0,1},{2,3},{4,5},{6,7}}" in rewritten
