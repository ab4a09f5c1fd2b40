"""fp8.select=auto (dsjax/precision, dsjax/fp8_probe.py): the probe's measurements against
independent computations, the choice and its hysteresis, the spike rules, delayed-scaling
restarts, and whole runs through launch.py (a planted outlier leaves fp8 and comes back; a
resumed run gives the same losses)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FLAT_MESH, read_records, run_launch

from dsjax import fp8, fp8_probe
from dsjax.config import layer_map
from dsjax.fp8_policy import Fp8Policy
from dsjax.precision import choose
from dsjax.precision.delayed import restart
from dsjax.precision.probe import Probe, probe_model

STAT = {name: i for i, name in enumerate(fp8_probe.STATS)}
MATMULS = ("q", "k", "v", "o", "gate", "up", "down")


def _rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(a - ref) / np.linalg.norm(ref)


def _underflow(a, fmt_max, smallest_normal):
    a = np.asarray(a, np.float64)
    scaled = np.abs(a) * fmt_max / np.max(np.abs(a))
    return np.mean(scaled[a != 0] < smallest_normal)


def test_measure_against_the_production_fp8_path_and_numpy():
    """Every stat of one projection from other code: the errors from the production fp8 VJP
    (`fp8_einsum`, not the emulation the probe uses) and from numpy float64 and ml_dtypes
    bfloat16; underflow and crest factors counted in numpy."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 48)).astype(np.float32)
    x[:, 3] *= 300.0  # an outlier channel: a visible underflow share
    w = (0.05 * rng.normal(size=(48, 40))).astype(np.float32)
    dy = rng.normal(size=(96, 40)).astype(np.float32)
    stats = np.asarray(fp8_probe.measure("nk,kf->nf", x, w, dy, "current", jnp.bfloat16))

    y8, vjp = jax.vjp(lambda a, b: fp8.fp8_einsum("nk,kf->nf", a, b, out_dtype=jnp.float32), x, w)
    dw8 = vjp(dy)[1]
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    y64, dw64 = x64 @ w64, x64.T @ dy64
    bf = lambda a: np.asarray(a, ml_dtypes.bfloat16).astype(np.float64)
    # A bfloat16 GEMM: bf16 operands, float32 accumulation, the result rounded to bf16.
    y_bf, dw_bf = bf(bf(x) @ bf(w)), bf(bf(x).T @ bf(dy))
    # fp8 errors: float32 vs float64 references differ by ~1e-7 relative, the errors are ~4e-2.
    np.testing.assert_allclose(stats[STAT["fwd_fp8"]], _rel(y8, y64), rtol=1e-4)
    np.testing.assert_allclose(stats[STAT["wgrad_fp8"]], _rel(dw8, dw64), rtol=1e-4)
    # bf16: a result within an ulp of a rounding tie may round either way (accumulation order).
    np.testing.assert_allclose(stats[STAT["fwd_other"]], _rel(y_bf, y64), rtol=2e-2)
    np.testing.assert_allclose(stats[STAT["wgrad_other"]], _rel(dw_bf, dw64), rtol=2e-2)
    assert 0.02 < stats[STAT["fwd_fp8"]] < 0.08 and stats[STAT["fwd_other"]] < 0.01
    e4m3, e5m2 = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn), ml_dtypes.finfo(ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(stats[STAT["x_underflow"]],
                               _underflow(x, float(e4m3.max), float(e4m3.smallest_normal)),
                               atol=1e-7)
    np.testing.assert_allclose(stats[STAT["dy_underflow"]],
                               _underflow(dy, float(e5m2.max), float(e5m2.smallest_normal)),
                               atol=1e-7)
    assert stats[STAT["x_underflow"]] > 0.01  # the outlier channel pushes the rest down
    rms = np.sqrt(np.mean(x64 ** 2))
    np.testing.assert_allclose(stats[STAT["x_crest"]], np.max(np.abs(x64)) / rms, rtol=1e-5)
    np.testing.assert_allclose(stats[STAT["x_outliers"]], np.mean(np.abs(x64) > 6 * rms),
                               atol=1e-7)


def test_the_probe_measures_each_layer_and_projection_on_its_own_inputs(tiny_overrides):
    """The whole-model probe: layer 0's q, k, v read the first norm of the embedded tokens,
    computed here by hand; their forward fp8 errors and crest factors must be the ones of that
    input with their own weights, and layer 1's (another input) must differ."""
    from dsjax import config as config_lib
    from dsjax.model.layers import rms_norm
    from dsjax.train import build_trainer
    from conftest import ROOT
    overrides = {**tiny_overrides, **FLAT_MESH, "train.compute_dtype": "fp8",
                 "fp8.select": "auto"}
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), overrides)
    trainer = build_trainer(cfg)
    state = trainer.init()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(8, 32)).astype(np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
             "positions": np.broadcast_to(np.arange(32, dtype=np.int32), (8, 32)).copy(),
             "segment_ids": np.ones((8, 32), np.int32), "weights": np.ones((8, 32), np.float32)}
    probe = Probe(probe_model(trainer.model, "float32"), trainer.mesh, trainer.rules)
    stats = probe(state.params, trainer.device_batch(batch))
    assert stats.shape == (2, 7, len(fp8_probe.STATS))

    params = jax.device_get(state.params)
    layer0 = jax.tree.map(lambda a: a[0], params["layers"])
    x = rms_norm(jnp.asarray(params["embedding"])[tokens], layer0["attn_norm"]["scale"],
                 cfg.model.norm_eps).reshape(-1, cfg.model.hidden_size)
    x64 = np.asarray(x, np.float64)
    for name in ("q", "k", "v"):
        w = layer0["attn"][name]
        y8 = fp8.fp8_einsum("nD,DHK->nHK", x, w, out_dtype=jnp.float32)
        want = _rel(y8, np.einsum("nd,dhk->nhk", x64, np.asarray(w, np.float64)))
        # The probe's input is the same float32 arithmetic; 1% covers an fp8 rounding tie
        # flipped by a different summation order in the norm.
        np.testing.assert_allclose(stats[0, MATMULS.index(name), STAT["fwd_fp8"]], want,
                                   rtol=1e-2)
        np.testing.assert_allclose(stats[0, MATMULS.index(name), STAT["x_crest"]],
                                   np.max(np.abs(x64)) / np.sqrt(np.mean(x64 ** 2)), rtol=1e-4)
    assert not np.allclose(stats[1, :3, STAT["x_crest"]], stats[0, :3, STAT["x_crest"]],
                           rtol=1e-3)
    # The probe changes nothing: the params it read are the state's, unchanged.
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def _stats(fwd8=0.03, wgrad8=0.03, other=0.002, underflow=0.0, shape=(3, 2)):
    s = np.zeros(shape + (len(fp8_probe.STATS),))
    s[..., STAT["fwd_fp8"]], s[..., STAT["wgrad_fp8"]] = fwd8, wgrad8
    s[..., STAT["fwd_other"]] = s[..., STAT["wgrad_other"]] = other
    s[..., STAT["x_underflow"]] = underflow
    return s


