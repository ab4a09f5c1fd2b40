"""1-bit Adam inside dsjax's training: the warmup against the AdamW train step, the bytes of the
compiled compressed train step, the MTP loss in both phases, h100_fp8.py:smoke, and resuming (same
mesh: bit-exact; another data size: errors reset). 8 simulated CPU devices."""

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

import references
from conftest import FLAT_MESH, ROOT, TINY_FLAGS, random_batch, read_records, run_launch
from dsjax import batching, sharding
from dsjax import config as config_lib
from dsjax import metrics as mx
from dsjax.metrics import gemms
from dsjax.checkpoint import Checkpointer
from dsjax.train import build_trainer
from dsjax.train import resume as resume_lib


def _tiny_cfg(config="configs/cpu_tiny.py", **overrides):
    flags = {**TINY_FLAGS, **FLAT_MESH, "train.steps": 10, "optim.name": "onebit_adam",
             **overrides}
    return config_lib.load(os.path.join(ROOT, config), flags)


def test_trainer_warmup_is_adamw_then_compressed_sends_a_thirtieth():
    """Through `build_trainer` on mesh (data 4, tensor 2): the warmup steps are dsjax's AdamW
    `train_step` (same schedule, clipping, weight-decay mask; bias correction on, as optax), the
    host switches to the compressed program at freeze_step, the loss keeps falling on a repeated
    batch, and the compiled compressed step sends <= 1/30 of a float32 all-reduce over `data`."""
    freeze = 3
    # clip_norm 0.5 < the gradient norms here (~0.95 at init): clipping is part of the comparison.
    common = {"optim.freeze_step": freeze, "optim.bias_correction": True, "optim.clip_norm": 0.5}
    trainer = build_trainer(_tiny_cfg(**common))
    adamw = build_trainer(_tiny_cfg(**common, **{"optim.name": "adamw"}))
    batch = random_batch(np.random.default_rng(11), 8, 32)
    state, ref = trainer.init(), adamw.init()
    first = jax.device_get(state.params)
    metrics, ref_metrics = [], []
    for _ in range(freeze):
        state, m = trainer.step(state, trainer.device_batch(batch))
        ref, m_ref = adamw.step(ref, adamw.device_batch(batch))
        metrics.append(jax.device_get(m))
        ref_metrics.append(jax.device_get(m_ref))
    ours, theirs = jax.device_get(state.params), jax.device_get(ref.params)
    # The same float32 operations on the same mean gradient, reduced in another order (a pmean of
    # per-worker gradients vs GSPMD's partial sums). Each of the 3 steps rounds p - update once,
    # so a reordered gradient can leave a param 1 ulp off per step: 4 ulps of max(|p0|, |p|)
    # (params <= ~1.01: 4.8e-7). Adam's m/sqrt(v) takes the gradients' relative reordering
    # error into the update: ~1e-6, up to ~1e-5 where a gradient's terms cancel to a tenth of
    # their size; 3 steps x lr 3e-3 x 1e-5 ~ 1e-7 more. Measured: bit-identical on a 2-core
    # AVX-512 EPYC, 1 ulp (1.0056920 vs 1.0056919) in 1 of 128 elements on an AVX-512/AMX
    # Xeon, and under the suite's code generation 1.8e-8 against 1.2e-8 of ulps in 2 of 4096.
    # A wrong lr step, missing clip, bias correction or weight-decay mask moves a parameter by
    # >= 1e-5.
    for a, b, p0 in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), jax.tree.leaves(first)):
        ulp = np.spacing(np.maximum(np.abs(p0), np.abs(b)).astype(np.float32))
        np.testing.assert_array_less(np.abs(a - b), 4 * ulp + 1e-7)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ours),
                                                              jax.tree.leaves(first)))
    assert moved > 1e-3  # not two unchanged copies
    for m, m_ref in zip(metrics, ref_metrics):
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-6)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-6)
        assert m["tokens"] == m_ref["tokens"] and int(m["onebit_compressed"]) == 0
    assert max(float(m["grad_norm"]) for m in metrics) > 0.5  # the clip was active

    for _ in range(4):
        state, m = trainer.step(state, trainer.device_batch(batch))
        metrics.append(jax.device_get(m))
    assert [int(m["onebit_compressed"]) for m in metrics] == [0] * freeze + [1] * 4
    losses = [float(m["loss"]) for m in metrics]
    assert all(np.isfinite(losses)) and int(state.step) == freeze + 4
    assert losses[-1] < losses[freeze] < losses[0], losses

    # Bytes on the wire, from the compiled programs; 'data' is mesh axis 0.
    with sharding.activate(trainer.mesh, trainer.rules):
        hlo = {name: fn.lower(state, trainer.device_batch(batch)).compile().as_text()
               for name, fn in (("warmup", trainer.jitted(0)),
                                ("compressed", trainer.jitted(1)))}
    ops = {k: mx.axis_collectives(v, trainer.mesh, "data") for k, v in hlo.items()}
    sent = {k: sum(c.sent_bytes() for c in v) for k, v in ops.items()}
    grad_bytes = 4 * sum(math.prod(p.sharding.shard_shape(p.shape))
                         for p in jax.tree.leaves(state.params))
    allreduce = 2 * (4 - 1) / 4 * grad_bytes
    # The warmup all-reduces the whole float32 gradient over `data` (so the parser sees it) ...
    assert sent["warmup"] == pytest.approx(allreduce, rel=1e-3)
    # ... the compressed step keeps only scalar all-reduces (loss, token count, norm) ...
    assert max(c.result_bytes for c in ops["compressed"] if c.op == "all-reduce") <= 16
    # ... and sends packed signs and scales: 1/32 plus per-bucket scales and padding, one bucket
    # per tensor (measured 1/31.3).
    print(f"data-parallel bytes per device: warmup {sent['warmup']:.0f}, compressed "
          f"{sent['compressed']:.0f} (1/{sent['warmup'] / sent['compressed']:.1f})")
    assert sent["compressed"] <= allreduce / 30


