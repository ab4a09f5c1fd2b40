"""dsjax/pipeline/: every schedule against the unpipelined single-device model (DESIGN
invariants 1 and 5), 1F1B's flat memory, training with remat + fp8, config errors, and a
checkpoint written with pp=2 evaluated with pp=1."""

import dataclasses
import functools
import json
import math
import os
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, random_batch, read_records, run_launch, tiny
from dsjax import config as config_lib
from dsjax import fp8, pipeline, sharding, train
from dsjax.metrics import gemms
from dsjax.config import ConfigError
from dsjax.model.loss import ModelLoss, loss_fn
from dsjax.pipeline import stages as stages_lib
from unpipelined import assert_grads_match, loss_and_grads, objective_and_aux, pipelined_and_plain

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import pipeline_table  # noqa: E402  pylint: disable=wrong-import-position

# 4 layers (8 where 4 stages x 2 repeats need them), tiny widths: compile time dominates.
TINY = tiny({"model.num_layers": 4, "model.hidden_size": 32, "model.mlp_dim": 64,
             "model.vocab_size": 128, "data.seq_len": 16, "train.steps": 4,
             "optim.warmup_steps": 1})


def _cfg(**overrides):
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **overrides})


def _pipelined(mesh, schedule, microbatches, repeats=1, batch=8, **overrides):
    data, tensor, stages = mesh
    return _cfg(**{"mesh.data": data, "mesh.tensor": tensor, "mesh.pipeline": stages,
                   "pipeline.schedule": schedule, "pipeline.microbatches": microbatches,
                   "pipeline.repeats": repeats, "data.global_batch": batch, **overrides})


def _loss_and_grads(apply_fn, params, batch):
    return jax.jit(functools.partial(loss_and_grads, apply_fn))(params, batch)


