"""Hugging Face vision `config.json`s <-> (`ModelConfig`, `VisionSpec`): a SigLIP vision tower
(`SiglipVisionModel`, model_type "siglip_vision_model") and DeepSeek-VL
(`DeepseekVLForConditionalGeneration`, model_type "deepseek_vl": a Llama `text_config`, a SigLIP
`vision_config`, the MLP aligner). As for text models, reading refuses what dsjax would not
compute as transformers does; writing starts from the source config where one is known.
"""

from __future__ import annotations

from typing import Any

from dsjax.config import ModelConfig
from dsjax.convert.hf_config import hf_config, model_config_from_hf
from dsjax.errors import ConvertError
from dsjax.model.vision import VisionSpec

SIGLIP, DEEPSEEK_VL = "siglip_vision_model", "deepseek_vl"
VISION_MODEL_TYPES = {SIGLIP: "SiglipVisionModel",
                      DEEPSEEK_VL: "DeepseekVLForConditionalGeneration"}
# transformers' SiglipVisionConfig defaults, for fields a config.json leaves out.
_SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                    "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
_GELU = {"gelu_pytorch_tanh": True, "gelu": False}  # hidden_act -> VisionSpec.gelu_tanh
_SPEC_KEYS = (("hidden_size", "hidden_size"), ("intermediate_size", "mlp_dim"),
              ("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
              ("num_channels", "num_channels"), ("image_size", "image_size"),
              ("patch_size", "patch_size"))


def vision_spec_from_hf(vc: dict, where: str, image_token_id: int = -1) -> VisionSpec:
    """A SigLIP vision config -> VisionSpec (mlp projector); refuses what dsjax does not model."""
    def fail(key: str, why: str):
        raise ConvertError(f"{where}: {key}: {why}")

    if vc.get("model_type", SIGLIP) != SIGLIP:
        fail("model_type", f"{vc.get('model_type')!r} is not supported; dsjax's vision tower is "
             f"SigLIP ({SIGLIP!r})")
    vc = {**_SIGLIP_DEFAULTS, **{k: v for k, v in vc.items() if v is not None}}
    fields = {}
    for key, field in _SPEC_KEYS:
        value = vc[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(key, f"expected a positive integer, got {value!r}")
        fields[field] = value
    if vc["hidden_act"] not in _GELU:
        fail("hidden_act", f"{vc['hidden_act']!r} is not supported; expected one of "
             f"{sorted(_GELU)}")
    eps = vc["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        fail("layer_norm_eps", f"expected a positive number, got {eps!r}")
    if fields["image_size"] % fields["patch_size"]:
        fail("patch_size", f"{fields['patch_size']} does not divide image_size "
             f"{fields['image_size']}")
    if fields["hidden_size"] % fields["num_heads"]:
        fail("num_attention_heads", f"{fields['num_heads']} does not divide hidden_size "
             f"{fields['hidden_size']}")
    return VisionSpec(**fields, image_token_id=image_token_id, norm_eps=float(eps),
                      gelu_tanh=_GELU[vc["hidden_act"]])


def vl_config_from_hf(hf: dict, where: str) -> tuple[ModelConfig, VisionSpec]:
    """A DeepSeek-VL config.json -> (the language model's ModelConfig, VisionSpec)."""
    if hf.get("tie_word_embeddings", True):
        # DeepseekVLConfig's default is true: a config.json that omits it ties the head.
        raise ConvertError(f"{where}: tie_word_embeddings: true (or absent: DeepseekVLConfig's "
                           "default) is not supported: dsjax keeps the embedding and the output "
                           "head separate")
    archs = hf.get("architectures") or [VISION_MODEL_TYPES[DEEPSEEK_VL]]
    if archs != [VISION_MODEL_TYPES[DEEPSEEK_VL]]:
        raise ConvertError(f"{where}: architectures: {archs} is not supported; expected "
                           f"[{VISION_MODEL_TYPES[DEEPSEEK_VL]!r}]")
    for key in ("text_config", "vision_config"):
        if not isinstance(hf.get(key), dict):
            raise ConvertError(f"{where}: {key}: expected an object")
    token = hf.get("image_token_id", 100015)  # DeepseekVLConfig's default
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ConvertError(f"{where}: image_token_id: expected a token id, got {token!r}")
    text = {k: v for k, v in hf["text_config"].items() if k != "architectures"}
    cfg = model_config_from_hf(text, f"{where} text_config")
    if token >= cfg.vocab_size:
        raise ConvertError(f"{where}: image_token_id: {token} is not below text_config."
                           f"vocab_size {cfg.vocab_size}")
    return cfg, vision_spec_from_hf(hf["vision_config"], f"{where} vision_config", token)


def vision_hf_config(spec: VisionSpec, torch_dtype: str, template: dict | None = None) -> dict:
    """A SigLIP vision config.json for `spec` (no pooling head: dsjax has none)."""
    out = {k: v for k, v in (template or {}).items() if k not in ("dtype", "torch_dtype")}
    out.update({hf_key: getattr(spec, field) for hf_key, field in _SPEC_KEYS})
    out.update({"model_type": SIGLIP, "layer_norm_eps": spec.norm_eps, "vision_use_head": False,
                "hidden_act": "gelu_pytorch_tanh" if spec.gelu_tanh else "gelu",
                "torch_dtype": torch_dtype})
    return dict(sorted(out.items()))


def vl_hf_config(cfg: ModelConfig, spec: VisionSpec, torch_dtype: str,
                 template: dict | None = None) -> dict:
    """DeepSeek-VL's config.json: the template's other fields, both sub-configs rewritten."""
    template = template or {}
    text = hf_config(cfg, torch_dtype, template.get("text_config"))
    text.pop("architectures", None)
    out: dict[str, Any] = {k: v for k, v in template.items() if k not in ("dtype", "torch_dtype")}
    out.update({"architectures": [VISION_MODEL_TYPES[DEEPSEEK_VL]], "model_type": DEEPSEEK_VL,
                "text_config": text, "image_token_id": spec.image_token_id,
                "vision_config": vision_hf_config(spec, torch_dtype,
                                                  template.get("vision_config")),
                "tie_word_embeddings": False, "torch_dtype": torch_dtype})
    return dict(sorted(out.items()))
