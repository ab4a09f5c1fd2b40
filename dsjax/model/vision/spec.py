"""`VisionSpec`: the explicit fields of a DeepSeek-VL image input (SigLIP tower, projector, image
token), the one value the decoder needs to read images. Built from the `vision` config section or
from a Hugging Face `DeepseekVLConfig` (dsjax.convert); it holds no defaults of its own beyond
SigLIP's fixed constants."""

from __future__ import annotations

import dataclasses
import json
import os

from dsjax.config.sections import PROJECTORS, tokens_per_image, view_side
# The tower's fields (`SiglipTower`), in its order.
TOWER_FIELDS = ("image_size", "patch_size", "num_channels", "hidden_size", "num_layers",
                "num_heads", "mlp_dim", "norm_eps", "gelu_tanh", "init_std")


# A checkpoint directory of a vision model holds its VisionSpec in this file, beside the steps
# (the Orbax meta holds the language model's config only); dsjax.convert exports from it.
SPEC_FILE = "vision_spec.json"


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    image_size: int  # square input side in pixels
    patch_size: int  # patch side; the tower sees (image_size // patch_size)^2 patches
    hidden_size: int  # tower width
    num_layers: int  # tower blocks (scanned)
    num_heads: int  # tower attention heads
    mlp_dim: int  # tower MLP hidden width
    image_token_id: int  # the placeholder token each image feature row replaces
    projector: str = "mlp"  # one of PROJECTORS
    frame_token_id: int = -1  # the separator between video frames (an ordinary token); -1 = none
    num_channels: int = 3  # pixel channels
    norm_eps: float = 1e-6  # tower LayerNorm epsilon (SigLIP: 1e-6)
    gelu_tanh: bool = True  # tower MLP GELU: tanh approximation (gelu_pytorch_tanh) or exact
    init_std: float = 0.02  # normal init std of every tower and projector matrix
    tiling: bool = False  # DeepSeek-VL2 tiling: learned row-newline and view-separator rows

    def __post_init__(self):
        if self.projector not in PROJECTORS:
            raise ValueError(f"projector {self.projector!r}: expected one of {PROJECTORS}")
        if self.image_size % self.patch_size or self.hidden_size % self.num_heads:
            raise ValueError("image_size must divide by patch_size and hidden_size by num_heads")

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def side(self) -> int:
        """Feature rows per view side after the projector."""
        return view_side(self.image_size, self.patch_size, self.projector)

    @property
    def tokens_per_image(self) -> int:
        """Feature rows (placeholder tokens) per image after the projector."""
        return tokens_per_image(self.image_size, self.patch_size, self.projector)

    def tower_fields(self) -> dict:
        return {name: getattr(self, name) for name in TOWER_FIELDS}

    def save(self, directory: str) -> None:
        """Writes SPEC_FILE into `directory` (atomically)."""
        path = os.path.join(directory, SPEC_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
