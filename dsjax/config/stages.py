"""The stages of a post-training recipe (`posttrain.recipe`), each as a config of its own: what a
stage changes in the recipe's config. Pure config: dsjax/posttrain trains the stages, and
validate.py checks every stage's config when the recipe's config loads, so that a setting one
stage cannot take (DPO on a pipelined mesh) fails before the first stage trains.
"""

from __future__ import annotations

import dataclasses

from dsjax.config.sections import Config

RECIPE_STAGES = {"pretrain,sft,dpo": ("pretrain", "sft", "dpo")}  # docs/posttraining.md
# A stage's checkpoint.init_from while it is only being validated: the previous stage's run,
# which does not exist until that stage has trained.
PREVIOUS_STAGE = "<the previous stage's run>"


def stage_changes(cfg: Config, stage: str, init_from: str, task_path: str) -> dict[str, dict]:
    """{section: {field: value}} that turns the recipe's config into `stage`'s: pretraining keeps
    the config's data; SFT and DPO train on the built-in arithmetic chat task at `task_path`,
    from the weights in `init_from`, and score instead of sampling text; DPO logs often enough
    for its reward accuracy to be a mean over several records."""
    p = cfg.posttrain
    if stage == "pretrain":
        return {"train": {"steps": p.pretrain_steps}}
    steps, lr = {"sft": (p.sft_steps, p.sft_lr), "dpo": (p.dpo_steps, p.dpo_lr)}[stage]
    log_every = cfg.train.log_every
    if stage == "dpo":  # ~20 records: the reward accuracy is a mean over the last of them
        log_every = max(1, min(log_every, steps // 20))
    return {"data": {"source": "arithmetic", "path": task_path, "mix": ""},
            "train": {"task": stage, "steps": steps, "sample_tokens": 0,
                      "log_every": log_every},
            "optim": {"lr": lr},
            "checkpoint": {"init_from": init_from}}


def stage_config(cfg: Config, stage: str, init_from: str = PREVIOUS_STAGE,
                 task_path: str = "") -> Config:
    """The config `stage` of cfg's recipe trains with: named NAME/STAGE, with no recipe itself."""
    changed = {key: dataclasses.replace(getattr(cfg, key), **fields)
               for key, fields in stage_changes(cfg, stage, init_from, task_path).items()}
    return dataclasses.replace(cfg, name=f"{cfg.name}/{stage}",
                               posttrain=dataclasses.replace(cfg.posttrain, recipe=""), **changed)
