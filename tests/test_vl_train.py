"""A vision-language model trains end to end: the cpu_vl corpus prepared through the real
prepare tool, mixed with text by weight, a SigLIP tower in front of the decoder, loss per source,
and frozen parameter groups that stay bit for bit."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import FLAT_MESH, TINY_FLAGS, read_records, run_launch
from dsjax import config as config_lib
from dsjax.data import mixed_stream
from dsjax.data.mm_prepare import prepare_multimodal
from dsjax.data.prepare import prepare
from dsjax.data.vl_corpus import build_vl_corpus
from dsjax.train import build_trainer

VISION = {"vision.tower": "siglip", "vision.image_size": 16, "vision.patch_size": 8,
          "vision.hidden_size": 32, "vision.num_layers": 1, "vision.num_heads": 2,
          "vision.mlp_dim": 64, "vision.max_images": 2}
MIX = "text:0.4,image:0.4,video:0.2"


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory):
    """data/{text,image,video}/{train,eval}: the corpus builder's records through prepare."""
    root = tmp_path_factory.mktemp("vl")
    corpus = build_vl_corpus(str(root / "raw"), image_size=16, seed=0, num_videos=60)
    data = root / "data"
    for kind in ("image", "video"):
        files = [corpus[f"{kind}_train"], corpus[f"{kind}_eval"]]
        prepare_multimodal(files, "byte", str(data / kind), image_size=16, video_fps=8.0,
                           max_frames=2, eval_fraction=0.3, seed=0)  # >= 8 held-out rows
    text = root / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3})
                              for i in range(200)))
    prepare([str(text)], "jsonl", "byte", str(data / "text"), eval_fraction=0.1)
    return str(data)


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
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    by_source = summary["eval_loss_by_modality"]
    assert set(by_source) == {"text", "image", "video"}
    assert all(np.isfinite(v) and v > 0 for v in by_source.values())
    # The overall loss is a token-weighted mean of the sources': between their extremes.
    assert min(by_source.values()) <= summary["eval_loss"] <= max(by_source.values())


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
