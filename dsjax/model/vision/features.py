"""From raw pixels to the language model's input: normalise, encode every image slot, order the
feature rows, and put them where the placeholder tokens are.

Shapes are static: a row has M image slots whether or not they hold an image; `image_mask_BM`
says which do. The k-th placeholder token of a row takes the k-th feature row of that row's
images, in slot order of the slots that hold one (HF `masked_scatter` order, per row).
`insert_image_features` is a pure function, so a pipeline's first stage can call it too.

With DeepSeek-VL2 tiling the order is the data pipeline's instead: `insert_tiled_features` takes
each placeholder's row of a table of all slots' features followed by the learned newline and
separator rows, at the index the batch's `feature_index` gives (dsjax.data.multimodal.tiling).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsjax.model.vision.projector import TILE_ROWS

# SigLIP's preprocessing: x / 255, then (x - mean) / std with mean = std = 0.5 per channel.
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5


def normalise_pixels(pixels: jax.Array) -> jax.Array:
    """Raw pixel values 0..255 (uint8 or float) -> float32 SigLIP input, about [-1, 1]."""
    return (pixels.astype(jnp.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD


def image_features(encode: Callable[[jax.Array], jax.Array], pixels_BMHWC: jax.Array,
                   image_mask_BM: jax.Array | None = None) -> jax.Array:
    """Feature rows [B, Q = M * P', D] of each row's images: `encode` (tower then projector,
    [N, H, W, C] normalised -> [N, P', D]) runs on all B * M slots. With a mask, the slots that
    hold an image come first (stable, in slot order) and empty slots' rows are zero."""
    B, M = pixels_BMHWC.shape[:2]
    x_NHWC = normalise_pixels(pixels_BMHWC.reshape(B * M, *pixels_BMHWC.shape[2:]))
    f_NPD = encode(x_NHWC)
    f_BMPD = f_NPD.reshape(B, M, *f_NPD.shape[1:])
    if image_mask_BM is not None:
        order_BM = jnp.argsort(~image_mask_BM, axis=1, stable=True)
        f_BMPD = jnp.take_along_axis(f_BMPD, order_BM[:, :, None, None], axis=1)
        filled_BM = jnp.take_along_axis(image_mask_BM, order_BM, axis=1)
        f_BMPD = jnp.where(filled_BM[:, :, None, None], f_BMPD, 0)
    return f_BMPD.reshape(B, M * f_BMPD.shape[2], f_BMPD.shape[3])


def insert_image_features(x_BSD: jax.Array, tokens_BS: jax.Array, feats_BQD: jax.Array,
                          image_token_id: int) -> jax.Array:
    """x with the embedding at every position where tokens == image_token_id replaced: the k-th
    such position of a row by feats[row, k]. Placeholders past Q reuse row Q - 1 (static shapes;
    the data pipeline writes exactly one per feature row)."""
    is_image_BS = tokens_BS == image_token_id
    k_BS = jnp.clip(jnp.cumsum(is_image_BS, axis=1) - 1, 0, feats_BQD.shape[1] - 1)
    picked_BSD = jnp.take_along_axis(feats_BQD, k_BS[:, :, None], axis=1)
    return jnp.where(is_image_BS[:, :, None], picked_BSD.astype(x_BSD.dtype), x_BSD)


def insert_tiled_features(x_BSD: jax.Array, tokens_BS: jax.Array, feats_BQD: jax.Array,
                          rows_RD: jax.Array, feature_index_BS: jax.Array,
                          image_token_id: int) -> jax.Array:
    """x with the embedding at every placeholder replaced by row feature_index[b, s] of
    [feats[b] (slot after slot, unreordered); rows (newline, separator)]. Indices are clipped to
    the table (static shapes); non-placeholder positions keep x."""
    B, Q, D = feats_BQD.shape
    table_BTD = jnp.concatenate(
        [feats_BQD, jnp.broadcast_to(rows_RD.astype(feats_BQD.dtype), (B, *rows_RD.shape))],
        axis=1)
    index_BS = jnp.clip(feature_index_BS, 0, table_BTD.shape[1] - 1)
    picked_BSD = jnp.take_along_axis(table_BTD, index_BS[:, :, None], axis=1)
    is_image_BS = tokens_BS == image_token_id
    return jnp.where(is_image_BS[:, :, None], picked_BSD.astype(x_BSD.dtype), x_BSD)


def with_image_features(x_BSD: jax.Array, tokens_BS: jax.Array, spec: Any,
                        encode: Callable[[jax.Array], jax.Array], projector_params: Any,
                        pixels_BMHWC: jax.Array, image_mask_BM: jax.Array,
                        feature_index_BS: jax.Array | None = None) -> jax.Array:
    """x with the projected features of a batch's views at its placeholders, in the order the
    `VisionSpec` `spec` implies: slot order, or with tiling the batch's `feature_index` into the
    slots' features and the projector's tile rows (`projector_params`, read after `encode`)."""
    if not spec.tiling:
        feats_BQD = image_features(encode, pixels_BMHWC, image_mask_BM)
        return insert_image_features(x_BSD, tokens_BS, feats_BQD, spec.image_token_id)
    if feature_index_BS is None:
        raise ValueError("a tiling vision model needs the batch's feature_index (prepare the "
                         "data with --max_tiles)")
    feats_BQD = image_features(encode, pixels_BMHWC)
    rows_RD = jnp.stack([nn.unbox(projector_params()[name]) for name in TILE_ROWS])
    return insert_tiled_features(x_BSD, tokens_BS, feats_BQD, rows_RD, feature_index_BS,
                                 spec.image_token_id)
