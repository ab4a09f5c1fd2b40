"""Where a run's train and held-out token shards are: the stdlib corpus (built once, in a cache
directory) or a prepared corpus (`python -m dsjax.data.prepare`), checked before training."""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from dsjax.config import Config
from dsjax.data.stdlib_corpus import build_stdlib_corpus
from dsjax.errors import DataError


@dataclasses.dataclass(frozen=True)
class Splits:
    train: str
    eval: str
    tokenizer: str


def data_splits(cfg: Config, workdir: str) -> Splits:
    """The train and held-out split directories for `cfg.data` (builds the stdlib corpus once)."""
    if cfg.data.source == "stdlib":
        if cfg.data.tokenizer != "byte":
            raise DataError("data.tokenizer: the stdlib corpus is byte-tokenized; use 'byte'")
        cache = cfg.data.path or os.path.join(workdir, "data", "stdlib")
        if jax.process_count() > 1:
            # One writer: process 0 builds the cache, the others wait for it and then read it.
            from jax.experimental import multihost_utils
            if jax.process_index() == 0:
                build_stdlib_corpus(cache)
            multihost_utils.sync_global_devices("dsjax stdlib corpus")
        train, held_out = build_stdlib_corpus(cache)
        return Splits(train, held_out, "byte")
    train, held_out = os.path.join(cfg.data.path, "train"), os.path.join(cfg.data.path, "eval")
    for split in (train, held_out):
        if not os.path.isfile(os.path.join(split, "meta.json")):
            raise DataError(f"data.path: {split} is not a prepared split (no meta.json); run "
                            f"`python -m dsjax.data.prepare --out {cfg.data.path} ...`")
    with open(os.path.join(train, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise DataError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's "
                        f"tokenizer vocabulary {meta['vocab_size']} ({train}/meta.json)")
    return Splits(train, held_out, meta["tokenizer"])
