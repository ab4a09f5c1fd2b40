"""Hugging Face DeepSeek-LLM checkpoints (safetensors, `LlamaForCausalLM` layout) <-> dsjax Orbax.

  python -m dsjax.convert hf-to-orbax --hf HF_DIR [--config configs/NAME.py[:ARG]] --out CKPT_DIR
  python -m dsjax.convert orbax-to-hf --checkpoint CKPT_DIR_OR_WORKDIR --out HF_DIR
                                      [--dtype float32|bfloat16] [--max_shard_size 5GB]

The one idea: one table, `RULES`, says how each HF tensor becomes a dsjax leaf (or one layer's
slice of a scanned leaf): torch `Linear` weights are [out, in], dsjax matrices are [in, ...out],
so a projection is a transpose and a reshape; embeddings and norm scales are copied. Both
directions and every check read that table. Everything is validated from the safetensors headers
and `config.json` before a single weight is read; weights then stream one tensor at a time
(`dsjax.safetensors_io`): no HF model is ever resident beyond one tensor. Import holds the float32
dsjax params (what Orbax writes); export holds one dsjax leaf. Memory in docs/convert.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from typing import Any, Sequence

import numpy as np

from dsjax.config import ConfigError, ModelConfig, _validate_deepseek
from dsjax.errors import ConvertError
from dsjax.safetensors_io import (DTYPES, SafetensorsCheckpoint, SafetensorsError, open_directory,
                                  parse_size, write_checkpoint)

HF_CONFIG_COPY = "hf_config.json"  # the source config.json, kept beside the Orbax steps
# Copied HF dir -> checkpoint dir -> HF dir untouched, so eval and export find the tokenizer.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "generation_config.json")
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
FLOAT_TAGS = ("F32", "BF16", "F16", "F64")


# ---------------------------------------------------------------------------------------------
# The mapping table


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

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf

    def to_dsjax(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return (w.T if self.transpose else w).reshape(shape)

    def to_hf(self, x: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
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
_DIM_NAMES = {"V": "vocab_size", "D": "hidden_size", "F": "intermediate_size",
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


def leaf_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The dsjax params tree (path -> shape) as the model itself declares it, checked against
    RULES so a new parameter in the decoder cannot be silently dropped by a conversion."""
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top

    from dsjax.model.decoder import abstract_params  # pylint: disable=g-import-not-at-top

    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract_params(cfg)))[0]
    shapes = {tuple(k.key for k in path): tuple(x.shape) for path, x in flat}
    plan = tensor_plan(cfg)
    covered = {rule.leaf for rule, _, _ in plan.values()}
    if cfg.num_mtp_layers and not is_deepseek_moe(cfg):
        raise ConvertError("model.num_mtp_layers: MTP modules are converted in the DeepSeek-V3 "
                           "layout only (MLA and/or MoE models); a DeepSeek-LLM (Llama) "
                           "checkpoint has no place for them")
    odd = sorted(set(shapes) ^ covered)
    for _, (rule, layer, hf_shape) in plan.items():
        shape = shapes.get(rule.leaf, ())[len(np.atleast_1d(layer)) if layer is not None else 0:]
        if math.prod(shape) != math.prod(hf_shape):
            odd.append(rule.leaf)
    if odd:
        raise ConvertError(f"params/{'/'.join(odd[0])}: the dsjax model and the conversion table "
                           "disagree about this parameter (update dsjax.convert.RULES)")
    return shapes


