"""DeepSeek-VL2 tiling on the model side: the feature order `data.multimodal.tiling` writes, placed by
the model, equals VL2's own assembly (rearrange, newline columns, separator, masked scatter); the
decoder and a pipeline's stage 0 both place it; the learned rows train."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FLAT_MESH, TINY_FLAGS, random_batch, read_records, run_launch
from dsjax import checkpoint as ckpt
from dsjax import config as config_lib
from dsjax import convert, pipeline
from dsjax.data.multimodal.tiling import feature_rows, image_tokens, num_views
from dsjax.model import Transformer
from dsjax.model.batch import media_layout
from dsjax.model.loss import ModelLoss, loss_fn
from dsjax.model.vision import insert_tiled_features
from dsjax.train import build_trainer
from unpipelined import assert_grads_match, pipelined_and_plain

IMAGE_TOKEN = 257


def _vl2_image_rows(feats_VPD, side, grid, newline, separator):
    """DeepSeek-VL2's `prepare_inputs_embeds` for one image, written as its code reads: the global
    view "(h w) d -> h w d" with a newline column, the separator, then the local tiles
    "(th tw) (h w) d -> (th h) (tw w) d" with a newline column."""
    D = feats_VPD.shape[-1]
    glob = feats_VPD[0].reshape(side, side, D)
    glob = np.concatenate([glob, np.broadcast_to(newline, (side, 1, D))], axis=1).reshape(-1, D)
    th, tw = grid
    if th * tw == 0:
        return glob
    local = feats_VPD[1:1 + th * tw].reshape(th, tw, side, side, D)
    local = local.transpose(0, 2, 1, 3, 4).reshape(th * side, tw * side, D)
    local = np.concatenate([local, np.broadcast_to(newline, (th * side, 1, D))], axis=1)
    return np.concatenate([glob, separator[None], local.reshape(-1, D)])


def _tiled_row(rng, images, seq, slots, side, vocab=200):
    """One row: random text with each (grid) image's placeholders at a random gap, its views in
    consecutive slots. Returns tokens [seq], feature_index [seq], the images' (first slot, grid)."""
    P = side * side
    tokens = rng.integers(1, vocab, seq).astype(np.int32)
    index = np.zeros(seq, np.int32)
    pos, slot, placed = int(rng.integers(0, 3)), 0, []
    for grid in images:
        n = image_tokens(side, grid)
        tokens[pos:pos + n] = IMAGE_TOKEN
        index[pos:pos + n] = feature_rows(side, grid, slot, slots * P, slots * P + 1)
        placed.append((slot, grid))
        pos, slot = pos + n + int(rng.integers(1, 4)), slot + num_views(grid)
    assert pos <= seq and slot <= slots
    return tokens, index, placed


def test_tiled_features_are_vl2s_assembly():
    rng = np.random.default_rng(0)
    side, slots, D, seq = 2, 6, 5, 64
    rows = [[(1, 2), (0, 0), (0, 0)], [(2, 2)], []]  # tiles + two video frames; 2x2; text only
    built = [_tiled_row(rng, r, seq, slots, side) for r in rows]
    tokens = np.stack([b[0] for b in built])
    index = np.stack([b[1] for b in built])
    feats = rng.normal(size=(len(rows), slots, side * side, D)).astype(np.float32)
    newline, separator = rng.normal(size=(2, D)).astype(np.float32)
    x = rng.normal(size=(len(rows), seq, D)).astype(np.float32)
    got = np.asarray(insert_tiled_features(
        jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(feats.reshape(len(rows), -1, D)),
        jnp.stack([newline, separator]), jnp.asarray(index), IMAGE_TOKEN))

    want = x.copy()
    for b, (_, _, placed) in enumerate(built):
        seqs = [_vl2_image_rows(feats[b, s:s + num_views(g)], side, g, newline, separator)
                for s, g in placed]
        if seqs:  # HF/VL2 masked_scatter: the image tokens in order take the rows in order
            want[b, tokens[b] == IMAGE_TOKEN] = np.concatenate(seqs)
    np.testing.assert_array_equal(got, want)


