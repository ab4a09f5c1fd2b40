"""The on-disk multimodal split: token documents with image placeholders, and the images.

A split directory holds documents whose images are ONE placeholder token each; the vision tower's
tokens per image are chosen at read time (`pack`), so one prepared corpus serves every vision
tower and sequence length:

  meta.json           {"format": "dsjax-multimodal-v1", "tokenizer", "vocab_size" (text vocabulary
                       + 2), "text_vocab_size", "image_token_id", "frame_token_id", "image_size",
                       "max_tiles", "dtype", "num_tokens", "num_docs", "num_images", "num_bytes",
                       "modalities", "shards": [{"tokens", "docs", "images", "num_tokens",
                       "num_docs", "num_images"}, ...], ...}   (written last: a directory without
                       it is incomplete)
  tokens-00000.npy    1-D uint16/uint32: documents back to back, each ending in eos (if the
                      tokenizer has one); an image is `image_token_id`, a video's frames are image
                      placeholders with one `frame_token_id` between neighbours
  docs-00000.npy      int64 [num_docs, 5]: token offset, token count, image offset, image count,
                      modality (MODALITIES index) of each document in this shard
  images-00000.npy    uint8 [num_images, image_size, image_size, 3]: the images in placeholder
                      order, document after document

Tiled splits (`--max_tiles N` > 0, DeepSeek-VL2's dynamic tiling, `tiling`) store views, not
images: an image is its global view then its rows x cols tiles, a video frame its global view
alone (grid (0, 0)). Then images-00000.npy is uint8 [num_views, size, size, 3], the views back to
back in placeholder order; grids-00000.npy is int64 [num_images, 2], each placeholder's (rows,
cols); each shard entry and meta.json also have "grids" / "num_views". Image offsets and counts
in docs-*.npy count placeholders (rows of grids-*.npy); an image's first view is the sum of the
views before it. "max_tiles" is 0 in an untiled split (absent in older ones: also 0); a split is
read with the max_tiles it was prepared with.

Documents never span shards. The special ids are the first ids after the text vocabulary (byte
tokenizer: 257 and 258), so text ids keep their meaning.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.shards import META, _save_npy, read_split_meta, token_dtype, write_meta
from dsjax.data.multimodal.layout import views_per_image

FORMAT = "dsjax-multimodal-v1"
MODALITIES = ("text", "image", "video")
DOC_FIELDS = ("token_offset", "num_tokens", "image_offset", "num_images", "modality")


def special_ids(text_vocab_size: int) -> tuple[int, int]:
    """(image_token_id, frame_token_id): the first ids after the text vocabulary."""
    return int(text_vocab_size), int(text_vocab_size) + 1


def split_max_tiles(meta: dict) -> int:
    """The --max_tiles a split was prepared with (0: untiled; a meta.json older than tiling)."""
    return int(meta.get("max_tiles", 0))


class MultimodalWriter:
    """Appends documents (token ids + their images) to a split directory.

    A shard is cut at the first document boundary after `shard_tokens` tokens or `shard_images`
    images (views, when tiled), so images of one shard are held in memory until it is written.
    With `max_tiles` > 0 the split is tiled: `add` takes each placeholder's grid.
    """

    def __init__(self, out_dir: str, tokenizer, image_size: int, shard_tokens: int = 2**24,
                 shard_images: int = 1024, extra_meta: dict | None = None, max_tiles: int = 0):
        if shard_tokens < 1 or shard_images < 1 or image_size < 1 or max_tiles < 0:
            raise ValueError("shard_tokens, shard_images and image_size must be >= 1, "
                             "max_tiles >= 0")
        self.out_dir = out_dir
        self.max_tiles = int(max_tiles)
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
            p for pattern in ("tokens-*.npy", "docs-*.npy", "images-*.npy", "grids-*.npy")
            for p in glob.glob(os.path.join(out_dir, pattern)))
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        self._tokens: list[np.ndarray] = []
        self._images: list[np.ndarray] = []
        self._grids: list[np.ndarray] = []
        self._docs: list[tuple[int, int, int, int, int]] = []
        self._num_tokens = self._num_images = self._num_views = 0  # in the pending shard
        self._shards: list[dict] = []
        self._totals = {"num_tokens": 0, "num_docs": 0, "num_images": 0, "num_bytes": 0}
        if self.max_tiles:
            self._totals["num_views"] = 0
        self._modalities = {m: 0 for m in MODALITIES}
        self._closed = False

    def add(self, ids: np.ndarray, images: np.ndarray, modality: str, num_bytes: int = 0,
            grids: np.ndarray | None = None) -> None:
        """One document: token ids (placeholders included, eos appended here) and its images
        uint8 [n, size, size, 3], n = the number of `image_token_id` placeholders in `ids`.
        Tiled: `grids` int [n, 2], each placeholder's (rows, cols), and `images` its views."""
        if self._closed:
            raise RuntimeError("MultimodalWriter.add after close")
        ids = np.asarray(ids, np.int64)
        if self.tokenizer.eos_id is not None:
            ids = np.append(ids, self.tokenizer.eos_id)
        images = np.asarray(images, np.uint8).reshape(-1, self.image_size, self.image_size, 3)
        placeholders = int(np.count_nonzero(ids == self.image_token_id))
        if (grids is None) != (not self.max_tiles):
            raise ValueError("grids are given for a tiled split (max_tiles > 0) and only then")
        views = placeholders
        if self.max_tiles:
            grids = np.asarray(grids, np.int64).reshape(-1, 2)
            views = int(views_per_image(grids).sum())
            if grids.shape[0] != placeholders:
                raise ValueError(f"{placeholders} image placeholders but {grids.shape[0]} grids")
        if views != images.shape[0]:
            raise ValueError(f"{placeholders} image placeholders take {views} views but "
                             f"{images.shape[0]} images are given")
        if ids.size == 0:
            return
        self._docs.append((self._num_tokens, int(ids.size), self._num_images, placeholders,
                           MODALITIES.index(modality)))
        self._tokens.append(ids.astype(self.dtype))
        if images.shape[0]:
            self._images.append(images)
        if self.max_tiles:
            self._grids.append(grids)
        self._num_tokens += int(ids.size)
        self._num_images += placeholders
        self._num_views += views
        self._modalities[modality] += 1
        self._totals["num_bytes"] += int(num_bytes)
        if self._num_tokens >= self.shard_tokens or self._num_views >= self.shard_images:
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
        entry = {**names, "num_tokens": self._num_tokens, "num_docs": len(self._docs),
                 "num_images": self._num_images}
        if self.max_tiles:
            entry["grids"] = f"grids-{index:05d}.npy"
            entry["num_views"] = self._num_views
            _save_npy(os.path.join(self.out_dir, entry["grids"]),
                      np.concatenate(self._grids).reshape(-1, 2))
            self._totals["num_views"] += self._num_views
        self._shards.append(entry)
        self._totals["num_tokens"] += self._num_tokens
        self._totals["num_docs"] += len(self._docs)
        self._totals["num_images"] += self._num_images
        self._tokens, self._images, self._grids, self._docs = [], [], [], []
        self._num_tokens = self._num_images = self._num_views = 0

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
            "max_tiles": self.max_tiles,
            "dtype": self.dtype.name,
            **self._totals,
            "modalities": dict(self._modalities),
            "shards": self._shards,
            **self._extra,
        }
        return write_meta(self.out_dir, meta)