def test_verdicts_bounds():
    s = _stats()
    s[0, 0, STAT["wgrad_fp8"]] = 0.2  # a weight gradient fp8 loses too much
    s[1, 1, STAT["x_underflow"]] = 0.05  # an outlier swamps the rest of the input
    s[2, 0, STAT["fwd_fp8"]] = s[2, 0, STAT["fwd_other"]] = 0.3  # even bf16 is not enough
    s[2, 1, STAT["dy_underflow"]] = 0.9  # reported, not a criterion
    got = choose.verdicts(s, max_rel_error=0.12, max_underflow=0.02)
    assert got.tolist() == [["o", "8"], ["8", "o"], ["f", "8"]]


def test_leaving_fp8_is_immediate_and_returning_takes_the_hysteresis():
    c = choose.Choices.start(3, 2, pinned=(False, False, True))
    fp8_all = np.full((3, 2), "8")
    assert c.update(fp8_all, hysteresis=2, first=True)  # the first probe is adopted at once
    assert c.words == ["88", "88", "oo"]  # ...except a pinned (keep_*_layers) layer
    bad = fp8_all.copy()
    bad[1, 0] = "o"
    assert c.update(bad, 2, first=False) == [(1, 0, "8", "o")]
    assert c.update(fp8_all, 2, False) == []  # one good probe: not yet
    assert c.update(bad, 2, False) == []  # the streak restarts...
    assert c.update(fp8_all, 2, False) == []
    assert c.update(fp8_all, 2, False) == [(1, 0, "o", "8")]  # ...two in a row: back
    assert c.words == ["88", "88", "oo"]
    # float32 -> other_dtype is a step toward fp8 too; a demotion skips no level.
    worst = fp8_all.copy()
    worst[0, 1] = "f"
    assert c.update(worst, 2, False) == [(0, 1, "8", "f")]
    state = c.get_state()
    c.update(fp8_all, 2, False)  # streak 1 of 2
    restored = choose.Choices.start(3, 2, pinned=(False, False, True))
    restored.set_state(state)
    restored.update(fp8_all, 2, False)
    assert restored.get_state() == c.get_state()
    assert c.demote_layer(1) == [(1, 0, "8", "o"), (1, 1, "8", "o")]


