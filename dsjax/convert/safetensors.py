"""A small, lazy safetensors reader and a streaming, sharded writer (numpy + ml_dtypes only).

The one idea: a safetensors file is an 8-byte little-endian header length, a JSON header mapping
each tensor name to its dtype, shape and byte range, then the raw bytes. So the reader parses only
the header and memory-maps the file: `read(name)` is a read-only view whose pages the OS brings in
when touched and may drop again, so a converter holds one tensor in anonymous memory at a time.
bfloat16 is viewed through `ml_dtypes.bfloat16` (the `safetensors` numpy backend cannot produce it).
The writer lays out each shard's header from names, shapes and dtypes alone, then asks for the
tensors one by one, in order, so it never holds more than one either.
Nothing here ever unpickles: a file that is not safetensors fails on its header.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
import sys
from typing import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from dsjax.errors import SafetensorsError

# safetensors dtype tag -> numpy dtype (little-endian; `_check_host` refuses big-endian hosts).
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # DeepSeek-V3's released weights (block-scaled)
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
TAGS = {dtype: tag for tag, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit; anything larger is not a header
INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".bin.index.json")


def _check_host() -> None:
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors is little-endian; this host is big-endian")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    file: str


class SafetensorsFile:
    """One .safetensors file: its header parsed eagerly, its tensors mapped lazily."""

    def __init__(self, path: str):
        _check_host()
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{path}: not a safetensors file (header length {n} does "
                                       f"not fit a {size}-byte file; a renamed pickle?)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: not a safetensors file (header is not JSON: {e})"
                                   ) from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: not a safetensors file (header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_bytes = size - self._data_start
        self._entries: dict[str, tuple[TensorInfo, int, int]] = {}
        for name, entry in header.items():
            try:
                tag, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), \
                    entry["data_offsets"]
            except (TypeError, KeyError, ValueError):
                raise SafetensorsError(f"{path}: tensor {name}: malformed header entry {entry!r}"
                                       ) from None
            if tag not in DTYPES:
                raise SafetensorsError(f"{path}: tensor {name}: unsupported dtype {tag!r}")
            want = math.prod(shape) * DTYPES[tag].itemsize
            if not 0 <= begin <= end <= data_bytes or end - begin != want:
                raise SafetensorsError(f"{path}: tensor {name}: byte range [{begin}, {end}) does "
                                       f"not hold {tag} {list(shape)} in {data_bytes} data bytes "
                                       "(truncated or corrupt file)")
            self._entries[name] = (TensorInfo(name, tag, shape, path), begin, end)

    def infos(self) -> list[TensorInfo]:
        return [info for info, _, _ in self._entries.values()]

    def read(self, name: str) -> np.ndarray:
        """A read-only array mapped from the file (copy it to keep it). Each tensor gets its own
        mapping, released with the array, so pages already read do not pile up in the process."""
        info, begin, end = self._entries[name]
        dtype = DTYPES[info.dtype]
        if begin == end:  # mmap cannot map zero bytes
            return np.zeros(info.shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin,
                         shape=info.shape)


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face weights directory: one file, several, or an index's shards."""

    def __init__(self, files: Sequence[str]):
        self.files = [SafetensorsFile(p) for p in files]
        self.tensors: dict[str, TensorInfo] = {}
        self._owner: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for info in f.infos():
                if info.name in self.tensors:
                    raise SafetensorsError(f"tensor {info.name} appears twice: in "
                                           f"{self.tensors[info.name].file} and {f.path}")
                self.tensors[info.name] = info
                self._owner[info.name] = f

    @classmethod
    def from_index(cls, index_path: str) -> "SafetensorsCheckpoint":
        """Opens the shards an index names and checks that each holds the tensors it claims."""
        directory = os.path.dirname(index_path)
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SafetensorsError(f"{index_path}: not a safetensors index (needs a "
                                   f"'weight_map' object): {e}") from None
        for name in files:
            if not name.endswith(".safetensors"):
                raise SafetensorsError(f"{index_path}: shard {name!r} is not a .safetensors file")
            if not os.path.isfile(os.path.join(directory, name)):
                raise SafetensorsError(f"{index_path}: shard {name} is missing")
        ckpt = cls([os.path.join(directory, name) for name in files])
        for tensor, shard in weight_map.items():
            where = ckpt.tensors.get(tensor)
            if where is None or os.path.basename(where.file) != shard:
                raise SafetensorsError(f"{index_path}: tensor {tensor} is not in {shard}")
        unindexed = sorted(set(ckpt.tensors) - set(weight_map))
        if unindexed:
            raise SafetensorsError(f"{index_path}: tensor {unindexed[0]} is in "
                                   f"{ckpt.tensors[unindexed[0]].file} but not in the index")
        return ckpt

    def read(self, name: str) -> np.ndarray:
        return self._owner[name].read(name)


