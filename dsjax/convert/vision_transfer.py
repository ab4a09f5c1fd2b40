"""Both directions for DeepSeek-VL (`DeepseekVLForConditionalGeneration`) and SigLIP vision
towers alone (`SiglipVisionModel`), on `transfer`'s machinery: check from headers, stream one
tensor at a time, write Orbax / safetensors.

The VisionSpec is saved beside the steps as `vision_spec.json` (the Orbax meta holds the
language model's config only); a tower-only checkpoint's params are {"vision_tower": ...} and
its meta has no "model". SigLIP's attention-pooling head (`head.*`) is skipped on import, and
said so: DeepSeek-VL reads the tower's last hidden state.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp

from dsjax.checkpoint import save_params, seal, try_read_meta
from dsjax.config import ModelConfig
from dsjax.convert.hf_config import check_same_model
from dsjax.convert.rules import DIM_NAMES
from dsjax.convert.safetensors import open_directory
from dsjax.convert.transfer import (EXPORT_DTYPES, HF_CONFIG_COPY, SIDE_FILES, check_plan,
                                    copy_side_files, fill_leaves, model_from_meta, nest_leaves,
                                    open_checkpoint, read_json, require_empty, write_weights)
from dsjax.convert.vision_config import (DEEPSEEK_VL, SIGLIP, VISION_MODEL_TYPES,
                                         vision_hf_config, vision_spec_from_hf, vl_config_from_hf,
                                         vl_hf_config)
from dsjax.convert.vision_rules import (DIM_NAMES as VISION_DIM_NAMES, TOWER_HEAD, VL_TOWER,
                                        tower_leaf_shapes, vision_plan, vl_leaf_shapes,
                                        vl_tensor_plan)
from dsjax.errors import ConvertError, unknown_choice
from dsjax.model.vision import SPEC_FILE as VISION_SPEC_FILE
from dsjax.model.vision import VisionSpec
_TOWER_PREFIX = "vision_model."  # a tower saved inside a SiglipModel-style checkpoint


def is_vision_source(hf_dir: str) -> bool:
    """True when `hf_dir`'s config.json is a DeepSeek-VL model or a SigLIP vision tower."""
    path = os.path.join(hf_dir, "config.json")
    return os.path.isfile(path) and read_json(path).get("model_type") in VISION_MODEL_TYPES


def is_vision_checkpoint(checkpoint: str) -> bool:
    """True when a converted checkpoint (or run workdir) has a `vision_spec.json`."""
    return any(os.path.isfile(os.path.join(d, VISION_SPEC_FILE))
               for d in (checkpoint, os.path.join(checkpoint, "checkpoints")))


def vision_hf_to_orbax(hf_dir: str, out_dir: str, model_cfg: ModelConfig | None = None,
                       log=print) -> tuple[ModelConfig | None, VisionSpec]:
    """`hf_to_orbax` for DeepSeek-VL or a SigLIP tower; returns (the language model's config, or
    None for a tower, the VisionSpec)."""
    config_path = os.path.join(hf_dir, "config.json")
    source = read_json(config_path)
    weights = open_directory(hf_dir)
    if source.get("model_type") == DEEPSEEK_VL:
        cfg, spec = vl_config_from_hf(source, config_path)
        if model_cfg is not None:
            check_same_model(cfg, model_cfg, f"{config_path} text_config")
            cfg = model_cfg
        plan, shapes = vl_tensor_plan(cfg, spec), vl_leaf_shapes(cfg, spec)
        head, what = VL_TOWER + TOWER_HEAD, "dsjax's DeepSeek-VL model"
    elif source.get("model_type") == SIGLIP:
        cfg, spec = None, vision_spec_from_hf(source, config_path)
        prefix = _TOWER_PREFIX if any(n.startswith(_TOWER_PREFIX) for n in weights.tensors) else ""
        plan, shapes = vision_plan(spec, prefix), tower_leaf_shapes(spec)
        head, what = prefix + TOWER_HEAD, "dsjax's SigLIP tower"
    else:
        raise ConvertError(f"{config_path}: model_type: {source.get('model_type')!r} is not a "
                           f"vision model ({', '.join(VISION_MODEL_TYPES)})")
    skipped = {n for n in weights.tensors if n.startswith(head)}
    check_plan(weights, plan, skipped, what, "(num_hidden_layers? image_size? patch_size?)",
               {**DIM_NAMES, **VISION_DIM_NAMES})
    if skipped:
        log(f"hf-to-orbax: skipping {len(skipped)} tensors of SigLIP's attention-pooling head "
            f"({head}*): DeepSeek-VL uses the tower's last hidden state, not the pooled output")
    require_empty(out_dir, "--out")
    log(f"hf-to-orbax: {len(plan)} tensors from {len(weights.files)} file(s) in {hf_dir}")
    leaves = fill_leaves(weights, plan, shapes)
    cpu = jax.devices("cpu")[0]
    params = jax.tree.map(lambda a: jax.device_put(a, cpu), nest_leaves(leaves))
    if cfg is not None:
        save_params(out_dir, params, cfg)
    else:
        _save_tower(out_dir, params, spec)
    spec.save(out_dir)
    copied = copy_side_files([hf_dir], out_dir, {"config.json": HF_CONFIG_COPY,
                                                  **{n: n for n in SIDE_FILES}})
    log(f"wrote {out_dir} (step 0; also {', '.join([VISION_SPEC_FILE] + copied)})")
    return cfg, spec


