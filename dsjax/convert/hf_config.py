"""Hugging Face `config.json` <-> dsjax `ModelConfig`, both ways, for DeepSeek-LLM and V2/V3.

The one idea: reading refuses, field by field, whatever the dsjax model would not compute as
transformers does (a tied head, biases, other RoPE kinds, ...), so a config that converts
describes the same math; writing starts from the source model's own config.json where one is
known and rewrites every field that defines the weights' math.
"""

from __future__ import annotations

import math
from typing import Any

from dsjax.config import ModelConfig, validate_deepseek
from dsjax.convert.rules import is_deepseek_moe
from dsjax.errors import ConfigError, ConvertError, unknown_choice


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
    _refuse_unmodelled(hf, fail, "LlamaForCausalLM", "DeepSeek-LLM does too")
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



def _refuse_unmodelled(hf: dict, fail, arch: str, same: str) -> None:
    """What neither family's dsjax model has: another architecture, a tied head, biases, an
    activation other than SwiGLU. `same` ends the tied-head message."""
    archs = hf.get("architectures") or [arch]
    if archs != [arch]:
        fail("architectures", f"{archs} is not supported; expected [{arch!r}]")
    if hf.get("tie_word_embeddings", False):
        fail("tie_word_embeddings", "true is not supported: dsjax keeps the embedding and the "
             f"output head separate ({same})")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            fail(key, "true is not supported: dsjax projections have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", f"{hf['hidden_act']!r} is not supported; dsjax's MLP is SwiGLU (silu)")


DEEPSEEK_ARCHS = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# HF rope_parameters / rope_scaling key -> ModelConfig field, for YaRN.
_YARN_FIELDS = (("factor", "rope_factor"), ("original_max_position_embeddings",
                                             "rope_original_max_len"),
                ("beta_fast", "rope_beta_fast"), ("beta_slow", "rope_beta_slow"),
                ("mscale", "rope_mscale"), ("mscale_all_dim", "rope_mscale_all_dim"))


def _deepseek_config_from_hf(hf: dict, fail) -> ModelConfig:
    """A DeepSeek-V2/V3 `config.json` -> ModelConfig (MLA, DeepSeekMoE); refuses the rest."""
    v3 = hf["model_type"] == "deepseek_v3"
    _refuse_unmodelled(hf, fail, DEEPSEEK_ARCHS[hf["model_type"]], "DeepSeek-V2/V3 do too")
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
                fail("topk_method", unknown_choice("method", method,
                                                   ("greedy", "group_limited_greedy")))
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
        validate_deepseek(cfg)
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
