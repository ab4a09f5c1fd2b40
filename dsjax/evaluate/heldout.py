"""Held-out evaluation: loss, perplexity, bits per byte, and a sampled continuation of a prompt.

Bits per byte (byte tokenizer only) = total held-out NLL in bits / number of predicted byte
tokens; the EOS predictions' NLL is counted in the numerator, so it is, if anything, pessimistic.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import metrics as mx
from dsjax import sharding
from dsjax.config import Config
from dsjax.data import eval_batches, load_tokenizer, mixed_eval_batches
from dsjax.data.splits import Splits, media_reading, vl_root
from dsjax.evaluate import grounding
from dsjax.evaluate.generation import Generator
from dsjax.evaluate.sampling import Sampling
from dsjax.model.loss import ModelLoss

BYTE_VOCAB = 256  # ids below this are raw bytes in the byte tokenizer


def _eval_step(model, params, batch):
    nll, count = ModelLoss(model).nll_sum(params, batch)
    byte_weights = batch["weights"] * (batch["targets"] < BYTE_VOCAB)
    return nll, count, jnp.sum(byte_weights)


def held_out(cfg: Config, splits: Splits, vision: Any) -> dict[str, list[dict]]:
    """{source: its held-out batches}: one source, or (data.mix, a vision model) each source of
    the mixture, with its media, so the loss is reported per source (per modality)."""
    d = cfg.data
    if not splits.mixed and vision is None:
        return {"data": eval_batches(splits.eval, d.seq_len, d.global_batch, d.eval_batches)}
    paths = {name: held for name, _, held in splits.sources} or {"data": splits.eval}
    return mixed_eval_batches(paths, d.seq_len, d.global_batch, d.eval_batches,
                              **media_reading(cfg, vision))


def evaluate_params(trainer, params: Any, splits: Splits, cfg: Config) -> dict[str, Any]:
    """Held-out loss (nats/token), perplexity and bits per byte over `data.eval_batches` batches
    (of each source: a mixture also reports `eval_loss_by_modality`, the loss per source, and the
    overall figures over all its sources' batches)."""
    step = jax.jit(_eval_step, static_argnums=0)
    sums = {}
    with sharding.activate(trainer.mesh, trainer.rules):
        for name, batches in held_out(cfg, splits, trainer.model.vision).items():
            nll = count = nbytes = 0.0
            for b in batches:
                out = step(trainer.eval_model, params, trainer.device_batch(_local(b)))
                n, c, nb = (float(x) for x in jax.device_get(out))
                nll, count, nbytes = nll + n, count + c, nbytes + nb
            sums[name] = (nll, count, nbytes)
    nll, count, nbytes = (sum(v[i] for v in sums.values()) for i in range(3))
    loss = nll / max(count, 1.0)
    results = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
               "eval_bits_per_byte": nll / math.log(2) / nbytes if nbytes else float("nan"),
               "eval_tokens": count}
    if splits.mixed:
        results["eval_loss_by_modality"] = {name: n / max(c, 1.0)
                                            for name, (n, c, _) in sums.items()}
    return results


def _local(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global host batch."""
    n = jax.process_count()
    if n == 1:
        return batch
    rows = len(next(iter(batch.values()))) // n
    i = jax.process_index()
    return {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}


def sample(trainer, params: Any, cfg: Config, tokenizer: Any) -> str:
    """The prompt `train.sample_prompt` and its continuation of `train.sample_tokens` tokens,
    decoded with the KV cache under the config's sampling (train.sample_*; seeded by
    train.seed), ending early at the tokenizer's eos."""
    t = cfg.train
    generator = Generator(trainer.eval_model, trainer.mesh, trainer.rules,
                          Sampling.from_config(t), t.sample_tokens,
                          stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
                          vocab_size=tokenizer.vocab_size)
    prompt = [int(i) for i in tokenizer.encode(t.sample_prompt)]
    return t.sample_prompt + tokenizer.decode(generator.generate(params, [prompt], t.seed)[0])


def evaluate_and_report(trainer, params: Any, splits: Splits, cfg: Config, workdir: str
                        ) -> dict[str, Any]:
    """Evaluates, samples, prints both, and merges the results into summary.json."""
    results: dict[str, Any] = evaluate_params(trainer, params, splits, cfg)
    if splits.tokenizer != "byte":
        results["eval_bits_per_byte"] = None  # only defined for the byte tokenizer
    tokenizer = load_tokenizer(splits.tokenizer)
    if cfg.train.sample_tokens:
        results["sample"] = sample(trainer, params, cfg, tokenizer)
    if cfg.data.source == "vl_corpus":
        results.update(grounding.report(trainer, params, vl_root(cfg, workdir), cfg))
    bpb = results["eval_bits_per_byte"]
    mx.log(f"held-out: loss {results['eval_loss']:.4f} nats/token | perplexity "
           f"{results['eval_perplexity']:.3f}" + (f" | {bpb:.4f} bits/byte" if bpb else "") +
           f" | over {int(results['eval_tokens']):,} tokens")
    if "sample" in results:
        mx.log(f"sample ({Sampling.from_config(cfg.train).describe()}):\n" + results["sample"])
    mx.update_summary(workdir, results)
    return results
