"""The cpu_vl corpus: captioned digits, moving-digit clips, sample photos and a GIF, no downloads.

Everything comes from files the scikit-learn and scikit-image wheels ship: the 1,797 labelled 8x8
digits (`sklearn.datasets.load_digits`), a few photographs, and a 24-frame GIF. The builder writes
real media files (PNG, JPEG, H.264 mp4, GIF) and JSONL records in the three kinds that
`python -m dsjax.data.prepare --format multimodal` reads:

  {"text": "<image> a handwritten digit seven", "images": ["media/digits/0007.png"]}
  {"text": "<video> the digit three moves left", "video": "media/clips/train/0042.mp4"}

(paths relative to the JSONL file; text-only data is the stdlib corpus). The held-out split is by
digit *sample*, fixed by the seed, so the grounding metrics (score every candidate caption of a
held-out image or clip, pick the lowest loss) see digits that training never showed, in neither
modality. The held-out labels live in `eval_labels.json`, one entry per eval record in file order,
so the records carry only the fields the prepare tool knows. The JSONL files are already split:
prepare each with `--eval_fraction 0`. Like the stdlib corpus, a build goes to a temp dir whose
entries are renamed into place, a stamp records the settings, and a directory holding anything
else is refused untouched.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import tempfile

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from dsjax.errors import DataError

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIRECTIONS = ("left", "right", "up", "down")  # on screen: "up" is towards row 0
IMAGE_TEMPLATES = ("a handwritten digit {}", "this is the number {}",
                   "the digit {}, written by hand", "a picture of the number {}")
VIDEO_TEMPLATE = "the digit {} moves {}"
MARKS = {"image": "<image>", "video": "<video>"}
# (package, file inside it, caption): photos as the wheels ship them, so both decoders' real-photo
# paths (PNG and baseline JPEG) run; each appears in `sample_repeats` train records.
PHOTOS = (
    ("skimage", "data/astronaut.png", "a smiling astronaut in an orange spacesuit"),
    ("skimage", "data/coffee.png", "a cup of coffee on a red saucer with a spoon"),
    ("skimage", "data/chelsea.png", "a close-up of a tabby cat"),
    ("skimage", "data/rocket.jpg", "a rocket on its launch pad at dusk"),
    ("sklearn", "datasets/images/china.jpg", "a chinese pagoda above a lake"),
    ("sklearn", "datasets/images/flower.jpg", "an orange dahlia flower"),
)
GIF = ("skimage", "data/no_time_for_that_tiny.gif",
       "a tiny, blurry clip of a person standing and talking")

_VERSION = 1  # bump when records, media or the split change, to invalidate old caches
_STAMP = "vl_corpus.json"
_KIND = "dsjax-vl-corpus"
_JSONL = ("image_train.jsonl", "image_eval.jsonl", "video_train.jsonl", "video_eval.jsonl")
_OURS = frozenset(_JSONL + ("eval_labels.json", "media", _STAMP))


def candidate_captions(kind: str, label: int | None = None, template: int = 0) -> list[str]:
    """The captions a grounding metric scores, exactly as training writes them (without the mark).

    "image": the ten digit captions of one template, index = digit. "video": the four direction
    captions of digit `label`, index = position in DIRECTIONS.
    """
    if kind == "image":
        return [IMAGE_TEMPLATES[template].format(name) for name in DIGIT_NAMES]
    if kind == "video":
        if label is None:
            raise ValueError("candidate_captions('video') needs the clip's digit label")
        return [VIDEO_TEMPLATE.format(DIGIT_NAMES[label], d) for d in DIRECTIONS]
    raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")


def record_text(kind: str, caption: str) -> str:
    """A record's text: the media mark, then the caption (how every record here is written)."""
    return f"{MARKS[kind]} {caption}"


def digit_image(pixels: np.ndarray, size: int) -> np.ndarray:
    """An 8x8 digit (values 0..16) -> uint8 RGB [size, size, 3], nearest-neighbour upscaled so
    every written pixel is one of the digit's own values (the tests recover the sample from it)."""
    grey = np.rint(np.asarray(pixels, np.float64) * (255.0 / 16.0)).astype(np.uint8)
    big = np.asarray(Image.fromarray(grey, "L").resize((size, size), Image.Resampling.NEAREST))
    return np.repeat(big[:, :, None], 3, axis=2)