def test_mtp_loss_is_trained_and_logged_in_both_phases():
    """An MTP model (DeepSeek-V3 §2.2) under 1-bit Adam: each worker adds its rows' weighted MTP
    loss to its objective, so the warmup steps equal AdamW's `train_step` (whose objective has
    it) and the metrics carry `mtp_loss` in both phases. Without the MTP term the MTP modules'
    params would not move at all and the comparison would fail."""
    common = {"optim.freeze_step": 2, "optim.bias_correction": True,
              "model.num_mtp_layers": 1, "model.mtp_loss_weight": 0.5}
    trainer = build_trainer(_tiny_cfg(**common))
    adamw = build_trainer(_tiny_cfg(**common, **{"optim.name": "adamw"}))
    # One document per row: every worker holds as many MTP targets as the others, so the
    # token-weighted mean of the workers' MTP losses is the batch's.
    batch = random_batch(np.random.default_rng(12), 8, 32, docs_per_row=1)
    state, ref = trainer.init(), adamw.init()
    first = jax.device_get(state.params)
    for _ in range(2):
        state, m = trainer.step(state, trainer.device_batch(batch))
        ref, m_ref = adamw.step(ref, adamw.device_batch(batch))
        np.testing.assert_allclose(np.asarray(m["mtp_loss"]), np.asarray(m_ref["mtp_loss"]),
                                   rtol=1e-5)
        assert float(m["aux_loss"]) == pytest.approx(float(m_ref["aux_loss"]), rel=1e-5)
    ours, theirs = jax.device_get(state.params), jax.device_get(ref.params)
    # Adam moves each element by ~lr (3e-3) whatever its gradient's size, so an element whose
    # gradient terms nearly cancel carries their reordering error into the update (measured:
    # 3.5e-6 in 3 of 8192 under the suite's code generation). A missing MTP term leaves the MTP
    # params ~1e-3 from AdamW's.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), ours, theirs)
    moved = np.abs(ours["mtp_eh_proj"] - first["mtp_eh_proj"]).max()
    assert moved > 1e-3  # lr 3e-3 Adam steps on the MTP projection
    state, m = trainer.step(state, trainer.device_batch(batch))
    assert int(m["onebit_compressed"]) == 1 and np.all(np.isfinite(np.asarray(m["mtp_loss"])))


