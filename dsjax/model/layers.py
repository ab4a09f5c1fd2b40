"""Layers of the DeepSeek-LLM (Llama-architecture) decoder: RMSNorm, RoPE, attention, SwiGLU MLP.

Parameters are created in float32 with logical axis names; matmuls run in `dtype` (the compute
dtype) with float32 accumulation where it matters (attention logits and softmax, norms), except
the projections the fp8 precision policy (`Fp8Policy`) names, which run as fp8 GEMMs. The
attention core (QK^T, softmax, PV) never runs in fp8. Numerics follow Hugging Face
`LlamaForCausalLM`, our reference: RMSNorm in float32, rotate-half RoPE, query head h reads kv
head h // R.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dsjax import fp8, fp8_probe
from dsjax.fp8_policy import Fp8Policy
from dsjax.model import kv_cache
from dsjax.model.attention import attention_core, attention_mask  # noqa: F401 (re-export)
from dsjax.model.attention import masked_attention
from dsjax.model.context_layout import Layout, row_layout
from dsjax.sharding import context_size

Dtype = Any
TOKENS = "n"  # the flattened B x S dim of a projection (`_project`)
# Projection params whose fp8 policy name is another's: MLA's low-rank q and kv factors.
POLICY_NAMES = {"q_a": "q", "q_b": "q", "kv_a": "k", "kv_b": "k"}
ROUTED_EXPERTS = "moe"  # the MoE module's name: its expert weights are not projections


def policy_name(param: str) -> str:
    """The fp8 precision policy's name (q, k, v, o, gate, up, down) for projection param
    `param`."""
    return POLICY_NAMES.get(param, param)


def prepare_fp8_weights(stack: dict, policy: Fp8Policy) -> dict:
    """The `fp8.WEIGHTS_COLLECTION` of a stack of layers ({"params": ..., and with delayed
    scaling "fp8_meta": ...}, each leaf on a leading layers dim): every projection weight the
    policy runs in fp8, quantised for all layers at once (`fp8.prepare_weight`). Quantised here,
    before the layer loop, the weights are loop-invariant in the micro-batch loop, which XLA
    then quantises once per step. Routed experts are left out: they quantise per expert, in
    their own call."""
    meta = stack.get(fp8.META_COLLECTION)

    def walk(params: dict, meta: dict | None, parent: str) -> dict:
        out = {}
        for key, value in params.items():
            if isinstance(value, dict):
                sub = walk(value, None if meta is None else meta.get(key), key)
                if sub:
                    out[key] = sub
            elif parent != ROUTED_EXPERTS and policy.runs(policy_name(key)) and value.ndim >= 3:
                scale = None if meta is None else meta[key].scale[..., fp8.W]
                out[key] = fp8.prepare_weight(value, policy.recipe, lead=1, meta_scale=scale)
        return out

    return walk(stack["params"], meta, "")


def probe_tokens(params: dict, matmuls: tuple[str, ...]) -> dict:
    """The `fp8_probe.COLLECTION` of a stack of layers: zeros [layers, len(STATS)] per
    projection weight in `matmuls` (routed experts left out), mirroring `params`."""
    def walk(params: dict, parent: str) -> dict:
        out = {}
        for key, value in params.items():
            if isinstance(value, dict):
                if sub := walk(value, key):
                    out[key] = sub
            elif (parent != ROUTED_EXPERTS and policy_name(key) in matmuls
                  and jnp.ndim(value) >= 3):
                out[key] = jnp.zeros((jnp.shape(value)[0], len(fp8_probe.STATS)), jnp.float32)
        return out
    return walk(params, "")


def _project(module: nn.Module, name: str, eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """One projection matmul: fp8 GEMMs if the precision policy names it (`policy_name(name)`),
    float32 if it widens it, else the compute dtype; in a probe's model (docs/precision.md) a
    float32 `fp8_probe.probe_einsum`. In fp8 it uses the weight `prepare_fp8_weights` quantised
    ahead where the layer has one.

    `eq` starts with the token dims "BS" on x and on the output; they are flattened into one
    before the matmul, so that the weight gradient contracts one dim, not two: XLA:CPU runs the
    two-dim contraction as transposing copies of the [B, S, F] activations plus a GEMM, 1.8x
    slower on the MLP (docs/performance.md). fp8 takes the float32 weight directly (quantising it
    skips a bf16 rounding)."""
    x_dims, rest = eq.split(",")
    w_dims, out_dims = rest.split("->")
    if not (x_dims.startswith("BS") and out_dims.startswith("BS")) or TOKENS in eq:
        raise ValueError(f"projection {eq!r}: x and the output must start with BS, and "
                         f"{TOKENS!r} is reserved")
    flat = f"{TOKENS}{x_dims[2:]},{w_dims}->{TOKENS}{out_dims[2:]}"
    x_n = x.reshape(-1, *x.shape[2:])
    policy = module.fp8_policy
    if policy is not None and policy.probe and module.has_variable(fp8_probe.COLLECTION, name):
        y_n = fp8_probe.probe_einsum(flat, policy.recipe, jnp.dtype(policy.probe), x_n, w,
                                     module.get_variable(fp8_probe.COLLECTION, name))
        y_n = y_n.astype(module.dtype)
    elif policy is not None and policy.runs(policy_name(name)):
        meta = fp8.meta_variable(module, name, policy.history) if policy.delayed else None
        prepared = (module.get_variable(fp8.WEIGHTS_COLLECTION, name)
                    if module.has_variable(fp8.WEIGHTS_COLLECTION, name) else None)
        y_n = fp8.fp8_einsum(flat, x_n, w, recipe=policy.recipe, out_dtype=module.dtype,
                             meta=meta, prepared=prepared)
    elif policy is not None and policy.widens(policy_name(name)):  # not TF32 on GPU
        y_n = jnp.einsum(flat, x_n.astype(jnp.float32), w,
                         precision=jax.lax.Precision.HIGHEST).astype(module.dtype)
    else:
        y_n = jnp.einsum(flat, x_n.astype(module.dtype), w.astype(module.dtype))
    return y_n.reshape(*x.shape[:2], *y_n.shape[1:])


def _param(module: nn.Module, name: str, shape: Sequence[int], names: Sequence[str],
           init_std: float) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.normal(init_std), tuple(names))
    return module.param(name, init, tuple(shape), jnp.float32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last dim, computed in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale * y).astype(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with a learned float32 scale [D], whatever the input dtype."""
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), jnp.float32)
        return rms_norm(x, scale, self.eps)