@pytest.mark.parametrize("schedule, mesh, microbatches, repeats, layers, typed, mtp", [
    ("gpipe", (2, 2, 2), 2, 1, 4, True, 0),
    # Unchecked shard_map (what fp8 models run): gradients of replicated params still exact.
    ("gpipe", (2, 2, 2), 2, 1, 4, False, 0),
    ("gpipe", (2, 2, 2), 4, 1, 4, True, 0),
    ("gpipe", (2, 1, 4), 4, 1, 4, True, 0),
    ("circular", (2, 2, 2), 2, 2, 4, True, 0),
    ("circular", (2, 2, 2), 4, 3, 6, True, 0),  # 3 chunks per stage: 2 all_to_all slots per pair
    ("circular", (2, 1, 4), 4, 2, 8, True, 0),
    ("1f1b", (2, 2, 2), 2, 1, 4, True, 0),
    ("1f1b", (2, 2, 2), 2, 1, 4, False, 0),
    ("1f1b", (2, 2, 2), 4, 1, 4, True, 0),
    ("1f1b", (2, 1, 4), 4, 1, 4, True, 0),
    ("1f1b", (1, 1, 8), 8, 1, 8, True, 0),
    # Interleaved 1F1B: 2 or 3 chunks per stage, units of one microbatch group per chunk.
    ("interleaved_1f1b", (2, 2, 2), 2, 2, 4, True, 0),
    ("interleaved_1f1b", (2, 2, 2), 2, 2, 4, False, 0),
    ("interleaved_1f1b", (2, 2, 2), 4, 3, 6, True, 0),  # 2 groups of 2 microbatches
    ("interleaved_1f1b", (2, 1, 4), 4, 2, 8, True, 0),
    # MTP modules (DeepSeek-V3 §2.2) run with the head on the last stage's outputs.
    ("gpipe", (2, 2, 2), 2, 1, 4, True, 2),
    ("1f1b", (2, 2, 2), 2, 1, 4, True, 1),
    ("interleaved_1f1b", (2, 2, 2), 4, 2, 4, True, 1),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_schedule_matches_the_unpipelined_model(schedule, mesh, microbatches, repeats, layers,
                                                typed, mtp):
    """Loss (with `mtp` modules: + the weighted MTP loss) and every gradient of the pipelined
    model against the plain decoder on one device."""
    cfg = _pipelined(mesh, schedule, microbatches, repeats, **{"model.num_layers": layers,
                                                               "model.num_mtp_layers": mtp,
                                                               "model.mtp_loss_weight": 0.5})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    assert isinstance(state.objective, pipeline.Pipelined)
    apply_fn = dataclasses.replace(state.objective, typed=typed)
    # The layer stack is split over the stages, as the rules table says.
    assert trainer.state_shardings.params["layers"]["attn"]["q"].spec[0] == "pipeline"
    host_batch = random_batch(np.random.default_rng(1), 8, 16, vocab=128)
    if mtp:  # every stage holds the MTP modules whole
        assert "pipeline" not in jax.tree.leaves(
            trainer.state_shardings.params["mtp_layers"]["attn"]["q"].spec)
        assert state.params["mtp_layers"]["attn"]["q"].shape[0] == mtp
    # Reference: the same weights, the plain decoder, one device, no mesh.
    (loss, grads), (ref_loss, ref_grads) = pipelined_and_plain(trainer, state, host_batch,
                                                               objective=apply_fn)
    # float32: only the summation order differs (per microbatch, then across them).
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_grads_match(grads, ref_grads)  # measured <= 5e-7


def test_1f1b_memory_is_flat_in_microbatches_and_gpipe_is_not():
    cfg = _pipelined((2, 2, 2), "gpipe", 2)
    temp = {(s, m): pipeline_table.measure(cfg, s, m, 2, rows_per_microbatch=2,
                                           flops=False)["temp_bytes"]
            for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (2, 8)}
    # gpipe grows with M, 1f1b and interleaved_1f1b (2 chunks per stage) do not
    for s in ("1f1b", "interleaved_1f1b"):
        assert temp[s, 8] <= 1.05 * temp[s, 2], temp
        assert temp[s, 8] < temp["gpipe", 8], temp
    assert temp["gpipe", 8] >= 1.5 * temp["gpipe", 2], temp


def test_bubble_fractions():
    assert pipeline.bubble_fraction("gpipe", 1, 8) == 0.0
    assert pipeline.bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction("circular", 4, 8, 2) == pytest.approx(3 / 19)
    # MoE stages run every 1f1b tick (no skipped idle slots): 2(S-1) idle ticks of M + 2(S-1).
    assert pipeline.bubble_fraction("1f1b", 4, 8, moe=True) == pytest.approx(6 / 14)
    assert pipeline.bubble_fraction("gpipe", 4, 8, moe=True) == pytest.approx(3 / 11)


def test_training_with_pipeline_remat_and_fp8_lowers_the_loss():
    cfg = _pipelined((2, 2, 2), "1f1b", 2, **{"train.compute_dtype": "fp8",
                                             "remat.policy": "attention_core",
                                             "optim.lr": 1e-2})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    batch = trainer.device_batch(random_batch(np.random.default_rng(2), 8, 16, vocab=128))
    losses = []
    for _ in range(4):  # one batch repeated: the loss must fall
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses


def _np_onebit_mean(x):
    """The error-compensated 1-bit mean of x [W, n] over W workers from zero error buffers, in
    float64 (docs/onebit.md): each worker sends signs and its RMS; server j averages chunk j of
    the W decompressed copies and sends its signs and RMS back. Returns (mean [n], worker errors
    [W, n], server errors [W, n / W])."""
    w, n = x.shape
    scale = np.linalg.norm(x, axis=1, keepdims=True) / np.sqrt(n)
    signs = np.where(x >= 0, 1.0, -1.0)  # zero sends +1
    server_x = (signs * scale / w).sum(0).reshape(w, n // w)  # row j: server j's chunk
    server_scale = np.linalg.norm(server_x, axis=1, keepdims=True) / np.sqrt(n // w)
    server_signs = np.where(server_x >= 0, 1.0, -1.0)
    return ((server_signs * server_scale).reshape(n), x - scale * signs,
            server_x - server_scale * server_signs)


def _device_shards(mesh, named_sharding, shape):
    """(error-buffer group, {column block: index}) of one leaf: its distinct shards, numbered
    along the non-data mesh axes its spec names (sorted), as 1-bit Adam lays out the column
    blocks of its error buffers (docs/onebit.md: P(data, those axes))."""
    coords = {mesh.devices[i].id: dict(zip(mesh.axis_names, i))
              for i in np.ndindex(mesh.devices.shape)}
    axes = sorted({a for e in named_sharding.spec if e
                   for a in (e if isinstance(e, tuple) else (e,)) if a != "data"})
    shards = {}
    for device, index in named_sharding.devices_indices_map(shape).items():
        at = coords[device.id]
        if at["data"] == 0:  # params are replicated over data
            block = np.ravel_multi_index([at[a] for a in axes], [mesh.shape[a] for a in axes])
            shards[int(block)] = index
    return "+".join(axes) or "replicated", shards


def _first_compressed_step(trainer, before, worker_grads, lr):
    """NumPy (float64) 1-bit Adam step from `before`, the state after the exact steps (zero error
    buffers), on the workers' gradients `worker_grads` [W][pytree], as docs/onebit.md defines it
    with this config (compress "update", update_bound, no bias correction, one bucket per
    tensor, clipping by the RMS of the workers' norms), each device's shard of a leaf its own
    bucket. Returns (params, mu, worker_error, server_error), the errors laid out like the
    optimizer's."""
    o, w = trainer.cfg.optim, len(worker_grads)
    b1, b2, eps, wd = o.b1, o.b2, o.eps, o.weight_decay
    bound = (1 - b1) / (np.sqrt(1 - b2) * (1 - b1 / np.sqrt(b2)))  # exact Adam never exceeds it
    norm = np.sqrt(np.mean([sum(np.sum(g ** 2) for g in jax.tree.leaves(gw))
                            for gw in worker_grads]))
    clip = 1.0 if not o.clip_norm or norm < o.clip_norm else o.clip_norm / norm
    multiple = w * math.lcm(w, 8)  # each worker's chunk is whole bytes of signs
    paths, treedef = jax.tree_util.tree_flatten_with_path(before.params)
    params, mu, errors = [], [], {}
    for i, (path, p) in enumerate(paths):
        p = np.asarray(p, np.float64)
        m = np.asarray(jax.tree.leaves(before.opt_state.mu)[i], np.float64)
        v = np.asarray(jax.tree.leaves(before.opt_state.nu)[i], np.float64)
        g = np.stack([np.asarray(jax.tree.leaves(gw)[i], np.float64) for gw in worker_grads])
        denom = np.sqrt(v) + eps
        # What each worker sends: its momentum over the frozen sqrt(v), bounded.
        sent = np.clip(np.where(v > 0, ((1 - b1) * clip * g + b1 * m) / denom, 0.0), -bound, bound)
        new_m = np.empty_like(m)
        group, shards = _device_shards(trainer.mesh, jax.tree.leaves(
            trainer.state_shardings.params)[i], p.shape)
        blocks = [None] * len(shards)
        for block, index in shards.items():
            x = sent[(slice(None),) + tuple(index)].reshape(w, -1)
            n = x.shape[1]
            padded = max(multiple, -(-n // multiple) * multiple)
            x = np.concatenate([x, np.zeros((w, padded - n))], axis=1)
            mean, we, se = _np_onebit_mean(x)
            new_m[tuple(index)] = mean[:n].reshape(new_m[tuple(index)].shape)
            blocks[block] = (we, se)
        new_m *= denom
        errors.setdefault(group, []).append(tuple(np.concatenate(e, axis=1)
                                                  for e in zip(*blocks)))
        upd = np.clip(np.where(v > 0, new_m, 0.0) / denom, -bound, bound)
        if "norm" not in jax.tree_util.keystr(path):  # no weight decay on norm scales
            upd = upd + wd * p
        params.append(p - lr * upd)
        mu.append(new_m)
    worker_error = {k: tuple(e[0] for e in v) for k, v in errors.items()}
    server_error = {k: tuple(e[1] for e in v) for k, v in errors.items()}
    return (jax.tree.unflatten(treedef, params), jax.tree.unflatten(treedef, mu), worker_error,
            server_error)


@pytest.mark.parametrize("schedule, chunk", [("1f1b", 4), ("gpipe", 0)])
def test_onebit_adam_with_a_pipeline_matches_onebit_adam_without(schedule, chunk):
    # The pipeline's shard_map (manual over `pipeline`) nests inside 1-bit Adam's gradient
    # shard_map (manual over `data`): same 2 data-parallel workers, the same gradients, loss and
    # exact steps. The compressed step's buckets are each device's shards (docs/onebit.md), and
    # the pipeline splits the layer stack into per-stage shards: those leaves are compressed with
    # per-stage scales, so each run is checked against NumPy 1-bit Adam on its own layout, and the
    # leaves the pipeline does not split must match across the two runs.
    def run(stages):
        cfg = _pipelined((2, 2, stages), schedule, 2, **{
            "optim.name": "onebit_adam", "optim.freeze_step": 2, "optim.lr": 3e-4,
            "model.loss_chunk": chunk})
        trainer = train.build_trainer(cfg, sharding.make_mesh(
            cfg, devices=jax.devices()[:4 * stages]))
        state, out, states = trainer.init(), [], []
        for b in batches:
            state, m = trainer.step(state, trainer.device_batch(b))
            out.append((float(m["loss"]), float(m["grad_norm"]), int(m["onebit_compressed"])))
            states.append(jax.device_get(state))
        return trainer, out, states

    rng = np.random.default_rng(5)
    batches = [random_batch(rng, 8, 16, vocab=128) for _ in range(3)]
    (flat_trainer, flat, flat_states), (piped_trainer, piped, piped_states) = run(1), run(2)
    assert [c for _, _, c in piped] == [0, 0, 1]  # two exact steps, then one compressed
    # float32 rounding only, through the first compressed step. (Later steps may flip the sign
    # of a near-zero momentum entry, which 1-bit compression turns into a full-size difference.)
    for (loss_a, norm_a, _), (loss_b, norm_b, _) in zip(flat, piped):
        assert loss_b == pytest.approx(loss_a, rel=1e-5)
        assert norm_b == pytest.approx(norm_a, rel=1e-5)

    rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b),
                                                                           1e-30)
    leaves = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
    # After the exact steps every parameter and moment matches (same relative Frobenius bound
    # as the gradients above; measured <= 4e-7).
    a, b = flat_states[1], piped_states[1]
    for tree_a, tree_b in ((a.params, b.params), (a.opt_state.mu, b.opt_state.mu),
                           (a.opt_state.nu, b.opt_state.nu)):
        for (path, x), y in zip(leaves(tree_a), jax.tree.leaves(tree_b)):
            assert rel(y, x) < 1e-5, (jax.tree_util.keystr(path), rel(y, x))

    # The compressed step of each run against NumPy, from that run's own state after step 2 and
    # the workers' gradients of the plain decoder on one device (worker i: rows 4i..4i+3, its
    # share sum(NLL) * W / (batch weight) of the global mean loss).
    host = batches[2]
    total = float(np.sum(host["weights"]))
    grad = jax.jit(jax.grad(lambda p, b: ModelLoss(flat_trainer.model).nll_sum(p, b)[0]))
    for trainer, states, norm in ((flat_trainer, flat_states, flat[2][1]),
                                  (piped_trainer, piped_states, piped[2][1])):
        before, after = states[1], states[2]
        worker_grads = [jax.tree.map(lambda g: np.asarray(g, np.float64) * 2 / total,
                                     grad(before.params, {k: v[4 * i:4 * i + 4]
                                                          for k, v in host.items()}))
                        for i in range(2)]
        assert np.sqrt(np.mean([sum(np.sum(g ** 2) for g in jax.tree.leaves(gw))
                                for gw in worker_grads])) == pytest.approx(norm, rel=1e-5)
        params, mu, worker_error, server_error = _first_compressed_step(
            trainer, before, worker_grads, float(trainer.tx.learning_rate(2)))
        assert jax.tree.map(np.shape, after.opt_state.worker_error) == jax.tree.map(
            np.shape, worker_error)
        # Every coordinate moves by lr * its chunk's scale (~3e-4 * 0.1..6): float32 against
        # float64 is an ulp of the param (|p| <= 1) and ~1e-6 of the update (measured <= 5.4e-8
        # at |p| ~ 1, <= 3.7e-9 below 0.1: a tenth of the tolerance). A coordinate whose sent
        # value is ~0 could flip its sign bit under float32 reordering and move by 2 lr * scale:
        # measured, none of the ~50k flips (none is out of tolerance, both schedules). A 1%
        # larger update is off by ~3e-6.
        for (path, got), want in zip(leaves(after.params), jax.tree.leaves(params)):
            np.testing.assert_allclose(got, want, rtol=5e-7, atol=1e-9,
                                       err_msg=jax.tree_util.keystr(path))
        # Momenta and errors: O(bound) values from O(1e-6)-accurate gradients (float32, another
        # summation order): 1e-5 of the largest (measured <= 4.5e-6 of it; a flipped sign bit
        # would be off by 2 * scale); a wrong scale, bucket or error feedback is off by O(1).
        for got, want in zip(jax.tree.leaves((after.opt_state.mu, after.opt_state.worker_error,
                                              after.opt_state.server_error)),
                             jax.tree.leaves((mu, worker_error, server_error))):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())

    # Leaves the pipeline does not split (embedding, head, final norm) are the same buckets in
    # both layouts, so the same numbers after the compressed step (measured <= 3e-7), except
    # where the momentum whose sign 1-bit compression sends is float32 noise around zero: there
    # one layout moves by +lr * scale and the other by -lr * scale. Measured with the chunked
    # head (1f1b): one embedding coordinate of 4096, momentum +9.1e-9 against -9.0e-9 (the
    # largest is 6e-3), differs by 4.2e-4, 3.3e-4 of the embedding's norm.
    split = {jax.tree_util.keystr(path) for path, s in leaves(piped_trainer.state_shardings.params)
             if "pipeline" in jax.tree.leaves(tuple(s.spec))}
    assert split and all("layers" in name for name in split), split
    for (path, x), y, m in zip(leaves(flat_states[2].params), jax.tree.leaves(
            piped_states[2].params), jax.tree.leaves(flat_states[2].opt_state.mu)):
        if jax.tree_util.keystr(path) not in split:
            x, y, m = (np.asarray(a, np.float64) for a in (x, y, m))
            signal = np.abs(m) > 1e-5 * np.abs(m).max()
            assert rel(y[signal], x[signal]) < 1e-5, (jax.tree_util.keystr(path),
                                                      rel(y[signal], x[signal]))
    for (path, x), y in zip(leaves(flat_states[2].opt_state.mu),
                            jax.tree.leaves(piped_states[2].opt_state.mu)):
        if jax.tree_util.keystr(path) not in split:
            assert rel(y, x) < 1e-5, (jax.tree_util.keystr(path), rel(y, x))


@pytest.mark.parametrize("schedule, repeats", [
    ("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_fsdp_inside_the_pipeline_matches_the_unpipelined_model(schedule, repeats):
    """mesh.fsdp with mesh.pipeline 2: params and optimizer state sharded over `data` within
    each stage; the pipeline gathers each stage's weights once per step, before its shard_map
    (no all-gather runs inside a loop: tick, layer or microbatch), so loss and gradients equal
    the unpipelined model's, and a train step keeps the state sharded."""
    from dsjax import batching
    from dsjax.metrics.hlo import computations_in_loops

    cfg = _pipelined((2, 2, 2), schedule, 2, repeats, **{"mesh.fsdp": True})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    q = trainer.state_shardings.params["layers"]["attn"]["q"].spec  # [L, D, H, K]
    assert tuple(q)[:2] == ("pipeline", "data")
    assert any("data" in jax.tree.leaves(tuple(s.spec))  # Adam's moments too
               for s in jax.tree.leaves(trainer.state_shardings.opt_state))
    host_batch = random_batch(np.random.default_rng(5), 8, 16, vocab=128)
    (loss, grads), (ref_loss, ref_grads) = pipelined_and_plain(trainer, state, host_batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_grads_match(grads, ref_grads)  # measured 4.4e-7
    shape = batching.Shape(8, 1, 2)
    with sharding.activate(trainer.mesh, trainer.rules):
        hlo = trainer.programs.jitted(0, shape).lower(
            trainer.abstract_state(),
            batching.abstract_batch(trainer.batch_shardings, shape, 16)).compile().as_text()
    comps, looped = computations_in_loops(hlo)
    gathers = lambda names: sum(len(re.findall(r" all-gather(?:-start)?\(", line))
                                for c in names for line in comps[c])
    # 9 data-sharded weights (embedding, head, q, k, v, o, gate, up, down), gathered whole
    assert gathers(comps) >= 9 and gathers(looped) == 0, (gathers(comps), gathers(looped))
    state, m = trainer.step(state, trainer.device_batch(host_batch))
    assert bool(m["finite"]) and float(m["loss"]) == pytest.approx(float(ref_loss), rel=1e-5)
    assert state.params["layers"]["attn"]["q"].sharding.spec == q


def test_float16_loss_scaling_reaches_inside_the_1f1b_backward():
    """float16 under 1f1b: the schedule's own backward starts from the loss scale (2**15), as
    jax.grad's does under gpipe, so the float16 gradients match gpipe's and keep their accuracy
    against float32; seeded with 1 instead (the scale applied only after the backward, as
    before) they lose it to underflow. Then an overflowing scale skips the step and halves."""
    host = random_batch(np.random.default_rng(1), 8, 16, vocab=128)
    scale = 2.0 ** 15

    def grads(schedule, dtype, seed):
        trainer = train.build_trainer(_pipelined((2, 2, 2), schedule, 2, **{
            "train.compute_dtype": dtype}))
        state = trainer.init()

        def scaled(params, batch):  # what the train step differentiates (ls.scale_loss)
            return state.objective.loss_and_aux(params, batch, None, seed)[0] * seed
        with sharding.activate(trainer.mesh, trainer.rules):
            g = jax.jit(jax.grad(scaled))(state.params, trainer.device_batch(host))
        return state, jax.tree.map(lambda a: np.asarray(a, np.float64) / seed, jax.device_get(g))

    state, gpipe = grads("gpipe", "float16", scale)
    _, scaled_1f1b = grads("1f1b", "float16", scale)
    _, unscaled_1f1b = grads("1f1b", "float16", 1.0)
    model = state.objective.model.clone(dtype=jnp.float32)  # the float32 reference
    ref = jax.jit(jax.grad(lambda p, b: loss_fn(p, ModelLoss(model), b)[0]))(
        jax.device_get(state.params), host)

    def err(grads):  # the worst tensor's relative Frobenius error against float32
        return max(np.linalg.norm(g - r) / np.linalg.norm(r)
                   for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)))
    for g, r in zip(jax.tree.leaves(scaled_1f1b), jax.tree.leaves(gpipe)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=0)
    # Measured: 1.3e-3 scaled (gpipe and 1f1b alike), 6.9e-3 seeded with 1.
    assert err(scaled_1f1b) < 3e-3 < 5e-3 < err(unscaled_1f1b), (err(scaled_1f1b),
                                                                  err(unscaled_1f1b))

    trainer = train.build_trainer(_pipelined((2, 2, 2), "1f1b", 2,
                                             **{"train.compute_dtype": "float16"}))
    state = trainer.init()
    batch = trainer.device_batch(host)
    state, m = trainer.step(state, batch)
    assert bool(m["finite"]) and int(state.step) == 1
    state = state.replace(loss_scale=state.loss_scale.replace(
        scale=jnp.asarray(2.0 ** 60, jnp.float32)))  # the float16 backward overflows
    before = jax.device_get(state.params)
    state, m = trainer.step(state, batch)
    assert not bool(m["finite"]) and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0 ** 59
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("overrides, field", [
    ({"model.num_layers": 6, "mesh.pipeline": 4, "mesh.data": 1}, "model.num_layers"),
    ({"pipeline.schedule": "circular", "pipeline.repeats": 4}, "model.num_layers"),  # 4 % 8
    ({"pipeline.microbatches": 3}, "pipeline.microbatches"),
    ({"pipeline.microbatches": 4, "data.global_batch": 12}, "data.global_batch"),  # 12 % 8
    ({"pipeline.schedule": "zero_bubble"}, "pipeline.schedule"),
    ({"pipeline.repeats": 2}, "pipeline.repeats"),  # 1f1b does not interleave
    ({"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 4}, "model.num_layers"),
    ({"remat.policy": "full", "remat.layers": "every_4"}, "remat.layers"),  # chunks of 2 differ
    ({"batch.micro_batch": 3}, "batch.micro_batch"),  # 3 rows per replica into 2 microbatches
    ({"train.compute_dtype": "fp8", "fp8.recipe": "delayed", "pipeline.schedule": "gpipe"},
     "fp8.recipe"),
])
def test_invalid_splits_name_the_field(overrides, field):
    base = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "pipeline.microbatches": 2,
            "data.global_batch": 8}
    with pytest.raises(ConfigError) as err:
        _cfg(**{**base, **overrides})
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_split_errors_say_which_values_would_split():
    base = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "pipeline.microbatches": 2,
            "data.global_batch": 8}
    with pytest.raises(ConfigError, match=r"use a multiple of 2, e\.g\. 4$"):
        _cfg(**{**base, "batch.micro_batch": 3})
    # interleaved_1f1b R = 2 on 4 layers: chunks of 1 layer, so every_2 differs between them
    with pytest.raises(ConfigError, match=r"chunks of 1 layers \(every stage runs one program\); "
                                          r"use a period that divides 1: all, every_1, or a list"):
        _cfg(**{**base, "pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                "remat.policy": "full", "remat.layers": "every_2"})
    # 8 layers on 2 stages: chunks of 4; every_8 recomputes layer 7 only
    with pytest.raises(ConfigError, match=r"divides 4: all, every_1, every_2, every_4, or a "
                                          r"list that repeats every 4 layers$"):
        _cfg(**{**base, "model.num_layers": 8, "remat.policy": "full", "remat.layers": "every_8"})


def test_checkpoint_written_with_pp2_evaluates_with_pp1(tmp_path):
    workdir = str(tmp_path / "pp2")
    pp2 = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "pipeline.schedule": "1f1b",
           "pipeline.microbatches": 2, "metrics.profile_every": 0}
    proc = run_launch(workdir, pp2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        trained = json.load(f)
    assert trained["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2, "context": 1}
    assert trained["pipeline_bubble"] == pytest.approx(1 / 3)
    proc = run_launch(workdir, {"mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1},
                      mode="eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        evaluated = json.load(f)
    # Same values on another layout: only the summation order of the eval program differs.
    assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)


def test_moe_dense_fallback_trains_in_a_pipeline_on_data_and_tensor(tmp_path):
    """launch.py, 3 steps: cpu_moe's experts under GSPMD (no expert parallelism) inside 1f1b
    stages on (2, 2, 2), the mesh that once aborted XLA's SPMD partitioner."""
    workdir = str(tmp_path / "run")
    proc = run_launch(workdir, {
        "mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "pipeline.schedule": "1f1b",
        "pipeline.microbatches": 2, "model.num_layers": 5, "model.num_kv_heads": 4,
        "model.expert_parallel": False,
        "train.steps": 3, "metrics.profile_every": 0}, config="configs/cpu_moe.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(workdir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)
    # It trains: step 3 follows one update at the peak lr (step 1's lr is 0). Measured: 6.25 ->
    # 6.04; batches alone move the loss by ~0.01 (steps 1 and 2, the same weights).
    assert records[-1]["loss"] < records[0]["loss"] - 0.1, [r["loss"] for r in records]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2, "context": 1}
    # Every MoE layer on both stages, and the MTP module, counted its assignments: each row is
    # its experts' shares (rounded to 4 decimals in metrics.jsonl: 8 * 5e-5 off at most).
    for r in records:
        load = np.asarray(r["expert_load"])
        assert load.shape == (5, 8)  # 4 MoE layers + MTP
        assert (load >= 0).all() and np.allclose(load.sum(axis=1), 1, atol=4e-4), load


@pytest.mark.parametrize("stages, repeats", [(2, 2), (4, 2), (2, 3), (3, 5), (4, 8)])
def test_interleave_tables_move_every_chunk_to_its_circular_slot(stages, repeats):
    send, recv = stages_lib.interleave_tables(stages, repeats)
    # Stage s holds chunks s*R + j contiguously; pad index R means "nothing".
    local = [list(range(s * repeats, (s + 1) * repeats)) + [-1] for s in range(stages)]
    sent = [[[local[s][j] for j in send[s, d]] for d in range(stages)] for s in range(stages)]
    for d in range(stages):
        got = [sent[src][d][p] for src, p in recv[d]]
        assert got == [r * stages + d for r in range(repeats)]
    # The inverse tables (the gradients' way back) restore the contiguous chunks.
    send, recv = stages_lib.interleave_tables(stages, repeats, inverse=True)
    circular = [[r * stages + s for r in range(repeats)] + [-1] for s in range(stages)]
    sent = [[[circular[s][j] for j in send[s, d]] for d in range(stages)] for s in range(stages)]
    for d in range(stages):
        assert [sent[src][d][p] for src, p in recv[d]] == local[d][:repeats]


# An fp8 comparison is exact only up to the values that sit at an fp8 rounding boundary: the two
# paths compute the float32 values they quantise in different orders (tensor-parallel partial
# sums, microbatches, the CPU's GEMM kernels), so those differ by a few ulps, and a value that
# close to a tie can round the other way, which moves it by a whole fp8 step. Such a flip is
# not a bug, and its effect on the gradients is not an ulp: one e5m2 dy of the third layer's
# `down` projection, 2 ulps from the tie between 12288 and 14336 (x/scale = -13312.002), moves
# the embedding gradient by 2.40e-3 of its norm 0.551 (4.4e-3), which is what an AVX-512/AMX
# CPU measured. `_fp8_flip_allowance` finds the reference's activations and gradients within
# FLIP_ULPS of a boundary (16: 8x the 2 ulps seen; 3 of 299k values here; weights are the same
# params and scales on both paths, so they cannot flip), rounds each the other way in turn, and
# sums the changes: with the float32 reordering bound, what the pipelined run may differ by on
# any CPU. A scale from the wrong step re-rounds every value: 2.8e-2 to 0.2 of each gradient.
FLIP_ULPS = 16


def _quantize_window(quantize, x, scale, dtype):
    """(fp8 values as `quantize` rounds them, the same values moved FLIP_ULPS ulps down and up
    before rounding, and x / scale)."""
    v = x.astype(jnp.float32) / scale
    down, up = v, v
    for _ in range(FLIP_ULPS):
        down, up = jnp.nextafter(down, -jnp.inf), jnp.nextafter(up, jnp.inf)
    return quantize(x, scale, dtype), quantize(down, 1.0, dtype), quantize(up, 1.0, dtype), v


def _fp8_flip_allowance(run, ref):
    """run(): (value, grads, amax observations) of the reference, traced afresh (so that it sees
    a patched `fp8.quantize`); ref: what it returns unpatched. Returns (the values near a tie,
    the allowances [|d value|, [||d grad|| per leaf], [|d amax| per leaf]]) summed over
    rounding each of those values the other way, one at a time.

    One compilation serves every flip: the value to flip (one per fp8 format, NaN for none) is
    read at run time by a host callback (an argument would be a tracer that fp8's custom VJP
    may not close over), so the search costs one compile and 1 + len(near) runs of the tiny
    model, not a compile per value. Only activations and gradients are
    patched: every weight (a layer stack's, quantised ahead by `prepare_weight`, and a routed
    expert's, quantised inside its own matmul) is the same param with the same scale on both
    paths (its amax, an exact max, or the delayed W scale from the same state), so it rounds
    the same way and is no candidate."""
    quantize, prepare_weight, forward = fp8.quantize, fp8.prepare_weight, fp8._forward
    formats = (jnp.dtype(fp8.E4M3).name, jnp.dtype(fp8.E5M2).name)
    near, recording, targets = set(), [False], [np.full(len(formats), np.nan, np.float32)]
    pair = jax.ShapeDtypeStruct((len(formats),), jnp.float32)

    def quantize_flipped(x, scale, dtype):
        q, down, up, v = _quantize_window(quantize, x, scale, dtype)
        name, tie = jnp.dtype(dtype).name, down != up

        def note(v, tie):
            if recording[0]:
                near.update((name, float(a)) for a in np.asarray(v)[np.asarray(tie)])
        jax.debug.callback(note, v, tie)
        target = jax.pure_callback(lambda: targets[0], pair)[formats.index(name)]
        return jnp.where((v == target) & tie, jnp.where(down != q, down, up), q)

    def weights_as_they_are(*args, **kwargs):
        with mock.patch.object(fp8, "quantize", quantize):
            return prepare_weight(*args, **kwargs)

    def forward_with_weights_as_they_are(spec, x, w, scale, prepared=None, gemm=fp8._gemm):
        if prepared is None and spec.recipe in ("current", "delayed"):  # what _forward does
            prepared = weights_as_they_are(w, spec.recipe, meta_scale=scale[fp8.W])
        return forward(spec, x, w, scale, prepared, gemm)

    @jax.jit
    def flipped():
        with mock.patch.object(fp8, "quantize", quantize_flipped), \
                mock.patch.object(fp8, "prepare_weight", weights_as_they_are), \
                mock.patch.object(fp8, "_forward", forward_with_weights_as_they_are):
            return run()

    def outcome(name=None, value=np.nan):
        targets[0] = np.full(len(formats), np.nan, np.float32)
        if name is not None:
            targets[0][formats.index(name)] = value
        out = jax.device_get(flipped())
        jax.effects_barrier()
        return out

    recording[0] = True
    base = outcome()
    recording[0] = False
    # The patched reference is the reference: nothing flipped, it computes ref's loss.
    assert abs(float(base[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0]))
    allowance = jax.tree.map(lambda a: np.zeros_like(np.asarray(a, np.float64)), _flip_sizes(ref))
    for name, value in sorted(near):
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a, np.float64) - b),
                             outcome(name, value), base)
        allowance = jax.tree.map(np.add, allowance, _flip_sizes(moved))
    return sorted(near), allowance


def _amaxes(tree):
    return [np.asarray(m.amax, np.float64)
            for m in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, fp8.Fp8Meta))]


def _flip_sizes(out):
    """(value, grads, observations) -> [value, [Frobenius norm per grad leaf], [amaxes]]."""
    value, grads, obs = out
    return [np.asarray(value, np.float64),
            [np.linalg.norm(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)],
            _amaxes(obs)]


def _assert_fp8_matches(out, ref, run):
    """out, ref: (value, grads, amax observations) of the pipelined and the unpipelined fp8
    model; run: the reference, traced afresh. They match up to float32 reordering (1e-5
    relative; measured <= 2e-7 per gradient, 1.5e-7 per amax, where no value flipped) plus
    what rounding the reference's values near an fp8 tie the other way can move
    (`_fp8_flip_allowance`)."""
    near, (d_value, d_grads, d_amax) = _fp8_flip_allowance(run, jax.device_get(ref))
    # ~0.2-0.4 values per ulp of window: FLIP_ULPS 16 finds a handful (3 here, which allow
    # 6e-4 to 3.8e-2 of a gradient; a scale from the wrong step moves each by 4-30x its
    # allowance). Dozens would blunt the bound.
    assert len(near) <= 30, near
    value, grads, obs = out
    assert abs(float(value) - float(ref[0])) <= 1e-5 * abs(float(ref[0])) + d_value
    for (path, g), r, d in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                               jax.tree.leaves(ref[1]), d_grads):
        err, size = np.linalg.norm(np.asarray(g, np.float64) - r), np.linalg.norm(r)
        assert err <= 1e-5 * size + d, (jax.tree_util.keystr(path), err / size, d / size, near)
    for g, w, d in zip(_amaxes(obs), _amaxes(ref[2]), d_amax):
        assert np.all(np.abs(g - w) <= 1e-5 * np.abs(w) + d)


@pytest.mark.parametrize("schedule, repeats, keep", [
    ("1f1b", 1, (0, 0)), ("interleaved_1f1b", 2, (0, 0)),
    # Layers kept out of fp8 (fp8.keep_first_layers, keep_last_layers): on 2 stages the 4
    # layers' flags F T T F differ between the chunks (F T | T F, or F | T | T | F
    # interleaved), so those layers switch at run time by their stack's flags.
    ("1f1b", 1, (1, 1)), ("interleaved_1f1b", 2, (1, 0))])
def test_hand_backward_with_delayed_fp8_matches_the_unpipelined_model(schedule, repeats, keep):
    """Delayed scaling quantises with last step's scales, so microbatching changes nothing: the
    loss, the gradients and the amax observations (max over microbatches) must all match."""
    cfg = _pipelined((2, 2, 2), schedule, 2, repeats, **{"train.compute_dtype": "fp8", "fp8.recipe":
                                              "delayed", "fp8.other_dtype": "float32",
                                              "fp8.history_len": 4,
                                              "fp8.keep_first_layers": keep[0],
                                              "fp8.keep_last_layers": keep[1]})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    assert bool(state.objective.fp8_switch()) == any(keep)
    host_batch = random_batch(np.random.default_rng(3), 8, 16, vocab=128)

    def loss_and_grads(apply_fn, params, meta, batch):
        fn = jax.value_and_grad(lambda p, m, b: loss_fn(p, apply_fn, b, m)[0], (0, 1))
        return jax.jit(fn)(params, meta, batch)

    params, meta = jax.device_get(state.params), jax.device_get(state.fp8_meta)
    reference = ModelLoss(state.objective.model)
    # One observation first: with empty histories (scale 0) every recipe falls back to current
    # scaling, whose per-tensor scales do depend on the microbatch.
    _, (_, observed) = loss_and_grads(reference, params, meta, host_batch)
    meta = jax.device_get(fp8.commit(meta, observed))
    ref_loss, (ref_grads, ref_obs) = loss_and_grads(reference, params, meta, host_batch)
    with sharding.activate(trainer.mesh, trainer.rules):
        loss, (grads, obs) = jax.device_get(loss_and_grads(
            state.objective, state.params, jax.device_put(meta, trainer.state_shardings.fp8_meta),
            trainer.device_batch(host_batch)))
    ref = (ref_loss, ref_grads, ref_obs)
    _assert_fp8_matches((loss, grads, obs), ref, lambda: (
        lambda out: (out[0], *out[1]))(loss_and_grads(reference, params, meta, host_batch)))
    got, want = _amaxes(jax.device_get(obs)), _amaxes(ref_obs)
    assert len(got) == 7  # q, k, v, o, gate, up, down (stacked over layers)
    kept = [i for i in range(4) if i < keep[0] or i >= 4 - keep[1]]
    for w in want:  # [layers, (x, w, g)]
        assert np.all(np.delete(w, kept, axis=0) > 0) and np.all(w[kept] == 0)  # kept: unused


KEEP_ENDS = {"fp8.keep_first_layers": 1, "fp8.keep_last_layers": 1}
# A per-projection map (codes in q,k,v,o,gate,up,down order; 8 fp8, o other_dtype, f float32)
# whose chunks differ at every position: 4 distinct layer choices to switch among.
LAYER_MAP = {"fp8.layers": "8o88888,888o8o8,88888oo,f888888"}


@pytest.mark.parametrize("schedule, repeats, choice", [
    ("gpipe", 1, KEEP_ENDS), ("circular", 2, KEEP_ENDS), ("gpipe", 1, LAYER_MAP),
    ("1f1b", 1, LAYER_MAP), ("interleaved_1f1b", 2, LAYER_MAP)])
def test_layers_kept_out_of_fp8_switch_per_stage_under_gpipe_and_circular(schedule, repeats,
                                                                          choice):
    """fp8.keep_first_layers / keep_last_layers, and a per-projection map (fp8.layers, what
    fp8.select=auto writes), current scaling. Both microbatches (rows m, M + m, ...) hold the
    same rows, so every per-tensor scale is the whole batch's, as unpipelined, and loss and
    gradients must match the unpipelined fp8 model. The layers' choices differ between chunks,
    so they run their `lax.switch` at run time."""
    cfg = _pipelined((2, 2, 2), schedule, 2, repeats, **{
        "train.compute_dtype": "fp8", "fp8.other_dtype": "float32", **choice})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    assert state.objective.fp8_switch()
    assert len(state.objective.fp8_variants()) == (4 if choice is LAYER_MAP else 2)
    rows = random_batch(np.random.default_rng(4), 4, 16, vocab=128)
    host_batch = {k: np.repeat(v, 2, axis=0) for k, v in rows.items()}  # microbatches alike
    with sharding.activate(trainer.mesh, trainer.rules):
        loss, grads = _loss_and_grads(state.objective, state.params,
                                      trainer.device_batch(host_batch))
    params = jax.device_get(state.params)
    reference = lambda: (*_loss_and_grads(ModelLoss(state.objective.model), params, host_batch),
                         {})  # current scaling: no amax observations
    ref_loss, ref_grads, _ = jax.device_get(reference())
    # Up to float32 reordering (1e-5 relative per gradient) plus the effect of the reference's
    # activations and gradients within FLIP_ULPS of an fp8 tie, each rounded the other way
    # (`_assert_fp8_matches`): the scales here are amaxes of float32 values the two paths
    # compute in different orders, so a value that close to a tie may round either way on
    # another CPU. Measured here: 1 candidate (an e5m2 dy at 1152 - 2 ulps), allowing 1e-5 to
    # 3e-4 of a gradient and nothing of the loss; the first layer run in fp8 on the pipelined
    # path although kept out moves the loss by 3.8x and every gradient by 300-3900x its bound.
    _assert_fp8_matches(jax.device_get((loss, grads, {})), (ref_loss, ref_grads, {}), reference)
    # ...and the kept layers are not fp8: the same model with every layer in fp8 differs.
    all_fp8 = ModelLoss(state.objective.model.clone(
        fp8_policy=dataclasses.replace(state.objective.model.fp8_policy, layers=())))
    other_loss, _ = _loss_and_grads(all_fp8, params, host_batch)
    assert abs(float(other_loss) - float(ref_loss)) > 1e-5


# configs/cpu_moe.py shrunk to 4 MoE blocks (no dense first block, no MTP: neither pipelines),
# MLA, sigmoid router with a correction bias, top-2 of 8 experts in 2 groups, a shared expert.
# The balance loss weight is large enough that a lost or double-counted balance gradient moves
# the gradients far beyond the tolerance.
MOE = {"model.num_layers": 4, "model.hidden_size": 32, "model.mlp_dim": 64,
       "model.vocab_size": 128, "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
       "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
       "model.moe_intermediate_size": 16, "model.first_k_dense_replace": 0,
       "model.num_mtp_layers": 0, "model.aux_loss_alpha": 0.3, "data.seq_len": 16,
       "data.global_batch": 8, "train.steps": 4, "optim.warmup_steps": 1}


def _moe_pipelined(mesh, schedule, microbatches, **overrides):
    data, tensor, stages = mesh
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_moe.py"), {
        **MOE, "mesh.data": data, "mesh.tensor": tensor, "mesh.pipeline": stages,
        "pipeline.schedule": schedule, "pipeline.microbatches": microbatches, **overrides})


@pytest.mark.parametrize(
    "schedule, mesh, microbatches, repeats, expert_parallel, dense, mtp, impl", [
        ("gpipe", (2, 2, 2), 2, 1, True, 0, 0, "capacity"),
        ("1f1b", (2, 2, 2), 2, 1, True, 0, 0, "capacity"),
        # dense fallback: experts under GSPMD inside each stage, data and tensor both > 1
        ("1f1b", (2, 2, 2), 2, 1, False, 0, 0, "capacity"),
        ("gpipe", (2, 2, 2), 2, 1, False, 1, 0, "capacity"),
        ("circular", (2, 2, 2), 2, 2, True, 0, 0, "capacity"),
        # DeepSeek-V2/V3's layout: dense first blocks (on stage 0, before the stages), then MoE;
        # V3's MTP module (a MoE block) with the head.
        ("gpipe", (2, 2, 2), 2, 1, True, 2, 1, "capacity"),
        ("1f1b", (2, 2, 2), 2, 1, True, 1, 1, "capacity"),
        ("circular", (2, 1, 4), 4, 1, True, 1, 0, "capacity"),
        ("interleaved_1f1b", (2, 2, 2), 2, 2, True, 0, 0, "capacity"),
        ("interleaved_1f1b", (2, 2, 2), 2, 2, True, 1, 1, "capacity"),
        # Dropless grouped GEMMs (docs/moe.md) under every schedule, both exchanges.
        ("gpipe", (2, 2, 2), 2, 1, True, 0, 0, "padded"),
        ("1f1b", (2, 2, 2), 2, 1, False, 0, 0, "padded"),
        ("circular", (2, 2, 2), 2, 2, True, 0, 0, "ragged"),
        ("interleaved_1f1b", (2, 2, 2), 2, 2, True, 1, 1, "padded"),
    ], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_moe_schedule_matches_the_unpipelined_model(schedule, mesh, microbatches, repeats,
                                                    expert_parallel, dense, mtp, impl):
    """Loss, gradients of loss + aux_loss, the aux loss and every layer's expert load of a MoE
    model, pipelined, against the plain decoder on one device with the same weights. `dense`:
    leading dense blocks (first_k_dense_replace) ahead of the 4 MoE blocks; `mtp`: MTP
    modules, whose MoE blocks' loads come after the layers'."""
    cfg = _moe_pipelined(mesh, schedule, microbatches, **{
        "pipeline.repeats": repeats, "model.expert_parallel": expert_parallel,
        "model.moe_impl": impl, "model.num_layers": 4 + dense, "model.first_k_dense_replace": dense,
        "model.num_mtp_layers": mtp, "model.mtp_loss_weight": 0.5})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    assert isinstance(state.objective, pipeline.Pipelined)
    specs = trainer.state_shardings.params
    assert specs["moe_layers"]["moe"]["up"].spec[0] == "pipeline"
    if dense:  # every stage holds the dense blocks whole (they run on stage 0)
        assert state.params["layers"]["mlp"]["up"].shape[0] == dense
        assert "pipeline" not in jax.tree.leaves(specs["layers"]["mlp"]["up"].spec)
    host_batch = random_batch(np.random.default_rng(4), 8, 16, vocab=128)
    ((_, (loss, aux)), grads), ((_, (ref_loss, ref_aux)), ref_grads) = pipelined_and_plain(
        trainer, state, host_batch, objective_and_aux)
    assert sorted(aux) == sorted(ref_aux) == ["aux_loss", "moe_load"] + ["mtp_loss"] * bool(mtp)
    # float32: only the summation order differs (per microbatch, then across them).
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(aux["aux_loss"]), float(ref_aux["aux_loss"]), rtol=1e-5)
    if mtp:
        np.testing.assert_allclose(np.asarray(aux["mtp_loss"]), np.asarray(ref_aux["mtp_loss"]),
                                   rtol=1e-5)
    load = np.asarray(aux["moe_load"])
    assert load.shape == (4 + mtp, 8) and np.all(load.sum(axis=1) == 8 * 16 * 2)  # x top-k
    np.testing.assert_array_equal(load, np.asarray(ref_aux["moe_load"]))  # counts: exact
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0],
                            jax.tree.leaves(ref_grads)):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name:  # moved by the load rule, never by a gradient
            assert np.all(g == 0) and np.all(r == 0), name
            continue
        # Relative Frobenius norm per tensor; a lost balance gradient moves the router's by O(1).
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel < 1e-5, (name, rel)


