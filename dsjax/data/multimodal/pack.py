"""Packing a multimodal split into rows at read time: placeholders expanded, whole documents.

Each image placeholder becomes its positions of `image_token_id` (`layout`: untiled
`tokens_per_image` copies, the vision tower's output length, e.g. (image_size / patch)^2; tiled,
DeepSeek-VL2's global view, separator and tiles with their row newlines); whole documents are
packed greedily into rows of seq_len + 1 tokens holding at most `max_images` view slots (an image
takes one, tiled its global view plus its tiles), the rest of a row padded (segment 0, never a
target). A document that does not fit in an empty row gets a row of its own and is cut at a text
position: the longest prefix that fits, never inside an image's tokens, so an image that would
cross the row end or exceed the slot budget is dropped with everything after it. The rest of that
document is dropped too, and counted in `MultimodalSource.cut`.

An image never ends on a row's last token: that token is only a target, so the model's inputs
would hold a partial image.

The row index is computed once per split with numpy (a pass over document lengths), so one
prepared corpus serves every (seq_len, tokens_per_image, max_images); a tiled split is read with
the max_tiles it was prepared with.
"""

from __future__ import annotations

import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.multimodal.layout import MediaLayout
from dsjax.data.multimodal.shards import check_shard, load_shard, read_mm_meta, split_max_tiles

PAD_ID = 0  # padding token; its segment id is 0 and it is never a target


def _tiling_mismatch(prepared: int, wanted: int) -> str:
    """What differs between a split's --max_tiles and the model's tiling, and what to run."""
    split = (f"the split was prepared with --max_tiles {prepared}" if prepared
             else "the split was prepared untiled (no --max_tiles)")
    model = (f"the model tiles images with vision.max_tiles={wanted}" if wanted
             else "the model reads untiled images (vision.tiling=False)")
    again = (f"--max_tiles {wanted}" if wanted else "without --max_tiles")
    other = (f"vision.tiling=True, vision.max_tiles={prepared}" if prepared
             else "vision.tiling=False")
    return (f"{split}, {model}; prepare it again with `python -m dsjax.data.prepare --format "
            f"multimodal ... {again}`, or set {other}")


