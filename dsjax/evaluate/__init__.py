"""Evaluation, a floor below training: held-out loss per source, perplexity, bits per byte and
samples (heldout), KV-cache generation (generation, sampling), and the cpu_vl corpus's grounding
scores and captions (grounding).

Everything here takes a built trainer and its params; nothing here builds or restores one. What
restores a checkpoint for `--mode eval` is `dsjax.train.run_eval`, above this package.
"""

from dsjax.evaluate import grounding
from dsjax.evaluate.generation import Generator
from dsjax.evaluate.heldout import (BYTE_VOCAB, evaluate_and_report, evaluate_params, held_out,
                                    sample)
from dsjax.evaluate.sampling import Sampling

__all__ = ["BYTE_VOCAB", "Generator", "Sampling", "evaluate_and_report", "evaluate_params",
           "grounding", "held_out", "sample"]
