"""Tests for the multimodal data path: media decoding, prepare --format multimodal, placeholder
expansion and packing, mixing sources by weight.

Media are real files written here with Pillow and PyAV; expected rows are rebuilt in the tests
from the documents and pixels the test wrote (plain Python), never read back through the code
under test.
"""

import json
import os
import pickle

import av
import numpy as np
import pytest
from PIL import Image

from dsjax.errors import ConfigError
from dsjax.data import (ByteTokenizer, DataError, MediaError, MultimodalSource, MultimodalWriter,
                        PackedSource, ShardWriter, load_image, load_video, make_example,
                        mixed_eval_batches, mixed_stream, parse_mix)
from dsjax.data.mixture import MixedIndex
from dsjax.data.multimodal.prepare import build_document, iter_records, prepare_multimodal
from dsjax.data.prepare import main as prepare_main

IMG, FRAME, EOS = 257, 258, 256  # byte tokenizer: the first ids after its 257


def bicubic(array: np.ndarray, size: int) -> np.ndarray:
    """Reference resize: Pillow's own bicubic, called directly."""
    return np.asarray(Image.fromarray(array).convert("RGB").resize((size, size), Image.BICUBIC))


def write_clip(path, levels, rate=10, codec="libx264", size=32):
    """A clip whose frame i is flat grey at `levels[i]`, `rate` frames per second."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for level in levels:
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), level, np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_gif(path, levels, ms_per_frame=100):
    frames = [Image.fromarray(np.full((20, 20, 3), v, np.uint8)) for v in levels]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=ms_per_frame, loop=0)


# ---------------------------------------------------------------------------------- decoding

def test_load_image_png_jpeg_shapes_and_bicubic(tmp_path):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (23, 37, 3), dtype=np.uint8)
    Image.fromarray(array).save(tmp_path / "a.png")
    Image.fromarray(array).save(tmp_path / "a.jpg", quality=95)
    Image.fromarray(array[..., 0]).save(tmp_path / "grey.png")  # mode L -> RGB
    got = load_image(str(tmp_path / "a.png"), 16)
    assert got.shape == (16, 16, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, bicubic(array, 16))  # PNG is lossless: exact
    # At its own size a PNG comes back untouched.
    np.testing.assert_array_equal(load_image(str(tmp_path / "a.png"), 23)[:, :23],
                                  bicubic(array, 23)[:, :23])
    jpeg = load_image(str(tmp_path / "a.jpg"), 16)
    assert jpeg.shape == (16, 16, 3)
    # JPEG is lossy; noise at quality 95 still keeps the mean within a few levels.
    assert abs(float(jpeg.mean()) - float(bicubic(array, 16).mean())) < 4
    grey = load_image(str(tmp_path / "grey.png"), 8)
    np.testing.assert_array_equal(grey[..., 0], grey[..., 2])


@pytest.mark.parametrize("fps,max_frames,frames", [
    (2.0, 8, [0, 5, 10, 15]),          # 0, .5, 1, 1.5 s of a 10 fps clip
    (3.0, 100, [0, 3, 6, 10, 13, 16]),  # the frame on screen at k/3 s: floor(10 k / 3)
    (2.0, 2, [0, 5]),                   # max_frames caps
    (20.0, 5, [0, 0, 1, 1, 2]),         # faster than the clip: frames repeat, by time
])
def test_video_frames_sampled_by_time(tmp_path, fps, max_frames, frames):
    levels = [20 + 10 * i for i in range(20)]
    write_clip(tmp_path / "clip.mp4", levels)
    got = load_video(str(tmp_path / "clip.mp4"), 16, fps, max_frames)
    assert got.shape == (len(frames), 16, 16, 3) and got.dtype == np.uint8
    # H.264 on a flat grey frame is off by ~1 level (yuv420 rounding); neighbours differ by 10.
    np.testing.assert_allclose(got.mean(axis=(1, 2, 3)), [levels[i] for i in frames], atol=3)


def test_gif_as_video_and_as_image(tmp_path):
    levels = [20 + 20 * i for i in range(10)]
    write_gif(str(tmp_path / "a.gif"), levels, ms_per_frame=100)
    got = load_video(str(tmp_path / "a.gif"), 8, 5.0, 100)
    # 10 frames of 0.1 s at 5 fps: 0, .2, .4, .6, .8 s -> frames 0, 2, 4, 6, 8.
    np.testing.assert_allclose(got.mean(axis=(1, 2, 3)), [levels[i] for i in (0, 2, 4, 6, 8)],
                               atol=1)
    assert load_image(str(tmp_path / "a.gif"), 8).mean() == pytest.approx(levels[0], abs=1)


def test_media_errors_name_the_file(tmp_path):
    (tmp_path / "trunc.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (tmp_path / "junk.mp4").write_bytes(os.urandom(2000))
    (tmp_path / "text.jpg").write_text("not an image")
    cases = [(load_image, "trunc.png"), (load_image, "text.jpg"), (load_image, "missing.png"),
             (lambda p, s: load_video(p, s, 1.0, 4), "junk.mp4"),
             (lambda p, s: load_video(p, s, 1.0, 4), "missing.mp4")]
    for fn, name in cases:
        with pytest.raises(MediaError, match=name) as info:
            fn(str(tmp_path / name), 8)
        assert isinstance(info.value, DataError)


# ------------------------------------------------------------------------- prepare and packing

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus of every record kind, plus the images each record should decode to."""
    root = tmp_path_factory.mktemp("mm")
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (int(rng.integers(10, 30)), int(rng.integers(10, 30)), 3),
                           dtype=np.uint8) for _ in range(5)]
    os.makedirs(root / "media")
    for i, a in enumerate(arrays):
        Image.fromarray(a).save(root / "media" / f"im{i}.png")
    write_clip(root / "media" / "clip.mp4", [20 + 10 * i for i in range(20)])
    records = [
        {"text": "plain text"},
        {"text": "a <image> b <image> c", "images": ["media/im0.png", "media/im1.png"]},
        {"text": "caption", "images": ["media/im2.png"]},
        {"text": "before <video> after", "video": "media/clip.mp4"},
        {"text": "clip first", "video": str(root / "media" / "clip.mp4")},  # absolute path
        {"text": "<image><image><image>", "images": [f"media/im{i}.png" for i in (3, 4, 0)]},
    ]
    with open(root / "d.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    return root, records, arrays


def expected_doc(record, arrays, size, frames):
    """Token ids (placeholders unexpanded, eos appended) and images, by hand."""
    text = list(record["text"].encode())
    if "video" in record:
        video = [IMG] + [FRAME, IMG] * (frames - 1)
        pieces = record["text"].split("<video>")
        ids = (video + list(pieces[0].encode()) if len(pieces) == 1
               else list(pieces[0].encode()) + video + list(pieces[1].encode()))
        return ids + [EOS], None
    images = [bicubic(arrays[int(p[-5])], size) for p in record.get("images", [])]
    if images and "<image>" not in record["text"]:
        return [IMG] + text + [EOS], images
    ids = []
    for i, piece in enumerate(record["text"].split("<image>")):
        ids += ([IMG] if i else []) + list(piece.encode())
    return ids + [EOS], images


def test_prepare_writes_placeholders_images_and_meta(corpus, tmp_path):
    root, records, arrays = corpus
    out = prepare_multimodal(str(root / "d.jsonl"), "byte", str(tmp_path), 12, video_fps=2.0,
                             max_frames=3, eval_fraction=0.0)
    assert out["skipped"] == []
    for split in ("train", "eval"):
        meta = out[split]
        assert meta["format"] == "dsjax-multimodal-v1" and meta["image_size"] == 12
        assert (meta["image_token_id"], meta["frame_token_id"], meta["vocab_size"]) == (257, 258,
                                                                                         259)
    assert sum(out[s]["num_docs"] for s in ("train", "eval")) == len(records)
    modalities = {m: out["train"]["modalities"][m] + out["eval"]["modalities"][m]
                  for m in ("text", "image", "video")}
    assert modalities == {"text": 1, "image": 3, "video": 2}
    # Every record's document is found whole in one split, its images in placeholder order.
    docs = []
    for split in ("train", "eval"):
        d = tmp_path / split
        tokens, table = np.load(d / "tokens-00000.npy"), np.load(d / "docs-00000.npy")
        images = np.load(d / "images-00000.npy")
        for off, n, ioff, ni, _ in table:
            docs.append((tokens[off:off + n].tolist(), images[ioff:ioff + ni]))
    for record in records:
        ids, images = expected_doc(record, arrays, 12, frames=3)
        match = [imgs for toks, imgs in docs if toks == ids]
        assert len(match) == 1, record
        if images is not None:
            np.testing.assert_array_equal(match[0], np.stack(images) if images
                                          else np.zeros((0, 12, 12, 3), np.uint8))
        else:  # video frames at 0, .5, 1 s of the 10 fps clip: levels 20, 70, 120
            np.testing.assert_allclose(match[0].mean(axis=(1, 2, 3)), [20, 70, 120], atol=3)


def write_split(path, docs, size=6, tokenizer=ByteTokenizer()):
    """docs: list of (ids with IMG placeholders, images). Returns the split dir."""
    writer = MultimodalWriter(str(path), tokenizer, size)
    for ids, images in docs:
        writer.add(np.asarray(ids), images, "image" if len(images) else "text")
    writer.close()
    return str(path)


def random_images(rng, n, size=6):
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def test_row_by_hand(tmp_path):
    rng = np.random.default_rng(2)
    pics = random_images(rng, 2)
    split = write_split(tmp_path / "s", [([97, 98, IMG, 99], pics[:1]), ([IMG, 100], pics[1:])])
    source = MultimodalSource(split, seq_len=15, tokens_per_image=3, max_images=2, image_size=6)
    assert len(source) == 1
    row = source[0]
    # doc 1: a b [img x3] c eos; doc 2: [img x3] d eos; then 3 pads (16 tokens).
    want = [97, 98, IMG, IMG, IMG, 99, EOS, IMG, IMG, IMG, 100, EOS, 0, 0, 0, 0]
    np.testing.assert_array_equal(row["tokens"], want)
    np.testing.assert_array_equal(row["segment_ids"], [1] * 7 + [2] * 5 + [0] * 4)
    np.testing.assert_array_equal(row["pixels"], pics)
    np.testing.assert_array_equal(row["image_mask"], [True, True])
    ex = make_example(row)
    # Loss on a, b->... : weight 0 where the target is an image token, a new document or a pad.
    np.testing.assert_array_equal(
        ex["weights"], [1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2])
    assert set(ex) == {"inputs", "targets", "segment_ids", "positions", "weights", "pixels",
                       "image_mask"}
    # Grain may ship the source to a worker process: it reopens its shards there.
    copy = pickle.loads(pickle.dumps(source))
    for key, value in copy[0].items():
        np.testing.assert_array_equal(value, row[key])


def test_expansion_and_packing_random(tmp_path):
    rng = np.random.default_rng(3)
    docs = []
    for _ in range(60):
        n = int(rng.integers(0, 3))
        ids = list(rng.integers(0, 256, int(rng.integers(1, 12))))
        for _ in range(n):
            ids.insert(int(rng.integers(0, len(ids) + 1)), IMG)
        if rng.random() < 0.2:  # a video: frames with separators
            ids += [IMG, FRAME, IMG]
        docs.append((ids, random_images(rng, ids.count(IMG))))
    split = write_split(tmp_path / "s", docs)
    per_image, max_images, seq_len = 4, 4, 40  # the largest doc: 4 images, 29 tokens
    source = MultimodalSource(split, seq_len, per_image, max_images, 6)
    assert source.cut["docs"] == 0  # every doc here fits a row
    rebuilt, rebuilt_images = [], []
    for i in range(len(source)):
        row = source[i]
        ex = make_example(row)
        tokens, seg = row["tokens"], row["segment_ids"]
        assert tokens.shape == (seq_len + 1,)
        # The image slots hold exactly as many images as the row has placeholders' worth.
        n_images = int(row["image_mask"].sum())
        assert np.count_nonzero(tokens == IMG) == per_image * n_images <= per_image * max_images
        assert np.count_nonzero(ex["inputs"] == IMG) == per_image * n_images  # never cut short
        assert not row["pixels"][n_images:].any()
        want_w = ((seg[:-1] == seg[1:]) & (seg[1:] > 0) & (tokens[1:] != IMG)
                  & (tokens[1:] != FRAME)).astype(np.float32)
        np.testing.assert_array_equal(ex["weights"], want_w)
        for s in range(1, seg.max() + 1):
            doc = tokens[seg == s].tolist()
            collapsed, j = [], 0
            while j < len(doc):  # runs of image tokens are whole images
                if doc[j] == IMG:
                    run = next((k for k in range(j, len(doc)) if doc[k] != IMG), len(doc)) - j
                    assert run % per_image == 0
                    collapsed += [IMG] * (run // per_image)
                    j += run
                else:
                    collapsed.append(doc[j])
                    j += 1
            rebuilt.append(collapsed)
        rebuilt_images += list(row["pixels"][:n_images])
    assert rebuilt == [ids + [EOS] for ids, _ in docs]
    np.testing.assert_array_equal(np.stack(rebuilt_images),
                                  np.concatenate([im for _, im in docs if len(im)]))


def test_long_documents_are_cut_at_text_positions(tmp_path):
    rng = np.random.default_rng(4)
    pics = random_images(rng, 4)
    docs = [
        ([1] * 30, pics[:0]),                        # text longer than a row: cut at 21 tokens
        ([IMG, 5, IMG, 6, IMG, 7], pics[:3]),        # 3 images, budget 2: third dropped with 7
        ([2] * 18 + [IMG, 3], pics[3:]),             # the image would cross the row end
        ([2] * 17 + [IMG, 3], pics[3:]),             # it would end on the target-only token
    ]
    split = write_split(tmp_path / "s", docs)
    source = MultimodalSource(split, seq_len=20, tokens_per_image=4, max_images=2, image_size=6)
    assert len(source) == 4
    np.testing.assert_array_equal(source[0]["tokens"], [1] * 21)
    np.testing.assert_array_equal(source[1]["tokens"][:10], [IMG] * 4 + [5] + [IMG] * 4 + [6])
    assert (source[1]["segment_ids"][10:] == 0).all()
    np.testing.assert_array_equal(source[1]["pixels"], pics[:2])
    np.testing.assert_array_equal(source[2]["tokens"][:18], [2] * 18)
    assert (source[2]["segment_ids"][18:] == 0).all() and not source[2]["image_mask"].any()
    np.testing.assert_array_equal(source[3]["tokens"][:17], [2] * 17)
    assert (source[3]["segment_ids"][17:] == 0).all() and not source[3]["image_mask"].any()
    # Dropped: 9 + 1 eos, image 3 + "7" + eos, image 4 + "3" + eos (twice).
    assert source.cut == {"docs": 4, "images_dropped": 3, "text_tokens_dropped": 10 + 2 + 2 + 2}


# ------------------------------------------------------------------------------------- errors

def test_placeholder_mismatch_names_the_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "<image> and <image>", "images": ["media/im0.png"]}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 2 <image> placeholders .* 1 images"):
        prepare_multimodal(str(bad), "byte", str(tmp_path / "out"), 8)
    assert not (tmp_path / "out").exists()  # pass 1 failed before anything was written


def test_bad_media_record_is_named_and_skipped(corpus, tmp_path, capsys):
    root, records, _ = corpus
    (root / "media" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (root / "media" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 200)  # a cut mp4 header; random bytes can probe as some format
    lines = [json.dumps(r) for r in records] + [
        json.dumps({"text": "x", "images": ["media/broken.jpg"]}),
        json.dumps({"text": "y <video>", "video": "media/broken.mp4"})]
    (root / "mixed.jsonl").write_text("\n".join(lines))
    for kind, line in (("image", 7), ("video", 8)):
        record = list(iter_records([str(root / "mixed.jsonl")]))[line - 1]
        with pytest.raises(MediaError, match=rf"mixed\.jsonl:{line}: .*broken"):
            build_document(record, ByteTokenizer(), 8, 1.0, 4)
    rc = prepare_main(["--format", "multimodal", "--input", str(root / "mixed.jsonl"),
                       "--image_size", "8", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0, captured.err
    assert "skipped 2 record(s)" in printed
    assert "mixed.jsonl:7:" in printed and "mixed.jsonl:8:" in printed
    metas = [json.load(open(tmp_path / "out" / s / "meta.json")) for s in ("train", "eval")]
    assert sum(m["num_docs"] for m in metas) == len(records)
    # All bad: exit 2, one line naming a record, no meta.json written.
    (root / "allbad.jsonl").write_text("\n".join(lines[-2:]))
    rc = prepare_main(["--format", "multimodal", "--input", str(root / "allbad.jsonl"),
                       "--image_size", "8", "--out", str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert rc == 2 and "allbad.jsonl:1:" in err
    assert not (tmp_path / "out2" / "train" / "meta.json").exists()


def test_eval_input_files_make_the_held_out_split(corpus, tmp_path, capsys):
    root, records, _ = corpus
    (root / "held.jsonl").write_text("\n".join(json.dumps(r) for r in records[1:3]))
    rc = prepare_main(["--format", "multimodal", "--input", str(root / "d.jsonl"),
                       "--eval_input", str(root / "held.jsonl"), "--image_size", "8",
                       "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    metas = {s: json.load(open(tmp_path / "out" / s / "meta.json")) for s in ("train", "eval")}
    assert metas["train"]["num_docs"] == len(records)  # every --input record, none moved
    assert metas["eval"]["num_docs"] == 2
    assert metas["eval"]["num_images"] == 3  # records[1] has two images, records[2] one
    rc = prepare_main(["--format", "jsonl", "--input", str(root / "d.jsonl"),
                       "--eval_input", str(root / "held.jsonl"), "--out", str(tmp_path / "t")])
    assert rc == 2 and "--eval_input is for --format multimodal" in capsys.readouterr().err


def test_read_time_checks(tmp_path):
    rng = np.random.default_rng(5)
    split = write_split(tmp_path / "s", [([IMG, 1, IMG], random_images(rng, 2)), ([3], [])])
    with pytest.raises(DataError, match="prepared at 6x6, the model expects 8x8"):
        MultimodalSource(split, 16, 2, 2, image_size=8)
    tokens_path = tmp_path / "s" / "tokens-00000.npy"
    tokens = np.load(tokens_path)
    tokens[2] = 7  # doc 0's second placeholder becomes text: two images stored, one placeholder
    np.save(tokens_path, tokens)
    with pytest.raises(DataError, match="docs-00000.npy: document 0 has 1 image placeholders "
                                        "but 2 images stored"):
        MultimodalSource(split, 16, 2, 2, image_size=6)


# ------------------------------------------------------------------------------------- mixing

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three splits whose rows tell their source apart: text only; images; video (frame ids)."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(6)
    text = ShardWriter(str(root / "text"), ByteTokenizer(), 4096)
    for i in range(300):
        text.add(f"text document {i} " * 3)
    text.close()
    image = write_split(root / "image", [([IMG] + list(rng.integers(0, 256, 20)),
                                          random_images(rng, 1)) for _ in range(200)])
    video = write_split(root / "video", [([IMG, FRAME, IMG] + list(rng.integers(0, 256, 20)),
                                          random_images(rng, 2)) for _ in range(150)])
    return {"text": str(root / "text"), "image": image, "video": video}


MIX = dict(seq_len=32, tokens_per_image=4, max_images=2, image_size=6)


def source_of(example) -> str:
    if (example["inputs"] == FRAME).any():
        return "video"
    return "image" if example["image_mask"].any() else "text"


def test_parse_mix():
    assert parse_mix("text:0.5,image:0.3,video:0.2") == pytest.approx(
        {"text": 0.5, "image": 0.3, "video": 0.2})
    assert parse_mix("a:1, b:3") == {"a": 0.25, "b": 0.75}
    for bad in ("a:0.5,a:0.5", "a", "a:-1", "a:0", "a:x"):
        with pytest.raises(ConfigError, match="data.mix: "):
            parse_mix(bad)


def test_mixture_proportions_and_shapes(sources):
    weights = {"text": 0.5, "image": 0.3, "video": 0.2}
    stream = mixed_stream(sources, "text:0.5,image:0.3,video:0.2", seed=0, prefetch=0, **MIX)
    batch = stream.take(10_000)
    assert batch["pixels"].shape == (10_000, 2, 6, 6, 3) and batch["image_mask"].shape == (
        10_000, 2)
    names = [source_of({k: v[i] for k, v in batch.items()}) for i in range(10_000)]
    for name, w in weights.items():
        # The brief's bound; block allocation makes it exact at a multiple of the block.
        assert abs(names.count(name) / 10_000 - w) <= 0.02, name
    text_rows = np.array([n == "text" for n in names])
    assert not batch["pixels"][text_rows].any() and not batch["image_mask"][text_rows].any()
    # A text row is exactly the text source's example (weights included).
    text_first = int(np.argmax(text_rows))
    ref = PackedSource(sources["text"], 32)
    ex = {k: v[text_first] for k, v in batch.items()}
    assert any(np.array_equal(make_example(ref[j])["inputs"], ex["inputs"])
               for j in range(len(ref)))


def test_mixture_resume_and_determinism(sources):
    args = dict(weights="text:0.5,image:0.3,video:0.2", prefetch=0, **MIX)
    first = mixed_stream(sources, seed=3, **args)
    batches = [first.take(n) for n in (7, 13, 20)]
    assert first.get_state() == {"cursor": 40}
    resumed = mixed_stream(sources, seed=3, **args)
    resumed.set_state(json.loads(json.dumps({"cursor": 20})))
    again = resumed.take(20)
    for k in batches[2]:
        np.testing.assert_array_equal(again[k], batches[2][k])
    same = mixed_stream(sources, seed=3, **args).take(40)
    np.testing.assert_array_equal(same["inputs"][20:], batches[2]["inputs"])
    other = mixed_stream(sources, seed=4, **args).take(40)
    assert not np.array_equal(other["inputs"], same["inputs"])
    # The seed also draws which source each sample comes from, not only the rows' shuffles.
    pattern = lambda b: [source_of({k: v[i] for k, v in b.items()}) for i in range(40)]
    assert pattern(other) != pattern(same)
    # Two processes read items p, p+2, ... of the same global stream.
    halves = [mixed_stream(sources, seed=3, process_index=p, process_count=2, **args).take(40)
              for p in range(2)]
    np.testing.assert_array_equal(halves[0]["inputs"], same["inputs"][0::2])
    np.testing.assert_array_equal(halves[1]["inputs"], same["inputs"][1::2])


def test_mixed_index_is_exact_per_block():
    index = MixedIndex([0.5, 0.3, 0.2], seed=0, block=100)
    picks = [index(i) for i in range(1000)]
    for k, share in enumerate((50, 30, 20)):
        js = [j for s, j in picks if s == k]
        assert len(js) == 10 * share
        assert sorted(js) == list(range(10 * share))  # each source row used once, none skipped


def test_text_only_mixture_and_eval_per_source(sources, tmp_path):
    other = ShardWriter(str(tmp_path / "t2"), ByteTokenizer(), 4096)
    for i in range(100):
        other.add(f"another {i} " * 4)
    other.close()
    stream = mixed_stream({"a": sources["text"], "b": str(tmp_path / "t2")}, "a:1,b:1",
                          seq_len=32, seed=0, prefetch=0)
    batch = stream.take(8)
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    evals = mixed_eval_batches(sources, batch=4, max_batches=2, **MIX)
    assert set(evals) == {"text", "image", "video"}
    keys = {name: set(b[0]) for name, b in evals.items()}
    assert len({frozenset(k) for k in keys.values()}) == 1 and "pixels" in keys["text"]
    for name, batches in evals.items():
        assert len(batches) == 2
        assert all(source_of({k: v[i] for k, v in b.items()}) == name
                   for b in batches for i in range(4))
