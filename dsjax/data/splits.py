"""Where a run's train and held-out token shards are: the stdlib corpus or the arithmetic chat
task (each built once, in a cache directory) or a prepared corpus (`python -m
dsjax.data.prepare`), checked before training.

A split's kind (its meta.json format) must suit `train.task`: pretraining reads text (and
multimodal) splits, SFT chat splits, DPO preference splits."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from dsjax.config import Config, mix_weights
from dsjax.data import shards
from dsjax.data.arithmetic_chat import build_arithmetic_corpus
from dsjax.data.chat_source import CHAT_FORMAT, PREFERENCE_FORMAT, check_fits, read_chat_meta
from dsjax.data.stdlib_corpus import build_stdlib_corpus
from dsjax.data.stream import open_split
from dsjax.data.multimodal import shards as mm_shards
from dsjax.data.multimodal.vl_sources import build_vl_sources
from dsjax.errors import DataError

# meta.json format -> the split's kind; the kinds each train.task reads.
KINDS = {shards.FORMAT: "text", mm_shards.FORMAT: "multimodal", CHAT_FORMAT: "chat",
         PREFERENCE_FORMAT: "preference"}
TASK_KINDS = {"pretrain": ("text", "multimodal"), "sft": ("chat",), "dpo": ("preference",)}
_PREPARE_FOR = {"sft": "--format chat", "dpo": "--format preference"}
_TASK_FOR = {"chat": "sft", "preference": "dpo"}


@dataclasses.dataclass(frozen=True)
class Splits:
    train: str  # "" for a mixture: its sources' splits are in `sources`
    eval: str
    tokenizer: str
    sources: tuple[tuple[str, str, str], ...] = ()  # data.mix: (name, train dir, eval dir)
    kind: str = "text"  # text | multimodal | chat | preference (every source's, in a mixture)

    @property
    def mixed(self) -> bool:
        return bool(self.sources)

    @property
    def pairs(self) -> bool:
        """Rows hold preference pairs: segments 2j-1 (chosen) and 2j (rejected) are pair j."""
        return self.kind == "preference"


def prepared_max_tiles(cfg: Config) -> int:
    """The --max_tiles this config's multimodal splits are prepared (and read) with: 0 untiled."""
    return cfg.vision.max_tiles if cfg.vision.tiling else 0


def vl_root(cfg: Config, workdir: str) -> str:
    """Where data.source='vl_corpus' builds its sources (data.path, or WORKDIR/data/vl)."""
    return cfg.data.path or os.path.join(workdir, "data", "vl")


def _one_writer(build, name: str):
    """`build()` on every process, after process 0 has built (a cache) and the others waited."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        if jax.process_index() == 0:
            build()
        multihost_utils.sync_global_devices(name)
    return build()


def _check_prepared(path: str, arg: str) -> dict:
    """meta.json of both prepared splits under `path`; DataError naming what is missing."""
    for split in ("train", "eval"):
        if not os.path.isfile(os.path.join(path, split, "meta.json")):
            raise DataError(f"data.path: {os.path.join(path, split)} is not a prepared split "
                            f"(no meta.json); run `python -m dsjax.data.prepare --out {arg} ...`")
    with open(os.path.join(path, "train", "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def _check_vocab(cfg: Config, meta: dict, where: str) -> None:
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise DataError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's "
                        f"tokenizer vocabulary {meta['vocab_size']} ({where}/meta.json)")
    v = cfg.vision
    for key in ("image_token_id", "frame_token_id"):
        if key in meta and v.enabled and int(meta[key]) != getattr(v, key):
            raise DataError(f"vision.{key}: {getattr(v, key)}, but {where} was prepared with "
                            f"{key} {meta[key]} ({where}/meta.json); set vision.{key}="
                            f"{meta[key]}")
    if "image_token_id" in meta and not v.enabled:
        raise DataError(f"vision.tower: {where} holds images and the model has no vision tower; "
                        f"set vision.tower='siglip'")


def _check_kind(cfg: Config, meta: dict, where: str) -> str:
    """The split's kind, which `train.task` must read; DataError saying what to change."""
    task, kind = cfg.train.task, KINDS.get(meta.get("format"), "text")
    if kind in TASK_KINDS[task]:
        return kind
    if task == "pretrain":
        raise DataError(f"train.task: {where} holds {kind} examples ({meta['format']}), which "
                        f"pretraining does not read; set train.task='{_TASK_FOR[kind]}'")
    raise DataError(f"train.task: '{task}' trains on {TASK_KINDS[task][0]} splits, but {where} "
                    f"holds {kind} data ({meta.get('format')}); prepare one with `python -m "
                    f"dsjax.data.prepare {_PREPARE_FOR[task]} ...`, or set train.task to "
                    f"'{_TASK_FOR.get(kind, 'pretrain')}'")


