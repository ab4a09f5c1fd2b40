"""The default corpus that exists on every machine: the Python standard library's own `.py` files.

Each file is one document, byte-tokenized. A file's split depends only on its relative path
(crc32), so train and eval never share a file and the split is the same on every machine with the
same Python. Test suites (`test/`, `tests/`, `idle_test/`) are left out: they are ~60% of the
library's bytes yet mostly repetitive assertions and deliberately odd inputs (bad encodings, syntax
errors), and dropping them halves the build time; the ~12 MB that remain are far more than a CPU
run consumes. The build goes to a temp dir that is renamed into place, and each split's meta.json
records the settings, so an interrupted or differently-configured build is never mistaken for a
cache hit. A rebuild replaces only a cache of its own: a directory holding anything else (a
prepared corpus, a user's files) is refused with a DataError, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib

from dsjax.data.shards import META, ShardWriter
from dsjax.errors import DataError
from dsjax.data.tokenizers import ByteTokenizer

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_CORPUS_VERSION = 1  # bump when file selection or splitting changes, to invalidate old caches


def _stdlib_files(root: str) -> list[str]:
    """Relative paths of the library's .py files, sorted so every machine lists them alike."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def _in_eval(rel_path: str, eval_fraction: float) -> bool:
    return zlib.crc32(rel_path.encode("utf-8")) / 2**32 < eval_fraction


def _settings(root: str, eval_fraction: float, max_bytes: int | None) -> dict:
    return {"kind": "python-stdlib", "version": _CORPUS_VERSION, "stdlib": root,
            "python": sys.version.split()[0], "eval_fraction": eval_fraction,
            "max_bytes": max_bytes}


def _cached(cache_dir: str, settings: dict) -> bool:
    for split in ("train", "eval"):
        try:
            with open(os.path.join(cache_dir, split, META)) as f:
                if json.load(f).get("corpus") != settings:
                    return False
        except (OSError, ValueError):
            return False
    return True


def _is_stdlib_split(split_dir: str) -> bool:
    try:
        with open(os.path.join(split_dir, META)) as f:
            return (json.load(f).get("corpus") or {}).get("kind") == "python-stdlib"
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(cache_dir: str) -> None:
    """Refuses, before anything is written, a `cache_dir` that holds anything but a stdlib
    corpus cache: a rebuild replaces `train/` and `eval/`, and only ours may be replaced."""
    if not os.path.isdir(cache_dir):
        if os.path.exists(cache_dir):
            raise DataError(f"data.path: {cache_dir} is a file, not a directory for the stdlib "
                            f"corpus cache (data.source='stdlib')")
        return
    for name in sorted(os.listdir(cache_dir)):
        path = os.path.join(cache_dir, name)
        if name.startswith(".build-") or (name in ("train", "eval") and _is_stdlib_split(path)):
            continue  # an interrupted build of ours, or a cache of ours
        what = ("a prepared corpus" if name in ("train", "eval") and
                os.path.isfile(os.path.join(path, META)) else "files dsjax did not write")
        raise DataError(f"data.path: {cache_dir} holds {what} ({name}), not a stdlib corpus "
                        f"cache; dsjax does not overwrite it. To train on a prepared corpus set "
                        f"data.source='prepared'; for the stdlib corpus point data.path at an "
                        f"empty or new directory")


def build_stdlib_corpus(cache_dir: str, eval_fraction: float = 0.05,
                        max_bytes: int | None = None) -> tuple[str, str]:
    """Writes (or reuses) `cache_dir/train` and `cache_dir/eval`; returns their paths.

    `max_bytes` caps the source bytes used; files are then taken in a stable pseudo-random order,
    so a small cap still samples the whole library rather than its alphabetical head.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    root = sysconfig.get_paths()["stdlib"]
    settings = _settings(root, eval_fraction, max_bytes)
    train_dir, eval_dir = os.path.join(cache_dir, "train"), os.path.join(cache_dir, "eval")
    if _cached(cache_dir, settings):
        return train_dir, eval_dir
    check_replaceable(cache_dir)

    files = _stdlib_files(root)
    if max_bytes is not None:
        sample_order = sorted(
            files, key=lambda p: hashlib.blake2b(p.encode(), digest_size=8).digest())
        chosen, total = set(), 0
        for rel in sample_order:
            size = os.path.getsize(os.path.join(root, rel))
            if total + size <= max_bytes:
                chosen.add(rel)
                total += size
        files = [f for f in files if f in chosen]
    texts = {}
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            texts[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few files are latin-1 on purpose; the byte tokenizer wants real UTF-8 text
    eval_files = [rel for rel in texts if _in_eval(rel, eval_fraction)]
    if not eval_files and len(texts) >= 2:
        # A tiny max_bytes can leave eval empty; promote the file whose hash is closest to the cut.
        eval_files = [min(texts, key=lambda rel: zlib.crc32(rel.encode("utf-8")))]
    eval_set = set(eval_files)
    train_files = [rel for rel in texts if rel not in eval_set]
    if not train_files or not eval_files:
        raise ValueError(
            f"stdlib corpus at {root}: too few files ({len(texts)}) for max_bytes={max_bytes}")

    os.makedirs(cache_dir, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix=".build-", dir=cache_dir)
    try:
        metas = {}
        for split, split_files in (("train", train_files), ("eval", eval_files)):
            writer = ShardWriter(os.path.join(build_dir, split), ByteTokenizer(),
                                 extra_meta={"corpus": settings})
            for rel in split_files:
                writer.add(texts[rel])
            metas[split] = writer.close()
        for split, final in (("train", train_dir), ("eval", eval_dir)):
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(os.path.join(build_dir, split), final)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    print(f"stdlib corpus {cache_dir}: train {len(train_files)} files / "
          f"{metas['train']['num_bytes']} bytes, eval {len(eval_files)} files / "
          f"{metas['eval']['num_bytes']} bytes", flush=True)
    return train_dir, eval_dir
