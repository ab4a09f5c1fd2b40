"""Activation recomputation: named policies and per-layer patterns for the scanned decoder.

The one idea: a policy decides which intermediates of a decoder block are *saved* for the
backward pass; everything else is recomputed. Policies are `jax.checkpoint` policies, and the
block tags its intermediates with `checkpoint_name` so policies can name them:

  q_proj, k_proj, v_proj   projections after RoPE            [B, S, H|N, K]
  attn_context             softmax(qk) v, before o           [B, S, H, K]
  attn_lse                 flash: row logsumexp, its backward's other residual [B, H, S]
  attn_out                 output projection                 [B, S, D]
  mlp_gate, mlp_up         the two input projections         [B, S, F]
  mlp_hidden               silu(gate) * up                   [B, S, F]
  mlp_out                  down projection                   [B, S, D]
  kv_latent                MLA: normed compressed KV latent  [B, S, C]
  moe_routed               MoE: experts' outputs in their slots [E, C, D], before the combine
                           (a MoE block's experts tag silu(gate) * up [E, C, F] as mlp_hidden)

Policies (`remat.policy`):
  none            save everything (no recomputation)
  full            save nothing; the whole block is recomputed (one extra forward)
  dots            save every matmul output (jax's `checkpoint_dots`)
  dots_no_batch   save matmul outputs without batch dims (weights-like dots), recompute the rest
  attention_core  save every tagged tensor except the attention core (Megatron-LM's selective
                  recompute: the S x S logits/softmax are recomputed, the projections are not).
                  A flash core never stores S x S: this policy saves its residuals (attn_context,
                  attn_lse) and nothing is recomputed; cudnn/pallas rerun their forward kernel
                  (docs/attention.md)
  names:a,b,...   save only the named tensors
  offload:a,b,... save the named tensors by offloading them to host memory (on CPU offloading is
                  a no-op: the table shows the same memory as `names:`)

Layer patterns (`remat.layers`), implemented by scanning over groups of layers so the loop stays
a scan: `all` (the policy on every layer), `every_N` (layer i is recomputed when i % N == N - 1,
the others save everything: `every_2` is the recipe's "save layer 1, recompute layer 2, ..."),
or an explicit comma list of one policy per layer (`none,full,none,full`), whose shortest
repeating period becomes the group.
"""

from __future__ import annotations

from typing import Callable

from dsjax.errors import RematError, unknown_choice

TAGS = ("q_proj", "k_proj", "v_proj", "attn_context", "attn_lse", "attn_out", "mlp_gate",
        "mlp_up", "mlp_hidden", "mlp_out", "kv_latent", "moe_routed")
ATTENTION_CORE = ("attn_context", "attn_lse")  # what `attention_core` drops (but for flash)
POLICIES = ("none", "full", "dots", "dots_no_batch", "attention_core", "names:", "offload:")
# as an error message lists them: "auto" is remat_plan's, chosen before a policy is built
_LISTED = tuple(p + "<tags>" if p.endswith(":") else p for p in POLICIES) + ("auto",)


def _names(spec: str, prefix: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in spec[len(prefix):].split(",") if n.strip())
    unknown = [n for n in names if n not in TAGS]
    if unknown or not names:
        raise RematError(f"remat.policy: {spec!r} names unknown tensors {unknown}; "
                         f"taggable tensors are {', '.join(TAGS)}")
    return names


def checkpoint_policy(name: str, attention_impl: str = "xla") -> tuple[bool, Callable | None]:
    """(wrap the block in `jax.checkpoint`?, the policy) for one policy name and the attention
    core's (concrete) implementation."""
    import jax  # local: config validation uses this module before JAX may be imported

    cp = jax.checkpoint_policies
    if name == "none":
        return False, None
    if name == "full":
        return True, cp.nothing_saveable
    if name == "dots":
        return True, cp.checkpoint_dots
    if name == "dots_no_batch":
        return True, cp.dots_with_no_batch_dims_saveable
    if name == "attention_core":
        recompute = ATTENTION_CORE if attention_impl != "flash" else ()
        return True, cp.save_only_these_names(*[t for t in TAGS if t not in recompute])
    if name.startswith("names:"):
        return True, cp.save_only_these_names(*_names(name, "names:"))
    if name.startswith("offload:"):
        return True, cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(_names(name, "offload:")),
            offload_src="device", offload_dst="pinned_host")
    raise RematError(unknown_choice("policy", name, _LISTED, "remat.policy"))


def validate_policy(name: str) -> None:
    """Checks a policy name without building it (no JAX import)."""
    if name in ("none", "full", "dots", "dots_no_batch", "attention_core"):
        return
    for prefix in ("names:", "offload:"):
        if name.startswith(prefix):
            _names(name, prefix)
            return
    raise RematError(unknown_choice("policy", name, _LISTED, "remat.policy"))


def layer_policies(policy: str, layers: str, num_layers: int) -> tuple[str, ...]:
    """The policy of each layer, from `remat.policy` and the `remat.layers` pattern."""
    validate_policy(policy)
    if layers == "all":
        return (policy,) * num_layers
    if layers.startswith("every_"):
        try:
            n = int(layers[len("every_"):])
        except ValueError:
            n = 0
        if n < 1:
            raise RematError(f"remat.layers: {layers!r} needs a positive integer, e.g. every_2")
        return tuple(policy if i % n == n - 1 else "none" for i in range(num_layers))
    per_layer = tuple(p.strip() for p in layers.split(","))
    if len(per_layer) != num_layers:
        raise RematError(f"remat.layers: the explicit list has {len(per_layer)} entries but "
                         f"model.num_layers is {num_layers}; or use all / every_N")
    for p in per_layer:
        validate_policy(p)
    return per_layer


def group_pattern(per_layer: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest period of the per-layer policies that divides the layer count: the scan
    runs over groups of this many layers, each layer of a group with its own policy."""
    n = len(per_layer)
    for g in range(1, n + 1):
        if n % g == 0 and per_layer == per_layer[:g] * (n // g):
            return per_layer[:g]
    return per_layer
