"""dsjax/evaluate/grounding.py: the rows it scores, and per-row caption losses against the model's own
training loss."""

import jax
import numpy as np

from conftest import FLAT_MESH, TINY_FLAGS
from dsjax import config as config_lib
from dsjax.evaluate import grounding
from dsjax.model.loss import ModelLoss
from dsjax.train import build_trainer

IMG, FRAME, EOS = 257, 258, 256
VISION = {"vision.tower": "siglip", "vision.image_size": 16, "vision.patch_size": 8,
          "vision.hidden_size": 32, "vision.num_layers": 1, "vision.num_heads": 2,
          "vision.mlp_dim": 64, "vision.max_images": 2}


def test_caption_rows_expand_placeholders_and_weigh_text_targets_only():
    frames = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    docs = [(np.array([IMG, 32, 97]), frames[:1]),
            (np.array([IMG, FRAME, IMG, 98]), frames)]
    b = grounding.caption_batch(docs, seq_len=10, tokens_per_image=3, max_images=2,
                                image_token_id=IMG, frame_token_id=FRAME, eos=EOS)
    # Written out by hand: 3 placeholder copies per image, eos, zero padding.
    np.testing.assert_array_equal(b["inputs"][0], [IMG, IMG, IMG, 32, 97, EOS, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["targets"][0], [IMG, IMG, 32, 97, EOS, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["weights"][0], [0, 0, 1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["inputs"][1], [IMG] * 3 + [FRAME] + [IMG] * 3 + [98, EOS, 0])
    np.testing.assert_array_equal(b["weights"][1], [0, 0, 0, 0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(b["segment_ids"][0], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(b["image_mask"], [[True, False], [True, True]])
    np.testing.assert_array_equal(b["pixels"][1], frames)
    assert not b["pixels"][0, 1].any()


def test_row_losses_add_up_to_the_training_loss_sum():
    cfg = config_lib.load("configs/cpu_tiny.py", {**TINY_FLAGS, **FLAT_MESH, **VISION})
    trainer = build_trainer(cfg)
    params = trainer.init().params
    rng = np.random.default_rng(1)
    docs = [(np.concatenate([[IMG] * int(rng.integers(1, 3)),
                             rng.integers(0, 256, int(rng.integers(3, 9)))]).astype(np.int64),
             rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)) for _ in range(11)]
    docs = [(ids, frames[:int(np.sum(ids == IMG))]) for ids, frames in docs]
    batch = grounding.caption_batch(docs, 32, 4, 2, IMG, FRAME, EOS)
    nll, count = grounding.row_losses(trainer, params, batch)  # 11 rows: a padded second chunk
    assert nll.shape == (11,) and np.all(nll > 0)
    np.testing.assert_array_equal(count, batch["weights"].sum(axis=1))
    # Reference: the training objective's own (chunked) loss sum, the rows 8 at a time.
    ref = 0.0
    host = jax.device_get(params)
    for lo in (0, 8):
        chunk = {k: v[lo:lo + 8] for k, v in batch.items()}
        pad = 8 - len(chunk["inputs"])
        chunk = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)])
                 for k, v in chunk.items()}
        ref += float(ModelLoss(trainer.eval_model).nll_sum(host, chunk)[0])
    np.testing.assert_allclose(nll.sum(), ref, rtol=1e-5)
    # The image matters: the same captions beside other pixels score differently.
    other = dict(batch, pixels=batch["pixels"][::-1].copy())
    assert not np.allclose(grounding.row_losses(trainer, params, other)[0], nll)
