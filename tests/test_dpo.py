"""DPO (dsjax/model/preference.py and train.task='dpo'): the loss and its gradient against a NumPy
transcription of Rafailov et al. 2023, eq. 7; sequence log-probs against the model's whole logits;
which positions get gradient; training through the real step from a saved checkpoint, its
normalisation under accumulation, and resume; what does not combine."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FLAT_MESH, ROOT, tiny
from dsjax import config as config_lib
from dsjax.checkpoint import Checkpointer, CheckpointError
from dsjax.config import ConfigError, ModelConfig
from dsjax.metrics import MetricsWriter
from dsjax.model.decoder import Transformer
from dsjax.model.preference import (METRICS, PreferenceLoss, dpo_loss, pair_count, pair_logps,
                                    token_logps)
from dsjax.train import build_trainer
from dsjax.train import resume as resume_lib
from dsjax.train.observer import Observer

EOS = 1


def preference_rows(rng, pairs_per_row, S, vocab, chosen=None, rejected=None):
    """A host batch as the data layer packs preference pairs: per row, pair j is segment 2j-1
    (prompt + chosen reply + eos) then 2j (prompt + rejected reply + eos), 0 padding; weight 1
    on exactly the reply targets. Replies are `chosen` / `rejected` (token lists) or random."""
    rows = len(pairs_per_row)
    tokens, seg, pos = (np.zeros((rows, S + 1), np.int32) for _ in range(3))
    reply = np.zeros((rows, S + 1), bool)
    for r, pairs in enumerate(pairs_per_row):
        at = 0
        for j in range(pairs):
            prompt = rng.integers(2, vocab, rng.integers(2, 6))
            answers = [chosen, rejected]
            for k in range(2):
                ans = answers[k] if answers[k] is not None else rng.integers(2, vocab,
                                                                             rng.integers(2, 5))
                seq = np.concatenate([prompt, ans, [EOS]])
                n = len(seq)
                assert at + n <= S + 1, "the pairs do not fit the row"
                tokens[r, at:at + n], seg[r, at:at + n] = seq, 2 * j + 1 + k
                pos[r, at:at + n] = np.arange(n)
                reply[r, at + len(prompt):at + n] = True
                at += n
    weights = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0) & reply[:, 1:]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg[:, :-1],
            "positions": pos[:, :-1], "weights": weights.astype(np.float32)}


def np_pairs(logp, weights, seg):
    """[(row, chosen logp, rejected logp)] per pair, the sums written out in loops."""
    out = []
    for r in range(seg.shape[0]):
        for j in range(1, int(seg[r].max()) // 2 + 1):
            c = sum(float(weights[r, s]) * float(logp[r, s]) for s in range(seg.shape[1])
                    if seg[r, s] == 2 * j - 1)
            rj = sum(float(weights[r, s]) * float(logp[r, s]) for s in range(seg.shape[1])
                     if seg[r, s] == 2 * j)
            out.append((r, j, c, rj))
    return out


def np_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


# ---------------------------------------------------------------------------------------------
# The loss


def test_dpo_loss_and_gradient_match_the_papers_formula():
    """Eq. 7 in NumPy float64: L = mean_j -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)));
    dL/dlogp_t = -(beta / n) sigmoid(-z_j) w_t on chosen tokens of pair j, +... on rejected,
    0 elsewhere. Rows of 2, 1, 0 (all padding) and 3 pairs."""
    rng = np.random.default_rng(0)
    S, beta = 64, 0.3
    batch = preference_rows(rng, [2, 1, 0, 3], S, vocab=50)
    seg, w = batch["segment_ids"], batch["weights"]
    logp = -rng.exponential(2.0, seg.shape).astype(np.float32)  # random per-token log-probs
    P = S // 2
    ref_c = (-rng.exponential(8.0, (4, P))).astype(np.float32)
    ref_r = (-rng.exponential(8.0, (4, P))).astype(np.float32)

    def loss_of(logp_BS):
        loss, pairs, metrics = dpo_loss(pair_logps(logp_BS, jnp.asarray(w), jnp.asarray(seg)),
                                        jnp.asarray(ref_c), jnp.asarray(ref_r), beta)
        return loss, (pairs, metrics)

    (loss, (pairs, metrics)), grad = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(
        jnp.asarray(logp))

    pairs_np = np_pairs(logp, w, seg)
    n = len(pairs_np)
    z = np.array([beta * ((c - ref_c[r, j - 1]) - (rj - ref_r[r, j - 1]))
                  for r, j, c, rj in pairs_np])
    assert n == 6 and float(pairs) == n
    assert float(pair_count(jnp.asarray(seg))) == n
    assert 0 < np.sum(z > 0) < n, "the data must hold both outcomes"
    want_grad = np.zeros(logp.shape)
    for (r, j, _, _), z_j in zip(pairs_np, z):
        for s in range(S):
            if seg[r, s] in (2 * j - 1, 2 * j):
                sign = -1.0 if seg[r, s] == 2 * j - 1 else 1.0
                want_grad[r, s] = sign * beta / n * np_sigmoid(-z_j) * w[r, s]
    want = {"loss": float(np.mean(-np.log(np_sigmoid(z)))),
            "dpo_reward_accuracy": float(np.mean(z > 0)), "dpo_reward_margin": float(np.mean(z)),
            "dpo_chosen_logp": float(np.mean([p[2] for p in pairs_np])),
            "dpo_rejected_logp": float(np.mean([p[3] for p in pairs_np]))}
    got = {"loss": float(loss), **{k: float(metrics[k]) for k in METRICS}}
    print({k: abs(got[k] - want[k]) / abs(want[k]) for k in want})
    # float32 sums of <= 64 terms and a log-sigmoid: relative error ~1e-7 (printed above); a
    # wrong sign, a dropped token or the wrong pairing moves each by far more than 1e-5.
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    # A count over a count: exact in float32.
    assert got["dpo_reward_accuracy"] == float(np.float32(np.sum(z > 0)) / np.float32(n))
    rel = np.linalg.norm(np.asarray(grad) - want_grad) / np.linalg.norm(want_grad)
    print(f"gradient rel {rel:.1e}")
    assert rel < 1e-5
    # Prompt tokens and padding: exactly zero.
    assert np.all(np.asarray(grad)[w == 0] == 0)


# ---------------------------------------------------------------------------------------------
# The model's sequence log-probs


_TINY = dict(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
             vocab_size=96)


@pytest.fixture(scope="module")
def tiny_model():
    """(model config with loss_chunk 5, params, a preference batch of S = 42)."""
    cfg = ModelConfig(**_TINY, loss_chunk=5)  # 9 chunks, the last one padded
    batch = {k: jnp.asarray(v) for k, v in preference_rows(np.random.default_rng(1), [2, 1, 0],
                                                           42, vocab=96).items()}
    params = jax.jit(Transformer(cfg).init)(jax.random.key(3), batch["inputs"])["params"]
    return cfg, params, batch


@pytest.mark.parametrize("chunk", [5, 0])
def test_sequence_logps_equal_the_whole_logits(tiny_model, chunk):
    """`PreferenceLoss.sequence_logps` (chunked head, or whole logits with 0) against log-softmax
    of the model's whole logits in NumPy float64, gathered at the targets, summed per segment."""
    cfg, params, batch = tiny_model
    model = Transformer(dataclasses.replace(cfg, loss_chunk=chunk))
    pairs, aux = jax.jit(PreferenceLoss(model, 0.1).sequence_logps)(params, batch)
    logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["inputs"],
                                             batch["positions"], batch["segment_ids"]),
                        np.float64)
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    logp = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0] - logz
    want = np_pairs(logp, np.asarray(batch["weights"]), np.asarray(batch["segment_ids"]))
    assert aux == {}  # a dense model has no auxiliary terms
    present = np.asarray(pairs.present_BP)
    assert [(r, j) for r, j in zip(*np.nonzero(present))] == [(r, j - 1) for r, j, _, _ in want]
    got_c = np.asarray(pairs.chosen_BP)[present]
    got_r = np.asarray(pairs.rejected_BP)[present]
    # float32 logits vs float64: measured ~1e-7 relative; a position off by one in the gather
    # or the segment changes a sum by a whole token's log-prob (~5 nats of ~20).
    np.testing.assert_allclose(got_c, [p[2] for p in want], rtol=1e-5)
    np.testing.assert_allclose(got_r, [p[3] for p in want], rtol=1e-5)


