"""The conversion table of DeepSeek-VL's image side: the SigLIP tower (`SiglipVisionModel`, or
`model.vision_model.` inside `DeepseekVLForConditionalGeneration`) and the aligner, in `Rule`s.

A SigLIP tower's q/k/v/out projections carry biases; a projection bias [H*K] becomes [H, K] as
its weight's output dims do. The patch conv [Dv, C, p, p] becomes dsjax's [p, p, C, Dv] kernel
(rows, columns, channels: the order `SiglipTower` flattens a patch in). SigLIP's attention
pooling head (`head.*`) is not used by DeepSeek-VL and has no dsjax leaf: import skips it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.convert.rules import Rule, covered, declared_shapes, tensor_plan
from dsjax.errors import ConvertError
from dsjax.model.decoder import Transformer
from dsjax.model.vision import SiglipTower, VisionSpec

VISION_TABLE = "dsjax.convert.vision_rules"  # named by a coverage error: the table to update
_V = "encoder.layers.{i}."
_T = ("vision_tower",)
_L = _T + ("layers",)
# Relative to the tower's prefix ("" for SiglipVisionModel, "model.vision_model." in DeepSeek-VL).
TOWER_RULES = (
    Rule("embeddings.patch_embedding.weight", _T + ("patch_embed",), ("VD", "VC", "VP", "VP"),
         False, perm=(2, 3, 1, 0)),
    Rule("embeddings.patch_embedding.bias", _T + ("patch_bias",), ("VD",), False),
    Rule("embeddings.position_embedding.weight", _T + ("pos_embed",), ("VN", "VD"), False),
    Rule(_V + "layer_norm1.weight", _L + ("ln1", "scale"), ("VD",), False),
    Rule(_V + "layer_norm1.bias", _L + ("ln1", "bias"), ("VD",), False),
    Rule(_V + "self_attn.q_proj.weight", _L + ("q",), ("VD", "VD"), True),
    Rule(_V + "self_attn.q_proj.bias", _L + ("q_bias",), ("VD",), False),
    Rule(_V + "self_attn.k_proj.weight", _L + ("k",), ("VD", "VD"), True),
    Rule(_V + "self_attn.k_proj.bias", _L + ("k_bias",), ("VD",), False),
    Rule(_V + "self_attn.v_proj.weight", _L + ("v",), ("VD", "VD"), True),
    Rule(_V + "self_attn.v_proj.bias", _L + ("v_bias",), ("VD",), False),
    Rule(_V + "self_attn.out_proj.weight", _L + ("o",), ("VD", "VD"), True),
    Rule(_V + "self_attn.out_proj.bias", _L + ("o_bias",), ("VD",), False),
    Rule(_V + "layer_norm2.weight", _L + ("ln2", "scale"), ("VD",), False),
    Rule(_V + "layer_norm2.bias", _L + ("ln2", "bias"), ("VD",), False),
    Rule(_V + "mlp.fc1.weight", _L + ("fc1",), ("VF", "VD"), True),
    Rule(_V + "mlp.fc1.bias", _L + ("fc1_bias",), ("VF",), False),
    Rule(_V + "mlp.fc2.weight", _L + ("fc2",), ("VD", "VF"), True),
    Rule(_V + "mlp.fc2.bias", _L + ("fc2_bias",), ("VD",), False),
    Rule("post_layernorm.weight", _T + ("post_norm", "scale"), ("VD",), False),
    Rule("post_layernorm.bias", _T + ("post_norm", "bias"), ("VD",), False),
)
TOWER_HEAD = "head."  # SigLIP's attention-pooling head: DeepSeek-VL does not use it
VL_TOWER, VL_ALIGNER, VL_LANGUAGE = "model.vision_model.", "model.aligner.", "model.language_model."
_P = ("projector",)
ALIGNER_RULES = (
    Rule(VL_ALIGNER + "linear1.weight", _P + ("linear1",), ("D", "VD"), True),
    Rule(VL_ALIGNER + "linear1.bias", _P + ("bias1",), ("D",), False),
    Rule(VL_ALIGNER + "linear2.weight", _P + ("linear2",), ("D", "D"), True),
    Rule(VL_ALIGNER + "linear2.bias", _P + ("bias2",), ("D",), False),
)
DIM_NAMES = {"VD": "vision_config.hidden_size", "VF": "vision_config.intermediate_size",
             "VC": "vision_config.num_channels", "VP": "vision_config.patch_size",
             "VN": "(vision_config.image_size/patch_size)^2"}


def vision_sizes(spec: VisionSpec) -> dict[str, int]:
    return {"VD": spec.hidden_size, "VF": spec.mlp_dim, "VC": spec.num_channels,
            "VP": spec.patch_size, "VN": spec.grid ** 2}


def vision_plan(spec: VisionSpec, tower_prefix: str, hidden_size: int | None = None
                ) -> dict[str, tuple[Rule, Any, tuple[int, ...]]]:
    """HF tensor name -> (rule, layer index or None, HF shape) of the tower under `tower_prefix`
    and, given the language model's `hidden_size`, DeepSeek-VL's aligner; `tensor_plan`'s form."""
    sizes = {**vision_sizes(spec), "D": hidden_size or 0}
    rules = [dataclasses.replace(r, hf=tower_prefix + r.hf) for r in TOWER_RULES]
    if hidden_size is not None:
        if spec.projector != "mlp":
            raise ConvertError(f"projector {spec.projector!r}: Hugging Face DeepSeek-VL has the "
                             "mlp aligner only")
        rules += ALIGNER_RULES
    plan = {}
    for rule in rules:
        shape = tuple(sizes[d] for d in rule.hf_dims)
        for i in range(spec.num_layers) if rule.per_layer else [None]:
            plan[rule.hf.format(i=i) if rule.per_layer else rule.hf] = (rule, i, shape)
    return plan


def vl_tensor_plan(cfg: ModelConfig, spec: VisionSpec
                   ) -> dict[str, tuple[Rule, Any, tuple[int, ...]]]:
    """`tensor_plan` of a `DeepseekVLForConditionalGeneration` checkpoint: the Llama language
    model under "model.language_model." (its head stays "lm_head.weight"), the tower under
    "model.vision_model." and the aligner."""
    plan = {(VL_LANGUAGE + name[len("model."):] if name.startswith("model.") else name): entry
            for name, entry in tensor_plan(cfg).items()}
    return {**plan, **vision_plan(spec, VL_TOWER, cfg.hidden_size)}


def vl_leaf_shapes(cfg: ModelConfig, spec: VisionSpec) -> dict[tuple[str, ...], tuple[int, ...]]:
    """`leaf_shapes` of the DeepSeek-VL model (`Transformer` with `vision`)."""
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    model = Transformer(cfg, vision=spec)
    abstract = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]
    return covered(declared_shapes(abstract), vl_tensor_plan(cfg, spec), VISION_TABLE)


def tower_leaf_shapes(spec: VisionSpec) -> dict[tuple[str, ...], tuple[int, ...]]:
    """`leaf_shapes` of a tower-only checkpoint: params {"vision_tower": ...}."""
    tower = SiglipTower(**spec.tower_fields())
    pixels = jax.ShapeDtypeStruct((1, spec.image_size, spec.image_size, spec.num_channels),
                                  jnp.float32)
    abstract = jax.eval_shape(lambda x: tower.init(jax.random.key(0), x), pixels)["params"]
    return covered(declared_shapes({"vision_tower": abstract}), vision_plan(spec, ""),
                   VISION_TABLE)
