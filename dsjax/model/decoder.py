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

from dsjax import fp8, remat
from dsjax.config import ModelConfig
from dsjax.model.layers import Attention, RMSNorm, SwiGLU, _param

RESIDUAL = ("act_batch", "act_seq", "act_embed")
ATTN_MATMULS = ("q", "k", "v", "o")
MLP_MATMULS = ("gate", "up", "down")


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
    fp8_matmuls: tuple[str, ...] = ()  # projections run as fp8 GEMMs (see dsjax/fp8.py)
    fp8_recipe: str = "current"
    fp8_history: int = fp8.DEFAULT_HISTORY

    @nn.compact
    def __call__(self, x_BSD, positions_BS, segment_ids_BS):
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)
        attn_fp8 = tuple(m for m in self.fp8_matmuls if m in ATTN_MATMULS)
        mlp_fp8 = tuple(m for m in self.fp8_matmuls if m in MLP_MATMULS)
        attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta,
                         self.init_std, self.dtype, attn_fp8, self.fp8_recipe, self.fp8_history,
                         name="attn")
        h_BSD = x_BSD + attn(RMSNorm(self.norm_eps, name="attn_norm")(x_BSD), positions_BS,
                             segment_ids_BS)
        h_BSD = nn.with_logical_constraint(h_BSD, RESIDUAL)
        mlp = SwiGLU(self.mlp_dim, self.init_std, self.dtype, mlp_fp8, self.fp8_recipe,
                     self.fp8_history, name="mlp")
        out_BSD = h_BSD + mlp(RMSNorm(self.norm_eps, name="mlp_norm")(h_BSD))
        return nn.with_logical_constraint(out_BSD, RESIDUAL), None


class Transformer(nn.Module):
    """tokens [B, S] -> float32 logits [B, S, V].

    Per-layer choices: `layer_policies` (remat policy of each layer, see dsjax/remat.py; empty =
    none) and `fp8_layers` (whether each layer runs `fp8_matmuls` as fp8 GEMMs; empty = all do).
    The stack is split into contiguous segments of equal fp8 choice, and each segment is a
    `lax.scan` over groups of layers (the shortest repeating period of its remat policies), so
    per-layer patterns keep the loop a scan. Params keep one layout whatever the choices: every
    block parameter has a leading "layers" axis of length num_layers. With the "delayed" fp8
    recipe, the `fp8_meta` collection holds one `Fp8Meta` per projection and layer, same layout.
    """
    cfg: ModelConfig
    dtype: Any = jnp.float32
    layer_policies: tuple[str, ...] = ()
    scan_unroll: bool = False  # straight-line code, for exact `cost_analysis` FLOPs
    fp8_matmuls: tuple[str, ...] = ()
    fp8_recipe: str = "current"
    fp8_history: int = fp8.DEFAULT_HISTORY
    fp8_layers: tuple[bool, ...] = ()

    def _block(self, use_fp8: bool) -> DecoderBlock:
        cfg = self.cfg
        return DecoderBlock(cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                            cfg.rope_theta, cfg.norm_eps, cfg.init_std, self.dtype,
                            self.fp8_matmuls if use_fp8 else (), self.fp8_recipe, self.fp8_history)

    def _init_stack(self, rng: jax.Array, collection: str) -> Any:
        """Per-layer block variables of `collection` stacked on a new leading "layers" axis."""
        cfg = self.cfg
        x = jnp.zeros((1, 1, cfg.hidden_size), self.dtype)
        pos, seg = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)
        keys = jax.random.split(rng, cfg.num_layers)
        block = self._block(use_fp8=True)  # every layer carries fp8 state: one uniform layout
        stacked = jax.vmap(lambda k: block.init(k, x, pos, seg)[collection])(keys)
        boxed = lambda b: isinstance(b, nn.LogicallyPartitioned)
        # fp8 meta leaves are not boxed: they stay replicated (small, and every device needs them).
        return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)) if boxed(b)
                            else b, stacked, is_leaf=boxed)

    def _layer_fn(self, policy: str, use_fp8: bool, positions_BS, segment_ids_BS):
        block = self._block(use_fp8)

        def apply(x_BSD, variables):
            if fp8.META_COLLECTION in variables:
                # Per layer, after the stack is sliced: the max-combining amax dtype does not
                # survive slicing. A layer used several times in one grad still max-combines.
                variables = {**variables, fp8.META_COLLECTION:
                             fp8.with_max_grad(variables[fp8.META_COLLECTION])}
            return block.apply(variables, x_BSD, positions_BS, segment_ids_BS)[0]

        use_remat, checkpoint_policy = remat.checkpoint_policy(policy)
        if not use_remat:
            return apply
        # Inside a scan, CSE cannot merge the recomputation away, so the barrier is not needed.
        return jax.checkpoint(apply, policy=checkpoint_policy, prevent_cse=self.scan_unroll)

    def _segments(self) -> list[tuple[int, int, bool, tuple[str, ...]]]:
        """(start, end, uses fp8, group pattern) of each contiguous run of layers."""
        L = self.cfg.num_layers
        policies = tuple(self.layer_policies) or ("none",) * L
        fp8_on = tuple(self.fp8_layers) or (bool(self.fp8_matmuls),) * L
        if len(policies) != L or len(fp8_on) != L:
            raise ValueError(f"per-layer choices must have num_layers={L} entries")
        segments, start = [], 0
        for i in range(1, L + 1):
            if i == L or fp8_on[i] != fp8_on[start]:
                segments.append((start, i, fp8_on[start],
                                 remat.group_pattern(policies[start:i])))
                start = i
        return segments

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

        stack = {"params": self.param("layers", self._init_stack, "params")}
        if self.fp8_matmuls and self.fp8_recipe == "delayed":
            stack[fp8.META_COLLECTION] = self.variable(
                fp8.META_COLLECTION, "layers",
                lambda: self._init_stack(jax.random.key(0), fp8.META_COLLECTION)).value
        for start, end, use_fp8, pattern in self._segments():
            fns = [self._layer_fn(p, use_fp8, positions_BS, segment_ids_BS) for p in pattern]
            G = len(pattern)
            grouped = jax.tree.map(
                lambda a: a[start:end].reshape((end - start) // G, G, *a.shape[1:]), stack)

            def group_body(x_BSD, group_vars, fns=fns):
                for g, fn in enumerate(fns):
                    x_BSD = fn(x_BSD, jax.tree.map(lambda a, g=g: a[g], group_vars))
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
