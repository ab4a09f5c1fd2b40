"""The DeepSeek decoder.

Einsum / shape-suffix legend used throughout `dsjax.model`:
  B batch, S query sequence, T key sequence, D model dim, H query heads, N kv heads,
  R query heads per kv head (H = N * R), K head dim, F MLP hidden dim, V vocab, L layers.
  DeepSeek-V2/V3 (mla.py, moe.py): E experts, A / P / U MLA no-RoPE / RoPE / value head dims,
  C the MLA KV latent rank or, in MoE, slots per expert; T tokens flattened (B * S) in MoE.
  Vision (vision/): M image slots per row, N images (B * M), P patches per image (T as keys),
  Q image feature rows per row (M * P'), X pixels per patch, E the tower width a projector maps
  to D; pixel arrays [B, M, H, W, C] use H, W, C for image height, width and channels; inside
  the tower D is its width, H its heads, K head dim, F MLP width.
"""

from dsjax.model import decode, kv_cache
from dsjax.model.decoder import Transformer, count_params
from dsjax.model.loss import ModelLoss, weighted_cross_entropy

__all__ = ["ModelLoss", "Transformer", "count_params", "decode", "kv_cache",
           "weighted_cross_entropy"]