def _check_eval_size(cfg: Config, meta: dict, eval_dir: str) -> None:
    """A held-out split too small for one eval batch stops the run before its first step, not
    after its last. (A multimodal split's rows depend on the model's media layout; its reader
    checks it.)"""
    if "image_token_id" in meta:
        return
    d = cfg.data
    rows = len(open_split(eval_dir, d.seq_len))
    if rows < d.global_batch:
        raise DataError(f"{eval_dir}: {rows} rows of data.seq_len={d.seq_len}, fewer than one "
                        f"eval batch of data.global_batch={d.global_batch}; prepare more held-out "
                        f"data (a larger prepare --eval_fraction), or lower data.seq_len or "
                        f"data.global_batch")


def _check_split(cfg: Config, path: str) -> tuple[dict, str]:
    """(train meta, kind) of the prepared splits under `path`, each check done up front."""
    meta = _check_prepared(path, path)
    train, held_out = os.path.join(path, "train"), os.path.join(path, "eval")
    kind = _check_kind(cfg, meta, train)
    _check_vocab(cfg, meta, train)
    if kind in _TASK_FOR:
        check_fits(read_chat_meta(train), train, cfg.data.seq_len)
    _check_eval_size(cfg, meta, held_out)
    return meta, kind


def arithmetic_root(path: str, workdir: str) -> str:
    """Where data.source='arithmetic' builds its task: `path` (data.path), or
    WORKDIR/data/arithmetic."""
    return path or os.path.join(workdir, "data", "arithmetic")


def _arithmetic(cfg: Config, workdir: str) -> Splits:
    """The built-in arithmetic chat task's chat (sft) or preference (dpo) splits."""
    built = _one_writer(lambda: build_arithmetic_corpus(arithmetic_root(cfg.data.path, workdir),
                                                        cfg.data.seq_len),
                        "dsjax arithmetic corpus")
    # sft or dpo: validate_data refuses pretraining on it
    path = built["chat" if cfg.train.task == "sft" else "preference"]
    meta, kind = _check_split(cfg, path)
    return Splits(os.path.join(path, "train"), os.path.join(path, "eval"), meta["tokenizer"],
                  kind=kind)


def data_splits(cfg: Config, workdir: str) -> Splits:
    """The train and held-out split directories for `cfg.data` (builds the stdlib corpus once)."""
    task = cfg.train.task
    if cfg.data.source == "arithmetic":
        return _arithmetic(cfg, workdir)
    if cfg.data.source != "prepared" and task != "pretrain":
        raise DataError(f"train.task: '{task}' trains on a prepared "
                        f"{TASK_KINDS[task][0]} split; set data.source='prepared' and data.path "
                        f"to the --out of `python -m dsjax.data.prepare {_PREPARE_FOR[task]} "
                        f"...` (data.source is {cfg.data.source!r})")
    if cfg.data.source == "stdlib":
        if cfg.data.tokenizer != "byte":
            raise DataError("data.tokenizer: the stdlib corpus is byte-tokenized; use 'byte'")
        cache = cfg.data.path or os.path.join(workdir, "data", "stdlib")
        train, held_out = _one_writer(lambda: build_stdlib_corpus(cache), "dsjax stdlib corpus")
        return Splits(train, held_out, "byte")
    if cfg.data.source == "vl_corpus":
        root = vl_root(cfg, workdir)
        built = _one_writer(lambda: build_vl_sources(
            root, cfg.vision.image_size, cfg.data.video_fps, cfg.data.max_frames,
            max_tiles=prepared_max_tiles(cfg)), "dsjax vl corpus")
        return Splits("", "", "byte", tuple((name, *built[name])
                                            for name in mix_weights(cfg.data.mix)), "multimodal")
    if cfg.data.mix:
        sources, tokenizer, kinds = [], None, set()
        for name in mix_weights(cfg.data.mix):
            path = os.path.join(cfg.data.path, name)
            meta, kind = _check_split(cfg, path)
            tokenizer = meta["tokenizer"]
            kinds.add(kind)
            sources.append((name, os.path.join(path, "train"), os.path.join(path, "eval")))
        # Text and multimodal sources mix (pretraining); a post-training task reads one kind.
        kind = kinds.pop() if len(kinds) == 1 else "multimodal"
        return Splits("", "", tokenizer, tuple(sources), kind)
    meta, kind = _check_split(cfg, cfg.data.path)
    train, held_out = os.path.join(cfg.data.path, "train"), os.path.join(cfg.data.path, "eval")
    return Splits(train, held_out, meta["tokenizer"], kind=kind)


def media_reading(cfg: Config, vision: Any) -> dict[str, int]:
    """How multimodal splits are read for the model: image tokens per view (the model's
    `VisionSpec`), view slots per row, image side, max_tiles (0: untiled); {} for a text model."""
    if vision is None:
        return {}
    return {"tokens_per_image": vision.tokens_per_image, "max_images": cfg.vision.max_images,
            "image_size": cfg.vision.image_size, "max_tiles": prepared_max_tiles(cfg)}