def read_mm_meta(split_dir: str) -> dict:
    """Parses and checks meta.json of a multimodal split directory."""
    return read_split_meta(split_dir, FORMAT, ("vocab_size", "dtype", "image_token_id",
                                         "frame_token_id", "image_size", "shards"),
                     "python -m dsjax.data.prepare --format multimodal")


def is_multimodal(split_dir: str) -> bool:
    """Whether `split_dir/meta.json` names the multimodal format (False if absent or other)."""
    try:
        with open(os.path.join(split_dir, META)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_shard(split_dir: str, shard: dict, meta: dict
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens, docs, images, grids) of one shard, memory-mapped, each checked against meta.json;
    grids is None in an untiled split, and images are views in a tiled one."""
    tiled = split_max_tiles(meta) > 0
    keys = ("tokens", "docs", "images") + (("grids",) if tiled else ())
    arrays = []
    for key in keys:
        if key not in shard:
            raise DataError(f"{os.path.join(split_dir, META)}: a shard entry has no {key!r} file "
                            f"(a tiled split lists its grids)")
        path = os.path.join(split_dir, shard[key])
        if not os.path.isfile(path):
            raise DataError(f"{path}: shard file listed in {META} is missing")
        try:
            arrays.append(np.load(path, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read shard ({e or type(e).__name__})") from None
    tokens, docs, images = arrays[:3]
    grids = arrays[3] if tiled else None
    size = int(meta["image_size"])
    where = os.path.join(split_dir, shard["tokens"])
    if tokens.ndim != 1 or tokens.dtype != np.dtype(meta["dtype"]) or (
            tokens.size != shard["num_tokens"]):
        raise DataError(f"{where}: expected {shard['num_tokens']} {meta['dtype']} tokens, found "
                        f"shape {tokens.shape} {tokens.dtype.name}")
    if docs.ndim != 2 or docs.shape[1] != len(DOC_FIELDS):
        raise DataError(f"{os.path.join(split_dir, shard['docs'])}: expected int64 [docs, "
                        f"{len(DOC_FIELDS)}], found shape {docs.shape}")
    stored = shard["num_views"] if tiled else shard["num_images"]
    if images.dtype != np.uint8 or images.shape[1:] != (size, size, 3) or (
            images.shape[0] != stored):
        raise DataError(f"{os.path.join(split_dir, shard['images'])}: expected uint8 "
                        f"[{stored}, {size}, {size}, 3], found {images.dtype.name} "
                        f"{images.shape}")
    if tiled and (grids.dtype.kind != "i" or grids.shape != (shard["num_images"], 2)):
        raise DataError(f"{os.path.join(split_dir, shard['grids'])}: expected int64 "
                        f"[{shard['num_images']}, 2], found {grids.dtype.name} {grids.shape}")
    return tokens, docs, images, grids


def check_shard(split_dir: str, shard: dict, arrays: tuple, image_token_id: int,
                max_tiles: int) -> None:
    """Documents tile the shard's tokens and images, each has as many placeholders as images,
    and (tiled) every grid is (0, 0) or of 1..max_tiles tiles and the grids imply exactly the
    views stored. A DataError names the file and the first bad document."""
    tokens, docs, images, grids = arrays
    where = os.path.join(split_dir, shard["docs"])
    offsets, counts = docs[:, 0], docs[:, 1]
    image_offsets, image_counts = docs[:, 2], docs[:, 3]
    num_images = images.shape[0] if grids is None else grids.shape[0]
    ends = np.cumsum(counts)
    if docs.shape[0] and (np.any(counts < 1) or np.any(offsets != ends - counts)
                          or ends[-1] != tokens.size):
        raise DataError(f"{where}: document token ranges do not tile the shard")
    image_ends = np.cumsum(image_counts)
    if docs.shape[0] and (np.any(image_counts < 0)
                          or np.any(image_offsets != image_ends - image_counts)
                          or image_ends[-1] != num_images):
        raise DataError(f"{where}: document image ranges do not tile the {num_images} images "
                        f"stored")
    if docs.shape[0]:
        found = np.add.reduceat((tokens == image_token_id).astype(np.int64), offsets)
        bad = np.flatnonzero(found != image_counts)
        if bad.size:
            d = int(bad[0])
            raise DataError(f"{where}: document {d} has {int(found[d])} image placeholders but "
                            f"{int(image_counts[d])} images stored")
    if grids is None:
        return
    grid_file = os.path.join(split_dir, shard["grids"])
    rows, cols = np.asarray(grids[:, 0]), np.asarray(grids[:, 1])
    frame = (rows == 0) & (cols == 0)
    tiled = (rows >= 1) & (cols >= 1) & (rows * cols <= max_tiles)
    bad = np.flatnonzero(~(frame | tiled))
    if bad.size:
        k = int(bad[0])
        d = int(np.searchsorted(image_ends, k, side="right"))
        raise DataError(f"{grid_file}: image {k} (document {d}) has grid ({int(rows[k])}, "
                        f"{int(cols[k])}), neither a video frame's (0, 0) nor at most "
                        f"max_tiles={max_tiles} tiles")
    views = int(views_per_image(grids).sum())
    if views != images.shape[0]:
        raise DataError(f"{grid_file}: the grids imply {views} views but "
                        f"{os.path.join(split_dir, shard['images'])} holds {images.shape[0]}")
