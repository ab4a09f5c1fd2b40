"""JSONL image/video/text records -> multimodal train/eval splits (`shards`).

  python -m dsjax.data.prepare --format multimodal --input data.jsonl --image_size 384 --out mm/

With `--max_tiles N` (DeepSeek-VL2's dynamic tiling, `vision.tiling`) every image is stored as its
global view plus the tiles of its best grid of at most N tiles, and each video frame as a padded
global view (`media.load_image_views`); the split records N and each image's grid (`shards`).

Records: {"text"}; {"text", "images": [paths]} with one "<image>" per image in the text
(interleaved, or none and a single image, which then goes before the text); {"text", "video":
path} with one "<video>" or none (the video then goes first). Relative paths resolve against the
JSONL file's directory. The same two passes as the text formats: the first checks every record's
structure (a malformed record stops the job, naming it, before anything is written) and assigns
it to train or eval by a hash of its content; the second decodes media and writes. A record whose
image or video cannot be decoded is skipped, counted and named in the summary; only if no record
is left does prepare fail.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Sequence

import numpy as np

from dsjax.config.sections import DataConfig
from dsjax.errors import DataError
from dsjax.data.inputs import check_out_dir, eval_score, expand_inputs, jsonl_records
from dsjax.data.multimodal.media import MediaError, load_image, load_image_views, load_video
from dsjax.data.multimodal.shards import MultimodalWriter, special_ids
from dsjax.data.multimodal.tiling import FRAME_GRID
from dsjax.data.tokenizers import load_tokenizer

IMAGE = "<image>"
VIDEO = "<video>"


@dataclasses.dataclass(frozen=True)
class Record:
    """One checked JSONL record; media paths already resolved."""
    where: str  # "file:line"
    text: str
    images: tuple[str, ...] = ()
    video: str | None = None

    @property
    def modality(self) -> str:
        return "video" if self.video else ("image" if self.images else "text")

    def content(self) -> str:
        """What the split hash sees: the text and the names of the media it refers to (not
        where the corpus lies, so a copy of it splits the same)."""
        names = (os.path.basename(p) for p in (*self.images, self.video or ""))
        return "\0".join((self.text, *names))


def parse_record(where: str, record: dict, base_dir: str) -> Record:
    """Checks one JSON object's fields and placeholder counts; a DataError names `where`."""
    for typo, field in (("image", "images"), ("videos", "video")):
        if typo in record:  # other extra fields (ids, sources) are ignored
            raise DataError(f"{where}: unknown field {typo!r}; did you mean {field!r}?")
    text = record.get("text")
    if not isinstance(text, str):
        raise DataError(f"{where}: field 'text' is {type(text).__name__}, expected a string")
    images, video = record.get("images", []), record.get("video")
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise DataError(f"{where}: field 'images' must be a list of file paths")
    if video is not None and (not isinstance(video, str) or not video):
        raise DataError(f"{where}: field 'video' must be a file path")
    if images and video:
        raise DataError(f"{where}: a record has 'images' or 'video', not both")
    placeholders = text.count(IMAGE)
    if placeholders != len(images) and not (placeholders == 0 and len(images) == 1):
        raise DataError(f"{where}: {placeholders} {IMAGE} placeholders in the text but "
                        f"{len(images)} images")
    videos = text.count(VIDEO)
    if videos > (1 if video else 0):
        raise DataError(f"{where}: {videos} {VIDEO} placeholders in the text but "
                        f"{1 if video else 0} videos")
    resolve = lambda p: os.path.normpath(os.path.join(base_dir, p))  # absolute paths stay
    return Record(where, text, tuple(resolve(p) for p in images),
                  resolve(video) if video else None)


def iter_records(files: Sequence[str]) -> Iterator[Record]:
    for path in files:
        base_dir = os.path.dirname(os.path.abspath(path))
        for where, record in jsonl_records(path):
            parsed = parse_record(where, record, base_dir)
            if parsed.text or parsed.images or parsed.video:
                yield parsed


TILED_IMAGES = 2  # a record with more images than this gets no best-fit grids (VL2's rule)


