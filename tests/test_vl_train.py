"""A vision-language model trains end to end: the cpu_vl corpus prepared through the real
prepare tool, mixed with text by weight, a SigLIP tower in front of the decoder, loss per source,
and frozen parameter groups that stay bit for bit."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from transformers import DeepseekVLForConditionalGeneration

from conftest import FLAT_MESH, TINY_FLAGS, once_per_session, random_batch, read_records, run_launch
from dsjax import checkpoint as ckpt
from dsjax import config as config_lib
from dsjax import convert
from dsjax import pipeline
from dsjax.data import mixed_stream
from dsjax.data.multimodal.prepare import prepare_multimodal
from dsjax.data.prepare import prepare_text
from dsjax.data.multimodal.vl_corpus import build_vl_corpus
from dsjax.train import build_trainer
from unpipelined import assert_grads_match, pipelined_and_plain

VISION = {"vision.tower": "siglip", "vision.image_size": 16, "vision.patch_size": 8,
          "vision.hidden_size": 32, "vision.num_layers": 1, "vision.num_heads": 2,
          "vision.mlp_dim": 64, "vision.max_images": 2}
MIX = "text:0.4,image:0.4,video:0.2"


def _build_vl_data(root):
    corpus = build_vl_corpus(os.path.join(root, "raw"), image_size=16, seed=0, num_videos=60)
    data = os.path.join(root, "data")
    for kind in ("image", "video"):
        files = [corpus[f"{kind}_train"], corpus[f"{kind}_eval"]]
        prepare_multimodal(files, "byte", os.path.join(data, kind), image_size=16, video_fps=8.0,
                           max_frames=2, eval_fraction=0.3, seed=0)  # >= 8 held-out rows
    text = os.path.join(root, "text.jsonl")
    with open(text, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3})
                          for i in range(200)))
    prepare_text([text], "jsonl", "byte", os.path.join(data, "text"), eval_fraction=0.1)


@pytest.fixture
def vl_data():
    """data/{text,image,video}/{train,eval}: the corpus builder's records through prepare, built
    once per session."""
    return os.path.join(once_per_session("vl_train_data", _build_vl_data), "data")


def _flags(data, **more):
    return {**TINY_FLAGS, **FLAT_MESH, **VISION, "data.source": "prepared", "data.path": data,
            "data.mix": MIX, "data.seq_len": 48, **more}


def test_a_vision_language_model_trains_and_reports_loss_per_source(vl_data, tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_launch(workdir, _flags(vl_data, **{"train.steps": 3}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(workdir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert all(r["images_per_sec"] > 0 for r in records)  # images and frames read per second
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    by_source = summary["eval_loss_by_modality"]
    assert set(by_source) == {"text", "image", "video"}
    assert all(np.isfinite(v) and v > 0 for v in by_source.values())
    # The overall loss is a token-weighted mean of the sources': between their extremes.
    assert min(by_source.values()) <= summary["eval_loss"] <= max(by_source.values())

    # The trained run exports to Hugging Face, and transformers computes its logits.
    out = str(tmp_path / "hf")
    assert convert.main(["orbax-to-hf", "--checkpoint", workdir, "--out", out]) == 0
    hf = DeepseekVLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = config_lib.load("configs/cpu_tiny.py", _flags(vl_data))
    trainer = build_trainer(cfg)
    params = jax.device_get(ckpt.restore_params(os.path.join(workdir, "checkpoints"),
                                                trainer.abstract_state().params, cfg.model))
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 256, (1, 24)).astype(np.int32)
    tokens[0, 3:7] = tokens[0, 12:16] = 257  # two images of 4 tokens
    pixels = rng.integers(0, 256, (1, 2, 16, 16, 3), dtype=np.uint8)
    ours = trainer.eval_model.apply({"params": params}, tokens, pixels_BMHWC=pixels,
                                    image_mask_BM=np.ones((1, 2), bool))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(tokens, dtype=torch.long), pixel_values=torch.tensor(
            (pixels[0].astype(np.float32) / 255 - 0.5) / 0.5).permute(0, 3, 1, 2)).logits
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)


def test_frozen_groups_do_not_change_bit_for_bit_over_a_step(vl_data):
    cfg = config_lib.load("configs/cpu_tiny.py", _flags(vl_data, **{
        "train.trainable": "projector", "optim.warmup_steps": 0}))  # lr > 0 at step 0
    trainer = build_trainer(cfg)
    state = trainer.init()
    before = jax.device_get(state.params)
    stream = mixed_stream({n: os.path.join(vl_data, n, "train") for n in ("text", "image",
                                                                          "video")},
                          MIX, cfg.data.seq_len, 0, tokens_per_image=4, max_images=2,
                          image_size=16, prefetch=0)
    batch = stream.take(cfg.data.global_batch)
    assert batch["image_mask"].any()  # the step sees images
    state, metrics = trainer.step(state, trainer.device_batch(batch))
    assert bool(metrics["finite"])
    after = jax.device_get(state.params)
    for name in after:
        changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after[name]),
                                                            jax.tree.leaves(before[name]))]
        if name == "projector":
            assert all(changed), name
        else:
            assert not any(changed), name  # the tower and the whole language model


def _vl_batch(rng, rows, seq, tokens_per_image, max_images, size):
    """Random rows of text with 0..max_images images each, placeholders where they belong."""
    batch = random_batch(rng, rows, seq, vocab=256)
    pixels = rng.integers(0, 256, (rows, max_images, size, size, 3), dtype=np.uint8)
    mask = np.zeros((rows, max_images), bool)
    for r in range(rows):
        n = int(rng.integers(0, max_images + 1))
        starts = np.sort(rng.choice(np.arange(0, seq - tokens_per_image, tokens_per_image),
                                    n, replace=False))
        for s in starts:
            batch["inputs"][r, s:s + tokens_per_image] = 257
        mask[r, :n] = True
    return {**batch, "pixels": pixels, "image_mask": mask}


@pytest.mark.parametrize("schedule, microbatches, repeats", [
    ("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved_1f1b", 2, 2)])
def test_the_tower_runs_on_stage_0_and_the_pipeline_matches_one_device(schedule, microbatches,
                                                                      repeats):
    cfg = config_lib.load("configs/cpu_tiny.py", {
        **TINY_FLAGS, **VISION, "model.num_layers": 4, "mesh.data": 2, "mesh.tensor": 2,
        "mesh.pipeline": 2, "pipeline.schedule": schedule, "pipeline.microbatches": microbatches,
        "pipeline.repeats": repeats, "data.seq_len": 32})
    trainer = build_trainer(cfg)
    state = trainer.init()
    assert isinstance(state.objective, pipeline.Pipelined)
    host = _vl_batch(np.random.default_rng(3), 8, 32, 4, 2, 16)
    (loss, grads), (ref_loss, ref_grads) = pipelined_and_plain(trainer, state, host)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    # As for the text model's schedules; a tower left out of stage 0's backward gives 1. The key
    # bias's true gradient is 0 (softmax ignores a score shift shared by all keys): its rounding
    # noise is measured against 1e-3 of the whole gradient instead.
    assert_grads_match(grads, ref_grads, floor=1e-3)
    assert np.linalg.norm(jax.tree.leaves(ref_grads["vision_tower"])[0]) > 0


def test_cpu_vl_trains_evaluates_grounding_and_captions(tmp_path):
    """configs/cpu_vl.py end to end at a tiny size: the packaged corpus built and prepared, the
    three sources mixed, held-out loss per source, grounding scores, and captions, also from
    --mode eval. (That the full-size run beats chance is measured in docs/multimodal.md.)"""
    workdir = str(tmp_path / "run")
    small = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
             "model.num_kv_heads": 2, "model.mlp_dim": 128, "vision.hidden_size": 32,
             "vision.num_layers": 1, "vision.num_heads": 2, "vision.mlp_dim": 64,
             "train.steps": 2, "train.log_every": 1, "data.eval_batches": 1,
             "data.seq_len": 128,
             "checkpoint.every": 0}
    proc = run_launch(workdir, small, config="configs/cpu_vl.py", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert set(summary["eval_loss_by_modality"]) == {"text", "image", "video"}
    g, v = summary["image_grounding"], summary["video_grounding"]
    assert g["digits_scored"] == 100 and v["clips_scored"] == 30
    # Accuracies are counts of scored items: k/100 digits, k/30 clips.
    for share, n in ((g["digit_accuracy"], 100), (v["direction_accuracy"], 30)):
        assert 0 <= share <= 1 and abs(share * n - round(share * n)) < 1e-9, (share, n)
    # The same captions beside other digits' images: a model that ignores the pixels (or a
    # projector whose features never reach the decoder) scores both bit for bit alike. After
    # these 2 steps the images move it by 1.5e-4 of the loss; float32 rounding is ~1e-7.
    true, shuffled = g["caption_loss_true_image"], g["caption_loss_shuffled_image"]
    assert true > 0 and shuffled > 0
    assert abs(true - shuffled) > 1e-5 * true, (true, shuffled)
    assert proc.stdout.count("caption of held-out digit") == 3, proc.stdout[-2000:]
    proc = run_launch(workdir, small, mode="eval", config="configs/cpu_vl.py", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("caption of held-out digit") == 3
    assert "digit accuracy" in proc.stdout
    # --mode eval restores the final checkpoint and scores the same items: the same numbers
    # (same mesh and programs; rtol covers a different reduction order only).
    with open(os.path.join(workdir, "summary.json")) as f:
        evaluated = json.load(f)
    for key in ("image_grounding", "video_grounding"):
        got, want = evaluated[key], summary[key]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-6), (key, name)


def test_stage_1_trains_the_projector_alone_and_stage_2_starts_from_it(vl_data, tmp_path):
    """The two stages through launch.py: stage 1's checkpoint holds the initial tower and
    language model bit for bit and a trained projector; stage 2 starts from those weights."""
    stage1, stage2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    proc = run_launch(stage1, _flags(vl_data, **{"train.trainable": "projector",
                                                 "train.steps": 2, "optim.warmup_steps": 0}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = config_lib.load("configs/cpu_tiny.py", _flags(vl_data))
    trainer = build_trainer(cfg)
    initial = jax.device_get(trainer.init().params)  # the same seed as the run's init
    trained = jax.device_get(ckpt.restore_params(os.path.join(stage1, "checkpoints"),
                                                 trainer.abstract_state().params, cfg.model))
    for name in initial:
        same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial[name]),
                                                     jax.tree.leaves(trained[name]))]
        assert (not any(same)) if name == "projector" else all(same), name
    proc = run_launch(stage2, _flags(vl_data, **{
        "checkpoint.init_from": os.path.join(stage1, "checkpoints"), "train.steps": 1}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised weights from" in proc.stdout + proc.stderr


def test_a_vision_model_trains_with_every_recipe_feature_at_once(vl_data, tmp_path):
    """h100_fp8.py:smoke's feature set (1f1b on (2, 2, 2), fp8, selective recomputation, 1-bit
    Adam, adaptive batch with accumulation) with a vision tower on the mixed corpus."""
    workdir = str(tmp_path / "run")
    flags = {**VISION, "model.hidden_size": 128, "model.num_kv_heads": 4, "model.mlp_dim": 256,
             "model.vocab_size": 512, "data.seq_len": 48, "train.steps": 6,
             "train.log_every": 1, "train.sample_tokens": 0, "optim.freeze_step": 2,
             "optim.refresh_every": 3, "checkpoint.every": 0, "data.source": "prepared",
             "data.path": vl_data, "data.mix": MIX, "metrics.profile_every": 0}
    proc = run_launch(workdir, flags, config="configs/h100_fp8.py:smoke", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(workdir)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(np.isfinite(r["loss"]) and r["images_per_sec"] > 0 for r in records)
    assert {r["onebit_compressed"] for r in records} == {0, 1}  # exact, then 1-bit steps
    assert records[-1]["batch_size"] > records[0]["batch_size"]  # the adaptive batch grew
