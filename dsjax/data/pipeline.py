"""Grain pipelines from a prepared split to model batches: shuffled and resumable for training,
sequential for eval.

The training order is one global stream: rows shuffled per epoch (Grain folds the epoch number
into the seed), repeated forever, then process p takes stream items p, p+P, p+2P, ... . So step k's
global batch is stream items [k*G, (k+1)*G) whatever the number of processes: changing the host
count never changes which examples a step sees. The iterator's whole state is one index, so it
checkpoints as a tiny JSON dict.

Batch keys, each [batch, seq_len]: inputs, targets (int32), segment_ids, positions (int32; the
attention mask and RoPE use them), weights (float32; 0 where the target starts a new document).
"""

from __future__ import annotations

import numpy as np

from dsjax.data import DataError
from dsjax.data.shards import PackedSource


def make_example(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One packed row of seq_len + 1 tokens -> next-token example of seq_len positions."""
    tokens, seg = row["tokens"], row["segment_ids"]
    seq_len = tokens.shape[-1] - 1
    in_seg = seg[:-1]
    index = np.arange(seq_len, dtype=np.int32)
    is_start = np.ones(seq_len, bool)
    is_start[1:] = in_seg[1:] != in_seg[:-1]
    # Position = distance to the most recent segment start at or before each index.
    positions = index - np.maximum.accumulate(np.where(is_start, index, 0))
    return {
        "inputs": tokens[:-1].astype(np.int32),
        "targets": tokens[1:].astype(np.int32),
        "segment_ids": in_seg.astype(np.int32),
        "positions": positions.astype(np.int32),
        # Predicting the first token of the next document from the previous one's eos is noise.
        "weights": (seg[:-1] == seg[1:]).astype(np.float32),
    }


def train_dataset(split_dir: str, seq_len: int, batch_per_process: int, seed: int,
                  process_index: int = 0, process_count: int = 1):
    """Infinite `grain.MapDataset` of this process's batches, reshuffled every epoch."""
    # Grain imports JAX; loading it here keeps `import dsjax.data` (and the prepare CLI) light.
    import grain  # pylint: disable=g-import-not-at-top

    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if batch_per_process < 1:
        raise ValueError(f"batch_per_process must be >= 1, got {batch_per_process}")
    source = PackedSource(split_dir, seq_len)
    if len(source) < process_count:
        raise DataError(f"{split_dir}: {len(source)} rows of seq_len={seq_len} cannot feed "
                        f"{process_count} processes")
    ds = grain.MapDataset.source(source)
    # shuffle before repeat: ShuffleMapDataset maps index i to epoch i // len and permutes within
    # it with seed + epoch, so every epoch is a fresh permutation and epochs never mix.
    ds = ds.shuffle(seed=int(seed) % 2**32).repeat()
    ds = ds[process_index::process_count]
    return ds.map(make_example).batch(batch_per_process, drop_remainder=True)


def train_iterator(split_dir: str, seq_len: int, batch_per_process: int, seed: int,
                   process_index: int = 0, process_count: int = 1, prefetch: int = 2):
    """Prefetching `grain.DatasetIterator` over `train_dataset`; state is {"next_index": int}.

    `prefetch` batches are built ahead by as many threads (0: build each batch on `next`).
    `json.dumps(it.get_state())` round-trips; `set_state` on a fresh iterator over the same split
    and arguments resumes with exactly the batch the original would have yielded next.
    """
    import grain  # pylint: disable=g-import-not-at-top

    ds = train_dataset(split_dir, seq_len, batch_per_process, seed, process_index, process_count)
    options = grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(split_dir: str, seq_len: int, batch: int, max_batches: int) -> list[dict]:
    """The split's first rows in order, as up to `max_batches` full batches (deterministic)."""
    if batch < 1 or max_batches < 1:
        raise ValueError(f"batch and max_batches must be >= 1, got {batch}, {max_batches}")
    source = PackedSource(split_dir, seq_len)
    num_batches = min(max_batches, len(source) // batch)
    if num_batches == 0:
        raise DataError(f"{split_dir}: {len(source)} rows of seq_len={seq_len}, fewer than one "
                        f"eval batch of {batch}")
    batches = []
    for b in range(num_batches):
        examples = [make_example(source[i]) for i in range(b * batch, (b + 1) * batch)]
        batches.append({k: np.stack([e[k] for e in examples]) for k in examples[0]})
    return batches
