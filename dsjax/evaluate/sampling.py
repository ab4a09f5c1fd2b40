"""Choosing the next token from logits: greedy, or sampled at a temperature from the top-k and
top-p (nucleus, Holtzman et al. 2020) filtered distribution."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsjax.config.sections import TrainConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; the defaults are the config's (train.sample_*)."""
    temperature: float = TrainConfig.sample_temperature  # 0: greedy
    top_p: float = TrainConfig.sample_top_p  # 1: off
    top_k: int = TrainConfig.sample_top_k  # 0: off

    @classmethod
    def from_config(cls, train) -> "Sampling":
        """The sampling a `TrainConfig` sets."""
        return cls(train.sample_temperature, train.sample_top_p, train.sample_top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        return ", ".join(parts)


def filtered_logits(logits_BV: jax.Array, sampling: Sampling) -> jax.Array:
    """float32 logits / temperature, -inf outside the top-k and outside the nucleus: the
    smallest set of most likely tokens whose probability reaches top_p (the token that crosses
    it included; ties at the cut all kept)."""
    logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept_B = jnp.sum(mass_before_BV < sampling.top_p, axis=-1)  # >= 1: the first is kept
        cut_B1 = jnp.take_along_axis(sorted_BV, kept_B[:, None] - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < cut_B1, -jnp.inf, logits_BV)
    return logits_BV


def next_tokens(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """int32 [B]: each row's next token under `sampling`."""
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BV, sampling),
                                  axis=-1).astype(jnp.int32)