def open_directory(directory: str) -> SafetensorsCheckpoint:
    """A Hugging Face weights directory: its index's shards, or its one .safetensors file.
    Pickle checkpoints (pytorch_model.bin, ...) are refused by name and never opened: unpickling
    runs arbitrary code."""
    indexes = sorted(glob.glob(os.path.join(directory, "*.safetensors.index.json")))
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not indexes and not files:
        pickles = sorted(p for p in os.listdir(directory) if p.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise SafetensorsError(
                f"{os.path.join(directory, pickles[0])}: a pickle (torch.save) checkpoint; dsjax "
                "never unpickles weights (that can run arbitrary code). Re-save it as "
                "safetensors where you trust it: model.save_pretrained(dir, "
                "safe_serialization=True)")
        raise SafetensorsError(f"{directory}: no *.safetensors weights found")
    if len(indexes) > 1:
        raise SafetensorsError(f"{directory}: several safetensors indexes: {', '.join(indexes)}")
    if indexes:
        return SafetensorsCheckpoint.from_index(indexes[0])
    if len(files) > 1:
        raise SafetensorsError(f"{directory}: {len(files)} .safetensors files but no {INDEX_NAME}")
    return SafetensorsCheckpoint(files)


# ---------------------------------------------------------------------------------------------
# Writing


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000' -> bytes (GB is 10**9, as in `save_pretrained`)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    digits = s.rstrip("KMGTIB")
    try:
        value = float(digits)
        return int(value * units[s[len(digits):]])
    except (ValueError, KeyError):
        raise SafetensorsError(f"--max_shard_size: cannot read {text!r} as a size (e.g. 5GB)"
                               ) from None


def plan_shards(specs: Sequence[tuple[str, tuple[int, ...], str]], max_shard_bytes: int
                ) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Greedy, order-preserving split of (name, shape, tag) into shards of at most the given size
    (a tensor larger than that gets a shard of its own)."""
    shards: list[list] = [[]]
    used = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * DTYPES[spec[2]].itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


def _write_file(path: str, specs: Sequence[tuple[str, tuple[int, ...], str]],
                produce: Callable[[str], np.ndarray]) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers requires the "pt" tag
    offset = 0
    for name, shape, tag in specs:
        nbytes = math.prod(shape) * DTYPES[tag].itemsize
        header[name] = {"dtype": tag, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, tag in specs:
            array = np.ascontiguousarray(produce(name))
            if array.shape != tuple(shape) or array.dtype != DTYPES[tag]:
                raise SafetensorsError(f"{path}: tensor {name} came out {array.dtype} "
                                       f"{list(array.shape)}, planned {tag} {list(shape)}")
            f.write(array.reshape(-1).view(np.uint8).data)
    return offset


def write_checkpoint(out_dir: str, specs: Iterable[tuple[str, tuple[int, ...], str]],
                     produce: Callable[[str], np.ndarray], max_shard_bytes: int) -> list[str]:
    """Writes `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`, calling `produce(name)` once per tensor in `specs` order.
    Returns the files written."""
    _check_host()
    shards = plan_shards(list(specs), max_shard_bytes)
    if len(shards) == 1:
        _write_file(os.path.join(out_dir, "model.safetensors"), shards[0], produce)
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total, weight_map = 0, {}
    for name, shard in zip(names, shards):
        total += _write_file(os.path.join(out_dir, name), shard, produce)
        weight_map.update({spec[0]: name for spec in shard})
    with open(os.path.join(out_dir, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return names + [INDEX_NAME]