def test_prompt_and_padding_get_no_gradient_and_the_reference_none(tiny_model):
    """The DPO loss's gradient w.r.t. the head's input x (each position's logits depend on its x
    alone) is exactly 0 at prompt and padding targets, nonzero at reply targets; the gradient
    w.r.t. the reference params is exactly 0 (stop_gradient)."""
    cfg, params, batch = tiny_model
    model = Transformer(cfg)
    objective = PreferenceLoss(model, 0.5)
    x, head = jax.jit(lambda p: model.apply({"params": p}, batch["inputs"], batch["positions"],
                                            batch["segment_ids"], head_inputs=True))(params)
    ref = jax.tree.map(lambda a: a * 1.01, params)  # another policy: rewards not all zero
    with_ref = jax.jit(objective.with_reference)(ref, batch)

    def loss_of_x(x_BSD):
        logp = token_logps(x_BSD, head, batch["targets"], dtype=jnp.float32, chunk=5)
        pairs = pair_logps(logp, batch["weights"], batch["segment_ids"])
        return dpo_loss(pairs, with_ref["ref_chosen_logp"], with_ref["ref_rejected_logp"],
                        0.5)[0]

    dx = np.asarray(jax.jit(jax.grad(loss_of_x))(x))
    per_position = np.abs(dx).sum(-1)
    w = np.asarray(batch["weights"])
    assert np.all(per_position[w == 0] == 0)
    assert np.all(per_position[w > 0] > 0)

    def loss_of_ref(ref_params):
        b = objective.with_reference(ref_params, batch)
        return objective.loss_and_aux(params, b)[0]

    ref_grads = jax.jit(jax.grad(loss_of_ref))(ref)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(ref_grads))