def apply_rope(x_BSHK: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half convention (the pairs are (i, i + K/2))."""
    head_dim = x_BSHK.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles_BSk = positions_BS[..., None].astype(jnp.float32) * inv_freq
    angles_BS1K = jnp.concatenate([angles_BSk, angles_BSk], axis=-1)[:, :, None, :]
    x = x_BSHK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(angles_BS1K) + rotated * jnp.sin(angles_BS1K)).astype(x_BSHK.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """The attention core as a layer runs it (GQA and MLA alike): its implementation, concrete
    (attention.resolve_impl of model.attention_impl), the flash tiles (model.attention_block_q
    / _k), and how it runs when the sequence is split over `context` (model.context_impl,
    model.context_layout). Hashable: a static field of the layers that hold it."""
    impl: str = "xla"
    block_q: int = 512
    block_k: int = 512
    context_impl: str = "all_gather"
    context_layout: str = "zigzag"

    def context(self, seq_len: int) -> tuple[str, Layout] | None:
        """(context impl, layout) while tracing rows of `seq_len` split over `context` (the mesh
        and rules in effect say whether they are, `context_layout.row_layout`); else None."""
        layout = row_layout(context_size(), self.context_layout, seq_len)
        return None if layout.parts == 1 else (self.context_impl, layout)

    def gathers_kv(self, seq_len: int) -> bool:
        """True when keys and values must be whole rows before the core (all_gather)."""
        context = self.context(seq_len)
        return context is not None and context[0] == "all_gather"

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids_BS: jax.Array, *,
                 scale: float, dtype: Any, **rope_parts: jax.Array) -> jax.Array:
        """softmax(q k^T * scale) v under the causal, segment-aware mask (`attention_core`)."""
        return attention_core(q, k, v, segment_ids_BS, scale=scale, impl=self.impl,
                              block_q=self.block_q, block_k=self.block_k, dtype=dtype,
                              context=self.context(q.shape[1]), **rope_parts)


class Attention(nn.Module):
    """Multi-head / grouped-query attention with a causal, segment-aware mask; no biases. With a
    `cache` ({"k", "v"} [B, T, N, K], dsjax.model.kv_cache) it decodes: writes this step's
    rotated keys and values at their positions, attends over the cache, returns (out, cache)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    init_std: float
    dtype: Dtype = jnp.float32
    fp8_policy: Fp8Policy | None = None  # asked for q, k, v, o
    core: AttentionCore = AttentionCore()

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array,
                 cache: dict[str, jax.Array] | None = None) -> Any:
        d_model = x_BSD.shape[-1]
        H, N, K = self.num_heads, self.num_kv_heads, self.head_dim
        w_q = _param(self, "q", (d_model, H, K), ("embed", "heads", "head_dim"), self.init_std)
        w_k = _param(self, "k", (d_model, N, K), ("embed", "kv_heads", "head_dim"), self.init_std)
        w_v = _param(self, "v", (d_model, N, K), ("embed", "kv_heads", "head_dim"), self.init_std)
        w_o = _param(self, "o", (H, K, d_model), ("heads", "head_dim", "embed"), self.init_std)
        x = x_BSD.astype(self.dtype)

        q_BSHK = _project(self, "q", "BSD,DHK->BSHK", x, w_q)
        k_BTNK = _project(self, "k", "BSD,DNK->BSNK", x, w_k)
        v_BTNK = _project(self, "v", "BSD,DNK->BSNK", x, w_v)
        # Tags name what remat policies may save (see dsjax/remat.py).
        q_BSHK = checkpoint_name(apply_rope(q_BSHK, positions_BS, self.rope_theta), "q_proj")
        k_BTNK = checkpoint_name(apply_rope(k_BTNK, positions_BS, self.rope_theta), "k_proj")
        v_BTNK = checkpoint_name(v_BTNK, "v_proj")

        if cache is not None:
            cache = {name: nn.with_logical_constraint(kv_cache.write(cache[name], new,
                                                                     positions_BS),
                                                      kv_cache.GQA_AXES)
                     for name, new in (("k", k_BTNK), ("v", v_BTNK))}
            mask_BST = kv_cache.readable(positions_BS, cache["k"].shape[1])
            ctx_BSHK = masked_attention(q_BSHK, cache["k"], cache["v"], mask_BST,
                                        scale=K ** -0.5, dtype=self.dtype)
            return _project(self, "o", "BSHK,HKD->BSD", ctx_BSHK, w_o), cache
        ctx_BSHK = self.core(q_BSHK, k_BTNK, v_BTNK, segment_ids_BS, scale=K ** -0.5,
                             dtype=self.dtype)
        ctx_BSHK = checkpoint_name(ctx_BSHK, "attn_context")
        return checkpoint_name(_project(self, "o", "BSHK,HKD->BSD", ctx_BSHK, w_o), "attn_out")


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); no biases."""
    mlp_dim: int
    init_std: float
    dtype: Dtype = jnp.float32
    fp8_policy: Fp8Policy | None = None  # asked for gate, up, down

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        d_model, F = x_BSD.shape[-1], self.mlp_dim
        w_gate = _param(self, "gate", (d_model, F), ("embed", "mlp"), self.init_std)
        w_up = _param(self, "up", (d_model, F), ("embed", "mlp"), self.init_std)
        w_down = _param(self, "down", (F, d_model), ("mlp", "embed"), self.init_std)
        x = x_BSD.astype(self.dtype)
        gate_BSF = checkpoint_name(_project(self, "gate", "BSD,DF->BSF", x, w_gate), "mlp_gate")
        up_BSF = checkpoint_name(_project(self, "up", "BSD,DF->BSF", x, w_up), "mlp_up")
        hidden_BSF = nn.with_logical_constraint(jax.nn.silu(gate_BSF) * up_BSF,
                                                ("act_batch", "act_seq", "act_mlp"))
        hidden_BSF = checkpoint_name(hidden_BSF, "mlp_hidden")
        return checkpoint_name(_project(self, "down", "BSF,FD->BSD", hidden_BSF, w_down),
                               "mlp_out")