VISION = {"vision.tower": "siglip", "vision.image_size": 16, "vision.patch_size": 8,
          "vision.hidden_size": 32, "vision.num_layers": 1, "vision.num_heads": 2,
          "vision.mlp_dim": 64, "vision.max_images": 4, "vision.tiling": True,
          "vision.max_tiles": 2}
SIDE, SLOTS, SEQ = 2, 4, 32  # 16 px / 8 px patches: 2 x 2 features per view


def _tiled_batch(rng, rows):
    """Token arrays plus the tiled media of `rows` rows (a (1, 2)-tiled image and a frame, a
    (2, 1) image, or no image)."""
    batch = random_batch(rng, rows, SEQ, vocab=256)
    layouts = [[(1, 2)], [(2, 1)], [(0, 0), (0, 0)], []]
    pixels = rng.integers(0, 256, (rows, SLOTS, 16, 16, 3), dtype=np.uint8)
    mask = np.zeros((rows, SLOTS), bool)
    index = np.zeros((rows, SEQ), np.int32)
    for r in range(rows):
        tokens, index[r], placed = _tiled_row(rng, layouts[r % 4], SEQ, SLOTS, SIDE, 256)
        is_image = tokens == IMAGE_TOKEN
        batch["inputs"][r] = np.where(is_image, IMAGE_TOKEN, batch["inputs"][r])
        batch["weights"][r] = np.where(is_image, 0.0, batch["weights"][r])
        mask[r, :sum(num_views(g) for _, g in placed)] = True
    return {**batch, "pixels": pixels, "image_mask": mask, "feature_index": index}


def _cfg(**more):
    return config_lib.load("configs/cpu_tiny.py", {**TINY_FLAGS, **VISION,
                                                   "data.seq_len": SEQ, **more})


def test_the_decoder_places_tiles_and_the_learned_rows_train():
    cfg = _cfg(**FLAT_MESH)
    assert set(media_layout(cfg.vision, SEQ)) == {"pixels", "image_mask", "feature_index"}
    trainer = build_trainer(cfg)
    params = jax.device_get(trainer.init().params)
    assert params["projector"]["image_newline"].shape == (cfg.model.hidden_size,)
    host = _tiled_batch(np.random.default_rng(1), 8)
    objective = ModelLoss(trainer.model)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, objective, host)[0])(params)
    assert np.isfinite(float(loss))
    for name in ("image_newline", "view_separator"):
        assert np.abs(grads["projector"][name]).max() > 0, name  # both rows reach the loss
    # The index decides: pointing every placeholder at the separator changes the loss.
    moved = {**host, "feature_index": np.where(host["inputs"] == IMAGE_TOKEN,
                                               SLOTS * SIDE * SIDE + 1, 0)}
    assert abs(float(loss_fn(params, objective, moved)[0]) - float(loss)) > 1e-4
    with pytest.raises(ValueError, match="feature_index"):
        loss_fn(params, objective, {k: v for k, v in host.items() if k != "feature_index"})


