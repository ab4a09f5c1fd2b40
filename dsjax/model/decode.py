"""The decoder run incrementally over a KV cache: one function serves the prefill (a prompt's
tokens at positions 0..) and every decoding step (one token a row, at that row's next position).

The one idea: it is the training model's own blocks (`DecoderBlock` with a cache), scanned over
the same stacked params, so decoding shares every projection, norm, router and expert with
training; only the attention reads the cache (dsjax.model.kv_cache). Projections run in the
compute dtype: an fp8 policy's current scaling would take its scale from one token's
activations at a time (docs/posttraining.md). The MTP modules are training-only and do not run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dsjax.model import kv_cache
from dsjax.model.chunked_loss import output_logits
from dsjax.model.decoder import Transformer, embed_tokens
from dsjax.model.layers import rms_norm


def init_cache(model: Transformer, batch: int, max_len: int) -> dict[str, dict[str, jax.Array]]:
    """A zero cache of `max_len` slots for `batch` rows of `model` (kv_cache.init_cache)."""
    return kv_cache.init_cache(model.cfg, model._stacks(), batch, max_len, model.dtype)


def forward(model: Transformer, params: Any, tokens_BS: jax.Array, positions_BS: jax.Array,
            cache: dict[str, dict[str, jax.Array]], logits_at: jax.Array | None = None
            ) -> tuple[jax.Array, dict]:
    """(float32 logits [B, S, V], the cache with these tokens written). Each row's S tokens are
    at consecutive positions starting at positions[b, 0]; a query reads the cache slots at or
    before its position. `params`: the model's unboxed params. `logits_at` [B]: only the logits
    of that index of each row, [B, 1, V] (a prefill needs its prompts' last ones only)."""
    cfg = model.cfg
    x_BSD = embed_tokens(params["embedding"], tokens_BS, model.dtype)
    segment_ids_BS = jnp.ones_like(tokens_BS)
    new_cache = {}
    for name, _, _, moe in model._stacks():
        block = model._block(((), ()), moe=moe)  # decoding runs no fp8 (docs/posttraining.md)

        def layer(x_BSD, params_and_cache, block=block):
            layer_params, layer_cache = params_and_cache
            x_BSD, _, layer_cache = block.apply({"params": layer_params}, x_BSD, positions_BS,
                                                segment_ids_BS, layer_cache)
            return x_BSD, layer_cache

        x_BSD, new_cache[name] = jax.lax.scan(layer, x_BSD, (params[name], cache[name]))
    if logits_at is not None:
        x_BSD = jnp.take_along_axis(x_BSD, logits_at[:, None, None], axis=1)
    x_BSD = rms_norm(x_BSD, params["final_norm"]["scale"], cfg.norm_eps)
    return output_logits(x_BSD, params["lm_head"], model.dtype), new_cache
