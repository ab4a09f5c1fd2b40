"""Image and video files -> uint8 RGB arrays of one square size, for the multimodal shards.

Images are decoded with Pillow, videos (and animated GIFs given as video) with PyAV, whose wheels
ship FFmpeg. Every frame is resized to (size, size) with bicubic resampling and no crop: SigLIP and
CLIP-style encoders (DeepSeek-VL's included) are trained on bicubic-resized squares, and squashing
keeps content a centre crop would cut away. Video frames are sampled by presentation time at a
fixed rate, so a 60 fps and a 25 fps clip of the same scene give the same frames.

With DeepSeek-VL2 tiling (`load_image_views`, `load_video(..., pad=True)`) nothing is squashed:
a view is the image padded to the target shape keeping its aspect ratio (Pillow's
`ImageOps.pad`: bicubic, centred, grey 127 = SigLIP's mean 0.5 in pixels, as VL2's processor
pads), and an image also gets local tiles cut from it padded to its best grid (`tiling`).

Every failure is a `MediaError` (a `DataError`) naming the file and the reason; the prepare tool
tells these apart from malformed records, which stop it, because a bad media file only skips its
record.
"""

from __future__ import annotations

import os

import numpy as np

from dsjax.errors import DataError
from dsjax.data.multimodal.tiling import best_grid

# A frame whose time is within this of a sample time counts as shown at it: presentation times are
# exact fractions, the sample grid k / fps is a float.
_TIME_EPS = 1e-6
PAD_COLOR = (127, 127, 127)  # SigLIP's normalisation mean 0.5, in uint8 (VL2 pads with it)


class MediaError(DataError):
    """An image or video cannot be decoded; names the file and the reason."""


def _check_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"image size must be >= 1, got {size}")


def _to_square(image, size: int) -> np.ndarray:
    """A PIL image -> uint8 [size, size, 3] RGB (bicubic, aspect ratio not kept)."""
    from PIL import Image  # pylint: disable=g-import-not-at-top

    rgb = image.convert("RGB")
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.uint8).reshape(size, size, 3)


def _padded(image, width: int, height: int) -> np.ndarray:
    """A PIL image -> uint8 [height, width, 3] RGB: scaled to fit (bicubic), centred, the rest
    PAD_COLOR (aspect ratio kept)."""
    from PIL import Image, ImageOps  # pylint: disable=g-import-not-at-top

    rgb = ImageOps.pad(image.convert("RGB"), (width, height), Image.Resampling.BICUBIC,
                       PAD_COLOR)
    return np.asarray(rgb, dtype=np.uint8).reshape(height, width, 3)


def _views(image, size: int, max_tiles: int) -> tuple[np.ndarray, tuple[int, int]]:
    """A PIL image -> (uint8 [1 + rows * cols, size, size, 3]: the global view, then the tiles
    row-major, (rows, cols))."""
    rows, cols = best_grid(image.width, image.height, size, max_tiles)
    canvas = _padded(image, cols * size, rows * size)
    tiles = canvas.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4)
    views = np.concatenate([_padded(image, size, size)[None],
                            tiles.reshape(rows * cols, size, size, 3)])
    return views, (rows, cols)


def _read_image(path: str, size: int, decode):
    """`decode(PIL image)` of an image file (its first frame if animated), errors as MediaError."""
    # Pillow is imported on use: `import dsjax.data` stays numpy-only.
    from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top

    _check_size(size)
    if not os.path.isfile(path):
        raise MediaError(f"{path}: image file not found")
    try:
        with Image.open(path) as image:
            image.load()  # open() reads only the header; truncated pixel data fails here
            return decode(image)
    except UnidentifiedImageError:
        raise MediaError(f"{path}: not an image Pillow can read") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise MediaError(f"{path}: corrupt image ({e or type(e).__name__})") from None


def load_image(path: str, size: int) -> np.ndarray:
    """Decodes an image file (its first frame if animated) to uint8 [size, size, 3] RGB."""
    return _read_image(path, size, lambda image: _to_square(image, size))


def load_image_views(path: str, size: int, max_tiles: int) -> tuple[np.ndarray, tuple[int, int]]:
    """DeepSeek-VL2's views of an image file: (uint8 [1 + rows * cols, size, size, 3], the
    (rows, cols) grid of `tiling.best_grid`): the global view, then the local tiles row-major."""
    if max_tiles < 1:
        raise ValueError(f"max_tiles must be >= 1, got {max_tiles}")
    return _read_image(path, size, lambda image: _views(image, size, max_tiles))


def load_video(path: str, size: int, fps: float, max_frames: int, pad: bool = False
               ) -> np.ndarray:
    """Decodes a video (or animated GIF) to uint8 [n, size, size, 3], 1 <= n <= max_frames.

    Frame k is the frame on screen at time t0 + k / fps (t0: the first frame's presentation time),
    for every such time up to the last frame's: sampling is by time, not every Nth decoded frame,
    so variable frame rates sample evenly. Frames are resized as they stream past, so memory holds
    one full-size frame. With `pad` (tiling: each frame is a global view, grid
    `tiling.FRAME_GRID`) frames are padded to the square, not squashed.
    """
    import av  # pylint: disable=g-import-not-at-top

    _check_size(size)
    if fps <= 0 or max_frames < 1:
        raise ValueError(f"need fps > 0 and max_frames >= 1, got {fps}, {max_frames}")
    if not os.path.isfile(path):
        raise MediaError(f"{path}: video file not found")
    square = (lambda image: _padded(image, size, size)) if pad else (
        lambda image: _to_square(image, size))
    out: list[np.ndarray] = []
    prev, prev_time, first = None, 0.0, None
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise MediaError(f"{path}: no video stream")
            for frame in container.decode(container.streams.video[0]):
                if frame.time is None:
                    raise MediaError(f"{path}: a frame has no presentation time")
                time = float(frame.time)
                if prev is not None and time < prev_time:
                    continue  # out of presentation order: the frame shown already moved past it
                first = time if first is None else first
                # Sample times before this frame's showed the previous frame.
                while prev is not None and len(out) < max_frames and (
                        first + len(out) / fps < time - _TIME_EPS):
                    out.append(square(prev))
                if len(out) == max_frames:
                    break
                prev, prev_time = frame.to_image(), time
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as e:
        raise MediaError(f"{path}: unreadable video ({e or type(e).__name__})") from None
    if prev is None:
        raise MediaError(f"{path}: video has zero frames")
    # The last frame answers every remaining sample time up to its own presentation time.
    while len(out) < max_frames and first + len(out) / fps <= prev_time + _TIME_EPS:
        out.append(square(prev))
    return np.stack(out)