class MultimodalSource:
    """Grain random-access source: row i -> {"tokens", "segment_ids", "target_mask"} [seq_len + 1],
    "pixels" uint8 [max_images, size, size, 3] (view slots in placeholder order, zeros in empty
    slots), "image_mask" bool [max_images] and, tiled, "feature_index" int32 [seq_len + 1] (each
    image position's feature-table index, `layout`; 0 elsewhere). `make_example` turns a row
    into a training example.

    `image_size` is the model's and `max_tiles` its tiling (0: none; `tokens_per_image` is then a
    view's, the square of `vision.view_side`): a split prepared otherwise is a DataError. Every
    shard is checked once at construction (placeholders per document against the images stored,
    tiled also the grids against the views stored).
    """

    def __init__(self, split_dir: str, seq_len: int, tokens_per_image: int, max_images: int,
                 image_size: int, max_tiles: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.layout = MediaLayout(tokens_per_image, max_images, max_tiles)
        if self.layout.min_image_tokens > seq_len:
            raise DataError(f"{split_dir}: one image is {self.layout.min_image_tokens} tokens, "
                            f"more than a row of seq_len={seq_len}")
        self.split_dir = split_dir
        self.seq_len, self.tokens_per_image = int(seq_len), int(tokens_per_image)
        self.max_images, self.max_tiles = int(max_images), int(max_tiles)
        self.meta = read_mm_meta(split_dir)
        where = os.path.join(split_dir, "meta.json")
        if int(self.meta["image_size"]) != int(image_size):
            raise DataError(f"{where}: images were prepared at {self.meta['image_size']}x"
                            f"{self.meta['image_size']}, the model expects {image_size}x"
                            f"{image_size}; prepare again with --image_size {image_size}")
        prepared = split_max_tiles(self.meta)
        if prepared != self.max_tiles:
            raise DataError(f"{where}: {_tiling_mismatch(prepared, self.max_tiles)}")
        self.image_token_id = int(self.meta["image_token_id"])
        self.frame_token_id = int(self.meta["frame_token_id"])
        self._open()
        for shard, arrays in zip(self.meta["shards"], self._shards):
            check_shard(split_dir, shard, arrays, self.image_token_id, self.max_tiles)
        self._build_index()

    def _open(self) -> None:
        self._shards = [load_shard(self.split_dir, shard, self.meta)
                        for shard in self.meta["shards"]]
        # Per shard and image: its positions, its view slots, and its first view in the shard.
        self._per_image = []
        for _, _, images, grids in self._shards:
            n = images.shape[0] if grids is None else grids.shape[0]
            views = self.layout.image_views(grids, n)
            self._per_image.append((self.layout.image_tokens(grids, n), views,
                                    np.cumsum(views) - views))

    def _build_index(self) -> None:
        """Greedy packing over document lengths; rows never span shards."""
        cap, budget = self.seq_len + 1, self.max_images
        rows = []  # (shard, first doc, end doc, raw tokens kept of the last doc or -1)
        cut = {"docs": 0, "images_dropped": 0, "text_tokens_dropped": 0}
        for s, (tokens, docs, _, _) in enumerate(self._shards):
            lens, views, _ = self._per_image[s]
            first, count = docs[:, 2], docs[:, 3]
            sum_lens = np.concatenate([[0], np.cumsum(lens)])
            sum_views = np.concatenate([[0], np.cumsum(views)])
            lengths = (docs[:, 1] - count + sum_lens[first + count] - sum_lens[first]).tolist()
            doc_views = (sum_views[first + count] - sum_views[first]).tolist()
            last = np.asarray(tokens[docs[:, 0] + docs[:, 1] - 1]) if docs.shape[0] else []
            ends_with_image = (np.asarray(last) == self.image_token_id).tolist()
            start, used, used_views = 0, 0, 0
            for d, (length, n) in enumerate(zip(lengths, doc_views)):
                room = cap - 1 if ends_with_image[d] else cap
                if length <= room and n <= budget:
                    if used + length <= room and used_views + n <= budget:
                        used, used_views = used + length, used_views + n
                        continue
                    if d > start:
                        rows.append((s, start, d, -1))
                    start, used, used_views = d, length, n
                    continue
                if d > start:
                    rows.append((s, start, d, -1))
                kept = self._cut_point(s, docs[d], cut)
                if kept:
                    rows.append((s, d, d + 1, kept))
                start, used, used_views = d + 1, 0, 0
            if len(lengths) > start:
                rows.append((s, start, len(lengths), -1))
        self._rows = np.asarray(rows, np.int64).reshape(-1, 4)
        self.cut = cut
        if not len(self._rows):
            raise DataError(f"{self.split_dir}: no rows: the split holds no documents")

    def _cut_point(self, s: int, doc: np.ndarray, cut: dict) -> int:
        """Raw tokens kept of a document too long for a row (the longest prefix that fits)."""
        offset, count, first, n = (int(v) for v in doc[:4])
        lens, views, _ = self._per_image[s]
        raw = np.asarray(self._shards[s][0][offset:offset + count])
        is_image = raw == self.image_token_id
        span, slots = np.ones(raw.size, np.int64), np.zeros(raw.size, np.int64)
        span[is_image], slots[is_image] = lens[first:first + n], views[first:first + n]
        span = np.cumsum(span)
        kept = int(np.searchsorted(span, self.seq_len + 1, side="right"))
        kept = min(kept, int(np.searchsorted(np.cumsum(slots), self.max_images, side="right")))
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
        tokens, docs, images, grids = self._shards[s]
        _, views, view_start = self._per_image[s]
        parts, segments, indices, pictures = [], [], [], []
        filled = 0  # view slots filled so far
        for segment, d in enumerate(range(lo, hi), start=1):
            offset, count, first = int(docs[d, 0]), int(docs[d, 1]), int(docs[d, 2])
            raw = np.asarray(tokens[offset:offset + (kept if d == hi - 1 and kept >= 0
                                                     else count)], np.int32)
            n = int(np.count_nonzero(raw == self.image_token_id))
            expanded, index_d = self.layout.expand(
                raw, self.image_token_id, None if grids is None else grids[first:first + n],
                filled)
            parts.append(expanded)
            segments.append(np.full(expanded.size, segment, np.int32))
            indices.append(index_d)
            if n:
                v0, used = int(view_start[first]), int(views[first:first + n].sum())
                pictures.append(images[v0:v0 + used])
                filled += used
        length = self.seq_len + 1
        row = np.full(length, PAD_ID, np.int32)
        seg = np.zeros(length, np.int32)
        used = sum(p.size for p in parts)
        row[:used] = np.concatenate(parts)
        seg[:used] = np.concatenate(segments)
        size = int(self.meta["image_size"])
        pixels = np.zeros((self.max_images, size, size, 3), np.uint8)
        if pictures:
            pixels[:filled] = np.concatenate(pictures)
        is_special = (row == self.image_token_id) | (row == self.frame_token_id)
        out = {
            "tokens": row,
            "segment_ids": seg,
            "target_mask": (seg > 0) & ~is_special,
            "pixels": pixels,
            "image_mask": np.arange(self.max_images) < filled,
        }
        if self.layout.tiled:
            out["feature_index"] = np.zeros(length, np.int32)
            out["feature_index"][:used] = np.concatenate(indices)
        return out

    def __repr__(self) -> str:
        return (f"MultimodalSource({self.split_dir!r}, seq_len={self.seq_len}, "
                f"tokens_per_image={self.tokens_per_image}, max_images={self.max_images}, "
                f"max_tiles={self.max_tiles}, rows={len(self._rows)})")

    # Grain may pickle the source into worker processes: ship the index, reopen the mmaps there.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_shards", "_per_image")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()