def _snapshot(state):
    """What the refresh test compares, on the host (the step donates the state it is given)."""
    opt = state.opt_state
    return jax.device_get({"step": state.step, "params": state.params, "count": opt.count,
                           "mu": opt.mu, "nu": opt.nu, "worker_error": opt.worker_error,
                           "server_error": opt.server_error})


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_refresh_step_runs_exact_and_resumes_bit_exactly_across_it(tmp_path):
    """optim.refresh_every (on by default) through `build_trainer`: freeze after 2 steps, every
    3rd step after it exact. The refresh step (step 5) runs the exact program, moves v (which the
    compressed steps around it leave frozen) and leaves the error buffers, which the compressed
    step after it uses, as they were. A run checkpointed after step 4 and resumed (the next step
    the refresh) continues bit for bit like the uninterrupted one: loss, params, optimizer state
    and error buffers after the refresh and the compressed steps after it."""
    cfg = _tiny_cfg(**{"optim.freeze_step": 2, "optim.refresh_every": 3})
    trainer = build_trainer(cfg)
    steps, interrupt, refresh = 7, 4, 5  # refresh: the 1-based step that is exact
    assert [trainer.phase_at(s) for s in range(steps)] == [0, 0, 1, 1, 0, 1, 1]
    rng = np.random.default_rng(13)
    batches = [random_batch(rng, 8, 32) for _ in range(steps)]

    state = trainer.init()
    snaps, metrics = [_snapshot(state)], []
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False,
                                log=lambda _: None, train_layout=resume_lib.train_layout(cfg))
    for t in range(steps):
        state, m = trainer.step(state, trainer.device_batch(batches[t]))
        metrics.append(jax.device_get(m))
        snaps.append(_snapshot(state))
        if t + 1 == interrupt:
            resume_lib.save(checkpointer, interrupt, state, {"cursor": interrupt}, trainer.mesh,
                            cfg.model)
    assert [int(m["onebit_compressed"]) for m in metrics] == [0, 0, 1, 1, 0, 1, 1]
    assert all(np.isfinite(float(m["loss"])) for m in metrics)
    assert [int(s["count"]) for s in snaps] == list(range(steps + 1))
    # snaps[k]: after k steps. v moves in the exact steps (1, 2 and the refresh 5) only; the
    # error buffers move in the compressed steps (3, 4, 6, 7) only, so the refresh keeps them
    # for step 6; m moves in every step, the params in every step but the first (the
    # schedule's lr starts at 0).
    for k in range(1, steps + 1):
        before, after = snaps[k - 1], snaps[k]
        exact = k <= 2 or k == refresh
        assert _same(before["nu"], after["nu"]) != exact, k
        assert _same(before["worker_error"], after["worker_error"]) == exact, k
        assert _same(before["server_error"], after["server_error"]) == exact, k
        assert not _same(before["mu"], after["mu"]), k
        assert _same(before["params"], after["params"]) == (k == 1), k

    # Interrupted after step 4 (a fresh initialised state, as a new process has), resumed.
    resumed, start, data_state = resume_lib.resume(checkpointer, trainer.init(), trainer.mesh,
                                                   cfg.model, False, lambda _: None)
    checkpointer.close()
    assert (start, data_state) == (interrupt, {"cursor": interrupt})
    assert _same(_snapshot(resumed), snaps[interrupt])
    for t in range(interrupt, steps):
        resumed, m = trainer.step(resumed, trainer.device_batch(batches[t]))
        m = jax.device_get(m)
        # Same programs, same inputs on the same CPU: equal to the last bit.
        assert int(m["onebit_compressed"]) == int(metrics[t]["onebit_compressed"])
        assert float(m["loss"]) == float(metrics[t]["loss"]), t + 1
        assert float(m["grad_norm"]) == float(metrics[t]["grad_norm"]), t + 1
    final = _snapshot(resumed)
    jax.tree.map(np.testing.assert_array_equal, final, snaps[steps])


