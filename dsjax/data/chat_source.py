"""Chat (SFT) and preference (DPO) splits on disk, their writer, and the Grain source that packs
whole examples into rows.

A split directory holds tokenized examples, each whole inside one shard:

  meta.json          {"format": "dsjax-chat-v1" | "dsjax-preference-v1", "tokenizer",
                      "vocab_size", "dtype", "num_tokens", "num_docs" (sequences),
                      "num_examples", "num_target_tokens", "max_example_tokens", "seq_len" (the
                      one prepare checked lengths against), "shards": [{"tokens", "doc_starts",
                      "mask", "num_tokens"}, ...], ...}   (written last)
  tokens-00000.npy   1-D uint16/uint32: the sequences back to back (the template's eos is part
                     of the text, so nothing is appended)
  docs-00000.npy     1-D int64: where each sequence starts
  mask-00000.npy     1-D uint8, beside the tokens: 1 on the tokens the loss trains (the replies)

A chat example is one sequence (a conversation); a preference example is a pair, two sequences
in a row: prompt + chosen reply, then prompt + rejected reply.

`ChatSource` packs examples greedily, in order, into rows of seq_len + 1 tokens; an example never
crosses a row, and the rest of a row is padding (token 0, segment 0, mask False). Segments number
the sequences in a row 1, 2, 3, ...: in a preference row, segments 2j-1 (chosen) and 2j
(rejected) are pair j.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.shards import META, read_split_meta, token_dtype, write_meta

CHAT_FORMAT = "dsjax-chat-v1"
PREFERENCE_FORMAT = "dsjax-preference-v1"
SEQUENCES = {CHAT_FORMAT: 1, PREFERENCE_FORMAT: 2}  # sequences per example
_PREPARE = {CHAT_FORMAT: "python -m dsjax.data.prepare --format chat",
            PREFERENCE_FORMAT: "python -m dsjax.data.prepare --format preference"}


def split_format(split_dir: str) -> str | None:
    """The format meta.json names (None when it is absent or unreadable)."""
    try:
        with open(os.path.join(split_dir, META), encoding="utf-8") as f:
            return json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        return None


class ExampleWriter:
    """Appends examples (lists of (ids, mask) sequences) to a split directory; a shard is cut
    before the example that would take it past `shard_tokens`, so examples stay whole."""

    def __init__(self, out_dir: str, fmt: str, tokenizer, seq_len: int,
                 shard_tokens: int = 2**24, extra_meta: dict | None = None):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.out_dir, self.fmt, self.shard_tokens = out_dir, fmt, int(shard_tokens)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self._meta = {"format": fmt, "tokenizer": tokenizer.name,
                      "vocab_size": int(tokenizer.vocab_size), "dtype": self.dtype.name,
                      "seq_len": int(seq_len), **(extra_meta or {})}
        os.makedirs(out_dir, exist_ok=True)
        # A rewrite must not look complete until it is: the old meta goes first, then old shards.
        stale = [os.path.join(out_dir, META)] + sorted(
            p for kind in ("tokens", "docs", "mask")
            for p in glob.glob(os.path.join(out_dir, f"{kind}-*.npy")))
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
        self._ids, self._masks, self._starts, self._count = [], [], [], 0
        self._shards: list[dict] = []
        self._num_examples = self._num_docs = self._num_tokens = self._targets = 0
        self._longest = 0

    def add(self, sequences) -> None:
        length = sum(int(ids.size) for ids, _ in sequences)
        if self._count and self._count + length > self.shard_tokens:
            self._write_shard()
        for ids, mask in sequences:
            self._starts.append(self._count)
            self._ids.append(np.asarray(ids).astype(self.dtype))
            self._masks.append(np.asarray(mask).astype(np.uint8))
            self._count += int(ids.size)
            self._targets += int(np.count_nonzero(mask))
        self._num_examples += 1
        self._num_docs += len(sequences)
        self._longest = max(self._longest, length)

    def _write_shard(self) -> None:
        index = len(self._shards)
        names = {"tokens": f"tokens-{index:05d}.npy", "doc_starts": f"docs-{index:05d}.npy",
                 "mask": f"mask-{index:05d}.npy"}
        # Plain saves: the directory counts as incomplete until meta.json, written last, names them.
        arrays = {"tokens": np.concatenate(self._ids), "mask": np.concatenate(self._masks),
                  "doc_starts": np.asarray(self._starts, np.int64)}
        for key, name in names.items():
            np.save(os.path.join(self.out_dir, name), arrays[key])
        self._shards.append({**names, "num_tokens": self._count})
        self._num_tokens += self._count
        self._ids, self._masks, self._starts, self._count = [], [], [], 0

    def close(self) -> dict:
        """Writes the last shard, then meta.json (renamed into place, so it appears whole)."""
        if self._count:
            self._write_shard()
        return write_meta(self.out_dir, {
            **self._meta, "num_tokens": self._num_tokens, "num_docs": self._num_docs,
            "num_examples": self._num_examples, "num_target_tokens": self._targets,
            "max_example_tokens": self._longest, "shards": self._shards})


def read_chat_meta(split_dir: str) -> dict:
    """meta.json of a chat or preference split, checked; DataError naming what is wrong."""
    fmt = split_format(split_dir)
    if fmt not in SEQUENCES:
        fmt = CHAT_FORMAT  # read_split_meta names the format found and the one expected
    return read_split_meta(split_dir, fmt, ("vocab_size", "dtype", "num_tokens", "num_examples",
                                            "max_example_tokens", "seq_len", "shards"),
                           _PREPARE[fmt])


def check_fits(meta: dict, split_dir: str, seq_len: int) -> None:
    """A split prepared for a longer seq_len may hold examples a row of `seq_len` cannot."""
    longest = int(meta["max_example_tokens"])
    if longest > seq_len + 1:
        what = "pair" if meta["format"] == PREFERENCE_FORMAT else "example"
        raise DataError(
            f"{split_dir}: its longest {what} is {longest} tokens, more than a row of "
            f"data.seq_len={seq_len} holds ({seq_len + 1}); it was prepared for --seq_len "
            f"{meta['seq_len']}. Prepare it again with --seq_len {seq_len} (longer examples are "
            f"then skipped), or raise data.seq_len")


class ChatSource:
    """Grain random-access source over a chat or preference split: row i -> {"tokens",
    "segment_ids" (int32), "target_mask" (bool)}, each [seq_len + 1], whole examples packed.

    Checked once at construction (each failure a `DataError` naming the file); shards are
    memory-mapped.
    """

    def __init__(self, split_dir: str, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split_dir, self.seq_len = split_dir, int(seq_len)
        self.meta = read_chat_meta(split_dir)
        check_fits(self.meta, split_dir, self.seq_len)
        self._open(validate=True)

    @property
    def kind(self) -> str:
        return "preference" if self.meta["format"] == PREFERENCE_FORMAT else "chat"

    def _open(self, validate: bool) -> None:
        group = SEQUENCES[self.meta["format"]]
        self._tokens, self._starts, self._masks, rows = [], [], [], []
        for s, shard in enumerate(self.meta["shards"]):
            tokens, starts, mask = self._load(shard)
            if validate:
                self._check_shard(shard, tokens, starts, mask, group)
            self._tokens.append(tokens)
            self._starts.append(starts)
            self._masks.append(mask)
            rows.extend(self._pack(s, starts[::group], tokens.size))
        if validate and not rows:
            raise DataError(f"{self.split_dir}: holds no examples")
        self._rows = np.asarray(rows, np.int64).reshape(-1, 3)  # (shard, begin, end)

    def _load(self, shard: dict):
        arrays = []
        for key in ("tokens", "doc_starts", "mask"):
            path = os.path.join(self.split_dir, str(shard.get(key)))
            if key not in shard or not os.path.isfile(path):
                raise DataError(f"{path}: shard file listed in {META} is missing")
            try:
                arrays.append(np.load(path, mmap_mode=None if key == "doc_starts" else "r"))
            except (ValueError, OSError, EOFError) as e:  # EOFError: an empty (0-byte) file
                raise DataError(f"{path}: cannot read shard ({e or type(e).__name__})") from None
        return arrays

    def _check_shard(self, shard, tokens, starts, mask, group) -> None:
        where = os.path.join(self.split_dir, shard["tokens"])
        dtype, vocab_size = np.dtype(self.meta["dtype"]), int(self.meta["vocab_size"])
        if tokens.ndim != 1 or tokens.dtype != dtype or tokens.size != shard["num_tokens"]:
            raise DataError(f"{where}: expected {shard['num_tokens']} {dtype.name} tokens "
                            f"({META}), found shape {tokens.shape} {tokens.dtype.name}")
        if tokens.size and int(tokens.max()) >= vocab_size:
            bad = int(np.argmax(tokens >= vocab_size))
            raise DataError(f"{where}: token id {int(tokens[bad])} at offset {bad} is >= "
                            f"vocab_size {vocab_size}")
        if mask.shape != tokens.shape or mask.dtype != np.uint8:
            raise DataError(f"{os.path.join(self.split_dir, shard['mask'])}: expected a uint8 "
                            f"mask of {tokens.size} entries, found shape {mask.shape} "
                            f"{mask.dtype.name}")
        starts_path = os.path.join(self.split_dir, shard["doc_starts"])
        if (starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer) or not starts.size
                or starts[0] != 0 or starts[-1] >= tokens.size or np.any(np.diff(starts) <= 0)
                or starts.size % group):
            raise DataError(f"{starts_path}: sequence offsets must start at 0, increase, stay "
                            f"inside [0, {tokens.size}) and come {group} per example")

    def _pack(self, shard: int, example_starts: np.ndarray, size: int) -> list[tuple]:
        """Greedy, in order: an example opens a new row when it does not fit the current one."""
        bounds = example_starts.tolist() + [int(size)]
        length, rows, begin = self.seq_len + 1, [], bounds[0]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end - start > length:  # meta.json's max_example_tokens said otherwise
                raise DataError(f"{self.split_dir}: an example of {end - start} tokens in shard "
                                f"{shard} does not fit a row of {length}; prepare it again")
            if end - begin > length:
                rows.append((shard, begin, start))
                begin = start
        rows.append((shard, begin, bounds[-1]))
        return rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < len(self._rows):
            raise IndexError(f"row {index} out of range for {len(self._rows)} rows")
        shard, begin, end = (int(v) for v in self._rows[index])
        length, n = self.seq_len + 1, end - begin
        tokens = np.zeros(length, np.int32)
        tokens[:n] = self._tokens[shard][begin:end]
        mask = np.zeros(length, bool)
        mask[:n] = self._masks[shard][begin:end] != 0
        starts = self._starts[shard]
        opens = np.zeros(length, np.int32)
        lo, hi = np.searchsorted(starts, [begin, end])
        opens[starts[lo:hi] - begin] = 1
        segments = np.cumsum(opens, dtype=np.int32)
        segments[n:] = 0
        return {"tokens": tokens, "segment_ids": segments, "target_mask": mask}

    def __repr__(self) -> str:
        return (f"ChatSource({self.split_dir!r}, seq_len={self.seq_len}, kind={self.kind}, "
                f"rows={len(self._rows)})")

    # Grain may pickle the source into worker processes: ship the path, reopen the mmaps there.
    def __getstate__(self) -> dict:
        return {"split_dir": self.split_dir, "seq_len": self.seq_len, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open(validate=False)
