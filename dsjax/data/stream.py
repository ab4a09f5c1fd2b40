"""Grain pipelines from a prepared split to model batches: shuffled and resumable for training,
sequential for eval.

The training order is one global stream: rows shuffled per epoch (Grain folds the epoch number
into the seed), repeated forever, then process p takes stream items p, p+P, p+2P, ... . Training
reads it by a global sample cursor (`SampleStream`): a step of G rows is stream items
[cursor, cursor + G), whatever the number of processes and whatever G was for earlier steps, so a
batch-size change (dsjax.batching) neither skips nor repeats a sample, and changing the host count
never changes which examples a step sees. The whole state is the cursor, a tiny JSON dict.

Batch keys, each [batch, seq_len]: inputs, targets (int32), segment_ids, positions (int32; the
attention mask and RoPE use them), weights (float32; 0 where the target starts a new document).
Multimodal rows (`multimodal.pack`) add pixels [batch, max_images, size, size, 3] uint8 and
image_mask [batch, max_images] bool (with tiling also feature_index [batch, seq_len] int32,
aligned with the inputs), and their weights are also 0 where the target is an image
placeholder, a frame separator or padding. Chat and preference rows (`chat_source`) carry a
target mask too, so their weights are 1 exactly on the assistant replies' tokens. Mixed streams
(`mixture`) build on `SampleStream.over`.
"""

from __future__ import annotations

import numpy as np

from dsjax.errors import DataError
from dsjax.data.chat_source import SEQUENCES, ChatSource, split_format
from dsjax.data.shards import PackedSource


def open_split(split_dir: str, seq_len: int) -> PackedSource | ChatSource:
    """The source a token split's meta.json format asks for: whole chat or preference examples
    (`ChatSource`), or windows of a document stream (`PackedSource`)."""
    if split_format(split_dir) in SEQUENCES:
        return ChatSource(split_dir, seq_len)
    return PackedSource(split_dir, seq_len)