def test_spike_rules():
    W = choose.SPIKE_WINDOW
    windows = [[1.0] * W, [2.0] * W, [1.0] * (W - 1)]
    words = ["88", "88", "88"]
    norms = np.array([5.0, 2.0, 100.0])
    # Layer 0 at 5x its median, layer 1 at 1x; layer 2's window is not full yet.
    assert set(choose.spikes(windows, [], norms, 1.0, words, 4.0, 1.5)) == {0}
    assert choose.spikes(windows, [], norms, 1.0, words, 0.0, 1.5) == {}
    # Every layer at 5x at once (early training): the optimizer's surge, not a layer's.
    assert choose.spikes(windows, [], np.array([5.0, 10.0, 1.0]), 1.0, words, 4.0, 1.5) == {}
    # Layer 0 at 25x while layer 1 is at 5x: 5x more than its peers.
    assert set(choose.spikes(windows, [], np.array([25.0, 10.0, 1.0]), 1.0, words, 4.0,
                             1.5)) == {0}
    # A loss spike takes the layer whose norm rose most, once the loss window is full.
    quiet = np.array([1.2, 3.0, 1.0])  # ratios 1.2, 1.5
    assert set(choose.spikes(windows, [2.0] * W, quiet, 3.5, words, 4.0, 1.5)) == {1}
    assert choose.spikes(windows, [2.0] * W, quiet, 2.9, words, 4.0, 1.5) == {}
    assert choose.spikes(windows, [2.0] * (W - 1), quiet, 3.5, words, 4.0, 1.5) == {}
    # A layer with nothing in fp8 has nothing to leave.
    assert choose.spikes(windows, [], norms, 1.0, ["oo", "88", "88"], 4.0, 1.5) == {}


def test_flops_fraction_and_words():
    weights = np.array([[1.0, 3.0], [1.0, 3.0]])
    assert choose.fp8_flops_fraction(["88", "o8"], weights) == pytest.approx(7 / 8)
    assert choose.fp8_layer_shares(["88", "8o"], weights) == [1.0, 0.25]
    assert layer_map.choice("8of8", ("q", "k", "v", "o")) == (("q", "o"), ("v",))
    assert layer_map.word(("q", "o"), ("v",), ("q", "k", "v", "o")) == "8of8"
    policy = Fp8Policy(matmuls=MATMULS, layers=(layer_map.choice("8of8888", MATMULS),))
    assert policy.runs("q", 0) and not policy.runs("k", 0)
    one = policy.for_choice(policy.layer_choices(1)[0])
    assert one.widens("v") and not one.runs("v") and one.runs("o")


