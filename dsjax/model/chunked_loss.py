"""The output head, and its cross-entropy computed over sequence chunks so that the [B, S, V]
float32 logits never exist at once.

The one idea: the loss needs only two numbers per token from the logits (their logsumexp and the
target's logit), and its gradient only (softmax - onehot(target)) * weight per chunk. So a
`lax.scan` over chunks of `chunk` positions computes the logits of one [B, c, V] chunk at a time,
keeps the per-token logsumexp [B, S] as the only residual, and the backward recomputes each
chunk's logits. See docs/loss.md. Shape letters (beyond the package legend): n chunks, c positions
per chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from dsjax.model.dots import einsum_f32
from dsjax.sharding import varying_axes

LOGITS = ("act_batch", "act_seq", "act_vocab")  # vocab over `tensor`, batch over `data`


def output_logits(x_BSD: jax.Array, head_DV: jax.Array, dtype: Any, rules: Any = None
                  ) -> jax.Array:
    """The output head on final-normed x [B, S, D] -> float32 logits [B, S, V]. `rules`: the
    logical axis rules to constrain them with (None: those in force)."""
    logits_BSV = einsum_f32("BSD,DV->BSV", x_BSD.astype(dtype), head_DV.astype(dtype))
    return nn.with_logical_constraint(logits_BSV, LOGITS, rules=rules)


def _rules_now() -> Any:
    """The logical axis rules in force, hashable, for the custom_vjp's backward: JAX traces it
    after the caller's `nn.logical_axis_rules` context may have ended (1-bit Adam traces the loss
    under rules that map no axis to the manual `data`, then differentiates outside them)."""
    rules = nn.get_logical_axis_rules()
    return tuple(tuple(r) for r in rules) if rules else None


def _split(a: jax.Array, n: int, c: int) -> jax.Array:
    """[B, S, ...] -> [n, B, c, ...], the sequence padded with zeros to n * c positions."""
    B, S = a.shape[:2]
    a = jnp.pad(a, [(0, 0), (0, n * c - S)] + [(0, 0)] * (a.ndim - 2))
    return a.reshape(B, n, c, *a.shape[2:]).swapaxes(0, 1)


def _chunks(S: int, chunk: int) -> tuple[int, int]:
    """(chunks n, positions per chunk c) for a sequence of S positions."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    c = min(chunk, S)
    return -(-S // c), c


def chunked_cross_entropy(x_BSD: jax.Array, head_DV: jax.Array, targets_BS: jax.Array,
                          weights_BS: jax.Array, *, dtype: Any, chunk: int
                          ) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted next-token NLL in nats, sum of weights), float32: the value of
    `weighted_cross_entropy(output_logits(x, head, dtype), targets, weights)` with logits made
    `chunk` sequence positions at a time ([B, chunk, V] each; S need not divide by it). The head
    matmuls run in `dtype` with float32 accumulation, forward and backward."""
    n, c = _chunks(x_BSD.shape[1], chunk)
    # padded positions get weight 0 (and target 0): they add nothing
    total = _chunked_nll(_split(x_BSD, n, c), head_DV, _split(targets_BS, n, c),
                         _split(weights_BS, n, c), dtype, _rules_now())
    return total, jnp.sum(weights_BS.astype(jnp.float32))


def chunked_token_nll(x_BSD: jax.Array, head_DV: jax.Array, targets_BS: jax.Array, *,
                      dtype: Any, chunk: int) -> jax.Array:
    """Each position's next-token NLL [B, S] float32 (logsumexp - target logit), logits made
    `chunk` positions at a time as in `chunked_cross_entropy`; its backward takes a cotangent
    per token (a sequence-level loss such as DPO's weighs each token's NLL by its own factor)."""
    B, S = targets_BS.shape
    n, c = _chunks(S, chunk)
    nll_nBc = _chunked_token_nll(_split(x_BSD, n, c), head_DV, _split(targets_BS, n, c), dtype,
                                 _rules_now())
    return nll_nBc.swapaxes(0, 1).reshape(B, n * c)[:, :S]


def _logits(x_BcD: jax.Array, head_DV: jax.Array, dtype: Any, rules: Any) -> jax.Array:
    return output_logits(x_BcD, head_DV, dtype, rules)  # [B, c, V] float32


def _is_target(logits_BcV: jax.Array, targets_Bc: jax.Array) -> jax.Array:
    """[B, c, V] bool, the target's vocab entry. A compare against the vocab index, not a gather:
    the iota is partitioned with the vocab axis, so each `tensor` shard tests its own slice, and
    a select-and-sum is one all-reduce of [B, c]. (take_along_axis with the vocab over `tensor`
    crashes XLA's SPMD partitioner inside the pipeline's shard_map; see docs/loss.md.)"""
    return lax.broadcasted_iota(jnp.int32, logits_BcV.shape, 2) == targets_Bc[..., None]


def _target_logit(logits_BcV: jax.Array, hit_BcV: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(hit_BcV, logits_BcV, 0.0), axis=-1)


def _forward(x_nBcD, head_DV, targets_nBc, dtype, rules):
    """Per token: logsumexp and target logit [n, B, c], one chunk's logits at a time."""
    def chunk_stats(_, xs):
        x_BcD, t_Bc = xs
        logits_BcV = _logits(x_BcD, head_DV, dtype, rules)
        target_Bc = _target_logit(logits_BcV, _is_target(logits_BcV, t_Bc))
        return None, (jax.nn.logsumexp(logits_BcV, axis=-1), target_Bc)

    return lax.scan(chunk_stats, None, (x_nBcD, targets_nBc))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_nll(x_nBcD, head_DV, targets_nBc, weights_nBc, dtype, rules):
    lse_nBc, target_nBc = _forward(x_nBcD, head_DV, targets_nBc, dtype, rules)
    return jnp.sum((lse_nBc - target_nBc) * weights_nBc)


