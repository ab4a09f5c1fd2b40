"""Does a vision-language model read its images? Grounding scores on the cpu_vl corpus's held-out
digits and clips (never seen in training), and greedy captions.

The one idea: a caption's loss is scored with its true image, with another image, and for every
candidate caption; a model that ignores the pixels scores them all alike. `image_grounding`:
caption loss with the true and with a shuffled image, and `digit_accuracy`, the share of held-out
digits whose true caption has the lowest loss of the ten "a handwritten digit <name>" (chance
0.1). `video_grounding`: `direction_accuracy` over the four "the digit <d> moves <dir>" captions
of each held-out clip (chance 0.25). Each scored text is its own row, exactly as the prepare tool
builds a record, placeholders expanded as the data pipeline does (`multimodal.layout`, tiled or
not).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import metrics as mx
from dsjax import sharding
from dsjax.config import Config
from dsjax.data import ByteTokenizer
from dsjax.data.multimodal.media import load_image, load_image_views
from dsjax.data.multimodal.layout import MediaLayout
from dsjax.data.multimodal.prepare import Record, build_document
from dsjax.data.splits import prepared_max_tiles
from dsjax.data.multimodal.vl_corpus import DIRECTIONS, candidate_captions, record_text
from dsjax.data.multimodal.vl_sources import eval_labels
from dsjax.errors import DataError
from dsjax.model.batch import media_args


def caption_batch(docs: list[tuple], seq_len: int, tokens_per_image: int, max_images: int,
                  image_token_id: int, frame_token_id: int, eos: int, max_tiles: int = 0
                  ) -> dict[str, np.ndarray]:
    """One row per document (ids with one placeholder per image, uint8 views, and tiled, with
    `max_tiles` > 0, the placeholders' int [n, 2] grids: `build_document`'s triple): placeholders
    expanded as packing does (`MediaLayout`), eos appended, padded (segment 0, weight 0); weights 1
    where the target is text, so a row's weighted NLL is its caption's. Tiled rows also get
    "feature_index" [B, seq_len]."""
    layout = MediaLayout(tokens_per_image, max_images, max_tiles)
    B = len(docs)
    size = docs[0][1].shape[1] if docs and docs[0][1].size else 1
    tokens = np.zeros((B, seq_len + 1), np.int32)
    seg = np.zeros((B, seq_len + 1), np.int32)
    index = np.zeros((B, seq_len + 1), np.int32)
    pixels = np.zeros((B, max_images, size, size, 3), np.uint8)
    mask = np.zeros((B, max_images), bool)
    for b, (ids, frames, *grids) in enumerate(docs):
        row, index_b = layout.expand(np.asarray(ids), image_token_id,
                                     grids[0] if grids else None)
        row = np.append(row, eos)
        if len(row) > seq_len + 1 or len(frames) > max_images:
            raise DataError(f"data.seq_len: a scored document of {len(row)} tokens and "
                            f"{len(frames)} views does not fit a row of {seq_len + 1} tokens "
                            f"and {max_images} view slots (vision.max_images)")
        tokens[b, :len(row)], seg[b, :len(row)] = row, 1
        if index_b is not None:
            index[b, :len(index_b)] = index_b
        pixels[b, :len(frames)], mask[b, :len(frames)] = frames, True
    targets = tokens[:, 1:]
    text_target = (targets != image_token_id) & (targets != frame_token_id)
    batch = {"inputs": tokens[:, :-1], "targets": targets, "segment_ids": seg[:, :-1],
             "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (B, seq_len)).copy(),
             "weights": (text_target & (seg[:, 1:] > 0)).astype(np.float32),
             "pixels": pixels, "image_mask": mask}
    if layout.tiled:
        batch["feature_index"] = index[:, :-1]
    return batch


@functools.partial(jax.jit, static_argnums=0)
def _row_nll(model: Any, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits_BSV = model.apply({"params": params}, batch["inputs"], batch["positions"],
                             batch["segment_ids"], **media_args(batch))
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    nll_BS = -jnp.take_along_axis(logp_BSV, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll_BS * batch["weights"], axis=1), jnp.sum(batch["weights"], axis=1)


def row_losses(trainer, params: Any, batch: dict[str, np.ndarray]) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """(summed caption NLL, caption tokens) per row, in chunks of data.global_batch rows."""
    G, rows = trainer.cfg.data.global_batch, len(batch["inputs"])
    nll, count = [], []
    with sharding.activate(trainer.mesh, trainer.rules):
        for lo in range(0, rows, G):
            chunk = {k: v[lo:lo + G] for k, v in batch.items()}
            pad = G - len(chunk["inputs"])
            chunk = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)])
                     for k, v in chunk.items()}
            n, c = jax.device_get(_row_nll(trainer.eval_model, params,
                                           trainer.device_batch(chunk)))
            nll.append(n[:G - pad])
            count.append(c[:G - pad])
    return np.concatenate(nll), np.concatenate(count)


def _docs(texts_and_media: list[tuple[str, str]], raw: str, cfg: Config) -> list:
    tok, d = ByteTokenizer(), cfg.data
    out = []
    for text, path in texts_and_media:
        video = text.startswith("<video>")
        record = Record("grounding", text, () if video else (os.path.join(raw, path),),
                        os.path.join(raw, path) if video else None)
        out.append(build_document(record, tok, cfg.vision.image_size, d.video_fps, d.max_frames,
                                  prepared_max_tiles(cfg)))
    return out


def _score(trainer, params, cfg, texts_and_media, raw):
    spec = trainer.model.vision
    batch = caption_batch(_docs(texts_and_media, raw, cfg), cfg.data.seq_len,
                          spec.tokens_per_image, cfg.vision.max_images, spec.image_token_id,
                          spec.frame_token_id, ByteTokenizer.eos_id, prepared_max_tiles(cfg))
    return row_losses(trainer, params, batch)


def caption_image(path: str, cfg: Config) -> tuple[np.ndarray, np.ndarray | None]:
    """(views, grids) of an image file as `greedy_caption` takes them: one squashed view and None
    untiled; with vision.tiling its global view and tiles, and its [1, 2] grid."""
    if not prepared_max_tiles(cfg):
        return load_image(path, cfg.vision.image_size)[None], None
    views, grid = load_image_views(path, cfg.vision.image_size, cfg.vision.max_tiles)
    return views, np.array([grid], np.int64)


def image_grounding(trainer, params: Any, root: str, cfg: Config, limit: int = 100
                    ) -> dict[str, float]:
    """Caption loss (nats/token) with the true and with a shuffled image, and digit accuracy,
    over the first `limit` held-out digits."""
    raw = os.path.join(root, "raw")
    items = eval_labels(root)["image"][:limit]
    true_caption = lambda it: record_text("image", candidate_captions("image")[it["label"]])
    nll, count = _score(trainer, params, cfg, [(true_caption(it), it["path"]) for it in items], raw)
    # Each image's caption beside the next held-out image whose digit differs.
    other = [next(items[(i + j) % len(items)] for j in range(1, len(items))
                  if items[(i + j) % len(items)]["label"] != it["label"])
             for i, it in enumerate(items)]
    s_nll, s_count = _score(trainer, params, cfg, [(true_caption(it), o["path"])
                                                   for it, o in zip(items, other)], raw)
    texts = [(record_text("image", c), it["path"]) for it in items
             for c in candidate_captions("image")]
    c_nll, _ = _score(trainer, params, cfg, texts, raw)
    picked = np.argmin(c_nll.reshape(len(items), 10), axis=1)
    return {"caption_loss_true_image": float(nll.sum() / count.sum()),
            "caption_loss_shuffled_image": float(s_nll.sum() / s_count.sum()),
            "digit_accuracy": float(np.mean(picked == [it["label"] for it in items])),
            "digits_scored": len(items)}


def video_grounding(trainer, params: Any, root: str, cfg: Config) -> dict[str, float]:
    """Direction accuracy over the held-out clips: the four direction captions of each clip's
    digit, the lowest loss picked."""
    raw = os.path.join(root, "raw")
    items = eval_labels(root)["video"]
    texts = [(record_text("video", c), it["path"]) for it in items
             for c in candidate_captions("video", it["label"])]
    c_nll, _ = _score(trainer, params, cfg, texts, raw)
    picked = np.argmin(c_nll.reshape(len(items), len(DIRECTIONS)), axis=1)
    truth = [DIRECTIONS.index(it["direction"]) for it in items]
    return {"direction_accuracy": float(np.mean(picked == truth)), "clips_scored": len(items)}


def greedy_caption(trainer, params: Any, frames: np.ndarray, num_tokens: int,
                   grids: np.ndarray | None = None) -> str:
    """The model's greedy continuation of one image (its placeholders, as a record starts):
    `frames` uint8 [1, size, size, 3], or with vision.tiling its views and `grids` [1, 2]
    (`caption_image` gives both)."""
    spec, cfg = trainer.model.vision, trainer.cfg
    tok = ByteTokenizer()
    ids = np.array([spec.image_token_id], np.int64)
    media = (frames,) if grids is None else (frames, grids)
    out = []
    for _ in range(num_tokens):
        batch = caption_batch([(np.append(ids, out).astype(np.int64), *media)],
                              cfg.data.seq_len, spec.tokens_per_image, cfg.vision.max_images,
                              spec.image_token_id, spec.frame_token_id, tok.eos_id,
                              prepared_max_tiles(cfg))
        length = int(batch["segment_ids"][0].sum()) - 1  # the eos caption_batch appended
        batch = {k: np.repeat(v, sharding.data_size(trainer.mesh), axis=0) for k, v in batch.items()}
        with sharding.activate(trainer.mesh, trainer.rules):
            logits = jax.device_get(_logits(trainer.eval_model, params,
                                            trainer.device_batch(batch)))
        nxt = int(np.argmax(logits[0, length - 1]))
        if nxt == tok.eos_id:
            break
        out.append(nxt)
    return tok.decode(np.array(out))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, batch):
    return model.apply({"params": params}, batch["inputs"], batch["positions"],
                       batch["segment_ids"], **media_args(batch))


def report(trainer, params: Any, root: str, cfg: Config) -> dict[str, Any]:
    """The cpu_vl corpus's grounding scores, logged with greedy captions of held-out digits."""
    out = {"image_grounding": image_grounding(trainer, params, root, cfg),
           "video_grounding": video_grounding(trainer, params, root, cfg)}
    g, v = out["image_grounding"], out["video_grounding"]
    mx.log(f"grounding: caption loss {g['caption_loss_true_image']:.4f} with the true image, "
           f"{g['caption_loss_shuffled_image']:.4f} with another | digit accuracy "
           f"{g['digit_accuracy']:.3f} (chance 0.1) | direction accuracy "
           f"{v['direction_accuracy']:.3f} (chance 0.25)")
    for item in eval_labels(root)["image"][:3]:
        views, grids = caption_image(os.path.join(root, "raw", item["path"]), cfg)
        caption = greedy_caption(trainer, params, views, 40, grids)
        mx.log(f"caption of held-out digit {item['label']} ({item['path']}): {caption!r}")
    return out
