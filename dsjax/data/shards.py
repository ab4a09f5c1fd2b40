"""The on-disk token format, its writer, and the Grain data source that packs it into rows.

A split directory is a tokenized *document stream*, not a set of training rows:

  meta.json           {"format": "dsjax-tokens-v1", "tokenizer", "vocab_size", "dtype",
                       "num_tokens", "num_docs", "num_bytes", "shards": [{"tokens", "doc_starts",
                       "num_tokens"}, ...]}   (written last: a directory without it is incomplete)
  tokens-00000.npy    1-D uint16/uint32: each document's tokens followed by eos (if the tokenizer
                      has one), documents back to back; a long document may continue into the
                      next shard
  docs-00000.npy      1-D int64: offsets in this shard where a document starts

Packing happens at read time, so one prepared corpus serves every `seq_len`. `PackedSource` row i
is the window `tokens[i*seq_len : i*seq_len + seq_len + 1]` of one shard: consecutive rows share
one token, so every token after a shard's first is a prediction target exactly once (what eval
bits-per-byte needs). Rows never span shards; a shard's tail shorter than a row is dropped.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from dsjax.errors import DataError

FORMAT = "dsjax-tokens-v1"
META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def _save_npy(path: str, array: np.ndarray) -> None:
    # np.save appends ".npy" to names that lack it, so the temp name must end in ".npy" too.
    tmp = path + ".tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents to a split directory, cutting shards of exactly `shard_tokens` tokens.

    `extra_meta` entries are stored in meta.json beside the format keys (e.g. how the split was
    built, so a cache can tell whether it is stale). Empty documents are skipped.
    """

    def __init__(self, out_dir: str, tokenizer, shard_tokens: int = 2**24,
                 extra_meta: dict | None = None):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.shard_tokens = int(shard_tokens)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self._extra = dict(extra_meta or {})
        os.makedirs(out_dir, exist_ok=True)
        # A rewrite must not look complete until it is: drop the old meta first, then old shards.
        old_shards = sorted(glob.glob(os.path.join(out_dir, "tokens-*.npy"))
                            + glob.glob(os.path.join(out_dir, "docs-*.npy")))
        for stale in [os.path.join(out_dir, META)] + old_shards:
            if os.path.exists(stale):
                os.remove(stale)
        self._pending: list[np.ndarray] = []  # token arrays not yet in a shard
        self._pending_starts: list[int] = []  # doc starts relative to the first pending token
        self._pending_count = 0
        self._shards: list[dict] = []
        self._num_tokens = self._num_docs = self._num_bytes = 0
        self._closed = False

    def add(self, text: str) -> None:
        if self._closed:
            raise RuntimeError("ShardWriter.add after close")
        if not text:
            return
        ids = self.tokenizer.encode(text)
        if self.tokenizer.eos_id is not None:
            ids = np.append(ids, np.int32(self.tokenizer.eos_id))
        if ids.size == 0:
            return
        self._pending.append(ids.astype(self.dtype))
        self._pending_starts.append(self._pending_count)
        self._pending_count += ids.size
        self._num_docs += 1
        self._num_bytes += len(text.encode("utf-8"))
        if self._pending_count >= self.shard_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        tokens = np.concatenate(self._pending) if self._pending else np.zeros(0, self.dtype)
        starts = np.asarray(self._pending_starts, dtype=np.int64)
        offset = 0
        while tokens.size - offset >= self.shard_tokens or (final and tokens.size > offset):
            n = min(self.shard_tokens, tokens.size - offset)
            in_shard = (starts >= offset) & (starts < offset + n)
            self._write_shard(tokens[offset:offset + n], starts[in_shard] - offset)
            offset += n
        rest = tokens[offset:]
        self._pending = [rest] if rest.size else []
        self._pending_starts = [int(s) - offset for s in starts if s >= offset]
        self._pending_count = int(rest.size)

    def _write_shard(self, tokens: np.ndarray, doc_starts: np.ndarray) -> None:
        index = len(self._shards)
        names = {"tokens": f"tokens-{index:05d}.npy", "doc_starts": f"docs-{index:05d}.npy"}
        _save_npy(os.path.join(self.out_dir, names["tokens"]), tokens)
        _save_npy(os.path.join(self.out_dir, names["doc_starts"]), doc_starts.astype(np.int64))
        self._shards.append({**names, "num_tokens": int(tokens.size)})
        self._num_tokens += int(tokens.size)

    def close(self) -> dict:
        """Writes the last shard, then meta.json (renamed into place, so it appears whole)."""
        if not self._closed:
            self._flush(final=True)
            self._closed = True
        meta = {
            "format": FORMAT,
            "tokenizer": self.tokenizer.name,
            "vocab_size": int(self.tokenizer.vocab_size),
            "dtype": self.dtype.name,
            "num_tokens": self._num_tokens,
            "num_docs": self._num_docs,
            "num_bytes": self._num_bytes,
            "shards": self._shards,
            **self._extra,
        }
        return write_meta(self.out_dir, meta)


def write_meta(out_dir: str, meta: dict) -> dict:
    """Writes meta.json last and atomically: a split directory without it is incomplete."""
    path = os.path.join(out_dir, META)
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)
    return meta


