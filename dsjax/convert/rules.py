"""The conversion table: how each Hugging Face tensor becomes a dsjax leaf, for every layout.

The one idea: a `Rule` names an HF tensor, the dsjax leaf it fills (or one layer's / expert's
slice of a stacked leaf) and its HF shape in symbols; torch `Linear` weights are [out, in], dsjax
matrices are [in, ...out], so a projection is a transpose and a reshape, and embeddings and norm
scales are copied. `tensor_plan` expands the rules for one model; `leaf_shapes` checks them
against the parameters the model itself declares, so a new decoder parameter cannot be dropped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from dsjax.config import ModelConfig
from dsjax.errors import ConvertError
from dsjax.model.decoder import abstract_params


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str                 # HF tensor name; "{i}" stands for the layer index, "{j}" the expert
    leaf: tuple[str, ...]   # path of the dsjax leaf; per-layer rules fill leaf[i] (leaf[i, j])
    hf_dims: tuple[str, ...]  # HF shape in the symbols of `_hf_sizes`
    transpose: bool         # torch Linear [out, in] -> dsjax [in, ...out]
    layers: str = "all"     # DeepSeek-V2/V3: which blocks have it: all | dense | moe. A per-layer
                            # leaf lives in the block's stack ("layers" or "moe_layers").
    export_tag: str = ""    # safetensors dtype written whatever --dtype says ("" = --dtype)
    copy: bool = False      # a copy of a leaf another rule also maps (V3's MTP layers repeat the
                            # embedding and head): import checks it equals, export writes it
    perm: tuple[int, ...] = ()  # instead of `transpose`: an axis permutation (a conv kernel)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf

    def to_dsjax(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.perm:
            return w.transpose(self.perm).reshape(shape)
        return (w.T if self.transpose else w).reshape(shape)

    def to_hf(self, x: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
        if self.perm:
            return x.reshape([hf_shape[a] for a in self.perm]).transpose(np.argsort(self.perm))
        if self.transpose:
            return x.reshape(hf_shape[::-1]).T
        return x.reshape(hf_shape)


_LAYER = "model.layers.{i}."
RULES = (
    Rule("model.embed_tokens.weight", ("embedding",), ("V", "D"), False),
    Rule(_LAYER + "input_layernorm.weight", ("layers", "attn_norm", "scale"), ("D",), False),
    # q_proj row h*K + k is query head h, dim k: W.T reshaped to [D, H, K] keeps that order.
    Rule(_LAYER + "self_attn.q_proj.weight", ("layers", "attn", "q"), ("HK", "D"), True),
    Rule(_LAYER + "self_attn.k_proj.weight", ("layers", "attn", "k"), ("NK", "D"), True),
    Rule(_LAYER + "self_attn.v_proj.weight", ("layers", "attn", "v"), ("NK", "D"), True),
    Rule(_LAYER + "self_attn.o_proj.weight", ("layers", "attn", "o"), ("D", "HK"), True),
    Rule(_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), ("D",),
         False),
    Rule(_LAYER + "mlp.gate_proj.weight", ("layers", "mlp", "gate"), ("F", "D"), True),
    Rule(_LAYER + "mlp.up_proj.weight", ("layers", "mlp", "up"), ("F", "D"), True),
    Rule(_LAYER + "mlp.down_proj.weight", ("layers", "mlp", "down"), ("D", "F"), True),
    Rule("model.norm.weight", ("final_norm", "scale"), ("D",), False),
    Rule("lm_head.weight", ("lm_head",), ("V", "D"), True),
)
# Each shape symbol in config.json's fields, for messages that name an expected shape.
DIM_NAMES = {"V": "vocab_size", "D": "hidden_size", "F": "intermediate_size",
             "HK": "num_attention_heads*head_dim", "NK": "num_key_value_heads*head_dim",
             "HQ": "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)",
             "Q": "q_lora_rank", "C": "kv_lora_rank", "CP": "kv_lora_rank+qk_rope_head_dim",
             "HKV": "num_attention_heads*(qk_nope_head_dim+v_head_dim)",
             "HV": "num_attention_heads*v_head_dim", "E": "n_routed_experts",
             "M": "moe_intermediate_size", "SM": "n_shared_experts*moe_intermediate_size",
             "DD": "2*hidden_size"}

# DeepSeek-V2/V3 (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): MLA in every block, the dense
# MLP in the first first_k_dense_replace blocks, DeepSeekMoE in the others. HF keeps one tensor
# per expert; dsjax stacks them on an experts axis ([L, E, ...]).
_ATTN = _LAYER + "self_attn."
_MOE = _LAYER + "mlp."
DEEPSEEK_RULES = (
    Rule("model.embed_tokens.weight", ("embedding",), ("V", "D"), False),
    Rule(_LAYER + "input_layernorm.weight", ("layers", "attn_norm", "scale"), ("D",), False),
    # Row h*(A+P) + k of q_proj/q_b_proj is head h, dim k (nope dims first, then rope dims).
    Rule(_ATTN + "q_proj.weight", ("layers", "attn", "q"), ("HQ", "D"), True),
    Rule(_ATTN + "q_a_proj.weight", ("layers", "attn", "q_a"), ("Q", "D"), True),
    Rule(_ATTN + "q_a_layernorm.weight", ("layers", "attn", "q_norm", "scale"), ("Q",), False),
    Rule(_ATTN + "q_b_proj.weight", ("layers", "attn", "q_b"), ("HQ", "Q"), True),
    Rule(_ATTN + "kv_a_proj_with_mqa.weight", ("layers", "attn", "kv_a"), ("CP", "D"), True),
    Rule(_ATTN + "kv_a_layernorm.weight", ("layers", "attn", "kv_norm", "scale"), ("C",), False),
    Rule(_ATTN + "kv_b_proj.weight", ("layers", "attn", "kv_b"), ("HKV", "C"), True),
    Rule(_ATTN + "o_proj.weight", ("layers", "attn", "o"), ("D", "HV"), True),
    Rule(_LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), ("D",),
         False),
    Rule(_MOE + "gate_proj.weight", ("layers", "mlp", "gate"), ("F", "D"), True, "dense"),
    Rule(_MOE + "up_proj.weight", ("layers", "mlp", "up"), ("F", "D"), True, "dense"),
    Rule(_MOE + "down_proj.weight", ("layers", "mlp", "down"), ("D", "F"), True, "dense"),
    Rule(_MOE + "gate.weight", ("layers", "moe", "router"), ("E", "D"), True, "moe"),
    # V3's correction bias stays float32 in both directions, as in the released checkpoints.
    Rule(_MOE + "gate.e_score_correction_bias", ("layers", "moe", "router_bias"), ("E",), False,
         "moe", "F32"),
    Rule(_MOE + "experts.{j}.gate_proj.weight", ("layers", "moe", "gate"), ("M", "D"), True,
         "moe"),
    Rule(_MOE + "experts.{j}.up_proj.weight", ("layers", "moe", "up"), ("M", "D"), True, "moe"),
    Rule(_MOE + "experts.{j}.down_proj.weight", ("layers", "moe", "down"), ("D", "M"), True,
         "moe"),
    Rule(_MOE + "shared_experts.gate_proj.weight", ("layers", "moe", "shared", "gate"),
         ("SM", "D"), True, "moe"),
    Rule(_MOE + "shared_experts.up_proj.weight", ("layers", "moe", "shared", "up"), ("SM", "D"),
         True, "moe"),
    Rule(_MOE + "shared_experts.down_proj.weight", ("layers", "moe", "shared", "down"),
         ("D", "SM"), True, "moe"),
    Rule("model.norm.weight", ("final_norm", "scale"), ("D",), False),
    Rule("lm_head.weight", ("lm_head",), ("V", "D"), True),
)


# DeepSeek-V3's MTP modules (num_nextn_predict_layers) are stored as decoder layers
# num_hidden_layers + k: the block's tensors under the usual names, plus these. transformers does
# not load them; DeepSeek's release, vLLM and SGLang do. eh_proj is [D, 2D] over
# [enorm(embedding); hnorm(hidden)], as dsjax's concatenation.
MTP_RULES = (
    Rule(_LAYER + "enorm.weight", ("mtp_enorm",), ("D",), False),
    Rule(_LAYER + "hnorm.weight", ("mtp_hnorm",), ("D",), False),
    Rule(_LAYER + "eh_proj.weight", ("mtp_eh_proj",), ("D", "DD"), True),
    Rule(_LAYER + "shared_head.norm.weight", ("mtp_norm",), ("D",), False),
    Rule(_LAYER + "embed_tokens.weight", ("embedding",), ("V", "D"), False, copy=True),
    Rule(_LAYER + "shared_head.head.weight", ("lm_head",), ("V", "D"), True, copy=True),
)


def is_deepseek_moe(cfg: ModelConfig) -> bool:
    """True for the DeepSeek-V2/V3 layout (MLA and/or MoE), False for DeepSeek-LLM (Llama)."""
    return cfg.attention == "mla" or cfg.is_moe


def _rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """The rules of the tensors `cfg`'s checkpoint holds."""
    if not is_deepseek_moe(cfg):
        return RULES
    skip = {"q_proj"} if cfg.q_lora_rank else {"q_a_proj", "q_a_layernorm", "q_b_proj"}
    if cfg.scoring != "sigmoid":
        skip.add("e_score_correction_bias")
    if not cfg.n_shared_experts:
        skip |= {f"shared_experts.{p}_proj" for p in ("gate", "up", "down")}
    return tuple(r for r in DEEPSEEK_RULES if not any(f".{x}." in r.hf or r.hf.endswith(f".{x}")
                                                      for x in skip))


