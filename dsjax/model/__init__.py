"""The DeepSeek decoder.

Einsum / shape-suffix legend used throughout `dsjax.model`:
  B batch, S query sequence, T key sequence, D model dim, H query heads, N kv heads,
  R query heads per kv head (H = N * R), K head dim, F MLP hidden dim, V vocab, L layers.
"""

from dsjax.model.decoder import Transformer, count_params, weighted_cross_entropy

__all__ = ["Transformer", "count_params", "weighted_cross_entropy"]
