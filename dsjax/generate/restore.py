"""A run's latest weights, restored onto its config's mesh, and their continuations of token
prompts (dsjax.evaluate.Generator under the config's sampling)."""

from __future__ import annotations

from typing import Sequence

from dsjax import checkpoint as ckpt
from dsjax import metrics as mx
from dsjax.config import Config
from dsjax.evaluate import Generator, Sampling
from dsjax.train import build_trainer


def generate_from_run(cfg: Config, workdir: str, prompts: Sequence[Sequence[int]], tokenizer,
                      max_new_tokens: int, seed: int) -> list[list[int]]:
    """Each prompt's continuation (ending before the tokenizer's eos)."""
    trainer = build_trainer(cfg)
    params = ckpt.restore_params(workdir, trainer.abstract_state().params, cfg.model, log=mx.log)
    generator = Generator(trainer.eval_model, trainer.mesh, trainer.rules,
                          Sampling.from_config(cfg.train), max_new_tokens,
                          stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
                          vocab_size=tokenizer.vocab_size)
    mx.log(f"generating up to {max_new_tokens} tokens for {len(prompts)} prompt(s) "
           f"({generator.sampling.describe()})")
    return generator.generate(params, prompts, seed)