def _hf_sizes(cfg: ModelConfig) -> dict[str, int]:
    k = cfg.resolved_head_dim
    H, A, P, U = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return {"V": cfg.vocab_size, "D": cfg.hidden_size, "F": cfg.mlp_dim,
            "HK": cfg.num_heads * k, "NK": cfg.num_kv_heads * k,
            "HQ": H * (A + P), "Q": cfg.q_lora_rank, "C": cfg.kv_lora_rank,
            "CP": cfg.kv_lora_rank + P, "HKV": H * (A + U), "HV": H * U,
            "E": cfg.n_routed_experts, "M": cfg.moe_intermediate_size,
            "SM": cfg.n_shared_experts * cfg.moe_intermediate_size, "DD": 2 * cfg.hidden_size}


def tensor_plan(cfg: ModelConfig) -> dict[str, tuple[Rule, Any, tuple[int, ...]]]:
    """HF tensor name -> (rule, index into the leaf or None, HF shape), rule-major (leaf by leaf).

    The index is the layer (an int) or, for DeepSeek-V2/V3 stacks, (layer within the stack,) or
    (layer within the stack, expert); the rule's leaf then names the block's stack."""
    sizes = _hf_sizes(cfg)
    plan = {}
    deepseek = is_deepseek_moe(cfg)
    k = cfg.first_k_dense_replace if cfg.is_moe else cfg.num_layers
    for rule in _rules(cfg):
        shape = tuple(sizes[d] for d in rule.hf_dims)
        if not rule.per_layer:
            plan[rule.hf] = (rule, None, shape)
            continue
        if not deepseek:
            for i in range(cfg.num_layers):
                plan[rule.hf.format(i=i)] = (rule, i, shape)
            continue
        for stack, lo, hi in (("layers", 0, k), ("moe_layers", k, cfg.num_layers)):
            if rule.layers == ("moe" if stack == "layers" else "dense") or lo == hi:
                continue
            resolved = dataclasses.replace(rule, leaf=(stack,) + rule.leaf[1:])
            for i in range(lo, hi):
                for j in range(cfg.n_routed_experts) if rule.per_expert else [None]:
                    index = (i - lo,) if j is None else (i - lo, j)
                    plan[rule.hf.format(i=i, j=j)] = (resolved, index, shape)
    if deepseek:
        plan.update(_mtp_plan(cfg, sizes))
    return plan


