"""The pretrain -> SFT -> DPO recipe (`posttrain.recipe="pretrain,sft,dpo"`, configs/cpu_sft.py).

Each stage is an ordinary run (dsjax.train.run) in WORKDIR/<stage>, started from the previous
stage's last checkpoint (`checkpoint.init_from`): pretraining on the config's data (skipped when
`posttrain.start_from` names a run of the same model that holds a checkpoint), SFT on the
built-in arithmetic chat task, DPO on its preference pairs against the SFT weights. Exact match
on the task's held-out prompts (dsjax.evaluate.exact_match, greedy KV-cache decoding) is scored
on the starting weights, after SFT and after DPO, and WORKDIR/summary.json gathers it. A stage
that finished is not trained again when the recipe is rerun: its run resumes at its last step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from dsjax import checkpoint as ckpt
from dsjax import metrics as mx
from dsjax import train
from dsjax.config import Config
from dsjax.config.stages import stage_config
from dsjax.data.arithmetic_chat import build_arithmetic_corpus
from dsjax.data.chat_template import ChatTemplate
from dsjax.data.splits import arithmetic_root, data_splits
from dsjax.data.tokenizers import load_tokenizer
from dsjax.errors import DataError
from dsjax.evaluate.exact_match import ExactMatch

REWARD_WINDOW = 0.25  # dpo_reward_accuracy: the mean over this last share of the logged steps


def _usable_start(cfg: Config) -> str:
    """posttrain.start_from when it holds a checkpoint of this very model, else ""."""
    run = cfg.posttrain.start_from
    checkpoints, config_json = os.path.join(run, "checkpoints"), os.path.join(run, "config.json")
    if not (run and os.path.isfile(config_json) and os.path.isdir(checkpoints)
            and os.listdir(checkpoints)):
        return ""
    with open(config_json, encoding="utf-8") as f:
        model = json.load(f).get("model")
    if model != dataclasses.asdict(cfg.model):
        mx.log(f"posttrain: {run} holds another model; pretraining this one instead")
        return ""
    return run


class _Scorer:
    """Exact match of a run's latest weights on the held-out prompts. One trainer and one
    generator for every stage (the stages change data and optimisation, not the model or the
    mesh), so the decoding program compiles once."""

    def __init__(self, cfg: Config, heldout: list[dict]):
        self.trainer = train.build_trainer(cfg)
        self.score = ExactMatch.for_trainer(self.trainer, load_tokenizer("byte"),
                                            ChatTemplate.for_tokenizer("byte"))
        self.heldout, self.model = heldout, cfg.model

    def __call__(self, weights: str) -> dict[str, Any]:
        params = ckpt.restore_params(weights, self.trainer.abstract_state().params, self.model,
                                     log=lambda *_: None)
        return self.score(params, self.heldout)


def _reward_accuracy(workdir: str) -> float:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    values = [r["dpo_reward_accuracy"] for r in records if "dpo_reward_accuracy" in r]
    tail = values[-max(1, int(len(values) * REWARD_WINDOW)):]
    return sum(tail) / len(tail)


class _Stopped(Exception):
    """A stage stopped early (SIGTERM, --max_runtime): the recipe stops there too."""


def _train(stage: Config, directory: str, seconds: dict[str, float], deadline: float,
           allow_fallback: bool) -> None:
    """Trains one stage in `directory` within what is left of the recipe's --max_runtime."""
    t = time.monotonic()
    left = max(deadline - t, 1e-3) if deadline else 0.0
    out = train.run(stage, directory, allow_fallback=allow_fallback, max_runtime_s=left)
    seconds[stage.train.task] = time.monotonic() - t  # a stage's task is its name
    if out.get("stopped_early"):
        raise _Stopped(f"the {stage.train.task} stage ({directory})")