def _chunked_nll_fwd(x_nBcD, head_DV, targets_nBc, weights_nBc, dtype, rules):
    lse_nBc, target_nBc = _forward(x_nBcD, head_DV, targets_nBc, dtype, rules)
    total = jnp.sum((lse_nBc - target_nBc) * weights_nBc)
    return total, (x_nBcD, head_DV, targets_nBc, weights_nBc, lse_nBc)


def _chunked_nll_bwd(dtype, rules, res, g):
    x_nBcD, head_DV, targets_nBc, weights_nBc, lse_nBc = res
    dx_nBcD, dhead_DV, nll_nBc = _head_backward(x_nBcD, head_DV, targets_nBc, lse_nBc,
                                                g * weights_nBc, dtype, rules)
    dw_nBc = (g * nll_nBc).astype(weights_nBc.dtype)
    return dx_nBcD, dhead_DV, None, _like_primal(dw_nBc, weights_nBc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_token_nll(x_nBcD, head_DV, targets_nBc, dtype, rules):
    lse_nBc, target_nBc = _forward(x_nBcD, head_DV, targets_nBc, dtype, rules)
    return lse_nBc - target_nBc


def _chunked_token_nll_fwd(x_nBcD, head_DV, targets_nBc, dtype, rules):
    lse_nBc, target_nBc = _forward(x_nBcD, head_DV, targets_nBc, dtype, rules)
    return lse_nBc - target_nBc, (x_nBcD, head_DV, targets_nBc, lse_nBc)


def _chunked_token_nll_bwd(dtype, rules, res, g_nBc):
    x_nBcD, head_DV, targets_nBc, lse_nBc = res
    dx_nBcD, dhead_DV, _ = _head_backward(x_nBcD, head_DV, targets_nBc, lse_nBc, g_nBc, dtype,
                                          rules)
    return dx_nBcD, dhead_DV, None


def _head_backward(x_nBcD, head_DV, targets_nBc, lse_nBc, scale_nBc, dtype, rules):
    """(dL/dx [n, B, c, D], dL/dhead [D, V], each token's NLL [n, B, c]) for a loss whose
    cotangent of token t's NLL is scale[t]: dlogits = (softmax - onehot(target)) * scale,
    recomputing one chunk's logits at a time."""
    head_c = head_DV.astype(dtype)

    def chunk_grads(xs):
        """One chunk: (dL/dhead [D, V] float32, (dL/dx [B, c, D], NLL [B, c]))."""
        x_BcD, t_Bc, s_Bc, lse_Bc = xs
        logits_BcV = _logits(x_BcD, head_DV, dtype, rules)
        p_BcV = jnp.exp(logits_BcV - lse_Bc[..., None])
        hit_BcV = _is_target(logits_BcV, t_Bc)  # softmax - onehot(target) as a select
        scale_Bc = s_Bc.astype(jnp.float32)
        dlogits_BcV = (jnp.where(hit_BcV, p_BcV - 1.0, p_BcV) * scale_Bc[..., None]).astype(dtype)
        dlogits_BcV = nn.with_logical_constraint(dlogits_BcV, LOGITS, rules=rules)
        dx_BcD = jnp.einsum("BcV,DV->BcD", dlogits_BcV, head_c,
                            preferred_element_type=jnp.float32).astype(x_BcD.dtype)
        dhead_DV = jnp.einsum("BcD,BcV->DV", x_BcD.astype(dtype), dlogits_BcV,
                              preferred_element_type=jnp.float32)
        return dhead_DV, (dx_BcD, lse_Bc - _target_logit(logits_BcV, hit_BcV))

    xs = (x_nBcD, targets_nBc, scale_nBc, lse_nBc)
    # The first chunk outside the scan: its dhead starts the accumulator with the right type
    # (inside shard_map, varying over the same manual axes as the later chunks' sums).
    dhead_DV, first = chunk_grads(jax.tree.map(lambda a: a[0], xs))

    def body(acc_DV, chunk_xs):
        d_DV, out = chunk_grads(chunk_xs)
        return acc_DV + d_DV, out

    dhead_DV, rest = lax.scan(body, dhead_DV, jax.tree.map(lambda a: a[1:], xs))
    dx_nBcD, nll_nBc = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)
    return (_like_primal(dx_nBcD, x_nBcD), _like_primal(dhead_DV.astype(head_DV.dtype), head_DV),
            nll_nBc)


def _like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent of an input that is invariant over manual axes its cotangent varies over
    (the gpipe head: replicated over the stages, used with each stage's activations): summed over
    them, as JAX's own transpose of the implicit broadcast would."""
    extra = varying_axes(ct) - varying_axes(primal)
    return lax.psum(ct, tuple(sorted(extra))) if extra else ct


_chunked_nll.defvjp(_chunked_nll_fwd, _chunked_nll_bwd)
_chunked_token_nll.defvjp(_chunked_token_nll_fwd, _chunked_token_nll_bwd)