def test_tiled_model_untiled_order_equals_the_untiled_model():
    """Indices that spell slot order (no newline or separator used) give the untiled model's
    logits with the same weights: the tiling path changes where rows go, nothing else."""
    cfg = _cfg(**FLAT_MESH)
    tiled = build_trainer(cfg).model
    spec = dataclasses.replace(tiled.vision, tiling=False)
    plain = Transformer(tiled.cfg, vision=spec, dtype=tiled.dtype)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, (2, SEQ)).astype(np.int32)
    tokens[0, 2:6] = tokens[0, 10:14] = tokens[1, 5:9] = IMAGE_TOKEN
    mask = np.array([[True, True, False, False], [True, False, False, False]])
    index = np.zeros_like(tokens)
    index[0, 2:6], index[0, 10:14], index[1, 5:9] = range(4), range(4, 8), range(4)
    pixels = rng.integers(0, 256, (2, SLOTS, 16, 16, 3), dtype=np.uint8)
    params = tiled.init(jax.random.key(3), jnp.asarray(tokens))["params"]
    got = tiled.apply({"params": params}, tokens, pixels_BMHWC=pixels, image_mask_BM=mask,
                      feature_index_BS=index)
    lean = {**params, "projector": {k: v for k, v in params["projector"].items()
                                    if k not in ("image_newline", "view_separator")}}
    want = plain.apply({"params": lean}, tokens, pixels_BMHWC=pixels, image_mask_BM=mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tiles_on_stage_0_match_one_device(schedule):
    cfg = _cfg(**{"model.num_layers": 4, "mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2,
                  "pipeline.schedule": schedule, "pipeline.microbatches": 2})
    trainer = build_trainer(cfg)
    state = trainer.init()
    assert isinstance(state.objective, pipeline.Pipelined)
    host = _tiled_batch(np.random.default_rng(3), 8)
    (loss, grads), (ref_loss, ref_grads) = pipelined_and_plain(trainer, state, host)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = grads["projector"]
    for name in ("image_newline", "view_separator"):
        r = np.asarray(ref_grads["projector"][name])
        assert np.linalg.norm(r) > 0
        assert np.linalg.norm(got[name] - r) / np.linalg.norm(r) < 1e-5, name
    assert_grads_match(grads, ref_grads, floor=1e-3)


def test_cpu_vl_tiled_trains_evaluates_and_refuses_export(tmp_path, capsys):
    """configs/cpu_vl.py with tiling, tiny, through launch.py: the corpus prepared into views
    and grids, training, held-out loss per source, grounding and captions on tiled images; the
    export to transformers (which has no VL2 class) is one clear error."""
    workdir = str(tmp_path / "run")
    small = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
             "model.num_kv_heads": 2, "model.mlp_dim": 128, "vision.hidden_size": 32,
             "vision.num_layers": 1, "vision.num_heads": 2, "vision.mlp_dim": 64,
             "vision.tiling": True, "vision.max_tiles": 2, "train.steps": 2,
             "train.log_every": 1, "data.eval_batches": 1, "data.seq_len": 128,
             "checkpoint.every": 0}
    proc = run_launch(workdir, small, config="configs/cpu_vl.py", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert all(np.isfinite(v) for v in summary["eval_loss_by_modality"].values())
    # The learned rows train: AdamW moves an element with a gradient by about the step's lr;
    # weight decay alone (all a row the tiled batches never reach gets) scales it by
    # prod(1 - lr * wd). What is left after the decay must be a visible share of the lr
    # (measured: the full lr for both rows; 1e-8 when the rows get no gradient). Adam's
    # first steps move no element by much more than the lr: more means another init.
    cfg = config_lib.load("configs/cpu_vl.py", {**TINY_FLAGS, **small})  # as run_launch
    trainer = build_trainer(cfg)
    before = jax.device_get(trainer.init().params)["projector"]  # the run's seed
    after = jax.device_get(ckpt.restore_params(os.path.join(workdir, "checkpoints"),
                                               trainer.abstract_state().params,
                                               cfg.model))["projector"]
    lrs = [r["lr"] for r in read_records(workdir)]
    decayed = np.prod([1 - lr * cfg.optim.weight_decay for lr in lrs])
    for name in ("image_newline", "view_separator"):
        moved = np.abs(after[name] - before[name] * decayed).max()
        assert 0.1 * max(lrs) < moved < 2 * max(lrs), (name, moved, lrs)
    assert summary["image_grounding"]["digits_scored"] == 100
    assert summary["video_grounding"]["clips_scored"] == 30
    assert proc.stdout.count("caption of held-out digit") == 3, proc.stdout[-2000:]
    out = str(tmp_path / "hf")
    assert convert.main(["orbax-to-hf", "--checkpoint", workdir, "--out", out]) != 0
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "DeepSeek-VL2 tiling" in err, err
    assert not os.path.exists(out)  # nothing half-written
