"""The batch schema: which arrays one step's batch holds, their dtypes and per-row shapes, and how
a vision-language batch's media reach the model. Data, batching, the train steps, the pipeline
and evaluation all read it from here, so a new batch array is added in one place."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# The arrays of one batch, each [B, S] (or [k, B/k, S] with accumulation): tokens in, next
# tokens out, packed-document ids, positions within a document, and per-target loss weights.
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")
# A vision-language batch also has, per row, its view slots' raw pixels [M, H, W, C] (uint8),
# which slots hold one [M] (bool), and with tiling each input position's feature row [S] (int32);
# see `media_layout`.
MEDIA_KEYS = ("pixels", "image_mask", "feature_index")


def media_layout(vision: Any, seq_len: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key: (per-row dims, dtype)} of a batch's media arrays for a `VisionConfig` and rows of
    `seq_len` inputs; {} for a text model. Every row has `vision.max_images` view slots (static
    shapes under jit); tiling adds the feature row of each input position
    (dsjax.data.multimodal.tiling)."""
    if not vision.enabled:
        return {}
    M, H = vision.max_images, vision.image_size
    layout = {"pixels": ((M, H, H, 3), jnp.uint8), "image_mask": ((M,), jnp.bool_)}
    if vision.tiling:
        layout["feature_index"] = ((seq_len,), jnp.int32)
    return layout


def media_args(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The model's keyword arguments for a batch's media arrays ({} for a text batch)."""
    if "pixels" not in batch:
        return {}
    args = {"pixels_BMHWC": batch["pixels"], "image_mask_BM": batch["image_mask"]}
    if "feature_index" in batch:
        args["feature_index_BS"] = batch["feature_index"]
    return args


def abstract_arrays(shardings: dict[str, Any], lead: tuple[int, ...], seq_len: int,
                    media: dict[str, tuple[tuple[int, ...], Any]] | None = None
                    ) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch as abstract arrays, one per key of `shardings` (for lowering, nothing allocated):
    `lead` dims ([B], or [k, B/k] with accumulation), then [S] for the token arrays (weights
    float32, the rest int32) or a `media` key's per-row dims and dtype (`media_layout`)."""
    media = media or {}

    def spec(key: str, where: Any) -> jax.ShapeDtypeStruct:
        dims, dtype = media.get(key, ((seq_len,), jnp.float32 if key == "weights" else jnp.int32))
        return jax.ShapeDtypeStruct(tuple(lead) + tuple(dims), dtype, sharding=where)
    return {k: spec(k, s) for k, s in shardings.items()}
