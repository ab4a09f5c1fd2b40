"""`python -m dsjax.generate --workdir RUN`: KV-cache generation from a run's latest checkpoint
(prompts from --prompt, a file or stdin; --chat applies the tokenizer's chat template). The top
floor beside dsjax.train: it restores what a run trained; the decoding itself is
dsjax.evaluate.generation."""