def _nested(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A Llama-architecture `config.json` -> ModelConfig; refuses what dsjax does not model."""
    def fail(key: str, why: str):
        raise ConvertError(f"{where}: {key}: {why}")

    if hf.get("model_type") in DEEPSEEK_ARCHS:
        return _deepseek_config_from_hf(hf, fail)
    if hf.get("model_type") != "llama":
        fail("model_type", f"{hf.get('model_type')!r} is not supported; dsjax converts the "
             "DeepSeek-LLM family, whose checkpoints are model_type 'llama' (LlamaForCausalLM), "
             f"and DeepSeek-V2/V3 ({', '.join(DEEPSEEK_ARCHS)})")
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if archs != ["LlamaForCausalLM"]:
        fail("architectures", f"{archs} is not supported; expected ['LlamaForCausalLM']")
    if hf.get("tie_word_embeddings", False):
        fail("tie_word_embeddings", "true is not supported: dsjax keeps the embedding and the "
             "output head separate (DeepSeek-LLM does too)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            fail(key, "true is not supported: dsjax projections have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", f"{hf['hidden_act']!r} is not supported; dsjax's MLP is SwiGLU (silu)")
    rope_params = hf.get("rope_parameters") or {}
    rope_scaling = hf.get("rope_scaling") or {}
    for key, table in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
        if not isinstance(table, dict):
            fail(key, f"expected an object or null, got {table!r}")
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in ("default", None):
            fail(f"{key}.rope_type", f"{kind!r} RoPE is not supported; dsjax implements the "
                 "default (unscaled) rotary embedding")

    def positive_int(key: str, value: Any) -> int:
        if value is None:
            fail(key, "required but missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(key, f"expected a positive integer, got {value!r}")
        return value

    hidden = positive_int("hidden_size", hf.get("hidden_size"))
    heads = positive_int("num_attention_heads", hf.get("num_attention_heads"))
    # Absent (or null) means multi-head attention / hidden_size // heads, as in transformers.
    kv_heads = positive_int("num_key_value_heads", hf.get("num_key_value_heads") or heads)
    if hf.get("head_dim") is None and hidden % heads:
        fail("num_attention_heads", f"hidden_size {hidden} is not divisible by {heads} heads "
             "and there is no head_dim")
    head_dim = positive_int("head_dim", hf.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    if head_dim % 2:
        fail("head_dim", f"rotary embeddings need an even head dim, got {head_dim}")
    theta = rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))
    eps = hf.get("rms_norm_eps", 1e-6)
    for key, value in (("rope_theta", theta), ("rms_norm_eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            fail(key, f"expected a positive number, got {value!r}")
    layers = positive_int("num_hidden_layers", hf.get("num_hidden_layers"))
    mlp_dim = positive_int("intermediate_size", hf.get("intermediate_size"))
    vocab = positive_int("vocab_size", hf.get("vocab_size"))
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        mlp_dim=mlp_dim, vocab_size=vocab,
        # 0 is dsjax's "hidden_size // num_heads", so configs that leave it unset compare equal.
        head_dim=0 if head_dim * heads == hidden else head_dim,
        rope_theta=float(theta), norm_eps=float(eps),
        init_std=float(hf.get("initializer_range", 0.02)))


DEEPSEEK_ARCHS = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# HF rope_parameters / rope_scaling key -> ModelConfig field, for YaRN.
_YARN_FIELDS = (("factor", "rope_factor"), ("original_max_position_embeddings",
                                             "rope_original_max_len"),
                ("beta_fast", "rope_beta_fast"), ("beta_slow", "rope_beta_slow"),
                ("mscale", "rope_mscale"), ("mscale_all_dim", "rope_mscale_all_dim"))


def _deepseek_config_from_hf(hf: dict, fail) -> ModelConfig:
    """A DeepSeek-V2/V3 `config.json` -> ModelConfig (MLA, DeepSeekMoE); refuses the rest."""
    v3 = hf["model_type"] == "deepseek_v3"
    arch = DEEPSEEK_ARCHS[hf["model_type"]]
    archs = hf.get("architectures") or [arch]
    if archs != [arch]:
        fail("architectures", f"{archs} is not supported; expected [{arch!r}]")
    if hf.get("tie_word_embeddings", False):
        fail("tie_word_embeddings", "true is not supported: dsjax keeps the embedding and the "
             "output head separate (DeepSeek-V2/V3 do too)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            fail(key, "true is not supported: dsjax projections have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", f"{hf['hidden_act']!r} is not supported; dsjax's MLP is SwiGLU (silu)")
    if not hf.get("rope_interleave", True):
        fail("rope_interleave", "false is not supported: dsjax's MLA uses DeepSeek's interleaved "
             "RoPE pairs, as the released checkpoints do")
    if hf.get("moe_layer_freq", 1) != 1:
        fail("moe_layer_freq", f"{hf['moe_layer_freq']} is not supported: every layer after "
             "first_k_dense_replace is MoE")

    def integer(key: str, default: Any = None, minimum: int = 1) -> int:
        value = hf.get(key, default)
        if value is None:
            value = default
        if value is None:
            fail(key, "required but missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            fail(key, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            fail(key, f"expected a non-negative number, got {value!r}")
        return float(value)

    heads = integer("num_attention_heads")
    if integer("num_key_value_heads", heads) != heads:
        fail("num_key_value_heads", f"{hf['num_key_value_heads']} is not supported: MLA expands "
             f"its latent to every head (num_attention_heads={heads})")
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        fail("rope_parameters.rope_type", f"{kind!r} RoPE is not supported; dsjax's MLA "
             "implements the default and 'yarn'")
    yarn = {}
    if kind == "yarn":
        if rope.get("attention_factor") is not None:
            fail("rope_parameters.attention_factor", "an explicit YaRN attention factor is not "
                 "supported (dsjax derives it from mscale and mscale_all_dim, as DeepSeek)")
        if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
            fail("rope_parameters", "yarn needs factor and original_max_position_embeddings")
        yarn = {field: number(f"rope_parameters.{key}", rope[key])
                for key, field in _YARN_FIELDS if rope.get(key) is not None}
        yarn["rope_original_max_len"] = int(yarn["rope_original_max_len"])
        yarn["rope_scaling"] = "yarn"
    theta = number("rope_theta", rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    layers = integer("num_hidden_layers")
    experts = integer("n_routed_experts", 0, minimum=0)
    moe = {}
    if experts:
        if v3:
            scoring, n_group = "sigmoid", integer("n_group", 1)
            topk_group = integer("topk_group", 1)
            if hf.get("scoring_func", "sigmoid") != "sigmoid":
                fail("scoring_func", f"{hf['scoring_func']!r}: DeepseekV3 routes with sigmoid")
        else:
            method = hf.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                fail("topk_method", f"{method!r} is not supported; valid: greedy, "
                     "group_limited_greedy")
            scoring = "softmax"
            if hf.get("scoring_func", "softmax") != "softmax":
                fail("scoring_func", f"{hf['scoring_func']!r}: DeepseekV2 routes with softmax")
            greedy = method == "greedy"
            n_group = 1 if greedy else integer("n_group")
            topk_group = 1 if greedy else integer("topk_group")
            if hf.get("norm_topk_prob"):
                fail("norm_topk_prob", "true is ambiguous for DeepSeek-V2: transformers ignores "
                     "it, DeepSeek's own code normalises; the released V2 models use false")
        moe = dict(n_routed_experts=experts,
                   n_shared_experts=integer("n_shared_experts", 0, minimum=0),
                   moe_intermediate_size=integer("moe_intermediate_size"),
                   num_experts_per_tok=integer("num_experts_per_tok"),
                   n_group=n_group, topk_group=topk_group, scoring=scoring,
                   routed_scaling_factor=number("routed_scaling_factor",
                                                hf.get("routed_scaling_factor", 1.0)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if v3 else False,
                   first_k_dense_replace=integer("first_k_dense_replace", 0, minimum=0))
    eps = number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))
    try:
        cfg = ModelConfig(
            num_layers=layers, hidden_size=integer("hidden_size"), num_heads=heads,
            num_kv_heads=heads, mlp_dim=integer("intermediate_size"),
            vocab_size=integer("vocab_size"), rope_theta=theta, norm_eps=eps,
            init_std=float(hf.get("initializer_range", 0.02)), attention="mla",
            q_lora_rank=integer("q_lora_rank", 0, minimum=0),
            kv_lora_rank=integer("kv_lora_rank"), qk_nope_head_dim=integer("qk_nope_head_dim"),
            qk_rope_head_dim=integer("qk_rope_head_dim"), v_head_dim=integer("v_head_dim"),
            num_mtp_layers=integer("num_nextn_predict_layers", 0, minimum=0) if v3 else 0,
            **yarn, **moe)
        _validate_deepseek(cfg)
    except ConfigError as e:
        fail("config", str(e))
    return cfg


# dsjax field -> (HF field, value getter): what must agree between a dsjax config and config.json.
_COMPARED = (
    ("num_layers", "num_hidden_layers", lambda m: m.num_layers),
    ("hidden_size", "hidden_size", lambda m: m.hidden_size),
    ("num_heads", "num_attention_heads", lambda m: m.num_heads),
    ("num_kv_heads", "num_key_value_heads", lambda m: m.num_kv_heads),
    ("mlp_dim", "intermediate_size", lambda m: m.mlp_dim),
    ("vocab_size", "vocab_size", lambda m: m.vocab_size),
    ("head_dim", "head_dim", lambda m: m.resolved_head_dim),
    ("rope_theta", "rope_theta", lambda m: m.rope_theta),
    ("norm_eps", "rms_norm_eps", lambda m: m.norm_eps),
)


_DEEPSEEK_COMPARED = (
    "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "rope_scaling", "rope_factor", "rope_original_max_len", "rope_beta_fast",
    "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "n_routed_experts",
    "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group",
    "routed_scaling_factor", "scoring", "norm_topk_prob", "first_k_dense_replace",
    "num_mtp_layers")


def check_same_model(hf_model: ModelConfig, dsjax_model: ModelConfig, where: str) -> None:
    """Fails with one message naming every field where a dsjax config disagrees with config.json."""
    diffs = [f"model.{key}: the dsjax config has {get(dsjax_model)!r} but {where} has "
             f"{hf_key}={get(hf_model)!r}"
             for key, hf_key, get in _COMPARED
             if not math.isclose(get(dsjax_model), get(hf_model), rel_tol=1e-9)]
    # DeepSeek-V2/V3 fields (all at their "off" defaults for DeepSeek-LLM configs).
    diffs += [f"model.{key}: the dsjax config has {getattr(dsjax_model, key)!r} but {where} "
              f"implies {getattr(hf_model, key)!r}"
              for key in _DEEPSEEK_COMPARED if getattr(dsjax_model, key) != getattr(hf_model, key)]
    if diffs:
        raise ConvertError("config mismatch: " + "; ".join(diffs))


def hf_config(cfg: ModelConfig, torch_dtype: str, template: dict | None = None) -> dict:
    """config.json for `cfg`: the source model's own config.json (token ids, context length, ...)
    where one is known, with every field that defines the weights' math rewritten from `cfg`."""
    out = {k: v for k, v in (template or {}).items()
           if k not in ("rope_parameters", "rope_scaling", "dtype", "torch_dtype")}
    if is_deepseek_moe(cfg):
        return _deepseek_hf_config(cfg, torch_dtype, out)
    out.setdefault("max_position_embeddings", 4096)  # DeepSeek-LLM's context; RoPE has no limit
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim, "intermediate_size": cfg.mlp_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        # The transformers 4.x spellings; 5.x reads them too (into `rope_parameters`, `dtype`).
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "torch_dtype": torch_dtype,
    })
    return dict(sorted(out.items()))


