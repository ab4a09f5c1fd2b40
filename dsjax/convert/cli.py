"""Hugging Face DeepSeek-LLM checkpoints (safetensors, `LlamaForCausalLM` layout) <-> dsjax Orbax;
also DeepSeek-VL (`DeepseekVLForConditionalGeneration`) and SigLIP vision towers
(`SiglipVisionModel`), recognised by config.json's model_type (`vision_transfer`).

  python -m dsjax.convert hf-to-orbax --hf HF_DIR [--config configs/NAME.py[:ARG]] --out CKPT_DIR
  python -m dsjax.convert orbax-to-hf --checkpoint CKPT_DIR_OR_WORKDIR --out HF_DIR
                                      [--dtype float32|bfloat16] [--max_shard_size 5GB]

The one idea: one table, `RULES`, says how each HF tensor becomes a dsjax leaf (or one layer's
slice of a scanned leaf): torch `Linear` weights are [out, in], dsjax matrices are [in, ...out],
so a projection is a transpose and a reshape; embeddings and norm scales are copied. Both
directions and every check read that table. Everything is validated from the safetensors headers
and `config.json` before a single weight is read; weights then stream one tensor at a time
(`dsjax.convert.safetensors`): no HF model is ever resident beyond one tensor. Import holds the
float32 dsjax params (what Orbax writes); export holds one dsjax leaf. Memory in docs/convert.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dsjax.config import load
from dsjax.convert.safetensors import parse_size
from dsjax.convert.transfer import EXPORT_DTYPES, hf_to_orbax, orbax_to_hf
from dsjax.convert.vision_transfer import (is_vision_checkpoint, is_vision_source,
                                           vision_hf_to_orbax, vision_orbax_to_hf)
from dsjax.errors import CheckpointError, ConfigError, ConvertError, SafetensorsError


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
    """The command line; returns the exit status (2 and one line on stderr for bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-orbax":
            model_cfg = load(args.config).model if args.config else None
            convert = vision_hf_to_orbax if is_vision_source(args.hf) else hf_to_orbax
            convert(args.hf, args.out, model_cfg)
        else:
            export = vision_orbax_to_hf if is_vision_checkpoint(args.checkpoint) else orbax_to_hf
            export(args.checkpoint, args.out, args.dtype, parse_size(args.max_shard_size),
                   args.step)
    except (ConvertError, SafetensorsError, ConfigError, CheckpointError, OSError) as e:
        print(f"dsjax.convert: error: {e}", file=sys.stderr)
        return 2
    return 0