def moving_digit_clip(pixels: np.ndarray, direction: str, canvas: int, num_frames: int,
                      offset: int) -> np.ndarray:
    """A digit half the canvas wide crossing a black canvas edge to edge -> uint8 [T, canvas,
    canvas, 3]. `offset` is its fixed position across the motion, in [0, canvas // 2]."""
    digit = digit_image(pixels, canvas // 2)
    travel = canvas - canvas // 2
    frames = np.zeros((num_frames, canvas, canvas, 3), np.uint8)
    for t in range(num_frames):
        along = round(t * travel / max(num_frames - 1, 1))
        forward = along if direction in ("right", "down") else travel - along
        y, x = (offset, forward) if direction in ("left", "right") else (forward, offset)
        frames[t, y:y + digit.shape[0], x:x + digit.shape[1]] = digit
    return frames


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
    """H.264 in mp4 at near-lossless quality (crf 10 keeps 8x8-digit edges); `bitexact` and one
    thread make the file byte-identical across runs. H.264's yuv420p needs even sizes."""
    import av  # pylint: disable=g-import-not-at-top  (optional: the GPU image has no PyAV)

    with av.open(path, "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps,
                                      options={"crf": "10", "preset": "veryfast", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _shipped(package: str, rel: str) -> str:
    path = os.path.join(str(importlib.resources.files(package)), rel)
    if not os.path.isfile(path):
        raise DataError(f"{path}: missing; the {package} wheel ships it (a source install of "
                        f"{package} may not), reinstall it from PyPI")
    return path


def _settings(image_size, video_size, seed, num_videos, num_frames, fps, eval_fraction,
              sample_repeats) -> dict:
    return {"kind": _KIND, "version": _VERSION, "image_size": image_size,
            "video_size": video_size, "seed": seed, "num_videos": num_videos,
            "num_frames": num_frames, "fps": fps, "eval_fraction": eval_fraction,
            "sample_repeats": sample_repeats}


def _read_stamp(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, _STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("kind") == _KIND else None


def check_replaceable(out_dir: str) -> None:
    """Refuses, before anything is written, an `out_dir` holding anything this builder did not
    write: a rebuild replaces its own entries and nothing else."""
    if not os.path.isdir(out_dir):
        if os.path.exists(out_dir):
            raise DataError(f"{out_dir} is a file, not a directory for the vl corpus")
        return
    names = [n for n in sorted(os.listdir(out_dir)) if not n.startswith(".build-")]
    foreign = [n for n in names if n not in _OURS]
    if not foreign and names and _read_stamp(out_dir) is None:
        foreign = names  # our names without our stamp: not provably ours
    if foreign:
        raise DataError(f"{out_dir} holds files dsjax did not write ({', '.join(foreign[:3])}); "
                        f"the vl corpus does not overwrite them, point it at an empty or new "
                        f"directory")


def _result(out_dir: str, stamp: dict) -> dict:
    paths = {name.removesuffix(".jsonl"): os.path.join(out_dir, name) for name in _JSONL}
    return {**paths, "eval_labels": os.path.join(out_dir, "eval_labels.json"),
            "counts": stamp["counts"], "fps": stamp["settings"]["fps"],
            "num_frames": stamp["settings"]["num_frames"]}


def _write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def _build(root: str, s: dict) -> dict:
    """Writes every record and media file under `root`; returns the counts."""
    digits = load_digits()
    images, targets = digits.images, digits.target.astype(int)
    n = len(targets)
    seed = s["seed"]
    order = np.random.default_rng([seed, 0]).permutation(n)
    n_eval = max(1, round(n * s["eval_fraction"]))
    pools = {"eval": np.sort(order[:n_eval]), "train": np.sort(order[n_eval:])}
    template_of = np.random.default_rng([seed, 1]).integers(len(IMAGE_TEMPLATES), size=n)

    for sub in ("digits", "photos", "clips/train", "clips/eval"):
        os.makedirs(os.path.join(root, "media", sub))
    for i in range(n):
        Image.fromarray(digit_image(images[i], s["image_size"])).save(
            os.path.join(root, "media", "digits", f"{i:04d}.png"))

    def image_record(i):
        caption = IMAGE_TEMPLATES[template_of[i]].format(DIGIT_NAMES[targets[i]])
        return {"text": record_text("image", caption), "images": [f"media/digits/{i:04d}.png"]}

    records = {"image_train": [image_record(i) for i in pools["train"]],
               "image_eval": [image_record(i) for i in pools["eval"]]}
    labels = {"image": [{"path": f"media/digits/{i:04d}.png", "label": int(targets[i]),
                         "sample": int(i)} for i in pools["eval"]], "video": []}
    for package, rel, caption in PHOTOS:
        name = f"media/photos/{os.path.basename(rel)}"
        shutil.copyfile(_shipped(package, rel), os.path.join(root, name))
        records["image_train"] += [{"text": record_text("image", caption), "images": [name]}
                                   ] * s["sample_repeats"]

    n_eval_videos = max(1, round(s["num_videos"] * s["eval_fraction"]))
    rng = np.random.default_rng([seed, 2])
    half = s["video_size"] // 2
    for split, count in (("train", s["num_videos"] - n_eval_videos), ("eval", n_eval_videos)):
        samples = rng.choice(pools[split], size=count)
        directions = rng.permutation(np.arange(count) % len(DIRECTIONS))  # balanced
        offsets = rng.integers(0, s["video_size"] - half + 1, size=count)
        records[f"video_{split}"] = []
        for k, (i, d, off) in enumerate(zip(samples, directions, offsets)):
            name = f"media/clips/{split}/{k:04d}.mp4"
            write_mp4(os.path.join(root, name), moving_digit_clip(
                images[i], DIRECTIONS[d], s["video_size"], s["num_frames"], int(off)), s["fps"])
            caption = VIDEO_TEMPLATE.format(DIGIT_NAMES[targets[i]], DIRECTIONS[d])
            records[f"video_{split}"].append({"text": record_text("video", caption),
                                              "video": name})
            if split == "eval":
                labels["video"].append({"path": name, "label": int(targets[i]),
                                        "direction": DIRECTIONS[d], "sample": int(i)})
    gif = f"media/{os.path.basename(GIF[1])}"
    shutil.copyfile(_shipped(GIF[0], GIF[1]), os.path.join(root, gif))
    records["video_train"] += [{"text": record_text("video", GIF[2]), "video": gif}
                               ] * s["sample_repeats"]

    # Train records in a seeded order, so a consumer reading them in sequence sees mixed labels.
    shuffle = np.random.default_rng([seed, 3])
    for key in ("image_train", "video_train"):
        records[key] = [records[key][j] for j in shuffle.permutation(len(records[key]))]
    for key, recs in records.items():
        _write_jsonl(os.path.join(root, f"{key}.jsonl"), recs)
    with open(os.path.join(root, "eval_labels.json"), "w", encoding="utf-8") as f:
        json.dump(labels, f, indent=1, sort_keys=True)
    return {key: len(recs) for key, recs in records.items()}


def build_vl_corpus(out_dir: str, image_size: int = 32, seed: int = 0, num_videos: int = 300,
                    num_frames: int = 8, fps: int = 8, video_size: int | None = None,
                    eval_fraction: float = 0.1, sample_repeats: int = 2) -> dict:
    """Writes (or reuses) the corpus in `out_dir`; returns the JSONL and label paths and counts.

    Keys: image_train, image_eval, video_train, video_eval, eval_labels (paths), counts (records
    per JSONL file), fps and num_frames of the clips. `video_size` (default `image_size`) must be
    even for H.264; clips last num_frames / fps seconds.
    """
    video_size = image_size if video_size is None else video_size
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 (the digits are 8x8), got {image_size}")
    if video_size < 16 or video_size % 2:
        raise ValueError(f"video_size must be even (H.264 yuv420p) and at least 16, got "
                         f"{video_size}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if num_videos < 2 or num_frames < 2 or fps < 1 or sample_repeats < 0:
        raise ValueError(f"need num_videos >= 2, num_frames >= 2, fps >= 1, sample_repeats >= 0; "
                         f"got {num_videos}, {num_frames}, {fps}, {sample_repeats}")
    settings = _settings(image_size, video_size, seed, num_videos, num_frames, fps,
                         eval_fraction, sample_repeats)
    stamp = _read_stamp(out_dir)
    if (stamp is not None and stamp.get("settings") == settings and stamp.get("complete")
            and all(os.path.exists(os.path.join(out_dir, n)) for n in _OURS)):
        return _result(out_dir, stamp)
    check_replaceable(out_dir)

    os.makedirs(out_dir, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix=".build-", dir=out_dir)
    try:
        counts = _build(build_dir, settings)
        stamp = {"kind": _KIND, "settings": settings, "counts": counts, "complete": False}
        # An incomplete stamp first: an interrupted swap leaves a directory that is still ours
        # (so the next build may replace it) but is never mistaken for a cache hit.
        with open(os.path.join(out_dir, _STAMP), "w", encoding="utf-8") as f:
            json.dump(stamp, f, sort_keys=True)
        for name in sorted(_OURS - {_STAMP}):
            final = os.path.join(out_dir, name)
            if os.path.isdir(final):
                shutil.rmtree(final)
            elif os.path.exists(final):
                os.remove(final)
            os.rename(os.path.join(build_dir, name), final)
        stamp["complete"] = True
        with open(os.path.join(build_dir, _STAMP), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=1, sort_keys=True)
        os.replace(os.path.join(build_dir, _STAMP), os.path.join(out_dir, _STAMP))
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    print(f"vl corpus {out_dir}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return _result(out_dir, stamp)