def run(cfg: Config, workdir: str, allow_fallback: bool = False,
        max_runtime_s: float = 0.0) -> dict[str, Any]:
    """Runs the recipe's stages in `workdir`; returns the summary it writes there. A stage that
    stops early (SIGTERM, `max_runtime_s` over the whole recipe) ends the recipe; the same
    command resumes it."""
    t0 = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    seconds: dict[str, float] = {}
    try:
        summary = _stages(cfg, workdir, seconds, t0 + max_runtime_s if max_runtime_s else 0.0,
                          allow_fallback)
    except _Stopped as stopped:
        mx.log(f"posttrain: stopped in {stopped}; run the same command to resume the recipe")
        return mx.update_summary(workdir, {"stopped_early": str(stopped)})
    seconds["total"] = time.monotonic() - t0
    return mx.update_summary(workdir, {**summary, "stopped_early": None,
                                       "stage_seconds": seconds})


def _stages(cfg: Config, workdir: str, seconds: dict[str, float], deadline: float,
            allow_fallback: bool) -> dict[str, Any]:
    p = cfg.posttrain
    # The chat task first: a seq_len too short for it fails before anything trains.
    task_path = arithmetic_root("", workdir)  # the recipe's own, not data.path (its text)
    heldout_path = build_arithmetic_corpus(task_path, cfg.data.seq_len, log=mx.log)["heldout"]
    with open(heldout_path, encoding="utf-8") as f:
        heldout = [json.loads(line) for line in f][:p.eval_prompts]
    start = _usable_start(cfg)
    if start:
        mx.log(f"posttrain: starting from {start} (posttrain.start_from): no pretraining")
    else:
        mx.log(f"posttrain: stage 1/3, pretraining {p.pretrain_steps} steps")
        start = os.path.join(workdir, "pretrain")
        pretrain = stage_config(cfg, "pretrain")
        tokenizer = data_splits(pretrain, start).tokenizer
        if tokenizer != "byte":  # before any stage trains
            raise DataError(f"data.path: the recipe's chat task is byte-tokenized, and "
                            f"{cfg.data.path} was prepared with {tokenizer!r}; pretrain on a "
                            f"corpus prepared with --tokenizer byte")
        _train(pretrain, start, seconds, deadline, allow_fallback)
    sft_dir, dpo_dir = os.path.join(workdir, "sft"), os.path.join(workdir, "dpo")
    sft = stage_config(cfg, "sft", init_from=start, task_path=task_path)
    score = _Scorer(sft, heldout)
    before = score(start)
    mx.log(f"posttrain: exact match before SFT {before['exact_match']:.3f} "
           f"({before['prompts']} held-out prompts)")
    mx.log(f"posttrain: stage 2/3, SFT {p.sft_steps} steps from {start}")
    _train(sft, sft_dir, seconds, deadline, allow_fallback)
    after_sft = score(sft_dir)
    mx.log(f"posttrain: exact match after SFT {after_sft['exact_match']:.3f}")

    dpo = stage_config(cfg, "dpo", init_from=sft_dir, task_path=task_path)
    mx.log(f"posttrain: stage 3/3, DPO {p.dpo_steps} steps from {sft_dir}")
    _train(dpo, dpo_dir, seconds, deadline, allow_fallback)
    after_dpo = score(dpo_dir)
    reward_accuracy = _reward_accuracy(dpo_dir)
    mx.log(f"posttrain: exact match after DPO {after_dpo['exact_match']:.3f} | DPO reward "
           f"accuracy {reward_accuracy:.3f} (last {REWARD_WINDOW:.0%} of its logged steps)")
    for example in after_dpo["examples"]:
        mx.log(f"  {example['question']!r} -> {example['reply']!r} (answer {example['answer']})")
    return {"config": cfg.name, "recipe": p.recipe, "started_from": start,
            "sft_exact_match_before": before["exact_match"],
            "sft_exact_match": after_sft["exact_match"],
            "dpo_exact_match": after_dpo["exact_match"],
            "dpo_reward_accuracy": reward_accuracy, "heldout_prompts": before["prompts"],
            "examples": after_dpo["examples"],
            "stages": {"pretrain": start, "sft": sft_dir, "dpo": dpo_dir}}
