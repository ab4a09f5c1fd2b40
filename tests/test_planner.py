"""The parallelism planner (dsjax/plan/): its layouts and their reasons, the exact parameter
shares, the analytic memory against compiled programs, the collectives it reads from HLO, the
CLI's ranked and compiled plans, and launch.py's plan=auto re-planning on fewer devices."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import ROOT, TINY_MODEL, child_env, run_launch
from launching import losses
from dsjax.config import ConfigError, load
from dsjax.config.load import parse_value
from dsjax.metrics import looped_axis_traffic
from dsjax.model.decoder import abstract_params
from dsjax.plan import auto, layouts, planner, profiles
from dsjax.plan.estimate import ParamTable

TINY = {**TINY_MODEL, "data.seq_len": 32, "data.global_batch": 8}


def test_layouts_cover_every_mesh_and_say_why_the_others_cannot_run():
    cfg = load("configs/cpu_tiny.py", TINY)
    seen = list(layouts.candidates(cfg, 8, hosts=2))
    meshes = {(l.data, l.tensor, l.pipeline, l.context) for l, _, _ in seen}
    by_hand = {(d, t, p, c) for d in (1, 2, 4, 8) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)
               for c in (1, 2, 4, 8) if d * t * p * c == 8}
    assert meshes == by_hand  # every factorisation of 8 over the four axes: 20
    reasons = {(l.data, l.tensor, l.pipeline, l.context): why for l, c, why in seen if why}
    assert "spans hosts" in reasons[(1, 8, 1, 1)]  # 4 devices per host
    assert "shorter than" in reasons[(4, 1, 1, 2)]  # 32-token rows are not split
    kv = [why for l, c, why in seen if l.tensor == 4 and l.context == 1 and l.data == 2]
    assert kv and all(w == "model.num_kv_heads: 2 is not divisible by mesh.tensor 4" for w in kv)
    ok = [(l, c) for l, c, why in seen if not why]
    assert ok and all(c.mesh.size == 8 and c.data.global_batch == 8 for _, c in ok)
    assert {l.remat for l, _ in ok} == {r for r, _ in layouts.REMATS}
    assert {l.fsdp for l, _ in ok} == {False, True}
    assert all(c.mesh.dcn_data * c.mesh.dcn_pipeline == 2 for _, c in ok)
    # data 1 cannot span 2 hosts: the stages do (sharding.host_split's dcn_pipeline)
    assert {l.dcn_pipeline for l, _, _ in seen if (l.data, l.pipeline) == (1, 2)} == {2}


def test_parameter_shares_by_hand():
    cfg = load("configs/cpu_tiny.py", TINY)
    table = ParamTable(abstract_params(cfg.model))
    D, H, N, K, F, V, L = 64, 4, 2, 16, 128, 512, 2
    per_layer = D * H * K + 2 * D * N * K + H * K * D + 3 * D * F  # q, k, v, o, gate/up/down
    norms = L * 2 * D + D  # two per layer and the final one: replicated everywhere
    assert table.count == 2 * V * D + L * per_layer + norms
    t2p2 = layouts.Layout(2, 2, 2)
    assert table.local(t2p2) == 2 * V * D / 2 + L * per_layer / 4 + L * 2 * D / 2 + D
    fsdp = layouts.Layout(4, 2, 1, fsdp=True)  # "embed" over data, heads/mlp/vocab over tensor
    assert table.local(fsdp) == 2 * V * D / 8 + L * per_layer / 8 + norms


def test_analytic_memory_tracks_the_compiled_program_unpipelined():
    """Within 10% (measured: 4-14% over the layouts of docs/planner.md; pipelines are not)."""
    cfg = load("configs/cpu_tiny.py")
    prof = profiles.profile("cpu", 8)
    params = ParamTable(abstract_params(cfg.model))
    for layout in (layouts.Layout(8, 1, 1, remat="dots"), layouts.Layout(4, 2, 1)):
        plan = planner.Plan(layout, layouts.apply(cfg, layout), None, 0.0)
        plan.estimate = planner.estimate(plan.cfg, layout, prof, params, "cpu")
        plan.model_mem_bytes = plan.estimate.mem_bytes
        planner.prove(plan, prof, params, "cpu")
        assert abs(plan.model_mem_bytes / plan.compiled.mem_bytes - 1) < 0.10, layout


def test_looped_traffic_counts_loops_and_the_costlier_branch():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(i, carry):
        v, flag = carry
        v = jax.lax.cond(flag > 0, lambda a: jax.lax.pcast(jax.lax.psum(a, "x"), "x",
                                                           to="varying") * 0.5,
                         lambda a: a * 2.0, v)
        return v, flag

    f = jax.shard_map(lambda v, flag: jax.lax.fori_loop(0, 3, body, (v, flag))[0], mesh=mesh,
                      in_specs=(P("x"), P()), out_specs=P("x"))
    x = jax.ShapeDtypeStruct((512,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    hlo = jax.jit(f).lower(x, jnp.int32(1)).compile().as_text()
    calls, sent = looped_axis_traffic(hlo, mesh, "x")
    assert calls == 3  # the taken-or-not branch's psum, once per iteration
    assert sent == 3 * 2 * (1 / 2) * 256 * 4  # ring all-reduce of 256 floats over 2 devices


def test_spearman_and_what_changed_by_hand():
    assert planner.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert planner.spearman([1, 2, 3], [3, 2, 1]) == -1.0
    assert planner.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    old = {"key": {"devices": 8, "device": "cpu", "hosts": 1, "config": {"a": 1}},
           "plan": {"mesh": {"data": 8}, "fsdp": False, "schedule": None,
                    "remat": {"policy": "dots"}, "micro_batch": 2, "accum_steps": 1}}
    key = {"devices": 4, "device": "cpu", "hosts": 1, "config": {"a": 1}}
    new = {"mesh": {"data": 4}, "fsdp": False, "schedule": None, "remat": {"policy": "dots"},
           "micro_batch": 4, "accum_steps": 1}
    assert auto.what_changed(old, key, new) == (
        "devices 8 -> 4; mesh {'data': 8} -> {'data': 4}; micro_batch 2 -> 4")


def test_profiles_and_plan_mode_are_checked():
    assert profiles.for_device_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert profiles.for_device_kind("NVIDIA H200") == "h200"
    assert profiles.for_device_kind("cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device: unknown"):
        profiles.profile("tpu")
    with pytest.raises(ConfigError, match="plan: unknown mode 'sometimes'"):
        load("configs/cpu_tiny.py", {"plan": "sometimes"})
    with pytest.raises(ConfigError, match="posttrain.recipe runs stages"):
        load("configs/cpu_tiny.py", {"plan": "auto", "posttrain.recipe": "pretrain,sft"})


def _plan_cli(tmp_path, *args):
    cmd = [sys.executable, "-m", "dsjax.plan", "--config", "configs/cpu_tiny.py", *args,
           *[f"--config.{k}={v}" for k, v in TINY.items()]]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)


def test_plan_cli_ranks_compiled_plans_and_prints_overrides(tmp_path):
    out = tmp_path / "plan.json"
    proc = _plan_cli(tmp_path, "--devices", "8", "--device", "cpu", "--top", "2",
                     "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = json.loads(out.read_text())["plans"]
    compiled = [p for p in plans if p["compiled"]]
    assert len(compiled) == 2 and plans[:2] == compiled  # proved plans first
    assert compiled[0]["predicted_step_ms"] <= compiled[1]["predicted_step_ms"]
    for p in plans:
        assert {"mesh", "schedule", "remat", "predicted_mem_bytes", "predicted_step_ms",
                "predicted_mfu"} <= set(p)
        assert np.prod(list(p["mesh"].values())) == 8
    assert "rejected" in proc.stdout and "model.num_kv_heads" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("python launch.py"))
    overrides = dict(a[len("--config."):].split("=", 1) for a in line.split()[4:])
    cfg = load("configs/cpu_tiny.py", {**TINY, **{k: parse_value(v) for k, v in
                                                   overrides.items()}})
    assert layouts.of_config(cfg).mesh() == plans[0]["mesh"]


def test_plan_cli_says_why_nothing_fits(tmp_path):
    proc = _plan_cli(tmp_path, "--devices", "3", "--device", "cpu", "--top", "0")
    assert proc.returncode == 2
    assert "no layout" in proc.stderr and "does not split over data 3" in proc.stderr
    proc = _plan_cli(tmp_path, "--devices", "8", "--device", "tpu")
    assert proc.returncode == 2 and "--device: unknown" in proc.stderr


def test_plan_auto_replans_on_fewer_devices_and_continues(tmp_path):
    """Stopped on 8 devices, resumed on 4: re-planned, restored onto the new mesh, and its next
    losses are those of a run restored onto the same 4-device layout set by hand."""
    four = "--xla_force_host_platform_device_count=4"
    first = tmp_path / "first"
    proc = run_launch(str(first), {"plan": "auto", "train.steps": 2})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((first / "summary.json").read_text())
    assert summary["plan"]["compiled"] and summary["plan_measured"]["step_ms"] > 0
    assert np.prod(list(summary["mesh"].values())) == 8
    shutil.copytree(first, tmp_path / "direct")

    proc = run_launch(str(first), {"plan": "auto"}, xla_flags=four)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "re-planned: devices 8 -> 4" in proc.stdout + proc.stderr
    assert "resumed from step 2" in proc.stdout + proc.stderr
    cached = json.loads((first / "plan.json").read_text())
    assert cached["key"]["devices"] == 4 and cached["history"][0]["mesh"] == summary["plan"]["mesh"]
    layout = layouts.Layout(**cached["plan"]["layout"])

    direct = tmp_path / "direct"
    proc = run_launch(str(direct), {k: v for k, v in layout.overrides().items()},
                      xla_flags=four)
    assert proc.returncode == 0, proc.stderr[-3000:]
    replanned, by_hand = losses(first), losses(direct)
    assert sorted(replanned) == sorted(by_hand) == [1, 2, 3, 4]
    for step in (3, 4):
        assert replanned[step] == pytest.approx(by_hand[step], rel=1e-5, abs=1e-5)
    assert replanned[1] == by_hand[1]  # the first run's steps, copied

