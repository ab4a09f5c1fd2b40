"""The SigLIP vision tower (Zhai et al. 2023; Hugging Face `SiglipVisionModel` without its pooling
head): patch embedding, learned position embeddings, pre-LN bidirectional blocks with biased
projections, a final LayerNorm. Pixels [B, H, W, C] -> features [B, P, D].

Blocks are scanned like the decoder's: every block parameter has a leading "vision_layers" axis,
so compile time does not grow with depth. Parameters are float32; matmuls run in `dtype`,
LayerNorm and softmax in float32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

VISION_LAYERS = "vision_layers"
VISION_RESIDUAL = ("act_batch", None, None)  # images [B, P, D]: images over the data axis


def _weight(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[Any, ...],
            init_std: float) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.normal(init_std), names)
    return module.param(name, init, shape, jnp.float32)


def _bias(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[Any, ...]
          ) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.zeros, names)
    return module.param(name, init, shape, jnp.float32)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last dim, in float32."""
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        D = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (D,), jnp.float32)
        bias = _bias(self, "bias", (D,), ("norm",))
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias).astype(x.dtype)


class VisionBlock(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(.)); full (bidirectional) attention over the patches."""
    num_heads: int
    mlp_dim: int
    norm_eps: float
    gelu_tanh: bool
    init_std: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BPD: jax.Array) -> jax.Array:
        D, H, F = x_BPD.shape[-1], self.num_heads, self.mlp_dim
        K, std, dt = D // H, self.init_std, self.dtype
        x_BPD = nn.with_logical_constraint(x_BPD, VISION_RESIDUAL)
        qkv = ("vision_embed", "vision_heads", "head_dim")
        h_BPD = LayerNorm(self.norm_eps, name="ln1")(x_BPD).astype(dt)
        q_BPHK, k_BPHK, v_BPHK = (
            jnp.einsum("BPD,DHK->BPHK", h_BPD, _weight(self, n, (D, H, K), qkv, std).astype(dt))
            + _bias(self, f"{n}_bias", (H, K), qkv[1:]).astype(dt) for n in ("q", "k", "v"))
        scores_BHPT = jnp.einsum("BPHK,BTHK->BHPT", q_BPHK, k_BPHK,
                                 preferred_element_type=jnp.float32) * K ** -0.5
        probs_BHPT = jax.nn.softmax(scores_BHPT, axis=-1).astype(dt)
        ctx_BPHK = jnp.einsum("BHPT,BTHK->BPHK", probs_BHPT, v_BPHK)
        w_o = _weight(self, "o", (H, K, D), ("vision_heads", "head_dim", "vision_embed"), std)
        attn_BPD = (jnp.einsum("BPHK,HKD->BPD", ctx_BPHK, w_o.astype(dt))
                    + _bias(self, "o_bias", (D,), ("vision_embed",)).astype(dt))
        x_BPD = x_BPD + attn_BPD

        h_BPD = LayerNorm(self.norm_eps, name="ln2")(x_BPD).astype(dt)
        fc1 = _weight(self, "fc1", (D, F), ("vision_embed", "vision_mlp"), std)
        fc2 = _weight(self, "fc2", (F, D), ("vision_mlp", "vision_embed"), std)
        u_BPF = (jnp.einsum("BPD,DF->BPF", h_BPD, fc1.astype(dt))
                 + _bias(self, "fc1_bias", (F,), ("vision_mlp",)).astype(dt))
        u_BPF = jax.nn.gelu(u_BPF, approximate=self.gelu_tanh)
        mlp_BPD = (jnp.einsum("BPF,FD->BPD", u_BPF, fc2.astype(dt))
                   + _bias(self, "fc2_bias", (D,), ("vision_embed",)).astype(dt))
        return nn.with_logical_constraint(x_BPD + mlp_BPD, VISION_RESIDUAL)


class SiglipTower(nn.Module):
    """Normalised pixels [B, H, W, C] (channels last) -> post-LayerNorm features [B, P, D]."""
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    norm_eps: float = 1e-6
    gelu_tanh: bool = True  # SigLIP's hidden_act gelu_pytorch_tanh; False: exact erf GELU
    init_std: float = 0.02
    dtype: Any = jnp.float32

    def _block(self) -> VisionBlock:
        return VisionBlock(self.num_heads, self.mlp_dim, self.norm_eps, self.gelu_tanh,
                           self.init_std, self.dtype, parent=None)

    def _init_stack(self, rng: jax.Array) -> Any:
        """Block params stacked on a leading "vision_layers" axis."""
        x = jnp.zeros((1, 1, self.hidden_size), self.dtype)
        keys = jax.random.split(rng, self.num_layers)
        stacked = jax.vmap(lambda k: self._block().init(k, x)["params"])(keys)
        boxed = lambda b: isinstance(b, nn.LogicallyPartitioned)
        return jax.tree.map(lambda b: b.replace(names=(VISION_LAYERS,) + tuple(b.names)),
                            stacked, is_leaf=boxed)

    @nn.compact
    def __call__(self, pixels_BHWC: jax.Array) -> jax.Array:
        p, C, D = self.patch_size, self.num_channels, self.hidden_size
        B = pixels_BHWC.shape[0]
        if pixels_BHWC.shape[1:] != (self.image_size, self.image_size, C):
            raise ValueError(f"pixels {pixels_BHWC.shape}: expected [B, {self.image_size}, "
                             f"{self.image_size}, {C}]")
        g = self.image_size // p
        # The stride-p conv as a matmul over each patch's (row, column, channel) pixels.
        kernel = _weight(self, "patch_embed", (p, p, C, D), (None, None, None, "vision_embed"),
                         self.init_std)
        patches_BPX = (pixels_BHWC.reshape(B, g, p, g, p, C).transpose(0, 1, 3, 2, 4, 5)
                       .reshape(B, g * g, p * p * C).astype(self.dtype))
        x_BPD = (jnp.einsum("BPX,XD->BPD", patches_BPX,
                            kernel.reshape(p * p * C, D).astype(self.dtype))
                 + _bias(self, "patch_bias", (D,), ("vision_embed",)).astype(self.dtype))
        pos_PD = _weight(self, "pos_embed", (g * g, D), (None, "vision_embed"), self.init_std)
        x_BPD = x_BPD + pos_PD.astype(self.dtype)

        stack = self.param("layers", self._init_stack)
        block = self._block()
        x_BPD, _ = jax.lax.scan(lambda x, layer: (block.apply({"params": layer}, x), None),
                                x_BPD, stack)
        return LayerNorm(self.norm_eps, name="post_norm")(x_BPD)
