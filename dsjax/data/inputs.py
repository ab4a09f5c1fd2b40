"""Input files of the prepare tool, and the seeded content hash that assigns documents to splits
(the same content always lands in the same split, so duplicates cannot leak from train into
eval)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Iterator, Sequence

from dsjax.errors import DataError


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files, directories (recursively; hidden files skipped) and globs -> sorted file paths."""
    files = []
    for spec in inputs:
        if glob.has_magic(spec):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"{spec}: no files match")
            files.extend(matches)
        elif os.path.isdir(spec):
            found = []
            for dirpath, dirnames, filenames in os.walk(spec):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found.extend(os.path.join(dirpath, n) for n in filenames if not n.startswith("."))
            if not found:
                raise DataError(f"{spec}: directory has no input files")
            files.extend(sorted(found))
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise DataError(f"{spec}: input file not found")
    return files


def eval_score(text: str, seed: int) -> float:
    """Stable, seeded hash of a document's content, uniform in [0, 1)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Existing train/eval splits in `out_dir` are a DataError unless `overwrite`."""
    existing = [os.path.join(out_dir, split) for split in ("train", "eval")
                if os.path.exists(os.path.join(out_dir, split))]
    if existing and not overwrite:
        raise DataError(f"--out {out_dir}: {' and '.join(existing)} exist already; nothing was "
                        f"written. Pass --overwrite to replace them, or choose another --out")


def jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    """("file:line", JSON object) for every non-blank line; a bad line is a DataError naming it."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