# ---------------------------------------------------------------------------------------------
# Training


S_TRAIN = 64
TRAIN = tiny({"data.seq_len": S_TRAIN, "data.global_batch": 8, "optim.warmup_steps": 1,
              "optim.lr": 3e-3, "train.steps": 20, "model.loss_chunk": 24}, FLAT_MESH)
CHOSEN, REJECTED = [200, 201, 202, 203], [300, 301, 302, 303]


def _cfg(**overrides):
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TRAIN, **overrides})


def _same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def dpo_setup(tmp_path_factory):
    """A pretraining trainer's initial params saved as a checkpoint (seed 1), the DPO trainer
    started from it (seed 0, so its own fresh init differs), and a preference batch whose rows
    hold 1, 2 or 3 pairs (chosen reply CHOSEN, rejected REJECTED, random prompts)."""
    start_dir = str(tmp_path_factory.mktemp("pretrained"))
    pre_cfg = _cfg(**{"train.seed": 1})
    pre = build_trainer(pre_cfg)
    pre_state = pre.init()
    checkpointer = Checkpointer(os.path.join(start_dir, "checkpoints"), async_save=False,
                                log=lambda _: None, train_layout=resume_lib.train_layout(pre_cfg))
    resume_lib.save(checkpointer, 3, pre_state, None, pre.mesh, pre_cfg.model)
    checkpointer.close()
    cfg = _cfg(**{"train.task": "dpo", "checkpoint.init_from": start_dir})
    trainer = build_trainer(cfg)
    host = preference_rows(np.random.default_rng(5), [1, 2, 3, 2, 1, 3, 2, 2], S_TRAIN, 100,
                           CHOSEN, REJECTED)
    return {"pre": pre, "pre_state": pre_state, "pre_cfg": pre_cfg, "cfg": cfg,
            "trainer": trainer, "host": host, "start_dir": start_dir}


def _started(setup):
    trainer = setup["trainer"]
    state = resume_lib.with_initial_weights(trainer.init(), setup["start_dir"],
                                            setup["cfg"].model)
    return state