def test_a_switched_projection_restarts_its_amax_history():
    meta = {"layers": {"attn": {"q": fp8.Fp8Meta(jnp.ones((3, 3, 4)), jnp.ones((3, 3)),
                                                 jnp.ones((3, 3)))},
                       "mlp": {"up": fp8.Fp8Meta(jnp.ones((3, 3, 4)), jnp.ones((3, 3)),
                                                 jnp.ones((3, 3)))}},
            "moe_layers": {"mlp": {"up": fp8.Fp8Meta(jnp.ones((2, 3, 4)), jnp.ones((2, 3)),
                                                     jnp.ones((2, 3)))}}}
    ranges = {"layers": (0, 3), "moe_layers": (3, 5)}
    out = restart(meta, [(1, "up"), (4, "up"), (2, "q")], ranges)
    for leaf in (out["layers"]["mlp"]["up"], out["layers"]["attn"]["q"],
                 out["moe_layers"]["mlp"]["up"]):
        assert {a.shape for a in (leaf.amax_history, leaf.scale, leaf.amax)} != set()
    restarted = {("layers", "up"): [1], ("layers", "q"): [2], ("moe_layers", "up"): [1]}
    for (stack, name), rows in restarted.items():
        leaf = out[stack]["attn" if name == "q" else "mlp"][name]
        for a in (leaf.amax_history, leaf.scale, leaf.amax):
            a = np.asarray(a)
            for r in range(a.shape[0]):
                assert np.all(a[r] == 0) == (r in rows), (stack, name, r)


# ---------------------------------------------------------------------------------------------
# Whole runs.

AUTO = {**FLAT_MESH, "train.compute_dtype": "fp8", "fp8.select": "auto",
        "fp8.other_dtype": "float32", "fp8.probe_every": 2, "fp8.hysteresis": 2,
        "checkpoint.every": 2}


