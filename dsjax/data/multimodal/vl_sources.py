"""The `vl_corpus` data source: text, image and video sources a vision-language run mixes, built
once from data that packages ship (no downloads).

text is the stdlib corpus; image and video are the cpu_vl corpus (`vl_corpus`: captioned digits,
sample photographs, moving-digit clips, a GIF) written as real files and read back through the
multimodal prepare tool, so training sees exactly what a user's own JSONL would give (tiled, with
`max_tiles` > 0, as `--max_tiles` prepares it). The digits held out by the corpus (never seen in
training) are the eval splits.
"""

from __future__ import annotations

import json
import os

from dsjax.data.multimodal.prepare import prepare_multimodal
from dsjax.data.stdlib_corpus import build_stdlib_corpus
from dsjax.data.multimodal.vl_corpus import build_vl_corpus

SOURCES = ("text", "image", "video")
_STAMP = "vl_sources.json"


def build_vl_sources(root: str, image_size: int, video_fps: float, max_frames: int,
                     seed: int = 0, num_videos: int = 300, log=print, max_tiles: int = 0
                     ) -> dict[str, tuple[str, str]]:
    """{source: (train split, eval split)} under `root` (text/, image/, video/, raw/), built on
    the first call and reused while the arguments are the same (a stamp records them)."""
    settings = {"image_size": image_size, "video_fps": video_fps, "max_frames": max_frames,
                "seed": seed, "num_videos": num_videos}
    if max_tiles:  # recorded only when tiled, so the untiled caches built before tiling still hit
        settings["max_tiles"] = max_tiles
    out = {"text": build_stdlib_corpus(os.path.join(root, "text"))}
    stamp = os.path.join(root, _STAMP)
    media = {kind: (os.path.join(root, kind, "train"), os.path.join(root, kind, "eval"))
             for kind in ("image", "video")}
    if _read(stamp) == settings:
        return {**out, **media}
    corpus = build_vl_corpus(os.path.join(root, "raw"), image_size=image_size, seed=seed,
                             num_videos=num_videos)
    for kind in ("image", "video"):
        result = prepare_multimodal(corpus[f"{kind}_train"], "byte", os.path.join(root, kind),
                                    image_size, video_fps, max_frames, seed=seed,
                                    overwrite=True, eval_inputs=corpus[f"{kind}_eval"],
                                    max_tiles=max_tiles)
        log(f"vl corpus {kind}: {result['train']['num_docs']:,} train and "
            f"{result['eval']['num_docs']:,} held-out documents"
            + (f", {len(result['skipped'])} skipped" if result.get("skipped") else ""))
    with open(stamp + ".tmp", "w", encoding="utf-8") as f:
        json.dump(settings, f)
    os.replace(stamp + ".tmp", stamp)
    return {**out, **media}


def eval_labels(root: str) -> dict:
    """The held-out records' labels (digit, direction) in record order: what grounding scores."""
    with open(os.path.join(root, "raw", "eval_labels.json"), encoding="utf-8") as f:
        return json.load(f)


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
