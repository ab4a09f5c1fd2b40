"""DeepSeek-VL2's dynamic tiling: which grid of tiles an image gets, how many decoder positions it
takes, and which feature row fills each of them (docs/multimodal.md, "Tiling").

An image becomes views of the tower's square size: one global view (the whole image, padded to a
square), then `rows x cols` local tiles (the image padded to the best-fitting grid's shape and cut
row-major). A video frame is a global view alone, grid (0, 0). With `side` feature rows per view
side, the decoder sees, per image:

  global   side rows of (side features + the row-newline embedding)
  sep      the view-separator embedding                               (only with local tiles)
  local    rows*side rows of (cols*side features + the row-newline)   (only with local tiles)

the local rows running across tiles: row R holds row R % side of tiles R // side, left to right.
`feature_rows` gives, per position, an index into the batch row's table of features: view slot v's
patch p is v * side^2 + p, then two learned rows follow all slots' features, NEWLINE then SEPARATOR
(their indices depend on the row's slot count, so they are passed in).
"""

from __future__ import annotations

import numpy as np

from dsjax.config.sections import global_view_tokens

FRAME_GRID = (0, 0)  # a video frame: the global view only


def grids(max_tiles: int) -> list[tuple[int, int]]:
    """Every (rows, cols) with rows * cols <= max_tiles, fewest tiles first, then fewest rows: the
    candidate order, which breaks ties in `best_grid`."""
    if max_tiles < 1:
        raise ValueError(f"max_tiles must be >= 1, got {max_tiles}")
    found = [(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles // r + 1)]
    return sorted(found, key=lambda g: (g[0] * g[1], g[0]))


def best_grid(width: int, height: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """The (rows, cols) grid whose canvas (cols * tile by rows * tile pixels) shows a width x
    height image at the most original pixels when scaled to fit, and of those wastes the fewest
    canvas pixels (DeepSeek-VL2's and LLaVA-NeXT's `select_best_resolution`)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    best, best_effective, best_wasted = (1, 1), -1, 0
    for rows, cols in grids(max_tiles):
        canvas_w, canvas_h = cols * tile, rows * tile
        scale = min(canvas_w / width, canvas_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_w * canvas_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (rows, cols), effective, wasted
    return best


def num_views(grid: tuple[int, int]) -> int:
    """Tower inputs one image takes: the global view plus its tiles."""
    return 1 + grid[0] * grid[1]


def image_tokens(side: int, grid: tuple[int, int]) -> int:
    """Decoder positions of one image (or frame, grid (0, 0)) with `side` feature rows per view
    side."""
    rows, cols = grid
    tokens = global_view_tokens(side, tiling=True)
    if rows * cols:
        tokens += 1 + rows * side * (cols * side + 1)
    return tokens


def feature_rows(side: int, grid: tuple[int, int], first_view: int, newline: int,
                 separator: int) -> np.ndarray:
    """int32 [image_tokens(side, grid)]: the feature-table index of each position of one image
    whose global view is in slot `first_view` and whose tiles follow it in row-major order."""
    P = side * side
    patch = np.arange(P, dtype=np.int64).reshape(side, side)
    eol = np.full((side, 1), newline, np.int64)
    parts = [np.concatenate([first_view * P + patch, eol], axis=1).ravel()]
    rows, cols = grid
    if rows * cols:
        # tile (i, j) is slot first_view + 1 + i * cols + j; big-grid row R = i * side + r.
        tile_IJ = first_view + 1 + np.arange(rows * cols).reshape(rows, cols)
        big = tile_IJ[:, None, :, None] * P + patch[None, :, None, :]  # [i, r, j, c]
        big = big.reshape(rows * side, cols * side)
        eol = np.full((rows * side, 1), newline, np.int64)
        parts += [np.array([separator]), np.concatenate([big, eol], axis=1).ravel()]
    return np.concatenate(parts).astype(np.int32)