def _summary(workdir):
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def test_a_planted_outlier_leaves_fp8_at_the_next_probe_and_returns_after_the_hysteresis(
        tmp_path):
    """Three launches on one run directory: 2 steps clean; to step 4 with the test hook (layer
    1's MLP input gets a 1e3 outlier channel); to step 8 without it. The probe at step 2 must
    take layer 1's MLP input projections (gate, up; down reads their product) out of fp8 and
    nothing else; with the hook gone, the probes at 4 and 6 find them clean, and they return at
    6 (hysteresis 2), which they would at 4 if the map were not restored from the checkpoint."""
    run = str(tmp_path / "run")
    for steps, hook in ((2, -1), (4, 1), (8, -1)):
        proc = run_launch(run, {**AUTO, "train.steps": steps, "fp8.test_outlier_layer": hook})
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(run)
    assert summary["precision_layers"] == "8888888,8888888"
    changes = [(c["step"], c["layer"], c["matmul"], c["from"], c["to"])
               for c in summary["precision_changes"]]
    left = [(s, l, m) for s, l, m, a, b in changes if (a, b) == ("fp8", "other_dtype")]
    back = [(s, l, m) for s, l, m, a, b in changes if (a, b) == ("other_dtype", "fp8")]
    assert {(2, 1, "gate"), (2, 1, "up")} <= set(left) <= {(2, 1, m) for m in
                                                        ("gate", "up", "down")}
    assert sorted(back) == sorted((6, l, m) for _, l, m in left)
    assert len(changes) == len(left) + len(back)
    assert summary["precision_probes"] == 4  # before steps 1, 3, 5 and 7 (indices 0, 2, 4, 6)
    # The fraction of projection FLOPs in fp8 at the end: all (by hand from the shapes).
    assert summary["fp8_flops_fraction"] == 1.0
    D, H, N, F = 64, 4, 2, 128
    K = D // H
    per_layer = {"q": D * H * K, "k": D * N * K, "v": D * N * K, "o": H * K * D,
                 "gate": D * F, "up": D * F, "down": F * D}
    records = read_records(run)
    during = [r for r in records if r["step"] in (3, 4)]  # after the probe at 2, hook on
    out = sum(per_layer[m] for _, _, m in left)
    assert all(r["fp8_flops_fraction"] == pytest.approx(1 - out / (2 * sum(per_layer.values())))
               for r in during)
    assert all(r["fp8_share/layer0"] == 1.0 and r["fp8_share/layer1"] < 1.0 for r in during)
    # The heat map: a PNG with the fp8 colour (and no other: the final map is all fp8).
    from PIL import Image
    image = np.asarray(Image.open(os.path.join(run, "precision_map.png")).convert("RGB"))
    colours = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)): code for code, c in
               (("8", "#4caf50"), ("o", "#ffb300"), ("f", "#e53935"))}
    seen = {code for rgb, code in colours.items() if np.all(image == rgb, axis=-1).sum() > 500}
    assert seen == {"8"}, seen
    # --mode eval evaluates in the map the run ended with.
    proc = run_launch(run, {**AUTO, "train.steps": 8}, mode="eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "evaluating with the run's map 8888888,8888888" in proc.stdout, proc.stdout


def test_auto_composes_with_1f1b_delayed_scaling_and_1bit_adam_and_resumes_bit_exact(tmp_path):
    """cpu_tiny's (2, 2, 2) 1f1b mesh, delayed scaling, 1-bit Adam, and a bound tight enough
    that the map mixes fp8 and float32 projections (the chunks differ: the run-time switch).
    A run restarted from its step-2 checkpoint gives the same losses as the run that went on."""
    flags = {"train.compute_dtype": "fp8", "fp8.select": "auto", "fp8.recipe": "delayed",
             "fp8.other_dtype": "float32", "fp8.probe_every": 3, "fp8.max_rel_error": 0.035,
             "optim.name": "onebit_adam", "optim.freeze_step": 2, "model.num_layers": 4}
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    proc = run_launch(full, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(full)
    words = summary["precision_layers"].split(",")
    assert any("8" in w for w in words) and any(set(w) != {"8"} for w in words), words
    shutil.copytree(os.path.join(full, "checkpoints", "2"),
                    os.path.join(resumed, "checkpoints", "2"))
    proc = run_launch(resumed, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = {r["step"]: r["loss"] for r in read_records(full)}
    second = {r["step"]: r["loss"] for r in read_records(resumed)}
    assert second == {3: first[3], 4: first[4]}
    assert _summary(resumed)["precision_layers"] == summary["precision_layers"]


def test_layer_grad_norms_per_layer_and_per_worker():
    """What the spike rule reads: each layer's gradient norm over every leaf of the stacks, in
    layer order; 1-bit Adam's per-worker leaves (a leading data axis) as the workers' RMS."""
    from dsjax.train.step import layer_grad_norms
    rng = np.random.default_rng(5)
    a = rng.normal(size=(2, 3, 4)).astype(np.float32)  # [workers, layers, ...]
    b = rng.normal(size=(3, 5)).astype(np.float32)  # [layers, ...], one copy
    c = rng.normal(size=(2, 6)).astype(np.float32)  # the MoE stack's 2 layers
    grads = {"layers": {"a": a, "b": b}, "moe_layers": {"c": c}, "embedding": np.ones(3)}
    per_worker = {"layers": {"a": True, "b": False}, "moe_layers": {"c": False},
                  "embedding": False}
    got = np.asarray(layer_grad_norms(grads, per_worker))
    a64, b64, c64 = (x.astype(np.float64) for x in (a, b, c))
    want = np.concatenate([np.sqrt(np.mean((a64 ** 2).sum(-1), axis=0) + (b64 ** 2).sum(-1)),
                           np.sqrt((c64 ** 2).sum(-1))])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert layer_grad_norms({"embedding": np.ones(3)}) is None