def _resume_from_step_4(source, workdir, overrides=None):
    shutil.copytree(os.path.join(source, "checkpoints", "4"),
                    os.path.join(workdir, "checkpoints", "4"))
    proc = run_launch(workdir, {**references.SMOKE, **(overrides or {})},
                      config=references.SMOKE_CONFIG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 4" in proc.stdout
    return proc, read_records(workdir)


@pytest.fixture
def smoke_run():
    """The smoke model's uninterrupted run (references.SMOKE: 8 steps, freezing after 2, step 5
    and 8 exact refreshes, the batch 8 -> 16 from step 5, checkpoints 4, 6, 8)."""
    return references.smoke()


def test_h100_fp8_smoke_trains_with_everything_on(smoke_run):
    workdir, stdout = smoke_run
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert (cfg["optim"]["name"], cfg["train"]["compute_dtype"], cfg["fp8"]["recipe"],
            cfg["remat"]["policy"], cfg["mesh"]["fsdp"]) == (
                "onebit_adam", "fp8", "current", "attention_core", False)
    assert (cfg["mesh"]["data"], cfg["mesh"]["tensor"], cfg["mesh"]["pipeline"]) == (2, 2, 2)
    assert cfg["pipeline"]["schedule"] == "1f1b" and cfg["batch"]["policy"] == "adaptive"
    records = read_records(workdir)
    # Warmup (steps 1-2), compressed (3-4), the refresh (5: exact, after freeze_step 2, as
    # optim.refresh_every 3 puts it), compressed again (6-7), the next refresh (8).
    assert cfg["optim"]["freeze_step"] == 2 and cfg["optim"]["refresh_every"] == 3
    assert [r["onebit_compressed"] for r in records] == [0, 0, 1, 1, 0, 1, 1, 0]
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)), losses
    # From ~6.24 (uniform over 512) to under 4 in 8 steps at lr 3e-3; the compressed steps keep
    # it falling (measured 6.24, 6.24, 5.70, 5.10, 4.24, 3.77, 3.75, 3.75).
    assert losses[-1] < losses[2] < losses[0] - 0.3, losses
    assert "held-out: loss" in stdout

    # The adaptive batch size changed once, 8 -> 16 rows from step 5, with accumulation.
    assert [(r["batch_size"], r["accum_steps"]) for r in records] == [(8, 2)] * 4 + [(16, 4)] * 4
    change = [c for r in records for c in r.get("batch_changes") or []]
    assert [(c["old"], c["new"], c["step"]) for c in change] == [(8, 16, 4)], change
    assert "batch size 8 -> 16 from step 5" in stdout
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert [(c["old"], c["new"]) for c in summary["batch_changes"]] == [(8, 16)]
    # Every (phase, shape) the run compiled ran: the refresh at 16 rows is the exact program.
    used = {(b["phase"], b["accum_steps"]) for b in summary["batch_shapes"] if b["used"]}
    assert used == {(0, 2), (1, 2), (0, 4), (1, 4)}, summary["batch_shapes"]

    # fp8 dots in every step program the run used, rebuilt from the config it wrote: each fp8
    # projection (fp8.matmuls) is an e4m3 x e4m3 dot forward and two e5m2 x e4m3 dots backward
    # (dgrad, wgrad) in the one stage body each pipeline stage runs; the 1f1b schedule
    # recomputes the forward, so that count is a lower bound.
    # fp8.select=auto chose the map: probes before steps 1, 5 (and the layer map the run ended
    # with is the program rebuilt here).
    assert cfg["fp8"]["select"] == "auto" and summary["precision_probes"] == 2
    words = summary["precision_layers"].split(",")
    assert summary["fp8_flops_fraction"] >= 0.6 and len(words) == 2
    raw = {k: v for k, v in cfg.items() if k != "xla_flags"}
    raw["fp8"] = {**raw["fp8"], "select": "policy", "layers": summary["precision_layers"]}
    trainer = build_trainer(config_lib.from_config_dict(raw))
    projections = min(w.count("8") for w in words)  # the stage bodies differ where words do
    assert projections >= 4, words
    for phase, accum in sorted(used):
        shape = batching.Shape(4 * accum, accum, 2)  # 4 rows per micro-step
        with sharding.activate(trainer.mesh, trainer.rules):
            text = trainer.programs.jitted(phase, shape).lower(
                trainer.abstract_state(), batching.abstract_batch(
                    trainer.batch_shardings, shape, trainer.cfg.data.seq_len)).as_text()
        dots = gemms.dot_general_dtypes(text)
        forward = dots.count(("f8E4M3FN", "f8E4M3FN", "f32"))
        backward = dots.count(("f8E5M2", "f8E4M3FN", "f32"))
        print(f"phase {phase}, accumulation {accum}: {forward} fp8 forward dots, {backward} "
              f"backward, {len(dots) - forward - backward} others")
        assert forward >= projections and backward >= 2 * projections, (phase, accum, dots)
        assert all(not d[0].startswith("f8") and not d[1].startswith("f8")
                   for d in dots if d not in (("f8E4M3FN", "f8E4M3FN", "f32"),
                                              ("f8E5M2", "f8E4M3FN", "f32"))), dots


def test_resume_in_the_compressed_phase_is_bit_exact(smoke_run, tmp_path):
    workdir, _ = smoke_run
    proc, records = _resume_from_step_4(workdir, str(tmp_path / "resumed"))
    assert "warning" not in proc.stdout
    # Same mesh, same CPU, same data position, and the error buffers restored: step 5's update
    # uses them, so step 6's loss would differ if they had been reset.
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] == [r["loss"] for r in read_records(workdir)[4:]]


def test_resume_on_another_data_size_resets_the_errors(smoke_run, tmp_path):
    workdir, _ = smoke_run
    resumed = str(tmp_path / "data8")
    proc, records = _resume_from_step_4(workdir, resumed, {"mesh.data": 4, "mesh.tensor": 1})
    assert ("warning: checkpoint step 4 was written with mesh.data 2, this run has mesh.data 4; "
            "1-bit Adam's error buffers restart from zero") in proc.stdout, proc.stdout
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert all(np.isfinite(r["loss"]) for r in records)
    # Step 5's loss comes from the restored params. Not to float32 rounding: fp8 current scaling
    # takes each worker's amax, and 8 workers of 1 row quantise otherwise than 4 of 2 (measured
    # 4.6708 vs 4.6716); wrong params would be off by > 0.5 (step 4's loss is 5.52).
    assert records[0]["loss"] == pytest.approx(read_records(workdir)[4]["loss"], abs=0.05)
    # The run went on and checkpointed its own layout: 8 workers' rows.
    checkpointer = Checkpointer(os.path.join(resumed, "checkpoints"))
    layout = checkpointer.step_meta(6)["errors_layout"]
    checkpointer.close()
    assert layout["mesh"]["data"] == 4 and all(shape[0] == 4 for shape in layout["shapes"])
