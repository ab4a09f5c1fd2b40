"""The two directions, Hugging Face safetensors -> Orbax (`hf_to_orbax`) and back (`orbax_to_hf`).

The one idea: everything is validated from the safetensors headers and config.json before a
single weight is read; weights then stream one tensor at a time (`dsjax.convert.safetensors`), so
no HF model is ever resident beyond one tensor. Import holds the float32 dsjax params (what Orbax
writes); export holds one dsjax leaf. Memory measured in docs/convert.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from dsjax.checkpoint import find_steps, save_params, try_read_meta
from dsjax.config import ModelConfig
from dsjax.convert.hf_config import check_same_model, hf_config, model_config_from_hf
from dsjax.convert.rules import DIM_NAMES, is_deepseek_moe, leaf_shapes, tensor_plan
from dsjax.convert.safetensors import (DTYPES, SafetensorsCheckpoint, open_directory,
                                       write_checkpoint)
from dsjax.errors import CheckpointError, ConvertError, unknown_choice

HF_CONFIG_COPY = "hf_config.json"  # the source config.json, kept beside the Orbax steps
# Copied HF dir -> checkpoint dir -> HF dir untouched, so eval and export find the tokenizer.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "generation_config.json")
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
FLOAT_TAGS = ("F32", "BF16", "F16", "F64")
FP8_TAG, SCALE_SUFFIX, FP8_BLOCK = "F8_E4M3", "_scale_inv", 128  # DeepSeek-V3's fp8 release


# ---------------------------------------------------------------------------------------------
# HF directory -> checks


def read_json(path: str) -> dict:
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
    return check_plan(weights, tensor_plan(cfg), _ignored_tensors(weights, cfg),
                      "dsjax's DeepSeek-LLM model", "(num_hidden_layers? tie_word_embeddings?)")


def check_plan(weights: SafetensorsCheckpoint, plan: dict, ignored: set[str], model: str,
               hint: str, dim_names: dict[str, str] = DIM_NAMES) -> dict:
    """`check_tensors` for any plan (HF name -> (rule, index, shape)); tensors in `ignored` may
    be present. `model` names the dsjax model, `hint` the config fields a mismatch suggests."""
    missing = [name for name in plan if name not in weights.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing tensor {missing[0]}{more}: the checkpoint does not match "
                           f"the config {hint}")
    unexpected = sorted(set(weights.tensors) - set(plan) - ignored)
    if unexpected:
        info = weights.tensors[unexpected[0]]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConvertError(f"unexpected tensor {info.name} in {info.file}{more}: {model} has no "
                           "such parameter")
    for name, (rule, _, shape) in plan.items():
        info = weights.tensors[name]
        if info.shape != shape:
            dims = ", ".join(dim_names[d] for d in rule.hf_dims)
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


def require_empty(path: str, flag: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConvertError(f"{flag}: {path} exists and is not an empty directory")


def copy_side_files(sources: Sequence[str], out_dir: str, renames: dict[str, str]) -> list[str]:
    copied = []
    for name, target in renames.items():
        for directory in sources:
            src = os.path.join(directory, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, target))
                copied.append(target)
                break
    return copied


def nest_leaves(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


# ---------------------------------------------------------------------------------------------
# The two directions


def hf_to_orbax(hf_dir: str, out_dir: str, model_cfg: ModelConfig | None = None,
                log=print) -> ModelConfig:
    """Converts a Hugging Face directory into a weights-only dsjax checkpoint; returns the model
    config written to its meta. With `model_cfg`, config.json must describe the same model."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"--hf: {config_path} not found (a Hugging Face model directory has "
                           "config.json beside its weights)")
    source = read_json(config_path)
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
    require_empty(out_dir, "--out")
    log(f"hf-to-orbax: {len(plan)} tensors from {len(weights.files)} file(s) in {hf_dir}")

    leaves = fill_leaves(weights, plan, shapes)
    # Orbax holds extra copies while it writes. Given CPU jax.Arrays that alias the numpy leaves
    # (device_put is zero-copy on the CPU) it held 1-1.4 copies; given the numpy leaves, ~1.8
    # (measured; docs/convert.md).
    cpu = jax.devices("cpu")[0]
    save_params(out_dir, jax.tree.map(lambda a: jax.device_put(a, cpu), nest_leaves(leaves)), cfg)
    copied = copy_side_files([hf_dir], out_dir, {"config.json": HF_CONFIG_COPY,
                                                  **{n: n for n in SIDE_FILES}})
    log(f"wrote {out_dir} (step 0; also {', '.join(copied)})")
    return cfg


