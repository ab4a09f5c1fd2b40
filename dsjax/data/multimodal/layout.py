"""How a document's image placeholders become decoder positions: the one expansion that packing
(`pack`) and caption scoring (`dsjax.evaluate.grounding`) share.

Untiled, each placeholder becomes `tokens_per_image` copies of itself, one per view slot filled in
order, and the model fills them from the slots' features in order. With DeepSeek-VL2 tiling
(`tiling`), placeholder k of grid g becomes `tiling.image_tokens(side, g)` copies and takes
`tiling.num_views(g)` view slots; each position also gets its feature-table index
(`tiling.feature_rows`): slot v's patch p is v * side^2 + p, then the row-newline
(max_images * side^2) and the view separator (max_images * side^2 + 1). Both special rows sit
after every slot's features, so their indices depend on the row's slot count only.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from dsjax.data.multimodal.tiling import feature_rows, image_tokens, num_views


def per_grid(fn: Callable[[tuple[int, int]], int], grids: np.ndarray) -> np.ndarray:
    """int64 [n]: fn((rows, cols)) of each row of int [n, 2] (evaluated once per distinct grid)."""
    grids = np.asarray(grids, np.int64).reshape(-1, 2)
    if not grids.shape[0]:
        return np.zeros(0, np.int64)
    unique, inverse = np.unique(grids, axis=0, return_inverse=True)
    values = np.array([fn((int(r), int(c))) for r, c in unique.tolist()], np.int64)
    return values[inverse.reshape(-1)]


def views_per_image(grids: np.ndarray) -> np.ndarray:
    """int64 [n]: the view slots each image of grid int [n, 2] takes (`tiling.num_views`)."""
    return per_grid(num_views, grids)


class MediaLayout:
    """The positions and view slots of a row's images, for `max_images` view slots per row and
    `tokens_per_image` positions per view (the square of the view side). `max_tiles` > 0: tiled
    (then every image has a grid, and `expand` also gives feature indices)."""

    def __init__(self, tokens_per_image: int, max_images: int, max_tiles: int = 0):
        if tokens_per_image < 1 or max_images < 1 or max_tiles < 0:
            raise ValueError(f"need tokens_per_image >= 1, max_images >= 1 and max_tiles >= 0, "
                             f"got {tokens_per_image}, {max_images}, {max_tiles}")
        self.tokens_per_image, self.max_images = int(tokens_per_image), int(max_images)
        self.max_tiles = int(max_tiles)
        self.side = math.isqrt(self.tokens_per_image)
        if self.tiled and self.side ** 2 != self.tokens_per_image:
            raise ValueError(f"tiling needs square views: tokens_per_image {tokens_per_image} is "
                             f"not side^2 (vision.view_side)")

    @property
    def tiled(self) -> bool:
        return self.max_tiles > 0

    @property
    def newline(self) -> int:
        """The row-newline embedding's feature index (after every slot's side^2 features)."""
        return self.max_images * self.tokens_per_image

    @property
    def separator(self) -> int:
        """The view-separator embedding's feature index."""
        return self.newline + 1

    @property
    def min_image_tokens(self) -> int:
        """Positions of the smallest image: one view (tiled: a video frame, with its newlines)."""
        return image_tokens(self.side, (0, 0)) if self.tiled else self.tokens_per_image

    def image_tokens(self, grids: np.ndarray | None, n: int) -> np.ndarray:
        """int64 [n]: positions of each of n images (grids int [n, 2]; None untiled)."""
        if not self.tiled:
            return np.full(n, self.tokens_per_image, np.int64)
        return per_grid(lambda g: image_tokens(self.side, g), grids)

    def image_views(self, grids: np.ndarray | None, n: int) -> np.ndarray:
        """int64 [n]: view slots each of n images takes."""
        return views_per_image(grids) if self.tiled else np.ones(n, np.int64)

    def expand(self, raw: np.ndarray, image_token_id: int, grids: np.ndarray | None = None,
               first_view: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """(int32 tokens, int32 feature index or None untiled) of a document's raw ids whose
        images' global views start at slot `first_view`; `grids`: the grids of its placeholders
        in order (tiled only)."""
        raw = np.asarray(raw)
        is_image = raw == image_token_id
        n = int(np.count_nonzero(is_image))
        if self.tiled:
            if grids is None:
                raise ValueError("a tiled layout needs the grid of every image (`build_document` "
                                 "and `grounding.caption_image` give them)")
            grids = np.asarray(grids, np.int64).reshape(-1, 2)
            if grids.shape[0] != n:
                raise ValueError(f"{n} image placeholders but {grids.shape[0]} grids")
        lengths = self.image_tokens(grids, n)
        repeats = np.ones(raw.size, np.int64)
        repeats[is_image] = lengths
        tokens = np.repeat(raw.astype(np.int32), repeats)
        if not self.tiled:
            return tokens, None
        index = np.zeros(tokens.size, np.int32)
        starts = (np.cumsum(repeats) - repeats)[is_image]
        views = self.image_views(grids, n)
        slots = first_view + np.cumsum(views) - views
        for start, length, slot, grid in zip(starts.tolist(), lengths.tolist(), slots.tolist(),
                                             grids.tolist()):
            index[start:start + length] = feature_rows(self.side, tuple(grid), slot,
                                                       self.newline, self.separator)
        return tokens, index