def make_example(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One packed row of seq_len + 1 tokens -> next-token example of seq_len positions.

    A row with "target_mask" [seq_len + 1] (multimodal, chat, preference) also zeroes the
    weights where the target is masked; a multimodal row's "pixels" and "image_mask" pass
    through, and a tiled row's "feature_index" [seq_len + 1] is cut to the inputs' positions.
    """
    tokens, seg = row["tokens"], row["segment_ids"]
    seq_len = tokens.shape[-1] - 1
    in_seg = seg[:-1]
    index = np.arange(seq_len, dtype=np.int32)
    is_start = np.ones(seq_len, bool)
    is_start[1:] = in_seg[1:] != in_seg[:-1]
    # Position = distance to the most recent segment start at or before each index.
    positions = index - np.maximum.accumulate(np.where(is_start, index, 0))
    # Predicting the first token of the next document from the previous one's eos is noise.
    weights = seg[:-1] == seg[1:]
    if "target_mask" in row:
        weights = weights & row["target_mask"][1:]
    example = {
        "inputs": tokens[:-1].astype(np.int32),
        "targets": tokens[1:].astype(np.int32),
        "segment_ids": in_seg.astype(np.int32),
        "positions": positions.astype(np.int32),
        "weights": weights.astype(np.float32),
    }
    for key in ("pixels", "image_mask"):
        if key in row:
            example[key] = row[key]
    if "feature_index" in row:
        example["feature_index"] = row["feature_index"][:-1].astype(np.int32)
    return example


def _examples(split_dir: str, seq_len: int, seed: int, process_index: int, process_count: int):
    """Infinite `grain.MapDataset` of this process's examples: stream items p, p+P, ... ."""
    # Grain imports JAX; loading it here keeps `import dsjax.data` (and the prepare CLI) light.
    import grain  # pylint: disable=g-import-not-at-top

    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    source = open_split(split_dir, seq_len)
    if len(source) < process_count:
        raise DataError(f"{split_dir}: {len(source)} rows of seq_len={seq_len} cannot feed "
                        f"{process_count} processes")
    ds = grain.MapDataset.source(source)
    # shuffle before repeat: ShuffleMapDataset maps index i to epoch i // len and permutes within
    # it with seed + epoch, so every epoch is a fresh permutation and epochs never mix.
    ds = ds.shuffle(seed=int(seed) % 2**32).repeat()
    return ds[process_index::process_count].map(make_example)


class SampleStream:
    """The training stream read by a global sample cursor: `take(n)` returns this process's rows
    of stream items [cursor, cursor + n) (items p, p+P, ... of them, stacked) and advances the
    cursor by n. Any sequence of batch sizes therefore reads every sample exactly once, in order.
    It is the one training stream. State: {"cursor": samples consumed, over all processes};
    `set_state` also reads the batch counter {"next_index": batches} that checkpoints held
    before the cursor (the fixed-batch iterator, since removed), given that batch size
    (`legacy_batch`): a single-source stream of such a checkpoint resumes at the same sample.
    `prefetch_rows` rows are read ahead by `prefetch` threads (0: read on `take`).
    """

    def __init__(self, split_dir: str, seq_len: int, seed: int, process_index: int = 0,
                 process_count: int = 1, prefetch: int = 2, prefetch_rows: int = 64,
                 legacy_batch: int = 0):
        ds = _examples(split_dir, seq_len, seed, process_index, process_count)
        self._start(ds, process_count, prefetch, prefetch_rows, legacy_batch)

    @classmethod
    def over(cls, dataset, process_count: int = 1, prefetch: int = 2,
             prefetch_rows: int = 64) -> "SampleStream":
        """A stream over any infinite `grain.MapDataset` of this process's examples (items p, p+P,
        ... of a global stream), e.g. a mixture of sources; same cursor and state."""
        stream = cls.__new__(cls)
        stream._start(dataset, process_count, prefetch, prefetch_rows, legacy_batch=0)
        return stream

    def _start(self, ds, process_count: int, prefetch: int, prefetch_rows: int,
               legacy_batch: int) -> None:
        import grain  # pylint: disable=g-import-not-at-top

        options = grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch_rows)
        self._it = iter(ds.to_iter_dataset(options))
        self.process_count = process_count
        self.legacy_batch = legacy_batch
        self.cursor = 0

    def take(self, n: int) -> dict[str, np.ndarray]:
        """The next n stream items (this process's n / P of them) as one batch."""
        if n < 1 or n % self.process_count:
            raise ValueError(f"a batch of {n} rows cannot be split over {self.process_count} "
                             f"processes")
        rows = [next(self._it) for _ in range(n // self.process_count)]
        self.cursor += n
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def set_state(self, state: dict) -> None:
        if "cursor" in state:
            cursor = int(state["cursor"])
        elif "next_index" in state and self.legacy_batch:
            cursor = int(state["next_index"]) * self.legacy_batch
        elif "next_index" in state:
            raise DataError(f"data iterator state {state!r}: a batch counter, written before "
                            f"the sample cursor (the fixed-batch iterator's checkpoints); only "
                            f"a single-source stream (no data.mix, no vision) resumes it")
        else:
            raise DataError(f"unreadable data iterator state {state!r}")
        if cursor % self.process_count:
            raise DataError(f"data cursor {cursor} cannot be split over {self.process_count} "
                            f"processes")
        self._it.set_state({"next_index": cursor // self.process_count})
        self.cursor = cursor


def eval_batches(split_dir: str, seq_len: int, batch: int, max_batches: int) -> list[dict]:
    """The split's first rows in order, as up to `max_batches` full batches (deterministic)."""
    if batch < 1 or max_batches < 1:
        raise ValueError(f"batch and max_batches must be >= 1, got {batch}, {max_batches}")
    source = open_split(split_dir, seq_len)
    num_batches = min(max_batches, len(source) // batch)
    if num_batches == 0:
        raise DataError(f"{split_dir}: {len(source)} rows of seq_len={seq_len}, fewer than one "
                        f"eval batch of {batch}")
    batches = []
    for b in range(num_batches):
        examples = [make_example(source[i]) for i in range(b * batch, (b + 1) * batch)]
        batches.append({k: np.stack([e[k] for e in examples]) for k in examples[0]})
    return batches