def _deepseek_hf_config(cfg: ModelConfig, torch_dtype: str, out: dict) -> dict:
    """config.json of a DeepSeek-V2 (softmax router) or -V3 (sigmoid router) model."""
    if cfg.attention != "mla":
        raise ConvertError("model.attention: transformers' DeepSeek-V2/V3 models use MLA; a MoE "
                           "model with attention='mha' has no Hugging Face equivalent")
    v3 = cfg.is_moe and cfg.scoring == "sigmoid"
    model_type = "deepseek_v3" if v3 else "deepseek_v2"
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update({"rope_type": "yarn", **{key: getattr(cfg, field)
                                             for key, field in _YARN_FIELDS}})
    out.setdefault("max_position_embeddings", 4096 if cfg.rope_scaling == "none" else
                   int(cfg.rope_original_max_len * cfg.rope_factor))
    out.update({
        "architectures": [DEEPSEEK_ARCHS[model_type]], "model_type": model_type,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "rope_parameters": rope, "dtype": torch_dtype,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        # A dense MLA model: every layer "before" the MoE ones.
        "first_k_dense_replace": cfg.first_k_dense_replace if cfg.is_moe else cfg.num_layers,
    })
    for key in ("head_dim", "qk_head_dim", "rope_theta"):
        out.pop(key, None)
    if cfg.is_moe:
        out.update({
            "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group,
            "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
            "norm_topk_prob": cfg.norm_topk_prob})
        if v3:
            out.update({"rope_interleave": True, "scoring_func": "sigmoid"})
        else:
            out.update({"topk_method": "greedy" if cfg.n_group == 1 else "group_limited_greedy",
                        "scoring_func": "softmax"})
            if cfg.norm_topk_prob:
                raise ConvertError("model.norm_topk_prob: transformers' DeepseekV2 ignores it; "
                                   "export a softmax router only with norm_topk_prob=False")
    if v3:
        out["num_nextn_predict_layers"] = cfg.num_mtp_layers
    elif cfg.num_mtp_layers:
        raise ConvertError("model.num_mtp_layers: only DeepSeek-V3 checkpoints (a MoE model with "
                           "the sigmoid router) hold MTP modules; export with num_mtp_layers=0 "
                           "or a V3-style model")
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# HF directory -> checks


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return value


