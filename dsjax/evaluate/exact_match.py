"""Exact match on held-out chat prompts: the share of prompts whose greedy reply, generated with
the KV cache (generation) after the chat template's assistant header and ending at eos, equals
the expected answer (surrounding whitespace ignored)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dsjax.data.chat_template import ChatTemplate, prompt_ids
from dsjax.evaluate.generation import Generator
from dsjax.evaluate.sampling import Sampling

MAX_REPLY_TOKENS = 16  # a reply longer than this is wrong anyway


@dataclasses.dataclass
class ExactMatch:
    """Scores any params of one model: its generator (and so its compiled program) is built
    once and serves every call."""
    generator: Generator
    tokenizer: Any
    template: ChatTemplate

    @classmethod
    def for_trainer(cls, trainer, tokenizer, template: ChatTemplate,
                    max_new_tokens: int = MAX_REPLY_TOKENS) -> "ExactMatch":
        generator = Generator(trainer.eval_model, trainer.mesh, trainer.rules,
                              Sampling(temperature=0.0), max_new_tokens,
                              stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
                              vocab_size=tokenizer.vocab_size)
        return cls(generator, tokenizer, template)

    def __call__(self, params: Any, records: Sequence[dict]) -> dict[str, Any]:
        """{"exact_match": share correct, "prompts": how many, "examples": the first few
        (question, reply, answer)} over `records` ({"messages", "answer"})."""
        tok = self.tokenizer
        prompts = [[int(t) for t in prompt_ids(self.template, tok, r["messages"])]
                   for r in records]
        replies = [tok.decode(out).strip() for out in self.generator.generate(params, prompts)]
        correct = [reply == str(r["answer"]).strip() for reply, r in zip(replies, records)]
        examples = [{"question": r["messages"][-1]["content"], "reply": reply,
                     "answer": r["answer"]} for r, reply in list(zip(records, replies))[:5]]
        return {"exact_match": sum(correct) / max(len(correct), 1), "prompts": len(correct),
                "examples": examples}