def _save_tower(directory: str, params, spec: VisionSpec) -> None:
    """A weights-only checkpoint of a tower alone: its meta names the VisionSpec, no model."""
    manager = ocp.CheckpointManager(os.path.abspath(directory),
                                    options=ocp.CheckpointManagerOptions(create=True))
    meta = {"format": "dsjax-checkpoint-v1", "vision": dataclasses.asdict(spec), "step": 0}
    manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                            meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()
    manager.close()
    if jax.process_index() == 0:
        seal(os.path.join(os.path.abspath(directory), "0"))


def vision_orbax_to_hf(checkpoint: str, out_dir: str, dtype: str = "float32",
                       max_shard_bytes: int = 5 * 10**9, step: int | None = None,
                       log=print) -> list[str]:
    """`orbax_to_hf` for a checkpoint with a `vision_spec.json`: a directory that
    `DeepseekVLForConditionalGeneration` (or `SiglipVisionModel`, for a tower) loads."""
    if dtype not in EXPORT_DTYPES:
        raise ConvertError(unknown_choice("dtype", dtype, EXPORT_DTYPES, "--dtype"))
    manager, step, steps_dir = open_checkpoint(checkpoint, step)
    where = f"checkpoint step {step} in {steps_dir}"
    sources = list(dict.fromkeys([checkpoint, steps_dir]))
    found = {name: next((os.path.join(d, name) for d in sources
                         if os.path.isfile(os.path.join(d, name))), None)
             for name in (VISION_SPEC_FILE, HF_CONFIG_COPY)}
    if found[VISION_SPEC_FILE] is None:
        raise ConvertError(f"{where}: no {VISION_SPEC_FILE} beside the steps")
    try:
        spec = VisionSpec(**read_json(found[VISION_SPEC_FILE]))
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{found[VISION_SPEC_FILE]}: not a VisionSpec ({e})") from None
    if spec.tiling:
        raise ConvertError(f"{found[VISION_SPEC_FILE]}: the model uses DeepSeek-VL2 tiling "
                           "(row-newline and view-separator rows), which transformers has no "
                           "class for; export supports DeepSeek-VL (vision.tiling=False) only")
    template = read_json(found[HF_CONFIG_COPY]) if found[HF_CONFIG_COPY] else None
    meta, why = try_read_meta(manager, step)
    if why is not None:
        raise ConvertError(f"{where}: no readable dsjax meta item ({why})")
    tag = EXPORT_DTYPES[dtype]
    if "model" in (meta or {}):
        cfg = model_from_meta(manager, step, where)
        plan, shapes = vl_tensor_plan(cfg, spec), vl_leaf_shapes(cfg, spec)
        config = vl_hf_config(cfg, spec, dtype, template)
    else:
        plan, shapes = vision_plan(spec, ""), tower_leaf_shapes(spec)
        config = {**vision_hf_config(spec, dtype, template),
                  "architectures": [VISION_MODEL_TYPES[SIGLIP]]}
    require_empty(out_dir, "--out")
    os.makedirs(out_dir, exist_ok=True)
    log(f"orbax-to-hf: {where} -> {out_dir} ({dtype})")
    files = write_weights(manager, step, plan, shapes, out_dir, tag, max_shard_bytes, where)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(config.items())), f, indent=2)
    copied = copy_side_files(sources, out_dir, {n: n for n in SIDE_FILES})
    log(f"wrote {out_dir}: {', '.join(files + ['config.json'] + copied)}")
    return files
