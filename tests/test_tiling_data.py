"""Tests for the data side of DeepSeek-VL2 dynamic tiling: grid choice and feature-row layout
(dsjax.data.multimodal.tiling), view loading (media), tiled prepare and shards (prepare, shards),
packing with feature indices (layout, pack), mixing, the vl corpus cache, and caption rows
(grounding).

Expected grids, token counts and layouts are worked out by hand in the comments; expected pixels
are rebuilt here with Pillow's resize and paste, or read straight off the source arrays (an image
whose size is exactly its grid's canvas is cut into tiles unscaled), never through the code under
test.
"""

import json
import os
import pickle

import av
import numpy as np
import pytest
from PIL import Image

from dsjax.evaluate import grounding
from dsjax.data import (ByteTokenizer, DataError, MultimodalSource, MultimodalWriter,
                        ShardWriter, make_example, mixed_eval_batches, mixed_stream)
from dsjax.data.multimodal import vl_sources
from dsjax.data.multimodal.media import load_image_views, load_video
from dsjax.data.multimodal.prepare import Record, build_document
from dsjax.data.prepare import main as prepare_main
from dsjax.data.multimodal.tiling import best_grid, feature_rows, image_tokens

IMG, FRAME, EOS = 257, 258, 256  # byte tokenizer: the first ids after its 257
GREY = 127  # the pad colour: SigLIP's mean 0.5 in uint8


# ------------------------------------------------------------------------ grids and layout

@pytest.mark.parametrize("width,height,tile,max_tiles,grid", [
    # Only canvases >= 800 wide (3 cols) and >= 400 tall (2 rows) show all 320,000 pixels; of
    # those (2, 3) = 1152 x 768 wastes the least.
    (800, 400, 384, 9, (2, 3)),
    # At most 2 tiles: (1, 2) = 768 x 384 shows 768 x 384 (scale 0.96); (1, 1) and (2, 1) only
    # 384 x 192.
    (800, 400, 384, 2, (1, 2)),
    (384, 384, 384, 9, (1, 1)),    # exact fit, no waste
    (100, 300, 384, 9, (1, 1)),    # small: every canvas shows it whole, (1, 1) wastes least
    # 1000 wide needs 3 cols; (1, 3) = 1152 x 384 at scale 1.152 shows all 300,000 pixels.
    (1000, 300, 384, 9, (1, 3)),
    # 50 x 20 at tile 16, <= 6 tiles: a full view needs 4 x 2 = 8 tiles; (2, 3) = 48 x 32 shows
    # 48 x 19 = 912 pixels, the most ((1, c): 40 x 16 = 640; (2, 2): 32 x 12 = 384).
    (50, 20, 16, 6, (2, 3)),
    (20, 50, 16, 6, (3, 2)),       # its transpose
])
def test_best_grid_by_hand(width, height, tile, max_tiles, grid):
    assert best_grid(width, height, tile, max_tiles) == grid


def test_feature_rows_by_hand():
    # side 2 (P = 4 features per view), grid 1 x 2, global view in slot 1: newline 100, sep 101.
    # Global: slot 1 = 4..7 as 2 rows + newline; then the separator; then the two local rows
    # across tiles: tile (0, 0) is slot 2 (8..11), tile (0, 1) slot 3 (12..15).
    want = [4, 5, 100, 6, 7, 100,
            101,
            8, 9, 12, 13, 100,
            10, 11, 14, 15, 100]
    np.testing.assert_array_equal(feature_rows(2, (1, 2), 1, 100, 101), want)
    assert image_tokens(2, (1, 2)) == len(want) == 17
    # 2 x 1: the tiles stack, so the local rows run down tile (0, 0) = slot 1, then (1, 0) = slot 2.
    want = [0, 1, 9, 2, 3, 9, 10, 4, 5, 9, 6, 7, 9, 8, 9, 9, 10, 11, 9]
    np.testing.assert_array_equal(feature_rows(2, (2, 1), 0, 9, 10), want)
    # side 1, 2 x 2: tiles row-major, (0, 1) is slot 2 and (1, 0) slot 3.
    np.testing.assert_array_equal(feature_rows(1, (2, 2), 0, 9, 8), [0, 9, 8, 1, 2, 9, 3, 4, 9])
    # A video frame: the global view alone.
    np.testing.assert_array_equal(feature_rows(2, (0, 0), 3, 50, 51), [12, 13, 50, 14, 15, 50])
    assert image_tokens(2, (0, 0)) == 6