def test_dpo_training_raises_reward_accuracy_and_resume_keeps_the_reference(dpo_setup,
                                                                             tmp_path):
    """Through the real train step: the reference is the checkpoint's params, never moves, and
    lives outside the optimizer state; loss falls from log 2, reward accuracy and margin rise;
    metrics reach the record and the console line; a checkpoint resumes with the same
    reference (not the fresh init) and continues bit for bit."""
    s = dpo_setup
    trainer, cfg = s["trainer"], s["cfg"]
    start = s["pre_state"].params
    state = _started(s)
    assert _same(state.params, start) and _same(state.ref_params, start)
    assert not _same(trainer.init().ref_params, start)  # seed 0's init: another policy
    # Adam's moments are the params' alone.
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(s["pre_state"].opt_state)

    batch = trainer.device_batch(s["host"])
    history = []
    for _ in range(8):
        state, m = trainer.step(state, batch)
        history.append(jax.device_get(m))
    loss = [float(m["loss"]) for m in history]
    acc = [float(m["dpo_reward_accuracy"]) for m in history]
    margin = [float(m["dpo_reward_margin"]) for m in history]
    print(f"loss {loss}\naccuracy {acc}\nmargin {margin}")
    assert float(history[0]["tokens"]) == 16  # the batch's pairs
    # Step 1: policy = reference, every reward ~0 (two programs may differ in the last bit).
    assert loss[0] == pytest.approx(np.log(2), abs=1e-5) and abs(margin[0]) < 1e-5
    assert loss[-1] < loss[0] - 0.05 and margin[-1] > 0.1 and acc[-1] == 1.0
    assert float(history[-1]["dpo_chosen_logp"]) > float(history[0]["dpo_chosen_logp"])
    assert _same(state.ref_params, start) and not _same(state.params, start)

    # The record and the console line.
    host_m = {**history[-1], "batch_size": 8}
    observer = Observer(trainer, str(tmp_path))
    record = observer.record(host_m, 8, 0.1, {}, 64, 64 * S_TRAIN)
    # MFU counts the reference's forward: 4 passes' FLOPs per token where pretraining has 3.
    pretraining = Observer(s["pre"], str(tmp_path)).flops_per_token
    assert observer.flops_per_token == pytest.approx(4 / 3 * pretraining, rel=1e-12)
    assert {k: record[k] for k in METRICS} == {k: float(history[-1][k]) for k in METRICS}
    writer = MetricsWriter(str(tmp_path), 8, tensorboard=False, live=False)
    writer.write(record)
    writer.close()

    # Checkpoint, then a fresh process's state (ref = seed 0's init) resumed from it.
    directory = str(tmp_path / "checkpoints")
    layout = resume_lib.train_layout(cfg)
    with_checkpointer(directory, layout, lambda c: resume_lib.save(c, 8, state, None,
                                                                   trainer.mesh, cfg.model))
    resumed, step, _ = with_checkpointer(directory, layout, lambda c: resume_lib.resume(
        c, trainer.init(), trainer.mesh, cfg.model, False, lambda _: None))
    assert step == 8 and _same(resumed.ref_params, start) and _same(resumed.params, state.params)
    state, m = trainer.step(state, batch)
    resumed, m_resumed = trainer.step(resumed, batch)
    assert float(m_resumed["loss"]) == float(m["loss"])  # same program, same inputs
    assert float(m_resumed["dpo_reward_margin"]) == float(m["dpo_reward_margin"])

    # A pretraining run refuses the DPO checkpoint, naming train.task.
    pre, pre_cfg = s["pre"], s["pre_cfg"]
    with pytest.raises(CheckpointError, match=r"train\.task changed from dpo to pretrain"):
        with_checkpointer(directory, resume_lib.train_layout(pre_cfg), lambda c: resume_lib.resume(
            c, pre.init(), pre.mesh, pre_cfg.model, False, lambda _: None))


def with_checkpointer(directory, layout, use):
    """`use(checkpointer)` on a synchronous Checkpointer of `directory`, closed (sealed) after."""
    checkpointer = Checkpointer(directory, async_save=False, log=lambda _: None,
                                train_layout=layout)
    try:
        return use(checkpointer)
    finally:
        checkpointer.close()


