"""The KV cache of incremental decoding: its layout per attention kind, writing new entries, and
which cached slots a query may read.

The one idea: every row keeps its own tokens left-aligned in slots 0, 1, 2, ... of a cache of
`max_len` slots, slot = the token's position. A step writes its tokens at their positions and
its queries read the slots at or before their own position; everything later is masked. Rows
of different prompt lengths therefore share one cache: a row's padding written past its prompt
is masked until the row's own generated tokens overwrite it, one slot per step.

What is cached, per token and layer (docs/posttraining.md):
- grouped-query attention: the rotated keys and the values, [N, K] each, sharded over `tensor`
  with the kv heads;
- MLA: the normed KV latent [C] and the rotated shared RoPE key [P], kv_lora_rank +
  qk_rope_head_dim values: the keys and values of every head are never materialised, the
  up-projections are absorbed into the query and the output (`mla.MLA`). The latent belongs to
  no head, so it is replicated over `tensor` like the activations.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# Logical axes of one layer's cache entries (the stacked cache adds a leading layers axis, None).
GQA_AXES = ("act_batch", None, "act_kv_heads", None)  # [B, T, N, K]
MLA_AXES = ("act_batch", None, None)  # [B, T, C] and [B, T, P]


def layer_shapes(cfg: Any, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """{entry: shape} of one layer's cache for a `ModelConfig`."""
    if cfg.attention == "mla":
        return {"latent": (batch, max_len, cfg.kv_lora_rank),
                "k_pe": (batch, max_len, cfg.qk_rope_head_dim)}
    shape = (batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    return {"k": shape, "v": shape}


def values_per_token(cfg: Any) -> int:
    """Cached values per token per layer: kv_lora_rank + qk_rope_head_dim for MLA, 2 N K
    otherwise."""
    return sum(s[-1] if len(s) == 3 else s[-1] * s[-2]
               for s in layer_shapes(cfg, 1, 1).values())


def entry_axes(cfg: Any) -> tuple[str | None, ...]:
    """The logical axes of one layer's cache entries."""
    return MLA_AXES if cfg.attention == "mla" else GQA_AXES


def init_cache(cfg: Any, stacks: list[tuple[str, int, int, bool]], batch: int, max_len: int,
               dtype: Any) -> dict[str, dict[str, jax.Array]]:
    """A zero cache {stack name: {entry: [layers of the stack, *layer shape]}} in `dtype` (the
    compute dtype), for `Transformer._stacks()`; call it inside `sharding.activate` so the
    entries take their shardings."""
    axes = (None,) + entry_axes(cfg)
    return {name: {key: nn.with_logical_constraint(jnp.zeros((hi - lo, *shape), dtype), axes)
                   for key, shape in layer_shapes(cfg, batch, max_len).items()}
            for name, lo, hi, _ in stacks}


def write(cache_BTX: jax.Array, new_BSX: jax.Array, positions_BS: jax.Array) -> jax.Array:
    """The cache with each row's S new entries written at that row's slots positions[b, 0] ...
    (a step's positions are consecutive)."""
    def row(cache_TX, new_SX, start):
        return jax.lax.dynamic_update_slice_in_dim(cache_TX, new_SX.astype(cache_TX.dtype),
                                                   start, axis=0)
    return jax.vmap(row)(cache_BTX, new_BSX, positions_BS[:, 0])


def readable(positions_BS: jax.Array, max_len: int) -> jax.Array:
    """[B, S, T] True where the query at positions[b, s] may read cache slot t: t <= its
    position (causal; later slots are padding or not yet written)."""
    return jnp.arange(max_len)[None, None, :] <= positions_BS[:, :, None]
