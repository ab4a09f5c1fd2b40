"""Batched generation with a KV cache: prefill, then one token a row per step, on the device.

The one idea: the whole generation is one compiled program: the prefill writes the prompts into
the cache (dsjax.model.decode), then a `lax.while_loop` decodes a token a row per step until every
row has met a stop token or `max_new_tokens`, with no host round trip per token. Prompts of any
lengths share the batch (rows are left-aligned in the cache, kv_cache); they are padded to a
multiple of `PROMPT_BUCKET` tokens, and the rows to the mesh's `data` size, so a few programs
serve every call. Multi-process: every process passes the same prompts and gets the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dsjax import sharding
from dsjax.evaluate.sampling import Sampling, next_tokens
from dsjax.model import decode

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this many tokens (one program each)


@dataclasses.dataclass
class Generator:
    """Generates continuations of token prompts from a `Transformer`'s params on `mesh`."""
    model: Any  # dsjax.model.decoder.Transformer
    mesh: Mesh
    rules: Any  # the logical axis rules the params are sharded by
    sampling: Sampling = Sampling()
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()  # a row ends at the first of these (not returned)
    vocab_size: int = 0  # ids at or above this are never chosen (the tokenizer's vocabulary,
                         # when the model's embedding is padded past it); 0: the model's
    _programs: dict = dataclasses.field(default_factory=dict, repr=False)

    def generate(self, params: Any, prompts: Sequence[Sequence[int]], seed: int = 0
                 ) -> list[list[int]]:
        """Each prompt's continuation: up to `max_new_tokens` ids, ending before a stop id."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        rows = -(-len(prompts) // sharding.data_size(self.mesh)) * sharding.data_size(self.mesh)
        width = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
        tokens = np.zeros((rows, width), np.int32)
        lengths = np.ones(rows, np.int32)  # padding rows: one token, their output is dropped
        for i, p in enumerate(prompts):
            tokens[i, :len(p)], lengths[i] = p, len(p)
        program = self._program(rows, width)
        rows_split = sharding.rows_sharding(self.mesh)  # decoding rows stay whole (no context)
        put = lambda a: jax.make_array_from_callback(a.shape, rows_split, lambda index: a[index])
        with sharding.activate(self.mesh, self.rules):
            out, steps = program(params, put(tokens), put(lengths), jax.random.key(seed))
        out, steps = np.asarray(jax.device_get(out)), int(jax.device_get(steps))
        results = []
        for row in out[:len(prompts), :steps]:
            stops = np.flatnonzero(np.isin(row, self.stop_ids)) if self.stop_ids else []
            results.append([int(t) for t in row[:stops[0] if len(stops) else steps]])
        return results

    def _program(self, rows: int, width: int):
        key = (rows, width)
        if key not in self._programs:
            self._programs[key] = jax.jit(self._run,
                                          out_shardings=sharding.replicated(self.mesh))
        return self._programs[key]

    def _run(self, params, prompt_BP, lengths_B, key):
        """(tokens [B, max_new_tokens] (0 after a row's stop), decoding steps taken)."""
        B, P = prompt_BP.shape
        N, model = self.max_new_tokens, self.model
        stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)
        cache = decode.init_cache(model, B, P + N)
        positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        logits_B1V, cache = decode.forward(model, params, prompt_BP, positions_BP, cache,
                                           logits_at=lengths_B - 1)
        key, sub = jax.random.split(key)
        token_B = self._choose(logits_B1V, sub)
        out_BN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token_B)
        done_B = jnp.isin(token_B, stop)

        def more(state):
            i, _, _, _, done_B, _ = state
            return (i < N) & ~jnp.all(done_B)

        def step(state):
            i, token_B, cache, out_BN, done_B, key = state
            # out[:, i - 1] sits at position length + i - 1
            logits_B1V, cache = decode.forward(model, params, token_B[:, None],
                                               (lengths_B + i - 1)[:, None], cache)
            key, sub = jax.random.split(key)
            token_B = jnp.where(done_B, 0, self._choose(logits_B1V, sub))
            out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, token_B[:, None], i, axis=1)
            return i + 1, token_B, cache, out_BN, done_B | jnp.isin(token_B, stop), key

        steps, _, _, out_BN, _, _ = jax.lax.while_loop(
            more, step, (jnp.int32(1), token_B, cache, out_BN, done_B, key))
        return out_BN, steps

    def _choose(self, logits_B1V, key):
        logits_BV = logits_B1V[:, 0]
        if self.vocab_size:
            ids_V = jnp.arange(logits_BV.shape[-1])
            logits_BV = jnp.where(ids_V < self.vocab_size, logits_BV, -jnp.inf)
        return next_tokens(logits_BV, key, self.sampling)
