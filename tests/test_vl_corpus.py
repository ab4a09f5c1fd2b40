"""Tests for dsjax.data.multimodal.vl_corpus: the captioned-digit, moving-digit, photo and GIF
corpus.

Every check decodes the written files with Pillow or PyAV and compares against scikit-learn's own
digits and labels (each image is traced back to its sklearn sample by its pixels, each clip by
template matching its first frame), never against what the builder says it wrote.
"""

import json
import os

import av
import numpy as np
import pytest
import skimage.data
from PIL import Image
from sklearn.datasets import load_digits, load_sample_images

from dsjax.data.multimodal.vl_corpus import build_vl_corpus, candidate_captions
from dsjax.errors import DataError

# Written out here, not imported: a typo in the module's tables must fail these tests.
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZE, VIDEO, FRAMES, NUM_VIDEOS = 32, 32, 8, 40
DIGITS = load_digits()
# The builder's 0..16 -> 0..255 scale, recomputed: the key that traces a PNG back to its sample.
SAMPLE_OF = {np.rint(img * 255 / 16).astype(np.uint8).tobytes(): i
             for i, img in enumerate(DIGITS.images)}
assert len(SAMPLE_OF) == len(DIGITS.images)  # no two sklearn digits are pixel-identical


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vl") / "corpus")
    return out, build_vl_corpus(out, image_size=SIZE, seed=0, num_videos=NUM_VIDEOS,
                                num_frames=FRAMES, video_size=VIDEO)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def caption_digits(text):
    """The digit names a caption mentions, as whole words."""
    words = text.replace(",", " ").split()
    return [NAMES.index(w) for w in words if w in NAMES]


