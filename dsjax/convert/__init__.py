"""Hugging Face safetensors <-> dsjax Orbax checkpoints, for DeepSeek-LLM, -V2 and -V3 models,
DeepSeek-VL and SigLIP vision towers.

`python -m dsjax.convert hf-to-orbax|orbax-to-hf ...` (usage in `cli`, guide in docs/convert.md).
One table (`rules`) maps every HF tensor to a dsjax leaf; both directions and every check read it.
  rules        the table, expanded per model (`tensor_plan`) and checked against the model
  hf_config    config.json <-> ModelConfig
  transfer     the two directions: validate everything first, then stream one tensor at a time
  safetensors  the lazy reader and the streaming, sharded writer
  cli          the command line; `__main__` runs it on the CPU
  vision_rules, vision_config, vision_transfer   the same three jobs for DeepSeek-VL / SigLIP
"""

from dsjax.convert.cli import main
from dsjax.convert.hf_config import check_same_model, hf_config, model_config_from_hf
from dsjax.convert.rules import (DEEPSEEK_RULES, MTP_RULES, RULES, Rule, is_deepseek_moe,
                                 leaf_shapes, tensor_plan)
from dsjax.convert.transfer import check_tensors, hf_to_orbax, orbax_to_hf, read_tensor
from dsjax.convert.vision_transfer import vision_hf_to_orbax, vision_orbax_to_hf
from dsjax.errors import ConvertError, SafetensorsError

__all__ = ["ConvertError", "DEEPSEEK_RULES", "MTP_RULES", "RULES", "Rule", "SafetensorsError",
           "check_same_model", "check_tensors", "hf_config", "hf_to_orbax", "is_deepseek_moe",
           "leaf_shapes", "main", "model_config_from_hf", "orbax_to_hf", "read_tensor",
           "tensor_plan", "vision_hf_to_orbax", "vision_orbax_to_hf"]
