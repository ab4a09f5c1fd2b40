"""Projectors from tower features [B, P, Dv] to the language model's width [B, P', D].

  mlp             DeepSeek-VL's aligner: Linear -> GELU (exact) -> Linear, P' = P
  downsample_mlp  DeepSeek-VL2's downsample_mlp_gelu: a 2x2 pixel-unshuffle of the patch grid
                  (4 neighbours concatenated in `F.unfold`'s channel order), then the same MLP
                  on 4 Dv features, P' = P / 4
The hidden width is D; it carries the "vision_mlp" axis, so tensor parallelism splits the pair
Megatron-style (column then row). With DeepSeek-VL2 tiling the projector also holds the learned
row-newline and view-separator rows [D] (`TILE_ROWS`), which `features.insert_tiled_features`
places between feature rows.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsjax.model.vision.siglip import _bias, _weight
from dsjax.model.vision.spec import VisionSpec


def pixel_unshuffle(x_BPD: jax.Array) -> jax.Array:
    """[B, h*w, D] on a square patch grid -> [B, ceil(h/2)*ceil(w/2), 4 D]: each 2x2 block of
    neighbours in one row, channel-major (d * 4 + 2 * row + column), as torch's `F.unfold(x,
    kernel_size=2, stride=2)` orders it; an odd grid is zero-padded at the bottom and right."""
    B, P, D = x_BPD.shape
    h = int(round(P ** 0.5))
    if h * h != P:
        raise ValueError(f"{P} patches are not a square grid")
    x = x_BPD.reshape(B, h, h, D)
    pad = h % 2
    x = jnp.pad(x, ((0, 0), (0, pad), (0, pad), (0, 0)))
    s = (h + pad) // 2
    # [B, s, row, s, col, D] -> [B, s, s, D, row, col]
    x = x.reshape(B, s, 2, s, 2, D).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(B, s * s, 4 * D)


# The tiling rows, in the order `dsjax.data.multimodal.tiling` indexes them after the views'
# features.
TILE_ROWS = ("image_newline", "view_separator")


def _mlp(module: nn.Module, x_BPE: jax.Array) -> jax.Array:
    """Linear -> GELU (exact erf, torch's nn.GELU()) -> Linear, with biases: [B, P, E] -> [B, P, D]
    in `module`'s params; with tiling, also creates the `TILE_ROWS` params (VL2 draws them
    from N(0, 1/D))."""
    E, D, dt = x_BPE.shape[-1], module.out_dim, module.dtype
    if module.tiling:
        for name in TILE_ROWS:
            module.param(name, nn.with_logical_partitioning(nn.initializers.normal(D ** -0.5),
                                                            ("embed",)), (D,), jnp.float32)
    w1 = _weight(module, "linear1", (E, D), ("vision_embed", "vision_mlp"), module.init_std)
    w2 = _weight(module, "linear2", (D, D), ("vision_mlp", "embed"), module.init_std)
    h_BPF = (jnp.einsum("BPE,EF->BPF", x_BPE.astype(dt), w1.astype(dt))
             + _bias(module, "bias1", (D,), ("vision_mlp",)).astype(dt))
    h_BPF = jax.nn.gelu(h_BPF, approximate=False)
    return (jnp.einsum("BPF,FD->BPD", h_BPF, w2.astype(dt))
            + _bias(module, "bias2", (D,), ("embed",)).astype(dt))


class MlpAligner(nn.Module):
    """DeepSeek-VL's aligner: [B, P, Dv] -> [B, P, D]."""
    out_dim: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    tiling: bool = False

    @nn.compact
    def __call__(self, x_BPE: jax.Array) -> jax.Array:
        return _mlp(self, x_BPE)


class DownsampleMlp(nn.Module):
    """DeepSeek-VL2's downsample_mlp_gelu: `pixel_unshuffle` then the same MLP on 4 Dv features:
    [B, P, Dv] -> [B, P/4, D]."""
    out_dim: int
    init_std: float = 0.02
    dtype: Any = jnp.float32
    tiling: bool = False

    @nn.compact
    def __call__(self, x_BPE: jax.Array) -> jax.Array:
        return _mlp(self, pixel_unshuffle(x_BPE))


PROJECTOR_MODULES = {"mlp": MlpAligner, "downsample_mlp": DownsampleMlp}


def make_projector(spec: VisionSpec, out_dim: int, dtype: Any, name: str) -> nn.Module:
    """The projector `spec.projector` names, projecting to width `out_dim`."""
    return PROJECTOR_MODULES[spec.projector](out_dim, spec.init_std, dtype, spec.tiling,
                                             name=name)