# -------------------------------------------------------------------------------- loading

def padded(array, width, height, fit):
    """`array` resized to `fit` (w, h) with Pillow's bicubic, centred on a grey width x height."""
    canvas = Image.new("RGB", (width, height), (GREY,) * 3)
    canvas.paste(Image.fromarray(array).resize(fit, Image.BICUBIC),
                 ((width - fit[0]) // 2, (height - fit[1]) // 2))
    return np.asarray(canvas)


@pytest.mark.parametrize("shape,grid,global_fit,canvas_fit", [
    # 50 x 20 into 16 x 16: 16 x round(6.4) = 6, 5 grey rows above and below. Grid (2, 3) (see
    # test_best_grid_by_hand): canvas 48 x 32 holds 48 x round(19.2) = 19, 6 grey rows above.
    ((20, 50), (2, 3), (16, 6), (48, 19)),
    ((50, 20), (3, 2), (6, 16), (19, 48)),  # tall: the same, transposed
])
def test_load_image_views_pads_and_cuts_tiles(tmp_path, shape, grid, global_fit, canvas_fit):
    array = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    Image.fromarray(array).save(tmp_path / "a.png")
    views, got_grid = load_image_views(str(tmp_path / "a.png"), 16, 6)
    rows, cols = grid
    assert got_grid == grid and views.shape == (1 + rows * cols, 16, 16, 3)
    assert views.dtype == np.uint8
    np.testing.assert_array_equal(views[0], padded(array, 16, 16, global_fit))
    # The padding is grey exactly where the resized image does not reach.
    gap = (16 - min(global_fit)) // 2
    side_strip = views[0][:gap] if global_fit[0] == 16 else views[0][:, :gap]
    assert gap == 5 and (side_strip == GREY).all()
    assert not (views[0][8] == GREY).all() and not (views[0][:, 8] == GREY).all()
    canvas = padded(array, cols * 16, rows * 16, canvas_fit)
    for i in range(rows):
        for j in range(cols):
            np.testing.assert_array_equal(views[1 + i * cols + j],
                                          canvas[16 * i:16 * i + 16, 16 * j:16 * j + 16])


def write_flat_clip(path, levels, width, height, rate=10):
    """A clip whose frame i is flat grey at `levels[i]` (H.264 needs even sides)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for level in levels:
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), level, np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_frames_are_padded_global_views(tmp_path):
    write_flat_clip(tmp_path / "c.mp4", [20, 60, 100, 140], 32, 16)
    frames = load_video(str(tmp_path / "c.mp4"), 16, 5.0, 2, pad=True)
    # 32 x 16 into 16 x 16: 16 x 8, 4 grey rows above and below; the squashed frame has none.
    assert frames.shape == (2, 16, 16, 3)
    assert (frames[:, :4] == GREY).all() and (frames[:, 12:] == GREY).all()
    # H.264 on a flat frame is off by ~1 level; the centre keeps each frame's own level.
    np.testing.assert_allclose(frames[:, 6:10].mean(axis=(1, 2, 3)), [20, 100], atol=3)
    squashed = load_video(str(tmp_path / "c.mp4"), 16, 5.0, 2)
    assert abs(float(squashed[0, :4].mean()) - 20) < 3


# ---------------------------------------------------------------------------- prepare + rows

SIDE, P = 2, 4  # feature rows per view side, features per view (tokens_per_image)
# Positions per image, by hand: global side * (side + 1) = 6; with tiles + 1 separator +
# rows * side * (cols * side + 1).
TOKENS = {(1, 3): 6 + 1 + 2 * 7, (2, 1): 6 + 1 + 4 * 3, (1, 1): 6 + 1 + 2 * 3,
          (2, 2): 6 + 1 + 4 * 5, (0, 0): 6}
VIEWS = {(1, 3): 4, (2, 1): 3, (1, 1): 2, (2, 2): 5, (0, 0): 1}


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    """A tiled split (--max_tiles 4, 8 x 8 views) from images whose sizes are exactly their
    grids' canvases at tile 8: 24 x 8 -> (1, 3), 8 x 16 -> (2, 1), 8 x 8 -> (1, 1), 16 x 16 ->
    (2, 2) (each the fewest tiles showing every pixel), and a 32 x 16 clip."""
    root = tmp_path_factory.mktemp("tiled")
    rng = np.random.default_rng(1)
    arrays = {(1, 3): (8, 24), (2, 1): (16, 8), (1, 1): (8, 8), (2, 2): (16, 16)}
    arrays = {g: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for g, hw in arrays.items()}
    os.makedirs(root / "media")
    for (r, c), a in arrays.items():
        Image.fromarray(a).save(root / "media" / f"im{r}{c}.png")
    write_flat_clip(root / "media" / "clip.mp4", [20 + 10 * i for i in range(20)], 32, 16)
    records = [
        {"text": "a <image> b", "images": ["media/im13.png"]},
        {"text": "<image> and <image>", "images": ["media/im21.png", "media/im11.png"]},
        {"text": "big <image>", "images": ["media/im22.png"]},
        {"text": "clip <video>", "video": "media/clip.mp4"},
        {"text": "just text"},
    ]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "held.jsonl").write_text(json.dumps({"text": "held <image>",
                                                 "images": ["media/im11.png"]}))
    rc = prepare_main(["--format", "multimodal", "--input", str(root / "d.jsonl"),
                       "--eval_input", str(root / "held.jsonl"), "--image_size", "8",
                       "--video_fps", "2", "--max_frames", "3", "--max_tiles", "4",
                       "--out", str(root / "out")])
    assert rc == 0
    return root / "out", arrays


def test_tiled_prepare_stores_grids_and_views(tiled):
    out, arrays = tiled
    meta = json.loads((out / "train" / "meta.json").read_text())
    assert meta["max_tiles"] == 4 and meta["num_images"] == 4 + 3  # 4 images, 3 video frames
    assert meta["num_views"] == 4 + 3 + 2 + 5 + 3
    docs = np.load(out / "train" / "docs-00000.npy")
    grids = np.load(out / "train" / "grids-00000.npy")
    views = np.load(out / "train" / "images-00000.npy")
    tokens = np.load(out / "train" / "tokens-00000.npy")
    assert grids.dtype == np.int64 and views.shape == (meta["num_views"], 8, 8, 3)
    # Records in order; a document's images are grids rows, its views follow the earlier ones'.
    assert grids.tolist() == [[1, 3], [2, 1], [1, 1], [2, 2], [0, 0], [0, 0], [0, 0]]
    assert docs[:, 3].tolist() == [1, 2, 1, 3, 0]
    first = 0
    for (r, c) in [(1, 3), (2, 1), (1, 1), (2, 2)]:
        a = arrays[(r, c)]
        for i in range(r):
            for j in range(c):  # an exact-fit canvas is the image itself, cut row-major
                np.testing.assert_array_equal(views[first + 1 + i * c + j],
                                              a[8 * i:8 * i + 8, 8 * j:8 * j + 8])
        first += 1 + r * c
    # The frames: padded global views of the 32 x 16 clip (4 grey rows above and below).
    assert (views[first:, :2] == GREY).all() and (views[first:, 6:] == GREY).all()
    assert np.count_nonzero(tokens == IMG) == 7 and np.count_nonzero(tokens == FRAME) == 2
    held = json.loads((out / "eval" / "meta.json").read_text())
    assert held["max_tiles"] == 4 and held["num_views"] == 2


def by_loops(side, grid, first, newline, separator):
    """One image's feature indices walked as VL2 lays it out (global rows, separator, the local
    rows across tiles), written with loops independently of `tiling.feature_rows`."""
    out = []
    for r in range(side):
        out += [first * side * side + r * side + c for c in range(side)] + [newline]
    rows, cols = grid
    if rows * cols:
        out.append(separator)
        for R in range(rows * side):
            for C in range(cols * side):
                slot = first + 1 + (R // side) * cols + C // side
                out.append(slot * side * side + (R % side) * side + C % side)
            out.append(newline)
    return out


def image_runs(inputs):
    """(start, length) of each run of image tokens (no two images touch in these corpora)."""
    runs, s = [], 0
    while s < len(inputs):
        if inputs[s] == IMG:
            e = s
            while e < len(inputs) and inputs[e] == IMG:
                e += 1
            runs.append((s, e - s))
            s = e
        else:
            s += 1
    return runs


@pytest.mark.parametrize("max_images,seq_len", [(8, 64), (5, 48)])
def test_tiled_rows_token_counts_and_feature_index(tiled, max_images, seq_len):
    out, arrays = tiled
    T = max_images
    newline, separator = T * P, T * P + 1
    source = MultimodalSource(str(out / "train"), seq_len, P, T, 8, max_tiles=4)
    assert source.cut["docs"] == 0
    grid_of_length = {n: g for g, n in TOKENS.items()}
    seen = []
    for i in range(len(source)):
        row = source[i]
        ex = make_example(row)
        inputs, index = ex["inputs"], ex["feature_index"]
        assert index.shape == (seq_len,) and index.dtype == np.int32
        np.testing.assert_array_equal(index, row["feature_index"][:-1])
        assert not index[inputs != IMG].any()  # 0 away from images
        assert not ex["weights"][ex["targets"] == IMG].any()  # image positions are never targets
        slot = 0
        for start, length in image_runs(inputs):
            grid = grid_of_length[length]  # every image took exactly image_tokens positions
            seen.append(grid)
            got = index[start:start + length]
            np.testing.assert_array_equal(got, by_loops(SIDE, grid, slot, newline, separator))
            assert np.count_nonzero(got == newline) == SIDE + grid[0] * SIDE
            assert np.count_nonzero(got == separator) == (1 if grid[0] else 0)
            # Every feature index names a filled slot of this image, and in the local rows the
            # patch shown at big-grid (R, C) is the image's pixels there (4 x 4 per patch).
            features = got[got < newline]
            assert set(features // P) == set(range(slot, slot + VIEWS[grid]))
            assert row["image_mask"][features // P].all()
            if grid[0]:
                a = arrays[grid]
                local = got[7:].reshape(grid[0] * SIDE, grid[1] * SIDE + 1)[:, :-1]
                for R, C in np.ndindex(*local.shape):
                    v, p = divmod(int(local[R, C]), P)
                    patch = row["pixels"][v][4 * (p // SIDE):4 * (p // SIDE) + 4,
                                             4 * (p % SIDE):4 * (p % SIDE) + 4]
                    np.testing.assert_array_equal(patch, a[4 * R:4 * R + 4, 4 * C:4 * C + 4])
            slot += VIEWS[grid]
        assert row["image_mask"].sum() == slot <= T  # the slots filled are this row's views
        assert not row["pixels"][slot:].any()
    assert sorted(seen) == sorted([(1, 3), (2, 1), (1, 1), (2, 2)] + [(0, 0)] * 3)


def write_tiled(path, docs, max_tiles=4, size=8):
    """docs: (ids with IMG placeholders, grids). Views are random; returns (split, views)."""
    rng = np.random.default_rng(7)
    writer = MultimodalWriter(str(path), ByteTokenizer(), size, max_tiles=max_tiles)
    all_views = []
    for ids, grids in docs:
        n = sum(1 + r * c for r, c in grids)
        views = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        all_views.append(views)
        writer.add(np.asarray(ids), views, "image" if grids else "text",
                   grids=np.asarray(grids, np.int64).reshape(-1, 2))
    writer.close()
    return str(path), all_views


def test_view_budget_moves_images_to_the_next_row_and_drops_oversized(tmp_path):
    docs = [
        ([IMG, 1], [(1, 1)]),              # 2 views, 13 + 2 tokens
        ([IMG, 2], [(1, 1)]),              # 2 more: 4 > T = 3 views, so a row of its own
        ([3, IMG, 4], [(2, 2)]),           # 5 views > T: cut before the image
        ([5, 5], []),
        ([IMG, 6], [(0, 0)]),              # a frame: 1 view, joins the text row
        ([IMG, 7, IMG, 8], [(1, 1)] * 2),  # 4 views > T: the second image is dropped with 8
    ]
    split, views = write_tiled(tmp_path / "s", docs)
    source = MultimodalSource(split, 40, P, 3, 8, max_tiles=4)
    rows = [source[i] for i in range(len(source))]
    assert len(rows) == 5
    np.testing.assert_array_equal(rows[0]["tokens"][:15], [IMG] * 13 + [1, EOS])
    assert (rows[0]["segment_ids"][15:] == 0).all()
    np.testing.assert_array_equal(rows[1]["tokens"][:15], [IMG] * 13 + [2, EOS])
    for r, v in ((0, 0), (1, 1)):
        np.testing.assert_array_equal(rows[r]["image_mask"], [True, True, False])
        np.testing.assert_array_equal(rows[r]["pixels"][:2], views[v])
    np.testing.assert_array_equal(rows[2]["tokens"][:2], [3, 0])
    assert not rows[2]["image_mask"].any() and not rows[2]["feature_index"].any()
    np.testing.assert_array_equal(rows[3]["tokens"][:11], [5, 5, EOS] + [IMG] * 6 + [6, EOS])
    np.testing.assert_array_equal(rows[3]["feature_index"][3:9], [0, 1, 12, 2, 3, 12])
    np.testing.assert_array_equal(rows[3]["image_mask"], [True, False, False])
    np.testing.assert_array_equal(rows[4]["tokens"][:15], [IMG] * 13 + [7, 0])
    np.testing.assert_array_equal(rows[4]["pixels"][:2], views[5][:2])
    # Dropped: doc 2's image, 4 and eos; doc 5's second image, 8 and eos.
    assert source.cut == {"docs": 2, "images_dropped": 2, "text_tokens_dropped": 4}
    copy = pickle.loads(pickle.dumps(source))  # as Grain ships it to a worker
    for key, value in copy[3].items():
        np.testing.assert_array_equal(value, rows[3][key])


def test_tiling_mismatch_is_refused_naming_meta(tiled, tmp_path):
    out, _ = tiled
    with pytest.raises(DataError, match=r"meta\.json: the split was prepared with --max_tiles 4, "
                                        r"the model reads untiled images.*without --max_tiles"):
        MultimodalSource(str(out / "train"), 64, P, 8, 8)
    with pytest.raises(DataError, match=r"--max_tiles 4, the model tiles images with "
                                        r"vision.max_tiles=9.*--max_tiles 9"):
        MultimodalSource(str(out / "train"), 64, P, 8, 8, max_tiles=9)
    plain = MultimodalWriter(str(tmp_path / "plain"), ByteTokenizer(), 8)
    plain.add(np.array([IMG, 1]), np.zeros((1, 8, 8, 3), np.uint8), "image")
    plain.close()
    with pytest.raises(DataError, match=r"prepared untiled .*--max_tiles 4`"):
        MultimodalSource(str(tmp_path / "plain"), 64, P, 8, 8, max_tiles=4)
    # An older meta.json without the key reads as untiled.
    meta_path = tmp_path / "plain" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta.pop("max_tiles") == 0
    meta_path.write_text(json.dumps(meta))
    assert "feature_index" not in MultimodalSource(str(tmp_path / "plain"), 64, P, 8, 8)[0]


def test_tiled_shard_checks_name_file_and_document(tmp_path):
    split, _ = write_tiled(tmp_path / "s", [([1, 2], []), ([IMG, 3], [(1, 2)])])
    MultimodalSource(split, 40, P, 4, 8, max_tiles=4)  # intact
    grids_path = tmp_path / "s" / "grids-00000.npy"
    grids = np.load(grids_path)
    np.save(grids_path, np.array([[1, 1]]))  # 2 views implied, 3 stored
    with pytest.raises(DataError, match=r"grids-00000\.npy: the grids imply 2 views but "
                                        r".*images-00000\.npy holds 3"):
        MultimodalSource(split, 40, P, 4, 8, max_tiles=4)
    np.save(grids_path, np.array([[1, 5]]))  # 5 tiles > max_tiles 4
    with pytest.raises(DataError, match=r"grids-00000\.npy: image 0 \(document 1\) has grid "
                                        r"\(1, 5\)"):
        MultimodalSource(split, 40, P, 4, 8, max_tiles=4)
    np.save(grids_path, grids)
    tokens_path = tmp_path / "s" / "tokens-00000.npy"
    tokens = np.load(tokens_path)
    tokens[3] = 9  # doc 1's placeholder becomes text
    np.save(tokens_path, tokens)
    with pytest.raises(DataError, match=r"docs-00000\.npy: document 1 has 0 image placeholders"):
        MultimodalSource(split, 40, P, 4, 8, max_tiles=4)


def test_text_rows_in_a_tiled_mixture_get_zero_feature_index(tmp_path):
    text = ShardWriter(str(tmp_path / "text"), ByteTokenizer(), 4096)
    for i in range(50):
        text.add(f"text document {i} " * 3)
    text.close()
    image, _ = write_tiled(tmp_path / "image", [([IMG] + [97] * 10, [(1, 2)])] * 30)
    mix = dict(seq_len=32, tokens_per_image=P, max_images=3, image_size=8, max_tiles=4)
    batch = mixed_stream({"text": str(tmp_path / "text"), "image": image}, "text:1,image:1",
                         seed=0, prefetch=0, **mix).take(40)
    assert batch["feature_index"].shape == (40, 32) and batch["feature_index"].dtype == np.int32
    text_rows = ~batch["image_mask"].any(axis=1)
    assert 5 < text_rows.sum() < 35
    assert not batch["feature_index"][text_rows].any()
    # Image rows: the 17 positions of grid (1, 2) then text; newline index T * P = 12, sep 13.
    want = [0, 1, 12, 2, 3, 12, 13, 4, 5, 8, 9, 12, 6, 7, 10, 11, 12]
    for r in np.flatnonzero(~text_rows):
        np.testing.assert_array_equal(batch["feature_index"][r, :17], want)
        assert not batch["feature_index"][r, 17:].any()
    evals = mixed_eval_batches({"text": str(tmp_path / "text"), "image": image}, batch=4,
                               max_batches=1, **mix)
    assert not evals["text"][0]["feature_index"].any()
    np.testing.assert_array_equal(evals["image"][0]["feature_index"][:, :17], [want] * 4)
    # Untiled reading of the same text: no feature_index key at all.
    plain = mixed_stream({"text": str(tmp_path / "text")}, "text:1", seq_len=32, seed=0,
                         prefetch=0, tokens_per_image=P, max_images=3, image_size=8).take(2)
    assert "feature_index" not in plain


def test_caption_batch_expands_tiled_images_like_packing():
    views = np.random.default_rng(3).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    docs = [(np.array([IMG, 97]), views, np.array([[1, 2]])),
            (np.array([98]), views[:0], np.zeros((0, 2), np.int64))]
    b = grounding.caption_batch(docs, 24, P, 4, IMG, FRAME, EOS, max_tiles=4)
    # 17 image positions (newline T * P = 16, separator 17), "a", eos, padding.
    np.testing.assert_array_equal(b["inputs"][0], [IMG] * 17 + [97, EOS] + [0] * 5)
    np.testing.assert_array_equal(
        b["feature_index"][0],
        [0, 1, 16, 2, 3, 16, 17, 4, 5, 8, 9, 16, 6, 7, 10, 11, 16] + [0] * 7)
    assert not b["feature_index"][1].any()
    np.testing.assert_array_equal(b["weights"][0], [0] * 16 + [1, 1] + [0] * 6)
    np.testing.assert_array_equal(b["image_mask"], [[True] * 3 + [False], [False] * 4])
    np.testing.assert_array_equal(b["pixels"][0, :3], views)
    # Untiled, the same call has no feature_index.
    assert "feature_index" not in grounding.caption_batch(
        [(np.array([IMG, 97]), views[:1])], 24, P, 4, IMG, FRAME, EOS)
    with pytest.raises(ValueError, match="needs the grid of every image"):
        grounding.caption_batch([(np.array([IMG, 97]), views)], 24, P, 4, IMG, FRAME, EOS,
                                max_tiles=4)
    with pytest.raises(DataError, match="4 view slots"):
        grounding.caption_batch([(np.array([IMG, IMG]), np.zeros((6, 8, 8, 3), np.uint8),
                                  np.array([[1, 2], [1, 1]]))], 64, P, 4, IMG, FRAME, EOS,
                                max_tiles=4)


def test_vl_sources_cache_knows_the_tiling(tmp_path, monkeypatch):
    """A vl corpus prepared untiled is rebuilt, not reused, for a tiled config (and back)."""
    calls = []
    monkeypatch.setattr(vl_sources, "build_stdlib_corpus", lambda path: (path, path))
    monkeypatch.setattr(vl_sources, "build_vl_corpus", lambda out, **kw: {
        f"{k}_{s}": f"{k}_{s}.jsonl" for k in ("image", "video") for s in ("train", "eval")})

    def prepare(*args, max_tiles=0, **kw):
        calls.append(max_tiles)
        return {"train": {"num_docs": 1}, "eval": {"num_docs": 1}}
    monkeypatch.setattr(vl_sources, "prepare_multimodal", prepare)
    build = lambda tiles: vl_sources.build_vl_sources(str(tmp_path), 16, 8.0, 4, log=str,
                                                      max_tiles=tiles)
    for tiles, prepared in ((0, [0, 0]), (0, []), (4, [4, 4]), (4, []), (2, [2, 2]),
                            (0, [0, 0])):
        calls.clear()
        build(tiles)
        assert calls == prepared, tiles


def test_records_with_more_than_two_images_get_one_tile_each(tiled):
    """DeepSeek-VL2 tiles the images of a record only when it has at most two; with three, each
    image is its global view and one tile (grid (1, 1)) whatever its shape."""
    media = tiled[0].parent / "media"
    paths = tuple(str(media / f"im{g}.png") for g in ("13", "21", "22"))
    tok = ByteTokenizer()
    three = Record("t:1", "<image><image><image>", paths)
    ids, views, grids = build_document(three, tok, 8, 2.0, 3, max_tiles=4)
    assert grids.tolist() == [[1, 1]] * 3 and views.shape[0] == 3 * 2
    two = Record("t:2", "<image><image>", paths[:2])
    assert build_document(two, tok, 8, 2.0, 3, max_tiles=4)[2].tolist() == [[1, 3], [2, 1]]