def build_document(record: Record, tokenizer, image_size: int, video_fps: float,
                   max_frames: int, max_tiles: int = 0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(token ids with placeholders, uint8 [v, size, size, 3] views, grids): untiled one view per
    placeholder and grids None; with `max_tiles` each image's global view and tiles and int64
    [n, 2] grids (a video frame: its padded global view, grid (0, 0)). A MediaError names the
    record when a file cannot be decoded."""
    image_id, frame_id = special_ids(tokenizer.vocab_size)
    grids = np.zeros((0, 2), np.int64) if max_tiles else None
    try:
        if record.video:
            frames = load_video(record.video, image_size, video_fps, max_frames,
                                pad=max_tiles > 0)
            media_ids = [np.array([image_id] + [frame_id, image_id] * (frames.shape[0] - 1))]
            pieces = record.text.split(VIDEO)
            if max_tiles:
                grids = np.tile(np.array(FRAME_GRID, np.int64), (frames.shape[0], 1))
        elif max_tiles and record.images:
            # DeepSeek-VL2 tiles the images of a record with at most TILED_IMAGES of them; more
            # get one tile each (the padded image, grid (1, 1)), keeping the record's length.
            tiles = max_tiles if len(record.images) <= TILED_IMAGES else 1
            loaded = [load_image_views(p, image_size, tiles) for p in record.images]
            frames = np.concatenate([views for views, _ in loaded])
            grids = np.array([grid for _, grid in loaded], np.int64)
            media_ids = [np.array([image_id])] * len(record.images)
            pieces = record.text.split(IMAGE)
        else:
            frames = np.stack([load_image(p, image_size) for p in record.images]) if (
                record.images) else np.zeros((0, image_size, image_size, 3), np.uint8)
            media_ids = [np.array([image_id])] * len(record.images)
            pieces = record.text.split(IMAGE)
    except MediaError as e:
        raise MediaError(f"{record.where}: {e}") from None
    if media_ids and len(pieces) == 1:  # no placeholder: the media go first
        pieces = ["", pieces[0]]
    parts = [tokenizer.encode(pieces[0])]
    for ids, piece in zip(media_ids, pieces[1:]):
        parts += [ids, tokenizer.encode(piece)]
    return np.concatenate(parts).astype(np.int64), frames, grids


def _decodes(record: Record, tokenizer, image_size: int, video_fps: float,
             max_frames: int, max_tiles: int) -> bool:
    try:
        build_document(record, tokenizer, image_size, video_fps, max_frames, max_tiles)
    except MediaError:
        return False
    return True


def prepare_multimodal(inputs: Sequence[str] | str, tokenizer_spec: str, out_dir: str,
                       image_size: int, video_fps: float = DataConfig.video_fps,
                       max_frames: int = DataConfig.max_frames,
                       eval_fraction: float = 0.01, seed: int = 0, shard_tokens: int = 2**24,
                       shard_images: int = 1024, overwrite: bool = False,
                       eval_inputs: Sequence[str] | str = (), max_tiles: int = 0) -> dict:
    """Writes `out_dir/train` and `out_dir/eval` in the multimodal format. With `eval_inputs`,
    `inputs` all go to train and `eval_inputs` all to eval (a held-out set chosen by the data's
    author, e.g. by digit sample); without, each record goes by a seeded hash of its content.
    `max_tiles` > 0 writes a tiled split (VL2 views and grids); 0 an untiled one.

    Returns {"train": meta, "eval": meta, "train_dir", "eval_dir", "skipped": ["file:line:
    reason", ...]} (records skipped for an undecodable image or video).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if image_size < 1:
        raise DataError(f"--image_size must be >= 1 for --format multimodal, got {image_size}")
    if video_fps <= 0 or max_frames < 1:
        raise DataError(f"--video_fps must be > 0 and --max_frames >= 1, got {video_fps}, "
                        f"{max_frames}")
    if max_tiles < 0:
        raise DataError(f"--max_tiles must be >= 0 (0: no tiling), got {max_tiles}")
    check_out_dir(out_dir, overwrite)
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(eval_inputs, str):
        eval_inputs = [eval_inputs]
    files = expand_inputs(inputs)
    held_files = expand_inputs(eval_inputs) if eval_inputs else []
    tokenizer = load_tokenizer(tokenizer_spec)

    # Pass 1: every record's structure, and its split, before touching out_dir.
    scores = np.array([eval_score(r.content(), seed) for r in iter_records(files)])
    if held_files:
        held = sum(1 for _ in iter_records(held_files))
        if not scores.size or not held:
            raise DataError(f"{(files + held_files)[0]}: train and eval need at least one "
                            f"record each, got {scores.size} and {held}")
        to_eval = np.concatenate([np.zeros(scores.size, bool), np.ones(held, bool)])
        files = files + held_files
    else:
        if scores.size < 2:
            raise DataError(f"{files[0]}: {scores.size} records; train and eval need at least "
                            "one each")
        to_eval = scores < eval_fraction
        to_eval[np.argmax(scores)] = False
        # At least one held-out record whose media decode (a bad one is skipped in pass 2):
        # the lowest-scoring that does, when none of those the hash assigned does.
        records = list(iter_records(files))
        decodes = lambda i: _decodes(records[i], tokenizer, image_size, video_fps, max_frames,
                                     max_tiles)
        if not any(decodes(i) for i in np.flatnonzero(to_eval)):
            good = next((i for i in np.argsort(scores) if i != np.argmax(scores) and decodes(i)),
                        None)
            if good is not None:
                to_eval[good] = True

    # Pass 2: decode and write; a record with a bad media file is skipped and named.
    dirs = {"train": os.path.join(out_dir, "train"), "eval": os.path.join(out_dir, "eval")}
    extra = {"video_fps": float(video_fps), "max_frames": int(max_frames)}
    writers = {split: MultimodalWriter(d, tokenizer, image_size, shard_tokens, shard_images,
                                       extra, max_tiles) for split, d in dirs.items()}
    skipped, written = [], {"train": 0, "eval": 0}
    for i, record in enumerate(iter_records(files)):
        try:
            ids, images, grids = build_document(record, tokenizer, image_size, video_fps,
                                                max_frames, max_tiles)
        except MediaError as e:
            skipped.append(str(e))
            continue
        split = "eval" if to_eval[i] else "train"
        writers[split].add(ids, images, record.modality, len(record.text.encode("utf-8")),
                           grids)
        written[split] += 1
    if not any(written.values()):
        raise DataError(f"every one of {to_eval.size} records was skipped; first: {skipped[0]}")
    for split, count in written.items():
        if not count:
            raise DataError(f"{dirs[split]}: no records left after skipping {len(skipped)} "
                            f"with bad media (first: {skipped[0]})")
    metas = {split: w.close() for split, w in writers.items()}
    return {**metas, "train_dir": dirs["train"], "eval_dir": dirs["eval"], "skipped": skipped}