def fill_leaves(weights: SafetensorsCheckpoint, plan: dict, shapes: dict[tuple[str, ...], tuple]
                ) -> dict[tuple[str, ...], np.ndarray]:
    """The float32 dsjax leaves (path -> array) of a checked plan, read one tensor at a time."""
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
    return leaves


def open_checkpoint(directory: str, step: int | None):
    """(manager, step, directory holding the steps) for a converted dir, a run workdir or its
    checkpoints/ dir."""
    try:
        candidate, manager = find_steps(directory)
    except CheckpointError:
        raise ConvertError(f"--checkpoint: no Orbax checkpoint in {directory!r} or its "
                           "checkpoints/") from None
    if step is None:
        step = manager.latest_step()
    elif step not in manager.all_steps():
        raise ConvertError(f"--step: {step} not in {candidate} (steps: {manager.all_steps()})")
    return manager, step, candidate


def model_from_meta(manager, step: int, where: str) -> ModelConfig:
    meta, why = try_read_meta(manager, step)
    if why is not None:
        raise ConvertError(f"{where}: no readable dsjax meta item ({why})")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in (meta or {}).get("model", {}).items() if k in fields}
    try:
        return ModelConfig(**model)
    except TypeError as e:
        raise ConvertError(f"{where}: meta has no complete model config ({e})") from None


def _restore_leaf(manager, step: int, path: tuple[str, ...], shape: tuple[int, ...],
                  where: str) -> np.ndarray:
    """One params leaf as a host numpy array; nothing else of the checkpoint is read."""
    item = nest_leaves({path: jax.ShapeDtypeStruct(shape, np.float32)})
    restore_args = nest_leaves({path: ocp.RestoreArgs(restore_type=np.ndarray)})
    try:
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)))["params"]
    except Exception as e:  # Orbax raises many types; name the leaf and the cause.
        raise ConvertError(f"{where}: cannot read params/{'/'.join(path)} {list(shape)} "
                           f"({type(e).__name__}: {e})") from None
    for key in path:
        restored = restored[key]
    return np.asarray(restored, np.float32)


def write_weights(manager, step: int, plan: dict, shapes: dict, out_dir: str, tag: str,
                  max_shard_bytes: int, where: str) -> list[str]:
    """Writes the plan's HF tensors (safetensors dtype `tag` unless a rule fixes its own) from
    the checkpoint, holding one dsjax leaf at a time; returns the files written."""
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
    return files


def orbax_to_hf(checkpoint: str, out_dir: str, dtype: str = "float32",
                max_shard_bytes: int = 5 * 10**9, step: int | None = None, log=print) -> list[str]:
    """Writes a directory `transformers.AutoModelForCausalLM.from_pretrained` loads; returns the
    weight files written. Reads the checkpoint leaf by leaf."""
    if dtype not in EXPORT_DTYPES:
        raise ConvertError(unknown_choice("dtype", dtype, EXPORT_DTYPES, "--dtype"))
    manager, step, steps_dir = open_checkpoint(checkpoint, step)
    where = f"checkpoint step {step} in {steps_dir}"
    cfg = model_from_meta(manager, step, where)
    shapes = leaf_shapes(cfg)
    plan = tensor_plan(cfg)
    require_empty(out_dir, "--out")
    os.makedirs(out_dir, exist_ok=True)
    tag = EXPORT_DTYPES[dtype]
    log(f"orbax-to-hf: {where} -> {out_dir} ({dtype})")

    files = write_weights(manager, step, plan, shapes, out_dir, tag, max_shard_bytes, where)
    sources = list(dict.fromkeys([checkpoint, steps_dir]))
    template_path = next((os.path.join(d, HF_CONFIG_COPY) for d in sources
                          if os.path.isfile(os.path.join(d, HF_CONFIG_COPY))), None)
    template = read_json(template_path) if template_path else None
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(cfg, dtype, template), f, indent=2)
    copied = copy_side_files(sources, out_dir, {n: n for n in SIDE_FILES})
    log(f"wrote {out_dir}: {', '.join(files + ['config.json'] + copied)}")
    return files
