"""The generation command line: a run's config and checkpoint -> continuations of prompts.

  python -m dsjax.generate --workdir runs/cpu_tiny --prompt "def " --max_new_tokens 64
  python -m dsjax.generate --workdir runs/cpu_sft/dpo --chat --greedy \
      --prompt "Mia has pears: 4, then 3 added. How many?"
  echo "import os" | python -m dsjax.generate --workdir runs/cpu_tiny

The run's own config.json says the model, mesh and tokenizer; sampling defaults to the config's
train.sample_* (--greedy for argmax). Every output is printed; --out also writes JSONL records
{"prompt", "completion", "tokens"}. Bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from dsjax.config import from_config_dict
from dsjax.config.sections import SECTIONS, TrainConfig
from dsjax.config.validate import validate_train
from dsjax.data.chat_template import ChatTemplate, prompt_ids
from dsjax.data.tokenizers import load_tokenizer
from dsjax.errors import USER_ERRORS, ConfigError, DataError
from dsjax.runtime.cpu_devices import ensure_cpu_devices

MAX_NEW_TOKENS = 256  # --max_new_tokens's default


def read_run_config(workdir: str):
    """The `Config` a run recorded in WORKDIR/config.json."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--workdir: {path} not found; {workdir} is not a dsjax run directory "
                          f"(a run writes it when training starts)")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return from_config_dict({k: v for k, v in raw.items() if k in SECTIONS or k == "name"})


def run_tokenizer_spec(cfg) -> str:
    """The tokenizer a run's data was prepared with ("byte" for the built-in corpora)."""
    if cfg.data.source != "prepared":
        return "byte"
    first = cfg.data.mix.split(":")[0].strip() if cfg.data.mix else ""
    meta = os.path.join(cfg.data.path, first, "train", "meta.json")
    if not os.path.isfile(meta):
        raise DataError(f"{meta}: not found; the run's prepared data (data.path) is needed for "
                        f"its tokenizer")
    with open(meta, encoding="utf-8") as f:
        return json.load(f)["tokenizer"]


def read_prompts(args) -> list[Any]:
    """Prompts as text, or (chat JSONL) message lists: --prompt, then --prompts FILE (a line
    each; .jsonl: {"prompt": text} or {"messages": [...]}), else stdin (a line each)."""
    prompts: list[Any] = list(args.prompt or [])
    if args.prompts:
        if not os.path.isfile(args.prompts):
            raise DataError(f"--prompts: {args.prompts} not found")
        with open(args.prompts, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if args.prompts.endswith(".jsonl"):
            for i, line in enumerate(lines, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{args.prompts}:{i}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not ({"prompt", "messages"} & set(record)):
                    raise DataError(f"{args.prompts}:{i}: expected an object with 'prompt' or "
                                    f"'messages'")
                prompts.append(record.get("messages", record.get("prompt")))
        else:
            prompts += lines
    if not prompts:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise DataError("no prompts: give --prompt TEXT, --prompts FILE, or lines on stdin")
    return prompts


def encode_prompts(prompts: Sequence[Any], tokenizer, chat: bool, tokenizer_spec: str
                   ) -> list[list[int]]:
    if not chat:
        if any(not isinstance(p, str) for p in prompts):
            raise DataError("a 'messages' prompt needs --chat")
        return [[int(t) for t in tokenizer.encode(p)] for p in prompts]
    template = ChatTemplate.for_tokenizer(tokenizer_spec)
    messages = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    return [[int(t) for t in prompt_ids(template, tokenizer, m)] for m in messages]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsjax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the run directory (its config.json and "
                   "checkpoints/)")
    p.add_argument("--prompt", action="append", help="a prompt; repeatable")
    p.add_argument("--prompts", help="a file of prompts: a line each, or .jsonl records with "
                   "'prompt' or (with --chat) 'messages'")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn with "
                   "the tokenizer's chat template (the built-in one for bytes)")
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"default: the run's train.sample_temperature "
                   f"({TrainConfig.sample_temperature} unless set)")
    p.add_argument("--top_p", type=float, default=None, help="default: train.sample_top_p")
    p.add_argument("--top_k", type=int, default=None, help="default: train.sample_top_k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write JSONL records {prompt, completion, tokens} here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _generate(args)
    except USER_ERRORS as e:
        print(f"dsjax.generate: error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    cfg = read_run_config(args.workdir)
    t = cfg.train
    t = dataclasses.replace(
        t, sample_temperature=0.0 if args.greedy else (
            t.sample_temperature if args.temperature is None else args.temperature),
        sample_top_p=t.sample_top_p if args.top_p is None else args.top_p,
        sample_top_k=t.sample_top_k if args.top_k is None else args.top_k)
    cfg = dataclasses.replace(cfg, train=t)
    validate_train(cfg)  # the sampling flags' bounds
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens: must be >= 1, got {args.max_new_tokens}")
    prompts = read_prompts(args)
    spec = run_tokenizer_spec(cfg)
    tokenizer = load_tokenizer(spec)
    ids = encode_prompts(prompts, tokenizer, args.chat, spec)
    ensure_cpu_devices(cfg.mesh.size)
    # Imported only now: it imports JAX, which must start after the device count is set.
    from dsjax.generate.restore import generate_from_run  # pylint: disable=g-import-not-at-top
    outputs = generate_from_run(cfg, args.workdir, ids, tokenizer, args.max_new_tokens,
                                args.seed)
    records = []
    for prompt, out in zip(prompts, outputs):
        text = tokenizer.decode(out)
        shown = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
        print(f"--- {shown}\n{text}")
        records.append({"prompt": prompt, "completion": text, "tokens": out})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0