def _mtp_plan(cfg: ModelConfig, sizes: dict[str, int]) -> dict[str, tuple[Rule, Any, tuple]]:
    """`tensor_plan`'s entries of the MTP modules: module k is HF layer num_layers + k, its
    block (a MoE block in a MoE model, as V3's) in the dsjax stack "mtp_layers"."""
    plan = {}
    kind = "moe" if cfg.is_moe else "dense"
    blocks = [r for r in _rules(cfg) if r.per_layer and r.layers in ("all", kind)]
    for k in range(cfg.num_mtp_layers):
        i = cfg.num_layers + k
        for rule in MTP_RULES:
            shape = tuple(sizes[d] for d in rule.hf_dims)
            plan[rule.hf.format(i=i)] = (rule, None if rule.copy else (k,), shape)
        for rule in blocks:
            resolved = dataclasses.replace(rule, leaf=("mtp_layers",) + rule.leaf[1:])
            shape = tuple(sizes[d] for d in rule.hf_dims)
            for j in range(cfg.n_routed_experts) if rule.per_expert else [None]:
                plan[rule.hf.format(i=i, j=j)] = (resolved, (k,) if j is None else (k, j), shape)
    return plan


def declared_shapes(abstract: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{leaf path: shape} of an abstract (boxed or not) params tree."""
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract))[0]
    return {tuple(k.key for k in path): tuple(x.shape) for path, x in flat}


def covered(shapes: dict[tuple[str, ...], tuple[int, ...]], plan: dict, table: str
            ) -> dict[tuple[str, ...], tuple[int, ...]]:
    """`shapes`, once the plan covers every leaf and every rule fits its leaf (less its stacked
    layer dims); else the first odd leaf, and `table`, the conversion table to update."""
    odd = sorted(set(shapes) ^ {rule.leaf for rule, _, _ in plan.values()})
    for rule, layer, hf_shape in plan.values():
        shape = shapes.get(rule.leaf, ())[len(np.atleast_1d(layer)) if layer is not None else 0:]
        if math.prod(shape) != math.prod(hf_shape):
            odd.append(rule.leaf)
    if odd:
        raise ConvertError(f"params/{'/'.join(odd[0])}: the dsjax model and the conversion table "
                           f"disagree about this parameter (update {table})")
    return shapes


def leaf_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The dsjax params tree (path -> shape) as the model itself declares it, checked against
    RULES so a new parameter in the decoder cannot be silently dropped by a conversion."""
    shapes = declared_shapes(abstract_params(cfg))
    plan = tensor_plan(cfg)
    if cfg.num_mtp_layers and not is_deepseek_moe(cfg):
        raise ConvertError("model.num_mtp_layers: MTP modules are converted in the DeepSeek-V3 "
                           "layout only (MLA and/or MoE models); a DeepSeek-LLM (Llama) "
                           "checkpoint has no place for them")
    return covered(shapes, plan, "dsjax.convert.RULES")
