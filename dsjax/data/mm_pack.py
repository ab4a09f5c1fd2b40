"""Packing a multimodal split into rows at read time: placeholders expanded, whole documents.

Each image placeholder becomes exactly `tokens_per_image` copies of `image_token_id` (the vision
tower's output length, e.g. (image_size / patch)^2); whole documents are packed greedily into rows
of seq_len + 1 tokens holding at most `max_images` images, the rest of a row padded (segment 0,
never a target). A document that does not fit in an empty row gets a row of its own and is cut at
a text position: the longest prefix that fits, never inside an image's tokens, so an image that
would cross the row end or exceed the image budget is dropped with everything after it. The rest
of that document is dropped too, and counted in `MultimodalSource.cut`.

An image never ends on a row's last token: that token is only a target, so the model's inputs
would hold a partial image.

The row index is computed once per split with numpy (a pass over document lengths), so one
prepared corpus serves every (seq_len, tokens_per_image, max_images).
"""

from __future__ import annotations

import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.mm_shards import load_shard, read_mm_meta

PAD_ID = 0  # padding token; its segment id is 0 and it is never a target


class MultimodalSource:
    """Grain random-access source: row i -> {"tokens", "segment_ids", "target_mask"} [seq_len + 1],
    "pixels" uint8 [max_images, size, size, 3] (placeholder order, zeros in empty slots) and
    "image_mask" bool [max_images]. `make_example` turns a row into a training example.

    `image_size` is the model's: a split prepared at another size is a DataError. Every shard is
    checked once at construction (placeholders per document against the images stored).
    """

    def __init__(self, split_dir: str, seq_len: int, tokens_per_image: int, max_images: int,
                 image_size: int):
        if seq_len < 1 or max_images < 1 or tokens_per_image < 1:
            raise ValueError(f"seq_len, max_images and tokens_per_image must be >= 1, got "
                             f"{seq_len}, {max_images}, {tokens_per_image}")
        if tokens_per_image > seq_len:
            raise DataError(f"{split_dir}: one image is {tokens_per_image} tokens, more than a "
                            f"row of seq_len={seq_len}")
        self.split_dir = split_dir
        self.seq_len, self.tokens_per_image = int(seq_len), int(tokens_per_image)
        self.max_images = int(max_images)
        self.meta = read_mm_meta(split_dir)
        if int(self.meta["image_size"]) != int(image_size):
            raise DataError(f"{os.path.join(split_dir, 'meta.json')}: images were prepared at "
                            f"{self.meta['image_size']}x{self.meta['image_size']}, the model "
                            f"expects {image_size}x{image_size}; prepare again with "
                            f"--image_size {image_size}")
        self.image_token_id = int(self.meta["image_token_id"])
        self.frame_token_id = int(self.meta["frame_token_id"])
        self._open()
        self._check()
        self._build_index()

    def _open(self) -> None:
        self._shards = [load_shard(self.split_dir, shard, self.meta)
                        for shard in self.meta["shards"]]

    def _check(self) -> None:
        for shard, (tokens, docs, images) in zip(self.meta["shards"], self._shards):
            where = os.path.join(self.split_dir, shard["docs"])
            offsets, counts = docs[:, 0], docs[:, 1]
            image_offsets, image_counts = docs[:, 2], docs[:, 3]
            ends = np.cumsum(counts)
            if docs.shape[0] and (np.any(counts < 1) or np.any(offsets != ends - counts)
                                  or ends[-1] != tokens.size):
                raise DataError(f"{where}: document token ranges do not tile the shard")
            image_ends = np.cumsum(image_counts)
            if docs.shape[0] and (np.any(image_counts < 0)
                                  or np.any(image_offsets != image_ends - image_counts)
                                  or image_ends[-1] != images.shape[0]):
                raise DataError(f"{where}: document image ranges do not tile the "
                                f"{images.shape[0]} images stored")
            if not docs.shape[0]:
                continue
            found = np.add.reduceat((tokens == self.image_token_id).astype(np.int64), offsets)
            bad = np.flatnonzero(found != image_counts)
            if bad.size:
                d = int(bad[0])
                raise DataError(f"{where}: document {d} has {int(found[d])} image placeholders "
                                f"but {int(image_counts[d])} images stored")

    def _build_index(self) -> None:
        """Greedy packing over document lengths; rows never span shards."""
        cap, per_image = self.seq_len + 1, self.tokens_per_image
        rows = []  # (shard, first doc, end doc, raw tokens kept of the last doc or -1)
        cut = {"docs": 0, "images_dropped": 0, "text_tokens_dropped": 0}
        for s, (tokens, docs, _) in enumerate(self._shards):
            lengths = (docs[:, 1] + docs[:, 3] * (per_image - 1)).tolist()
            num_images = docs[:, 3].tolist()
            last = np.asarray(tokens[docs[:, 0] + docs[:, 1] - 1]) if docs.shape[0] else []
            ends_with_image = (np.asarray(last) == self.image_token_id).tolist()
            start, used, used_images = 0, 0, 0
            for d, (length, n) in enumerate(zip(lengths, num_images)):
                room = cap - 1 if ends_with_image[d] else cap
                if length <= room and n <= self.max_images:
                    if used + length <= room and used_images + n <= self.max_images:
                        used, used_images = used + length, used_images + n
                        continue
                    if d > start:
                        rows.append((s, start, d, -1))
                    start, used, used_images = d, length, n
                    continue
                if d > start:
                    rows.append((s, start, d, -1))
                kept = self._cut_point(tokens, docs[d], cut)
                if kept:
                    rows.append((s, d, d + 1, kept))
                start, used, used_images = d + 1, 0, 0
            if len(lengths) > start:
                rows.append((s, start, len(lengths), -1))
        self._rows = np.asarray(rows, np.int64).reshape(-1, 4)
        self.cut = cut
        if not len(self._rows):
            raise DataError(f"{self.split_dir}: no rows: the split holds no documents")

    def _cut_point(self, tokens: np.ndarray, doc: np.ndarray, cut: dict) -> int:
        """Raw tokens kept of a document too long for a row (the longest prefix that fits)."""
        offset, count = int(doc[0]), int(doc[1])
        raw = np.asarray(tokens[offset:offset + count])
        is_image = raw == self.image_token_id
        span = np.cumsum(np.where(is_image, self.tokens_per_image, 1))
        kept = int(np.searchsorted(span, self.seq_len + 1, side="right"))
        kept = min(kept, int(np.searchsorted(np.cumsum(is_image), self.max_images, side="right")))
        if kept and is_image[kept - 1] and span[kept - 1] > self.seq_len:
            kept -= 1  # the image would end on the row's last token, which is not an input
        cut["docs"] += 1
        cut["images_dropped"] += int(np.count_nonzero(is_image[kept:]))
        cut["text_tokens_dropped"] += int(np.count_nonzero(~is_image[kept:]))
        return kept

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < len(self._rows):
            raise IndexError(f"row {index} out of range for {len(self._rows)} rows")
        s, lo, hi, kept = (int(v) for v in self._rows[index])
        tokens, docs, images = self._shards[s]
        parts, segments, pictures = [], [], []
        for segment, d in enumerate(range(lo, hi), start=1):
            offset, count, image_offset = int(docs[d, 0]), int(docs[d, 1]), int(docs[d, 2])
            raw = np.asarray(tokens[offset:offset + (kept if d == hi - 1 and kept >= 0
                                                     else count)], np.int32)
            is_image = raw == self.image_token_id
            expanded = np.repeat(raw, np.where(is_image, self.tokens_per_image, 1))
            parts.append(expanded)
            segments.append(np.full(expanded.size, segment, np.int32))
            n = int(np.count_nonzero(is_image))
            if n:
                pictures.append(images[image_offset:image_offset + n])
        length = self.seq_len + 1
        row = np.full(length, PAD_ID, np.int32)
        seg = np.zeros(length, np.int32)
        used = sum(p.size for p in parts)
        row[:used] = np.concatenate(parts)
        seg[:used] = np.concatenate(segments)
        size = int(self.meta["image_size"])
        pixels = np.zeros((self.max_images, size, size, 3), np.uint8)
        count = 0
        if pictures:
            stacked = np.concatenate(pictures)
            count = stacked.shape[0]
            pixels[:count] = stacked
        is_special = (row == self.image_token_id) | (row == self.frame_token_id)
        return {
            "tokens": row,
            "segment_ids": seg,
            "target_mask": (seg > 0) & ~is_special,
            "pixels": pixels,
            "image_mask": np.arange(self.max_images) < count,
        }

    def __repr__(self) -> str:
        return (f"MultimodalSource({self.split_dir!r}, seq_len={self.seq_len}, "
                f"tokens_per_image={self.tokens_per_image}, max_images={self.max_images}, "
                f"rows={len(self._rows)})")

    # Grain may pickle the source into worker processes: ship the index, reopen the mmaps there.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_shards"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()
