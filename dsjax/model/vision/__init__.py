"""DeepSeek-VL image input: the SigLIP tower (`siglip`), the projectors (`projector`), the feature
insertion at placeholder tokens (`features`), and `VisionSpec`, their fields (`spec`)."""

from dsjax.model.vision.features import (image_features, insert_image_features,
                                        insert_tiled_features, normalise_pixels,
                                        with_image_features)
from dsjax.model.vision.projector import (TILE_ROWS, DownsampleMlp, MlpAligner, make_projector,
                                          pixel_unshuffle)
from dsjax.model.vision.siglip import SiglipTower
from dsjax.model.vision.spec import PROJECTORS, SPEC_FILE, VisionSpec

__all__ = ["DownsampleMlp", "MlpAligner", "PROJECTORS", "SPEC_FILE", "SiglipTower", "TILE_ROWS",
           "VisionSpec", "image_features", "insert_image_features", "insert_tiled_features",
           "make_projector", "normalise_pixels", "pixel_unshuffle", "with_image_features"]