def test_moe_trains_through_1f1b_and_moves_the_router_bias_by_its_loads():
    """A train step through the pipeline: the loads it logs are the whole batch's, and the V3
    bias update moves every MoE layer's router bias by gamma towards balance from them."""
    gamma = 0.01
    cfg = _moe_pipelined((2, 2, 2), "1f1b", 2, **{"model.bias_update_speed": gamma,
                                                  "optim.lr": 1e-2})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    before = np.asarray(jax.device_get(state.params)["moe_layers"]["moe"]["router_bias"])
    batch = trainer.device_batch(random_batch(np.random.default_rng(6), 8, 16, vocab=128))
    losses = []
    for step in range(3):  # one batch repeated: the loss must fall
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]) + float(metrics["aux_loss"]))
        if step == 0:
            share = np.asarray(metrics["expert_load"])
            after = np.asarray(jax.device_get(state.params)["moe_layers"]["moe"]["router_bias"])
    assert share.shape == (4, 8)
    np.testing.assert_allclose(share.sum(axis=1), 1.0, rtol=1e-6)
    counts = np.round(share * 8 * 16 * 2)  # rows x seq x top-k assignments per layer
    step = np.sign(counts - counts.mean(axis=1, keepdims=True)) * gamma
    np.testing.assert_allclose(after, before - step, atol=1e-7)
    assert np.any(step != 0)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_moe_with_fp8_experts_trains_through_1f1b_with_dense_prefix_and_mtp():
    """DeepSeek-V3's layout through the pipeline with fp8 experts: a dense first block on stage
    0, 4 MoE blocks over 2 1F1B stages with the experts' gate/up/down as fp8 einsums (current
    scaling) inside the expert-parallel all-to-all shard_map, and an MTP module (a MoE block)
    with the head. The first loss differs from the float32 pipeline's by e4m3 rounding only (same
    weights; 0 would mean no expert ran in fp8), the MTP loss is reported, and training on one
    batch lowers the loss."""
    flags = {"model.num_layers": 5, "model.first_k_dense_replace": 1, "model.num_mtp_layers": 1,
             "fp8.matmuls": "gate,up,down", "fp8.other_dtype": "float32", "optim.lr": 1e-2}
    exact = train.build_trainer(_moe_pipelined((2, 2, 2), "1f1b", 2, **flags))
    quant = train.build_trainer(_moe_pipelined((2, 2, 2), "1f1b", 2, **flags,
                                               **{"train.compute_dtype": "fp8"}))
    host_batch = random_batch(np.random.default_rng(8), 8, 16, vocab=128)
    _, m_exact = exact.step(exact.init(), exact.device_batch(host_batch))
    state, batch, losses = quant.init(), quant.device_batch(host_batch), []
    for _ in range(3):  # one batch repeated: the loss must fall
        state, metrics = quant.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(np.asarray(metrics["mtp_loss"])))  # per MTP module
    # Quantisation of the experts' matmuls moves a ~4.8-nat loss by far less than 5%.
    gap = abs(losses[0] - float(m_exact["loss"]))
    assert 0 < gap < 0.05 * float(m_exact["loss"]), (losses[0], float(m_exact["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses


def test_delayed_fp8_on_the_dense_prefix_under_1f1b_matches_the_unpipelined_model():
    """A MoE model's dense first block runs on stage 0 before the stages; with delayed fp8 its
    state rides with its params, and its amax observations (max over microbatches) come back
    with the stack's: loss, gradients and every observation equal the unpipelined model's.
    Every projection in fp8, the routed experts too (per expert, inside the all-to-all)."""
    cfg = _moe_pipelined((2, 2, 2), "1f1b", 2, **{
        "model.first_k_dense_replace": 1, "model.num_layers": 5, "train.compute_dtype": "fp8",
        "fp8.recipe": "delayed", "fp8.other_dtype": "float32", "fp8.history_len": 4})
    trainer = train.build_trainer(cfg)
    state = trainer.init()
    assert set(state.fp8_meta) == {"layers", "moe_layers"}
    host_batch = random_batch(np.random.default_rng(6), 8, 16, vocab=128)

    def objective_grads(apply_fn, params, meta, batch):
        def objective(p, m, b):
            loss, _, aux = apply_fn.loss_and_aux(p, b, m)
            return loss + aux["aux_loss"]
        return jax.jit(jax.value_and_grad(objective, (0, 1)))(params, meta, batch)

    params, meta = jax.device_get(state.params), jax.device_get(state.fp8_meta)
    reference = ModelLoss(state.objective.model)
    _, (_, observed) = objective_grads(reference, params, meta, host_batch)  # a history first
    meta = jax.device_get(fp8.commit(meta, observed))
    run = lambda: (lambda out: (out[0], *out[1]))(objective_grads(reference, params, meta,
                                                                 host_batch))
    ref_value, ref_grads, ref_obs = jax.device_get(run())
    with sharding.activate(trainer.mesh, trainer.rules):
        value, (grads, obs) = jax.device_get(objective_grads(
            state.objective, state.params,
            jax.device_put(meta, trainer.state_shardings.fp8_meta),
            trainer.device_batch(host_batch)))
    # Value, gradients and every amax observation up to float32 reordering (1e-5 relative) plus
    # the effect of rounding each of the reference's activations and gradients within
    # FLIP_ULPS of an fp8 tie the other way (`_assert_fp8_matches`). The routed experts'
    # weights are no candidates: they quantise per expert with the delayed W scale, from the
    # same state on both paths. Measured here: 9 candidates (7 e4m3, 2 e5m2); a flipped
    # activation can move a token's top-k choice, so the allowance is 3e-3 to 0.16 of a
    # gradient. The dense prefix's scales x1.1 on the pipelined path (its state mishandled)
    # re-round the whole block: the loss moves 2.4x its bound, every gradient 1.06-55x and
    # the amaxes 1.2-17000x.
    _assert_fp8_matches((value, grads, obs), (ref_value, ref_grads, ref_obs), run)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(ref_grads)):
        if np.linalg.norm(r) == 0:  # the router bias: moved by the load rule, not a gradient
            assert np.all(g == 0), jax.tree_util.keystr(path)
    for key in ("layers", "moe_layers"):
        got, want = _amaxes(obs[key]), _amaxes(ref_obs[key])
        assert got and len(got) == len(want), key
        assert all(np.all(w > 0) for w in want), key  # every fp8 projection observed something


def test_moe_pipeline_with_layers_that_do_not_split_evenly_names_num_layers():
    """3 MoE layers over 2 stages. (The dense expert fallback on data 2 x tensor 2 was refused
    here once; it trains now: test_moe_schedule_matches_the_unpipelined_model.)"""
    with pytest.raises(ConfigError) as err:
        _moe_pipelined((2, 2, 2), "1f1b", 2, **{"model.first_k_dense_replace": 1})
    assert str(err.value).startswith("model.num_layers:"), str(err.value)


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1),
                                              ("interleaved_1f1b", 2)])
