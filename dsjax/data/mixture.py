"""Several prepared sources mixed by weight into one resumable training stream, and held-out
batches per source.

`"text:0.5,image:0.3,video:0.2"` names each source and its share of training rows. The mixed
stream is random access by global sample index, so `SampleStream`'s cursor (its whole state)
resumes it exactly: the stream is cut into blocks of `BLOCK` samples, each block holds exactly
round(weight * BLOCK) samples of each source (largest remainders, so the counts sum to BLOCK) in
an order drawn from (seed, block). Sample i of block b that is the r-th of source k in its block
is row b * count_k + r of source k's own stream: its rows shuffled per epoch and repeated, like a
single-source stream. Proportions are therefore exact per block (to 1 / BLOCK), not only on
average, and no sample index depends on the ones read before it.

Text splits (`shards`) and multimodal splits (`multimodal.shards`) mix alike: when any source is
multimodal, every example carries pixels and image_mask, zeros and all-False for text rows (and
with tiling, `max_tiles` > 0, feature_index zeros), so all rows have the same keys and shapes.
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

import numpy as np

from dsjax.config.validate import mix_weights
from dsjax.errors import DataError
from dsjax.data.multimodal.pack import MultimodalSource
from dsjax.data.multimodal.shards import is_multimodal
from dsjax.data.stream import SampleStream, make_example, open_split

BLOCK = 1000  # samples per block; the mixture's proportions are exact to 1 / BLOCK per block


def parse_mix(spec: str) -> dict[str, float]:
    """`"name:weight,..."` (`data.mix`, parsed by the config's one rule) -> {name: weight / sum},
    in the order given."""
    weights = mix_weights(spec)
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def block_counts(weights: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Samples of each source per block: floor(w * block), plus one for the largest remainders."""
    exact = np.asarray(weights, np.float64) * block
    counts = np.floor(exact).astype(np.int64)
    short = block - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class MixedIndex:
    """Global sample index -> (source, index in that source's stream); pure arithmetic."""

    def __init__(self, weights, seed: int, block: int = BLOCK):
        self.counts = block_counts(np.asarray(weights), block)
        if np.any(self.counts == 0):
            raise DataError(f"a mixture weight below 1/{block} gets no samples: {list(weights)}")
        self.block, self.seed = int(block), int(seed)
        self._labels = np.repeat(np.arange(self.counts.size), self.counts)
        self._cached = (-1, None, None)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._cached  # one read: Grain's reader threads share this object
        if cached[0] != b:
            labels = np.random.default_rng([self.seed, b]).permutation(self._labels)
            ranks = np.empty(self.block, np.int64)
            for k in range(self.counts.size):  # rank of each position among its source's
                ranks[labels == k] = np.arange(self.counts[k])
            cached = self._cached = (b, labels, ranks)
        return cached[1], cached[2]

    def __call__(self, index: int) -> tuple[int, int]:
        b, offset = divmod(int(index), self.block)
        labels, ranks = self._block(b)
        k = int(labels[offset])
        return k, b * int(self.counts[k]) + int(ranks[offset])


class _MixedRows:
    """Random-access source over the infinite mixed stream of examples (Grain reads it)."""

    def __init__(self, streams, index: MixedIndex, pad):
        self._streams, self._index, self._pad = streams, index, pad

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        k, j = self._index(index)
        return self._pad(make_example(self._streams[k][j]))


def open_source(split_dir: str, seq_len: int, tokens_per_image: int, max_images: int,
                image_size: int, max_tiles: int = 0):
    """`MultimodalSource` for a multimodal split, else what `stream.open_split` opens (text,
    chat, preference)."""
    if is_multimodal(split_dir):
        return MultimodalSource(split_dir, seq_len, tokens_per_image, max_images, image_size,
                                max_tiles)
    return open_split(split_dir, seq_len)


def _open_all(paths_by_name: Mapping[str, str], seq_len, tokens_per_image, max_images,
              image_size, max_tiles) -> tuple[dict, Callable]:
    """The sources, and the function that gives a text example empty image slots (and, tiled,
    feature indices) when the model reads images (`image_size` > 0) or another source has them."""
    sources = {name: open_source(path, seq_len, tokens_per_image, max_images, image_size,
                                 max_tiles)
               for name, path in paths_by_name.items()}
    tokenizers = {name: s.meta["tokenizer"] for name, s in sources.items()}
    if len(set(tokenizers.values())) > 1:
        raise DataError(f"data mix: sources use different tokenizers {tokenizers}")
    if not image_size and not any(isinstance(s, MultimodalSource) for s in sources.values()):
        return sources, lambda example: example  # a text model on text: no image slots

    def pad(example):
        if "pixels" not in example:
            example["pixels"] = np.zeros((max_images, image_size, image_size, 3), np.uint8)
            example["image_mask"] = np.zeros(max_images, bool)
            if max_tiles:
                example["feature_index"] = np.zeros(seq_len, np.int32)
        return example
    return sources, pad


def mixed_dataset(paths_by_name: Mapping[str, str], weights: Mapping[str, float] | str,
                  seq_len: int, seed: int, tokens_per_image: int = 1, max_images: int = 1,
                  image_size: int = 0, process_index: int = 0, process_count: int = 1,
                  max_tiles: int = 0):
    """Infinite `grain.MapDataset` of this process's examples: mixed items p, p+P, ... ."""
    import grain  # pylint: disable=g-import-not-at-top

    if isinstance(weights, str):
        weights = parse_mix(weights)
    if set(weights) != set(paths_by_name):
        raise DataError(f"data mix names {sorted(weights)} but the sources are "
                        f"{sorted(paths_by_name)}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    names = list(weights)
    sources, pad = _open_all({n: paths_by_name[n] for n in names}, seq_len, tokens_per_image,
                             max_images, image_size, max_tiles)
    streams = []
    for k, name in enumerate(names):
        # Each source's own seed, so adding a source does not reshuffle the others.
        source_seed = int(np.random.SeedSequence([int(seed), k]).generate_state(1)[0])
        streams.append(grain.MapDataset.source(sources[name]).shuffle(seed=source_seed).repeat())
    total = sum(weights.values())
    index = MixedIndex([weights[n] / total for n in names], seed)
    ds = grain.MapDataset.source(_MixedRows(streams, index, pad))
    return ds[process_index::process_count]


def mixed_stream(paths_by_name: Mapping[str, str], weights: Mapping[str, float] | str,
                 seq_len: int, seed: int, tokens_per_image: int = 1, max_images: int = 1,
                 image_size: int = 0, process_index: int = 0, process_count: int = 1,
                 prefetch: int = 2, prefetch_rows: int = 64, max_tiles: int = 0) -> SampleStream:
    """The mixed training stream read by a global sample cursor (take / get_state / set_state).

    `paths_by_name`: prepared split directories (text or multimodal); `image_size` and
    `max_tiles` (0: untiled): the model's, checked against every multimodal split.
    """
    ds = mixed_dataset(paths_by_name, weights, seq_len, seed, tokens_per_image, max_images,
                       image_size, process_index, process_count, max_tiles)
    return SampleStream.over(ds, process_count, prefetch, prefetch_rows)


def mixed_eval_batches(paths_by_name: Mapping[str, str], seq_len: int, batch: int,
                       max_batches: int, tokens_per_image: int = 1, max_images: int = 1,
                       image_size: int = 0, max_tiles: int = 0) -> dict[str, list[dict]]:
    """Per source, its held-out split's first rows in order as up to `max_batches` full batches
    (deterministic), all with the same keys, so eval loss can be reported per source."""
    if batch < 1 or max_batches < 1:
        raise ValueError(f"batch and max_batches must be >= 1, got {batch}, {max_batches}")
    sources, pad = _open_all(paths_by_name, seq_len, tokens_per_image, max_images, image_size,
                             max_tiles)
    out = {}
    for name, source in sources.items():
        num_batches = min(max_batches, len(source) // batch)
        if num_batches == 0:
            raise DataError(f"{paths_by_name[name]}: {len(source)} rows of seq_len={seq_len}, "
                            f"fewer than one eval batch of {batch}")
        out[name] = []
        for b in range(num_batches):
            rows = [pad(make_example(source[i])) for i in range(b * batch, (b + 1) * batch)]
            out[name].append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return out