def read_split_meta(split_dir: str, fmt: str = FORMAT,
              keys: tuple[str, ...] = ("vocab_size", "dtype", "num_tokens", "shards"),
              how: str = "python -m dsjax.data.prepare") -> dict:
    """Parses and checks meta.json of a split directory of format `fmt`, which must have `keys`;
    `how`: the command that writes such a split (named in the error)."""
    path = os.path.join(split_dir, META)
    if not os.path.isdir(split_dir):
        raise DataError(f"{split_dir}: data split directory not found")
    if not os.path.isfile(path):
        raise DataError(f"{path}: missing; {split_dir} is not a prepared split "
                        f"(run `{how}`, or an earlier run was interrupted)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{path}: format is {found!r}, expected {fmt!r}")
    for key in keys:
        if key not in meta:
            raise DataError(f"{path}: missing key {key!r}")
    return meta


class PackedSource:
    """Grain random-access source: row i -> {"tokens", "segment_ids"}, int32[seq_len + 1] each.

    Segment ids number the documents inside the row 1, 2, 3, ...; a document cut by the row start
    is segment 1. Everything is checked once at construction, each failure a `DataError` naming
    the file. Shards are memory-mapped, so a worker holds only the pages it reads.
    """

    def __init__(self, split_dir: str, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split_dir = split_dir
        self.seq_len = int(seq_len)
        self.meta = read_split_meta(split_dir)
        self._open(validate=True)

    def _open(self, validate: bool) -> None:
        meta, dtype = self.meta, np.dtype(self.meta["dtype"])
        self._tokens, self._doc_starts = [], []
        for shard in meta["shards"]:
            tokens_path = os.path.join(self.split_dir, shard["tokens"])
            starts_path = os.path.join(self.split_dir, shard["doc_starts"])
            for path in (tokens_path, starts_path):
                if not os.path.isfile(path):
                    raise DataError(f"{path}: shard file listed in {META} is missing")
            try:
                tokens = np.load(tokens_path, mmap_mode="r")
                starts = np.load(starts_path)
            except (ValueError, OSError, EOFError) as e:  # EOFError: an empty (0-byte) file
                raise DataError(f"{tokens_path}: cannot read shard ({e or type(e).__name__})"
                                ) from None
            if validate:
                self._check_shard(tokens_path, tokens, starts_path, starts, shard, dtype)
            self._tokens.append(tokens)
            self._doc_starts.append(starts)
        # Row r of a shard is tokens[r*L : r*L + L + 1], so n tokens give (n - 1) // L rows.
        rows = [max(0, (t.size - 1) // self.seq_len) for t in self._tokens]
        self._row_ends = np.cumsum(rows, dtype=np.int64)
        self._num_rows = int(self._row_ends[-1]) if rows else 0
        if validate and self._num_rows == 0:
            largest = max((t.size for t in self._tokens), default=0)
            raise DataError(
                f"{self.split_dir}: too little data: {meta['num_tokens']} tokens (largest shard "
                f"{largest}), but one row of seq_len={self.seq_len} needs {self.seq_len + 1} "
                "tokens in one shard")

    def _check_shard(self, tokens_path, tokens, starts_path, starts, shard, dtype) -> None:
        if tokens.ndim != 1 or tokens.dtype != dtype:
            raise DataError(f"{tokens_path}: expected 1-D {dtype.name} tokens, "
                            f"found {tokens.ndim}-D {tokens.dtype.name}")
        if tokens.size != shard["num_tokens"]:
            raise DataError(
                f"{tokens_path}: has {tokens.size} tokens, {META} says {shard['num_tokens']}")
        vocab_size = int(self.meta["vocab_size"])
        # One pass over the mmap per open: an out-of-range id would otherwise surface as a NaN or a
        # silent clamp deep inside the embedding lookup.
        if tokens.size and int(tokens.max()) >= vocab_size:
            bad = int(np.argmax(tokens >= vocab_size))
            raise DataError(f"{tokens_path}: token id {int(tokens[bad])} at offset {bad} is >= "
                            f"vocab_size {vocab_size}")
        if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
            raise DataError(f"{starts_path}: expected 1-D integer document offsets")
        increasing = np.all(np.diff(starts) > 0)
        if starts.size and (starts[0] < 0 or starts[-1] >= tokens.size or not increasing):
            raise DataError(f"{starts_path}: document offsets must be increasing and inside "
                            f"[0, {tokens.size})")

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self._num_rows:
            raise IndexError(f"row {index} out of range for {self._num_rows} rows")
        shard = int(np.searchsorted(self._row_ends, index, side="right"))
        row = index - (int(self._row_ends[shard - 1]) if shard else 0)
        length = self.seq_len + 1
        begin = row * self.seq_len
        tokens = np.asarray(self._tokens[shard][begin:begin + length], dtype=np.int32)
        starts = self._doc_starts[shard]
        # Documents starting strictly inside the window open a new segment there.
        lo = np.searchsorted(starts, begin, side="right")
        hi = np.searchsorted(starts, begin + length, side="left")
        opens = np.zeros(length, np.int32)
        opens[starts[lo:hi] - begin] = 1
        return {"tokens": tokens, "segment_ids": 1 + np.cumsum(opens, dtype=np.int32)}

    def __repr__(self) -> str:
        return f"PackedSource({self.split_dir!r}, seq_len={self.seq_len}, rows={self._num_rows})"

    # Grain may pickle the source into worker processes: ship the path, reopen the mmaps there,
    # and skip re-validating what the parent already checked.
    def __getstate__(self) -> dict:
        return {"split_dir": self.split_dir, "seq_len": self.seq_len, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open(validate=False)