def test_console_line_shows_the_rewards(tmp_path, capsys):
    writer = MetricsWriter(str(tmp_path), 4, tensorboard=False, live=False)
    writer.write({"step": 1, "loss": 0.6, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0,
                  "step_ms": 5.0, "mfu": 0.1, "dpo_reward_accuracy": 0.75,
                  "dpo_reward_margin": 0.125})
    writer.close()
    assert "reward acc 0.75 margin 0.125" in capsys.readouterr().out


def test_accumulated_dpo_step_equals_one_batch(dpo_setup):
    """Micro-batches of 7 and 9 pairs ([2, 4, S]): each one's mean counts by its pairs / the
    batch's 16 (a plain mean of the two means would weigh a pair of the first by 1/14, of the
    second by 1/18), so the step equals the [8, S] one: loss, rewards, gradient and update."""
    s = dpo_setup
    trainer = s["trainer"]
    order = [0, 1, 2, 4, 3, 5, 6, 7]  # pairs 1 2 3 1 | 2 3 2 2
    host = {k: v[order] for k, v in s["host"].items()}
    state = _started(s)
    for _ in range(3):  # away from the start, where every reward is 0 whatever the weighting
        state, _ = trainer.step(state, trainer.device_batch(host))
    copy = jax.tree.map(jnp.copy, state)
    whole, m_a = trainer.step(state, trainer.device_batch(host))
    split, m_b = trainer.step(copy, trainer.device_batch(
        {k: v.reshape(2, 4, *v.shape[1:]) for k, v in host.items()}))
    print({k: (float(m_a[k]), float(m_b[k])) for k in ("loss", "grad_norm") + METRICS})
    # The same float32 terms summed in another order: measured ~1e-7 relative; the unweighted
    # mean of means moves the loss and margin by ~1e-2.
    for k in ("loss", "grad_norm", "tokens") + METRICS:
        assert float(m_b[k]) == pytest.approx(float(m_a[k]), rel=1e-5), k
    assert float(m_a["dpo_reward_margin"]) > 0.01
    a_leaves, b_leaves = (jax.tree.leaves(jax.device_get(p)) for p in (whole.params,
                                                                        split.params))
    worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(a))
                for a, b in zip(a_leaves, b_leaves))
    assert worst < 1e-5


def test_dpo_trains_under_float16_loss_scaling(dpo_setup):
    """float16 compute with its dynamic loss scale combines with DPO: the scaled objective's
    gradient is unscaled as for the token loss, and the same batch is learned."""
    s = dpo_setup
    cfg = _cfg(**{"train.task": "dpo", "checkpoint.init_from": s["start_dir"],
                  "train.compute_dtype": "float16"})
    trainer = build_trainer(cfg)
    state = resume_lib.with_initial_weights(trainer.init(), s["start_dir"], cfg.model)
    batch = trainer.device_batch(s["host"])
    for _ in range(5):
        state, m = trainer.step(state, batch)
    m = jax.device_get(m)
    assert bool(m["finite"]) and float(m["loss_scale"]) == 32768.0  # scaled, none skipped
    assert float(m["dpo_reward_accuracy"]) == 1.0 and float(m["dpo_reward_margin"]) > 0.1


# ---------------------------------------------------------------------------------------------
# What does not combine


@pytest.mark.parametrize("overrides, match", [
    ({}, r"^checkpoint\.init_from: train\.task='dpo' trains against the frozen weights"),
    ({"mesh.pipeline": 2, "mesh.data": 2, "init_from": True},
     r"^mesh\.pipeline: train\.task='dpo' needs the unpipelined model"),
    ({"optim.name": "onebit_adam", "optim.freeze_step": 4, "init_from": True},
     r"^optim\.name: train\.task='dpo' runs on the adamw step"),
])
def test_what_does_not_combine_with_dpo(overrides, match, tmp_path):
    overrides = dict(overrides)
    if overrides.pop("init_from", False):
        overrides["checkpoint.init_from"] = str(tmp_path)
    with pytest.raises(ConfigError, match=match):
        _cfg(**{"train.task": "dpo", **overrides})
    # The same settings train the token loss.
    _cfg(**{k: v for k, v in overrides.items() if k != "checkpoint.init_from"})
