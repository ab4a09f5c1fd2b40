"""The DeepSeek decoder.

Einsum / shape-suffix legend used throughout `dsjax.model`:
  B batch, S query sequence, T key sequence, D model dim, H query heads, N kv heads,
  R query heads per kv head (H = N * R), K head dim, F MLP hidden dim, V vocab, L layers.
  DeepSeek-V2/V3 (mla.py, moe.py): E experts, A / P / U MLA no-RoPE / RoPE / value head dims,
  C the MLA KV latent rank or, in MoE, slots per expert; T tokens flattened (B * S) in MoE.
"""

from dsjax.model.decoder import Transformer, count_params
from dsjax.model.loss import ModelLoss, weighted_cross_entropy

__all__ = ["ModelLoss", "Transformer", "count_params", "weighted_cross_entropy"]