def check_tensors(weights: SafetensorsCheckpoint, cfg: ModelConfig) -> dict:
    """Every expected tensor present with its shape and a float dtype, nothing else; returns the
    plan of `tensor_plan`."""
    plan = tensor_plan(cfg)
    missing = [name for name in plan if name not in weights.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing tensor {missing[0]}{more}: the checkpoint does not match "
                           "the config (num_hidden_layers? tie_word_embeddings?)")
    ignored = _ignored_tensors(weights, cfg)
    unexpected = sorted(set(weights.tensors) - set(plan) - ignored)
    if unexpected:
        info = weights.tensors[unexpected[0]]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConvertError(f"unexpected tensor {info.name} in {info.file}{more}: dsjax's "
                           "DeepSeek-LLM model has no such parameter")
    for name, (rule, _, shape) in plan.items():
        info = weights.tensors[name]
        if info.shape != shape:
            dims = ", ".join(_DIM_NAMES[d] for d in rule.hf_dims)
            raise ConvertError(f"tensor {name} in {info.file}: shape {list(info.shape)}, expected "
                               f"{list(shape)} = [{dims}]")
        if info.dtype == FP8_TAG and name + SCALE_SUFFIX in weights.tensors:
            scale = weights.tensors[name + SCALE_SUFFIX]
            want = tuple(-(-n // FP8_BLOCK) for n in shape)
            if scale.shape != want or scale.dtype not in FLOAT_TAGS:
                raise ConvertError(f"tensor {scale.name} in {scale.file}: {scale.dtype} "
                                   f"{list(scale.shape)}, expected a float {list(want)} (one "
                                   f"scale per {FP8_BLOCK}x{FP8_BLOCK} block of {name})")
        elif info.dtype not in FLOAT_TAGS:
            raise ConvertError(f"tensor {name} in {info.file}: dtype {info.dtype}, expected one "
                               f"of {', '.join(FLOAT_TAGS)}")
    return plan


FP8_TAG, SCALE_SUFFIX, FP8_BLOCK = "F8_E4M3", "_scale_inv", 128  # DeepSeek-V3's fp8 release


def _mtp_tensors(weights: SafetensorsCheckpoint, cfg: ModelConfig, first: int) -> set[str]:
    """Names of DeepSeek-V3 MTP-module tensors: layers >= `first` of a model of cfg.num_layers
    decoder layers (fp8 block scales included)."""
    prefix, out = "model.layers.", set()
    if not is_deepseek_moe(cfg):
        return out
    for n in weights.tensors:
        index = n[len(prefix):].split(".")[0] if n.startswith(prefix) else ""
        if index.isdigit() and int(index) >= first:
            out.add(n)
    return out


def _ignored_tensors(weights: SafetensorsCheckpoint, cfg: ModelConfig) -> set[str]:
    """Tensors read with others or skipped: fp8 block scales; DeepSeek-V3 MTP modules beyond
    cfg.num_mtp_layers (`hf_to_orbax` says so when it skips them)."""
    ignored = {n for n in weights.tensors if n.endswith(SCALE_SUFFIX)
               and weights.tensors.get(n[:-len(SCALE_SUFFIX)]) is not None}
    return ignored | _mtp_tensors(weights, cfg, cfg.num_layers + cfg.num_mtp_layers)


def read_tensor(weights: SafetensorsCheckpoint, name: str) -> np.ndarray:
    """A tensor as stored, or float32 if it is fp8 with 128x128 block scales (w * scale_inv of
    its block; DeepSeek-V3's `weight_dequant`)."""
    w = weights.read(name)
    if weights.tensors[name].dtype != FP8_TAG:
        return w
    scale = np.asarray(weights.read(name + SCALE_SUFFIX), np.float32)
    full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return w.astype(np.float32) * full[:w.shape[0], :w.shape[1]]


def _require_empty(path: str, flag: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConvertError(f"{flag}: {path} exists and is not an empty directory")


def _copy_side_files(sources: Sequence[str], out_dir: str, renames: dict[str, str]) -> list[str]:
    copied = []
    for name, target in renames.items():
        for directory in sources:
            src = os.path.join(directory, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, target))
                copied.append(target)
                break
    return copied


# ---------------------------------------------------------------------------------------------
# The two directions


def hf_to_orbax(hf_dir: str, out_dir: str, model_cfg: ModelConfig | None = None,
                log=print) -> ModelConfig:
    """Converts a Hugging Face directory into a weights-only dsjax checkpoint; returns the model
    config written to its meta. With `model_cfg`, config.json must describe the same model."""
    import jax  # pylint: disable=g-import-not-at-top

    from dsjax.checkpoint import save_params  # pylint: disable=g-import-not-at-top

    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"--hf: {config_path} not found (a Hugging Face model directory has "
                           "config.json beside its weights)")
    source = _read_json(config_path)
    cfg = model_config_from_hf(source, config_path)
    weights = open_directory(hf_dir)
    if cfg.num_mtp_layers and not _mtp_tensors(weights, cfg, cfg.num_layers):
        # transformers builds no MTP modules, so its save_pretrained writes none.
        log(f"hf-to-orbax: {config_path} has num_nextn_predict_layers={cfg.num_mtp_layers} but "
            f"the weights hold no MTP module (no model.layers.{cfg.num_layers}.*): importing "
            f"without MTP (num_mtp_layers=0)")
        cfg = dataclasses.replace(cfg, num_mtp_layers=0)
    if model_cfg is not None:
        if cfg.num_mtp_layers and not model_cfg.num_mtp_layers:
            cfg = dataclasses.replace(cfg, num_mtp_layers=0)  # the dsjax config drops MTP
        check_same_model(cfg, model_cfg, config_path)
        cfg = model_cfg
    plan = check_tensors(weights, cfg)
    skipped = _mtp_tensors(weights, cfg, cfg.num_layers + cfg.num_mtp_layers)
    if skipped:
        log(f"hf-to-orbax: skipping {len(skipped)} tensors of MTP modules past "
            f"num_mtp_layers={cfg.num_mtp_layers} (layers >= "
            f"{cfg.num_layers + cfg.num_mtp_layers})")
    shapes = leaf_shapes(cfg)
    _require_empty(out_dir, "--out")
    log(f"hf-to-orbax: {len(plan)} tensors from {len(weights.files)} file(s) in {hf_dir}")

    # The float32 dsjax tree is our only large allocation: each source tensor is a mapped view
    # whose transpose-and-cast copy lands straight in its slot.
    leaves = {path: np.empty(shape, np.float32) for path, shape in shapes.items()}
    for name, (rule, layer, _) in plan.items():
        dest = leaves[rule.leaf] if layer is None else leaves[rule.leaf][layer]
        if rule.copy:  # after the leaf itself (the plan is rule-major, MTP rules last)
            if not np.array_equal(rule.to_dsjax(read_tensor(weights, name), dest.shape)
                                  .astype(np.float32), dest):
                raise ConvertError(f"tensor {name} in {weights.tensors[name].file}: differs from "
                                   f"{'/'.join(rule.leaf)}'s tensor; dsjax's MTP modules share "
                                   "the main embedding and output head (DeepSeek-V3 §2.2)")
            continue
        dest[...] = rule.to_dsjax(read_tensor(weights, name), dest.shape)
        if not np.isfinite(dest).all():
            raise ConvertError(f"tensor {name} in {weights.tensors[name].file}: contains NaN or "
                               "Inf; refusing to write a checkpoint with non-finite values")
    # Orbax holds extra copies while it writes. Given CPU jax.Arrays that alias the numpy leaves
    # (device_put is zero-copy on the CPU) it held 1-1.4 copies; given the numpy leaves, ~1.8
    # (measured; docs/convert.md).
    cpu = jax.devices("cpu")[0]
    save_params(out_dir, jax.tree.map(lambda a: jax.device_put(a, cpu), _nested(leaves)), cfg)
    copied = _copy_side_files([hf_dir], out_dir, {"config.json": HF_CONFIG_COPY,
                                                  **{n: n for n in SIDE_FILES}})
    log(f"wrote {out_dir} (step 0; also {', '.join(copied)})")
    return cfg


def _open_checkpoint(directory: str, step: int | None):
    """(manager, step, directory holding the steps) for a converted dir, a run workdir or its
    checkpoints/ dir."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    for candidate in (directory, os.path.join(directory, "checkpoints")):
        if os.path.isdir(candidate):
            manager = ocp.CheckpointManager(os.path.abspath(candidate))
            if manager.latest_step() is not None:
                break
    else:
        raise ConvertError(f"--checkpoint: no Orbax checkpoint in {directory!r} or its "
                           "checkpoints/")
    if step is None:
        step = manager.latest_step()
    elif step not in manager.all_steps():
        raise ConvertError(f"--step: {step} not in {candidate} (steps: {manager.all_steps()})")
    return manager, step, candidate


def _model_from_meta(manager, step: int, where: str) -> ModelConfig:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # Orbax raises many types; name the checkpoint and the cause.
        raise ConvertError(f"{where}: no readable dsjax meta item ({type(e).__name__}: {e})"
                           ) from None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in (meta or {}).get("model", {}).items() if k in fields}
    try:
        return ModelConfig(**model)
    except TypeError as e:
        raise ConvertError(f"{where}: meta has no complete model config ({e})") from None


def _restore_leaf(manager, step: int, path: tuple[str, ...], shape: tuple[int, ...],
                  where: str) -> np.ndarray:
    """One params leaf as a host numpy array; nothing else of the checkpoint is read."""
    import jax  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    item = _nested({path: jax.ShapeDtypeStruct(shape, np.float32)})
    restore_args = _nested({path: ocp.RestoreArgs(restore_type=np.ndarray)})
    try:
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))["params"]
    except Exception as e:  # Orbax raises many types; name the leaf and the cause.
        raise ConvertError(f"{where}: cannot read params/{'/'.join(path)} {list(shape)} "
                           f"({type(e).__name__}: {e})") from None
    for key in path:
        restored = restored[key]
    return np.asarray(restored, np.float32)


def orbax_to_hf(checkpoint: str, out_dir: str, dtype: str = "float32",
                max_shard_bytes: int = 5 * 10**9, step: int | None = None, log=print) -> list[str]:
    """Writes a directory `transformers.AutoModelForCausalLM.from_pretrained` loads; returns the
    weight files written. Reads the checkpoint leaf by leaf."""
    if dtype not in EXPORT_DTYPES:
        raise ConvertError(f"--dtype: {dtype!r}; valid: {', '.join(EXPORT_DTYPES)}")
    manager, step, steps_dir = _open_checkpoint(checkpoint, step)
    where = f"checkpoint step {step} in {steps_dir}"
    cfg = _model_from_meta(manager, step, where)
    shapes = leaf_shapes(cfg)
    plan = tensor_plan(cfg)
    _require_empty(out_dir, "--out")
    os.makedirs(out_dir, exist_ok=True)
    tag = EXPORT_DTYPES[dtype]
    log(f"orbax-to-hf: {where} -> {out_dir} ({dtype})")

    loaded: dict[tuple[str, ...], np.ndarray] = {}  # at most one leaf: the plan is leaf-major

    def produce(name: str) -> np.ndarray:
        rule, layer, hf_shape = plan[name]
        if rule.leaf not in loaded:
            loaded.clear()
            loaded[rule.leaf] = _restore_leaf(manager, step, rule.leaf, shapes[rule.leaf], where)
        x = loaded[rule.leaf] if layer is None else loaded[rule.leaf][layer]
        return rule.to_hf(x, hf_shape).astype(DTYPES[rule.export_tag or tag])

    files = write_checkpoint(out_dir, [(n, shape, rule.export_tag or tag)
                                       for n, (rule, _, shape) in plan.items()],
                             produce, max_shard_bytes)
    sources = list(dict.fromkeys([checkpoint, steps_dir]))
    template_path = next((os.path.join(d, HF_CONFIG_COPY) for d in sources
                          if os.path.isfile(os.path.join(d, HF_CONFIG_COPY))), None)
    template = _read_json(template_path) if template_path else None
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(cfg, dtype, template), f, indent=2)
    copied = _copy_side_files(sources, out_dir, {n: n for n in SIDE_FILES})
    log(f"wrote {out_dir}: {', '.join(files + ['config.json'] + copied)}")
    return files


# ---------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsjax.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-orbax", help="Hugging Face safetensors -> dsjax Orbax checkpoint")
    imp.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    imp.add_argument("--config", default="", help="configs/NAME.py[:ARG] the checkpoint is for; "
                     "config.json must agree with its model section (default: derive from it)")
    imp.add_argument("--out", required=True, help="new (or empty) checkpoint directory")
    exp = sub.add_parser("orbax-to-hf", help="dsjax Orbax checkpoint -> Hugging Face safetensors")
    exp.add_argument("--checkpoint", required=True,
                     help="a converted checkpoint, a run workdir or its checkpoints/ dir")
    exp.add_argument("--out", required=True, help="new (or empty) output directory")
    exp.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                     help="weight dtype written (default: float32, the master weights' own)")
    exp.add_argument("--max_shard_size", default="5GB", help="largest .safetensors shard")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Imported here: dsjax.checkpoint imports JAX, which `__main__` first points at the CPU.
    from dsjax.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
    from dsjax.config import ConfigError, load  # pylint: disable=g-import-not-at-top

    try:
        if args.command == "hf-to-orbax":
            model_cfg = load(args.config).model if args.config else None
            hf_to_orbax(args.hf, args.out, model_cfg)
        else:
            orbax_to_hf(args.checkpoint, args.out, args.dtype, parse_size(args.max_shard_size),
                        args.step)
    except (ConvertError, SafetensorsError, ConfigError, CheckpointError, OSError) as e:
        print(f"dsjax.convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Conversion is host work: keep JAX off any accelerator (and its memory) unless told otherwise.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
