"""The DeepSeek-LLM decoder: embedding, a scanned stack of pre-norm blocks, final norm, output head.

Layers are scanned (`lax.scan` over groups of layers), so every block parameter carries a leading
"layers" axis and compile time does not grow with depth. The input embedding and the output head are untied.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dsjax import remat
from dsjax.config import ModelConfig
from dsjax.model.layers import Attention, RMSNorm, SwiGLU, _param

RESIDUAL = ("act_batch", "act_seq", "act_embed")


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); shaped for `nn.scan` (returns (carry, None))."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    norm_eps: float
    init_std: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BSD, positions_BS, segment_ids_BS):
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)
        attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta,
                         self.init_std, self.dtype, name="attn")
        h_BSD = x_BSD + attn(RMSNorm(self.norm_eps, name="attn_norm")(x_BSD), positions_BS,
                             segment_ids_BS)
        h_BSD = nn.with_logical_constraint(h_BSD, RESIDUAL)
        mlp = SwiGLU(self.mlp_dim, self.init_std, self.dtype, name="mlp")
        out_BSD = h_BSD + mlp(RMSNorm(self.norm_eps, name="mlp_norm")(h_BSD))
        return nn.with_logical_constraint(out_BSD, RESIDUAL), None


class Transformer(nn.Module):
    """tokens [B, S] -> float32 logits [B, S, V].

    `layer_policies` gives each layer's remat policy (see dsjax/remat.py; empty = none). The
    stack is a `lax.scan` over groups of layers (the shortest repeating period of the policies),
    so per-layer recomputation patterns keep the loop a scan and the params keep one layout:
    every block parameter has a leading "layers" axis of length num_layers.
    """
    cfg: ModelConfig
    dtype: Any = jnp.float32
    layer_policies: tuple[str, ...] = ()
    scan_unroll: bool = False  # straight-line code, for exact `cost_analysis` FLOPs

    def _block(self) -> DecoderBlock:
        cfg = self.cfg
        return DecoderBlock(cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                            cfg.rope_theta, cfg.norm_eps, cfg.init_std, self.dtype)

    def _init_stack(self, rng: jax.Array) -> Any:
        """Per-layer block params stacked on a new leading "layers" axis (boxed with names)."""
        cfg = self.cfg
        x = jnp.zeros((1, 1, cfg.hidden_size), self.dtype)
        pos, seg = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)
        keys = jax.random.split(rng, cfg.num_layers)
        stacked = jax.vmap(lambda k: self._block().init(k, x, pos, seg)["params"])(keys)
        return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)), stacked,
                            is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))

    def _layer_fn(self, policy: str, positions_BS, segment_ids_BS):
        block = self._block()

        def apply(x_BSD, params):
            return block.apply({"params": params}, x_BSD, positions_BS, segment_ids_BS)[0]

        use_remat, checkpoint_policy = remat.checkpoint_policy(policy)
        if not use_remat:
            return apply
        # Inside a scan, CSE cannot merge the recomputation away, so the barrier is not needed.
        return jax.checkpoint(apply, policy=checkpoint_policy, prevent_cse=self.scan_unroll)

    @nn.compact
    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                 segment_ids_BS: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        if segment_ids_BS is None:
            segment_ids_BS = jnp.ones_like(tokens_BS)
        embedding_VD = _param(self, "embedding", (cfg.vocab_size, cfg.hidden_size),
                              ("vocab", "embed"), cfg.init_std)
        x_BSD = jnp.take(embedding_VD, tokens_BS, axis=0).astype(self.dtype)
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)

        stack = self.param("layers", self._init_stack)
        policies = self.layer_policies or ("none",) * cfg.num_layers
        if len(policies) != cfg.num_layers:
            raise ValueError(f"{len(policies)} layer policies for {cfg.num_layers} layers")
        pattern = remat.group_pattern(tuple(policies))
        fns = [self._layer_fn(p, positions_BS, segment_ids_BS) for p in pattern]
        G = len(pattern)
        grouped = jax.tree.map(lambda a: a.reshape(cfg.num_layers // G, G, *a.shape[1:]), stack)

        def group_body(x_BSD, group_params):
            for g, fn in enumerate(fns):
                x_BSD = fn(x_BSD, jax.tree.map(lambda a, g=g: a[g], group_params))
            return x_BSD, None

        x_BSD, _ = jax.lax.scan(group_body, x_BSD, grouped, unroll=bool(self.scan_unroll))

        x_BSD = RMSNorm(cfg.norm_eps, name="final_norm")(x_BSD)
        head_DV = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                         cfg.init_std)
        logits_BSV = jnp.einsum("BSD,DV->BSV", x_BSD, head_DV.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        return nn.with_logical_constraint(logits_BSV, ("act_batch", "act_seq", "act_vocab"))


def weighted_cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array,
                           weights_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted next-token NLL in nats, sum of weights); logits in float32."""
    logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    # A one-hot contraction rather than take_along_axis: it stays a fused reduction when the vocab
    # axis is sharded over `tensor`.
    target_logit_BS = jnp.sum(logits_BSV * jax.nn.one_hot(targets_BS, logits_BSV.shape[-1],
                                                          dtype=logits_BSV.dtype), axis=-1)
    nll_BS = (logz_BS - target_logit_BS) * weights_BS
    return jnp.sum(nll_BS), jnp.sum(weights_BS)


def abstract_params(cfg: ModelConfig, seq_len: int = 8) -> Any:
    """Boxed (logically partitioned) abstract params; allocates nothing."""
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]


def count_params(params: Any) -> int:
    """Number of scalars in a (possibly abstract, possibly boxed) params pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params))))