def sample_of_png(path):
    img = np.asarray(Image.open(path))
    assert img.shape == (SIZE, SIZE, 3) and img.dtype == np.uint8, path
    assert (img[..., 0] == img[..., 1]).all() and (img[..., 0] == img[..., 2]).all(), path
    step = SIZE // 8  # nearest upscaling by an integer factor: any pixel of a block is the value
    return SAMPLE_OF[np.ascontiguousarray(img[step // 2::step, step // 2::step, 0]).tobytes()]


def decode_video(path):
    with av.open(path) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


# All digits at the clips' scale (half the canvas), flattened for matching.
_TEMPLATES = np.stack([np.asarray(Image.fromarray(np.rint(img * 255 / 16).astype(np.uint8))
                                  .resize((VIDEO // 2,) * 2, Image.Resampling.NEAREST))
                       for img in DIGITS.images]).reshape(len(DIGITS.images), -1).astype(np.float64)


def sample_of_frame(frame):
    """The sklearn sample whose upscaled digit, at its best position, is closest to `frame`."""
    grey = frame.astype(np.float64).mean(-1)
    windows = np.lib.stride_tricks.sliding_window_view(grey, (VIDEO // 2,) * 2)
    windows = windows.reshape(-1, (VIDEO // 2) ** 2)
    ssd = ((windows ** 2).sum(1)[:, None] + (_TEMPLATES ** 2).sum(1)[None]
           - 2 * windows @ _TEMPLATES.T)
    return int(np.unravel_index(np.argmin(ssd), ssd.shape)[1])


def test_every_image_decodes_and_its_caption_names_the_sklearn_label(corpus):
    out, paths = corpus
    seen = []
    for split in ("image_train", "image_eval"):
        for rec in read_jsonl(paths[split]):
            assert set(rec) == {"text", "images"} and len(rec["images"]) == 1
            assert rec["text"].startswith("<image> ")
            path = os.path.join(out, rec["images"][0])
            if "/digits/" not in rec["images"][0]:
                continue
            i = sample_of_png(path)
            assert caption_digits(rec["text"]) == [DIGITS.target[i]], (rec, DIGITS.target[i])
            seen.append(i)
    # Every sklearn digit is used exactly once across the two splits.
    assert sorted(seen) == list(range(len(DIGITS.images)))


def test_sample_photos_decode_to_the_shipped_pictures(corpus):
    out, paths = corpus
    photos = [r for r in read_jsonl(paths["image_train"]) if "/digits/" not in r["images"][0]]
    reference = {"astronaut.png": skimage.data.astronaut(), "coffee.png": skimage.data.coffee(),
                 "chelsea.png": skimage.data.chelsea(), "rocket.jpg": skimage.data.rocket()}
    sk = load_sample_images()
    reference.update({os.path.basename(f): im for f, im in zip(sk.filenames, sk.images)})
    assert sorted({os.path.basename(r["images"][0]) for r in photos}) == sorted(reference)
    for rec in photos:
        img = np.asarray(Image.open(os.path.join(out, rec["images"][0])).convert("RGB"))
        ref = reference[os.path.basename(rec["images"][0])]
        # Same decoder family as the reference loaders (both Pillow underneath), same bytes:
        # identical pixels; a resized or re-encoded copy would differ.
        np.testing.assert_array_equal(img, ref)
        assert caption_digits(rec["text"]) == []
    assert len(photos) <= 3 * len(reference)  # a few times each at most


def test_clips_decode_and_the_digit_moves_in_the_captioned_direction(corpus):
    out, paths = corpus
    unit = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
    travel = VIDEO - VIDEO // 2
    checked = 0
    for split in ("video_train", "video_eval"):
        for rec in read_jsonl(paths[split]):
            assert set(rec) == {"text", "video"} and rec["text"].startswith("<video> ")
            if not rec["video"].endswith(".mp4"):
                continue
            frames = decode_video(os.path.join(out, rec["video"]))
            assert frames.shape == (FRAMES, VIDEO, VIDEO, 3), rec
            words = rec["text"].split()
            direction = words[-1]
            grey = frames.astype(np.float64).mean(-1)
            ys, xs = np.mgrid[:VIDEO, :VIDEO]
            com = np.stack([[(g * ys).sum() / g.sum(), (g * xs).sum() / g.sum()] for g in grey])
            along = com @ np.array(unit[direction], np.float64)
            across = com @ np.array(unit[direction][::-1], np.float64)
            # The digit crosses the whole free width; lossy H.264 moves the centre of mass by a
            # fraction of a pixel, so allow 1 px total and 0.5 px per step.
            assert along[-1] - along[0] > travel - 1, (rec, com)
            assert (np.diff(along) > 0.5).all(), (rec, com)
            assert np.ptp(across) < 1.0, (rec, com)
            # The captioned digit is the sklearn sample drawn in the clip.
            assert caption_digits(rec["text"]) == [DIGITS.target[sample_of_frame(frames[0])]], rec
            checked += 1
    assert checked == NUM_VIDEOS


def test_the_gif_is_a_24_frame_video_record(corpus):
    out, paths = corpus
    gifs = [r for r in read_jsonl(paths["video_train"]) if r["video"].endswith(".gif")]
    assert gifs and len({r["video"] for r in gifs}) == 1
    path = os.path.join(out, gifs[0]["video"])
    assert Image.open(path).n_frames == 24
    assert len(decode_video(path)) == 24


def test_held_out_digits_are_never_trained_on_and_labels_match(corpus):
    out, paths = corpus
    def samples(split):
        found = set()
        for rec in read_jsonl(paths[f"image_{split}"]):
            if "/digits/" in rec["images"][0]:
                found.add(sample_of_png(os.path.join(out, rec["images"][0])))
        for rec in read_jsonl(paths[f"video_{split}"]):
            if rec["video"].endswith(".mp4"):
                found.add(sample_of_frame(decode_video(os.path.join(out, rec["video"]))[0]))
        return found
    train, held_out = samples("train"), samples("eval")
    assert held_out and not train & held_out
    assert 0.05 < len(held_out) / len(DIGITS.images) < 0.2

    # The grounding candidates are the training phrasing, one per digit.
    assert candidate_captions("image") == [f"a handwritten digit {n}" for n in NAMES]
    labels = json.load(open(paths["eval_labels"]))
    image_eval, video_eval = read_jsonl(paths["image_eval"]), read_jsonl(paths["video_eval"])
    assert len(labels["image"]) == len(image_eval) and len(labels["video"]) == len(video_eval)
    for rec, lab in zip(image_eval, labels["image"]):
        assert lab["label"] == DIGITS.target[sample_of_png(os.path.join(out, rec["images"][0]))]
    for rec, lab in zip(video_eval, labels["video"]):
        frames = decode_video(os.path.join(out, rec["video"]))
        assert lab["label"] == DIGITS.target[sample_of_frame(frames[0])]
        cands = candidate_captions("video", lab["label"])
        assert cands == [f"the digit {NAMES[lab['label']]} moves {d}"
                         for d in ("left", "right", "up", "down")]
        assert rec["text"] == "<video> " + cands[["left", "right", "up", "down"].index(
            lab["direction"])]
    # Each held-out image caption is its label's candidate under one of the training phrasings.
    for rec, lab in zip(image_eval, labels["image"]):
        caption = rec["text"].removeprefix("<image> ")
        assert any(candidate_captions("image", template=t)[lab["label"]] == caption
                   for t in range(4)), rec


def test_cache_reuse_seed_change_and_byte_identical_rebuild(corpus, tmp_path):
    out, paths = corpus
    png = os.path.join(out, "media", "digits", "0000.png")
    before = {p: os.stat(p).st_mtime_ns for p in (paths["image_train"], png)}
    again = build_vl_corpus(out, image_size=SIZE, seed=0, num_videos=NUM_VIDEOS,
                            num_frames=FRAMES, video_size=VIDEO)
    assert again == paths
    assert {p: os.stat(p).st_mtime_ns for p in before} == before  # nothing rewritten

    def contents(result):
        return [open(result[k], "rb").read() for k in
                ("image_train", "image_eval", "video_train", "video_eval", "eval_labels")]
    twin = build_vl_corpus(str(tmp_path / "twin"), image_size=SIZE, seed=0,
                           num_videos=NUM_VIDEOS, num_frames=FRAMES, video_size=VIDEO)
    assert contents(twin) == contents(paths)
    other = build_vl_corpus(str(tmp_path / "twin"), image_size=SIZE, seed=1,
                            num_videos=NUM_VIDEOS, num_frames=FRAMES, video_size=VIDEO)
    assert all(a != b for a, b in zip(contents(other), contents(paths)))
    eval_files = lambda r: {x["path"] for x in json.load(open(r["eval_labels"]))["image"]}
    assert eval_files(other) != eval_files(paths)


def test_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "media").mkdir()
    with pytest.raises(DataError, match="did not write"):
        build_vl_corpus(str(tmp_path), num_videos=4)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["media", "notes.txt"]