def test_every_schedule_step_has_each_fp8_dot_once(schedule, repeats):
    """h100_fp8:smoke's step with 4 layers, remat none: each stage chunk's forward runs once (the
    1F1B schedules: its backward from the stash), so the StableHLO holds exactly the precision
    policy's dots, as unpipelined. By
    hand: one scanned body of 7 fp8 projections x 3 GEMMs = 21 fp8 dots, and the attention
    core's 6 and the chunked head's 4 high-precision ones. A stage forward recomputed in the
    backward adds 7 fp8 dots; an interleaved chunk traced apart from the others, 21."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import fp8_hlo  # noqa: E402  pylint: disable=import-outside-toplevel

    cfg = config_lib.load(os.path.join(ROOT, "configs", "h100_fp8.py:smoke"), {
        "model.num_layers": 4, "pipeline.schedule": schedule, "pipeline.repeats": repeats,
        "remat.policy": "none", "optim.name": "adamw"})
    trainer = train.build_trainer(cfg)
    with sharding.activate(trainer.mesh, trainer.rules):
        text = trainer.jitted(0).lower(trainer.abstract_state(),
                                       trainer.abstract_batch()).as_text()
    dots = gemms.dot_general_dtypes(text)
    fp8_dots = [d for d in dots if any(t.startswith("f8") for t in d[:2])]
    assert (len(fp8_dots), len(dots) - len(fp8_dots)) == fp8_hlo.expected_counts(trainer)
    assert (len(fp8_dots), len(dots) - len(fp8_dots)) == (21, 10)
