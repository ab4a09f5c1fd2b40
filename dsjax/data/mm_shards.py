"""The on-disk multimodal split: token documents with image placeholders, and the images.

A split directory holds documents whose images are ONE placeholder token each; the vision tower's
tokens per image are chosen at read time (`mm_pack`), so one prepared corpus serves every vision
tower and sequence length:

  meta.json           {"format": "dsjax-multimodal-v1", "tokenizer", "vocab_size" (text vocabulary
                       + 2), "text_vocab_size", "image_token_id", "frame_token_id", "image_size",
                       "dtype", "num_tokens", "num_docs", "num_images", "num_bytes", "modalities",
                       "shards": [{"tokens", "docs", "images", "num_tokens", "num_docs",
                       "num_images"}, ...], ...}   (written last: a directory without it is
                      incomplete)
  tokens-00000.npy    1-D uint16/uint32: documents back to back, each ending in eos (if the
                      tokenizer has one); an image is `image_token_id`, a video's frames are image
                      placeholders with one `frame_token_id` between neighbours
  docs-00000.npy      int64 [num_docs, 5]: token offset, token count, image offset, image count,
                      modality (MODALITIES index) of each document in this shard
  images-00000.npy    uint8 [num_images, image_size, image_size, 3]: the images in placeholder
                      order, document after document

Documents never span shards. The special ids are the first ids after the text vocabulary (byte
tokenizer: 257 and 258), so text ids keep their meaning.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.shards import META, _save_npy, read_meta, token_dtype, write_meta

FORMAT = "dsjax-multimodal-v1"
MODALITIES = ("text", "image", "video")
DOC_FIELDS = ("token_offset", "num_tokens", "image_offset", "num_images", "modality")


def special_ids(text_vocab_size: int) -> tuple[int, int]:
    """(image_token_id, frame_token_id): the first ids after the text vocabulary."""
    return int(text_vocab_size), int(text_vocab_size) + 1


class MultimodalWriter:
    """Appends documents (token ids + their images) to a split directory.

    A shard is cut at the first document boundary after `shard_tokens` tokens or `shard_images`
    images, so images of one shard are held in memory until it is written.
    """

    def __init__(self, out_dir: str, tokenizer, image_size: int, shard_tokens: int = 2**24,
                 shard_images: int = 1024, extra_meta: dict | None = None):
        if shard_tokens < 1 or shard_images < 1 or image_size < 1:
            raise ValueError("shard_tokens, shard_images and image_size must be >= 1")
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.image_size = int(image_size)
        self.image_token_id, self.frame_token_id = special_ids(tokenizer.vocab_size)
        self.vocab_size = int(tokenizer.vocab_size) + 2
        self.dtype = token_dtype(self.vocab_size)
        self.shard_tokens, self.shard_images = int(shard_tokens), int(shard_images)
        self._extra = dict(extra_meta or {})
        os.makedirs(out_dir, exist_ok=True)
        # A rewrite must not look complete until it is: drop the old meta first, then old shards.
        stale = [os.path.join(out_dir, META)] + sorted(
            p for pattern in ("tokens-*.npy", "docs-*.npy", "images-*.npy")
            for p in glob.glob(os.path.join(out_dir, pattern)))
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        self._tokens: list[np.ndarray] = []
        self._images: list[np.ndarray] = []
        self._docs: list[tuple[int, int, int, int, int]] = []
        self._num_tokens = self._num_images = 0  # in the pending shard
        self._shards: list[dict] = []
        self._totals = {"num_tokens": 0, "num_docs": 0, "num_images": 0, "num_bytes": 0}
        self._modalities = {m: 0 for m in MODALITIES}
        self._closed = False

    def add(self, ids: np.ndarray, images: np.ndarray, modality: str, num_bytes: int = 0) -> None:
        """One document: token ids (placeholders included, eos appended here) and its images
        uint8 [n, size, size, 3], n = the number of `image_token_id` placeholders in `ids`."""
        if self._closed:
            raise RuntimeError("MultimodalWriter.add after close")
        ids = np.asarray(ids, np.int64)
        if self.tokenizer.eos_id is not None:
            ids = np.append(ids, self.tokenizer.eos_id)
        images = np.asarray(images, np.uint8).reshape(-1, self.image_size, self.image_size, 3)
        placeholders = int(np.count_nonzero(ids == self.image_token_id))
        if placeholders != images.shape[0]:
            raise ValueError(f"{placeholders} image placeholders but {images.shape[0]} images")
        if ids.size == 0:
            return
        self._docs.append((self._num_tokens, int(ids.size), self._num_images, images.shape[0],
                           MODALITIES.index(modality)))
        self._tokens.append(ids.astype(self.dtype))
        if images.shape[0]:
            self._images.append(images)
        self._num_tokens += int(ids.size)
        self._num_images += images.shape[0]
        self._modalities[modality] += 1
        self._totals["num_bytes"] += int(num_bytes)
        if self._num_tokens >= self.shard_tokens or self._num_images >= self.shard_images:
            self._write_shard()

    def _write_shard(self) -> None:
        if not self._docs:
            return
        index = len(self._shards)
        names = {"tokens": f"tokens-{index:05d}.npy", "docs": f"docs-{index:05d}.npy",
                 "images": f"images-{index:05d}.npy"}
        size = self.image_size
        images = (np.concatenate(self._images) if self._images
                  else np.zeros((0, size, size, 3), np.uint8))
        _save_npy(os.path.join(self.out_dir, names["tokens"]), np.concatenate(self._tokens))
        _save_npy(os.path.join(self.out_dir, names["docs"]), np.asarray(self._docs, np.int64))
        _save_npy(os.path.join(self.out_dir, names["images"]), images)
        self._shards.append({**names, "num_tokens": self._num_tokens, "num_docs": len(self._docs),
                             "num_images": self._num_images})
        self._totals["num_tokens"] += self._num_tokens
        self._totals["num_docs"] += len(self._docs)
        self._totals["num_images"] += self._num_images
        self._tokens, self._images, self._docs = [], [], []
        self._num_tokens = self._num_images = 0

    def close(self) -> dict:
        """Writes the last shard, then meta.json (renamed into place, so it appears whole)."""
        if not self._closed:
            self._write_shard()
            self._closed = True
        meta = {
            "format": FORMAT,
            "tokenizer": self.tokenizer.name,
            "vocab_size": self.vocab_size,
            "text_vocab_size": int(self.tokenizer.vocab_size),
            "image_token_id": self.image_token_id,
            "frame_token_id": self.frame_token_id,
            "image_size": self.image_size,
            "dtype": self.dtype.name,
            **self._totals,
            "modalities": dict(self._modalities),
            "shards": self._shards,
            **self._extra,
        }
        return write_meta(self.out_dir, meta)


def read_mm_meta(split_dir: str) -> dict:
    """Parses and checks meta.json of a multimodal split directory."""
    return read_meta(split_dir, FORMAT, ("vocab_size", "dtype", "image_token_id",
                                         "frame_token_id", "image_size", "shards"),
                     "python -m dsjax.data.prepare --format multimodal")


def is_multimodal(split_dir: str) -> bool:
    """Whether `split_dir/meta.json` names the multimodal format (False if absent or other)."""
    try:
        with open(os.path.join(split_dir, META)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_shard(split_dir: str, shard: dict, meta: dict) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """(tokens, docs, images) of one shard, memory-mapped, each checked against meta.json."""
    arrays = []
    for key in ("tokens", "docs", "images"):
        path = os.path.join(split_dir, shard[key])
        if not os.path.isfile(path):
            raise DataError(f"{path}: shard file listed in {META} is missing")
        try:
            arrays.append(np.load(path, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read shard ({e or type(e).__name__})") from None
    tokens, docs, images = arrays
    size = int(meta["image_size"])
    where = os.path.join(split_dir, shard["tokens"])
    if tokens.ndim != 1 or tokens.dtype != np.dtype(meta["dtype"]) or (
            tokens.size != shard["num_tokens"]):
        raise DataError(f"{where}: expected {shard['num_tokens']} {meta['dtype']} tokens, found "
                        f"shape {tokens.shape} {tokens.dtype.name}")
    if docs.ndim != 2 or docs.shape[1] != len(DOC_FIELDS):
        raise DataError(f"{os.path.join(split_dir, shard['docs'])}: expected int64 [docs, "
                        f"{len(DOC_FIELDS)}], found shape {docs.shape}")
    if images.dtype != np.uint8 or images.shape[1:] != (size, size, 3) or (
            images.shape[0] != shard["num_images"]):
        raise DataError(f"{os.path.join(split_dir, shard['images'])}: expected uint8 "
                        f"[{shard['num_images']}, {size}, {size}, 3], found {images.dtype.name} "
                        f"{images.shape}")
    return tokens, docs, images
