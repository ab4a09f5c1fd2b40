"""DeepSeekMoE (DeepSeek-V2 §2.2, DeepSeek-V3 §2.1.2): shared experts + routed experts.

The one idea: routing picks, per token, k of E experts; the tokens are then *dispatched* into a
buffer [E, C, D] (C slots per expert, filled in token order), every expert runs one SwiGLU on its
slots as a batched einsum, and the outputs are *combined* back, weighted by the router. With expert
parallelism the same buffer is cut by expert owner and exchanged with one all-to-all each way
inside `jax.shard_map`, so a device only ever holds its own experts' weights. That is
`moe_impl='capacity'`; the dropless sorted-row implementations (`ragged`, `padded`) are in
dsjax/model/moe_grouped.py and take over from the same routing (docs/moe.md).

Routing (float32 always; the reference is Hugging Face `DeepseekV2TopkRouter` /
`DeepseekV3TopkRouter`):
- softmax (V2): s = softmax(x W_r); group-limited greedy keeps the topk_group groups with the
  largest max(s) in the group; top-k of s; weights = s (optionally normalised) * routed_scaling.
- sigmoid (V3): s = sigmoid(x W_r); the choice uses s + b, b a correction bias that no gradient
  reaches (it is moved by `update_router_bias` after each step, V3's auxiliary-loss-free
  balancing); groups are scored by the sum of their top-2 s + b and the others masked with -inf;
  weights are the *unbiased* s of the chosen experts, normalised, * routed_scaling.
Capacity: C = T (every token could pick one expert) is dropless; with capacity_factor > 0,
C = ceil(factor * T * k / E) per source device, and assignments past C are dropped (their weight
contributes nothing), earlier tokens first.
Letters: see dsjax/model/__init__.py; T tokens, E experts, C slots, A assignments (T * k).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from dsjax import fp8
from dsjax.fp8_policy import Fp8Policy
from dsjax.model import moe_exchange, moe_grouped
from dsjax.model.layers import SwiGLU, _param

Dtype = Any
BIAS = "router_bias"  # the correction bias leaf of a sigmoid router (not trained by gradients)
EXPERT = "expert"  # the routed experts' logical axis (dsjax.sharding maps it to a mesh axis)
EXPERT_MANUAL = "expert_manual"  # a rules entry naming the experts' mesh axis where a caller's
                                 # shard_map is already manual over it (1-bit Adam's step; there
                                 # EXPERT maps to None so that parameter constraints stay legal)


def moe_fields(cfg) -> tuple[tuple[str, Any], ...]:
    """The `MoE` fields a `ModelConfig` sets, as hashable (name, value) pairs for the block."""
    return (("num_experts", cfg.n_routed_experts), ("experts_per_token", cfg.num_experts_per_tok),
            ("expert_dim", cfg.moe_intermediate_size), ("n_shared", cfg.n_shared_experts),
            ("n_group", cfg.n_group), ("topk_group", cfg.topk_group),
            ("routed_scaling_factor", cfg.routed_scaling_factor), ("scoring", cfg.scoring),
            ("norm_topk_prob", cfg.norm_topk_prob), ("capacity_factor", cfg.capacity_factor),
            ("expert_parallel", cfg.expert_parallel), ("init_std", cfg.init_std),
            ("impl", cfg.moe_impl), ("tile", cfg.moe_tile), ("exchange", cfg.moe_exchange))


def route(logits_TE: jax.Array, bias_E: jax.Array | None, *, k: int, n_group: int,
          topk_group: int, scoring: str, norm_topk_prob: bool, scaling: float
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen experts [T, k] int32, their weights [T, k], scores s [T, E]); all float32."""
    logits_TE = logits_TE.astype(jnp.float32)
    T, E = logits_TE.shape
    if scoring == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        choice_TE = scores_TE
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        choice_TE = scores_TE + lax.stop_gradient(bias_E)
    choice_TE = lax.stop_gradient(choice_TE)  # selection is discrete: no gradient through it
    if n_group > 1:
        grouped_TGe = choice_TE.reshape(T, n_group, E // n_group)
        if scoring == "softmax":
            group_TG = grouped_TGe.max(axis=-1)
        else:
            group_TG = lax.top_k(grouped_TGe, 2)[0].sum(axis=-1)
        _, groups_Tg = lax.top_k(group_TG, topk_group)
        keep_TG = jnp.zeros((T, n_group), jnp.bool_).at[jnp.arange(T)[:, None], groups_Tg].set(True)
        keep_TE = jnp.repeat(keep_TG, E // n_group, axis=1)
        choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
    _, experts_TK = lax.top_k(choice_TE, k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(axis=-1, keepdims=True) + 1e-20)
    return experts_TK.astype(jnp.int32), weights_TK * scaling, scores_TE


def balance_term(experts_BSK: jax.Array, scores_BSE: jax.Array) -> jax.Array:
    """Sequence-wise balance loss sum_i f_i P_i, averaged over sequences (V3 eq. 17-20; V2's
    expert-level loss is the same with softmax scores): f_i = E / (k S) * #(tokens choosing i),
    P_i = mean over the sequence of s_i / sum_j s_j. Multiply by alpha."""
    B, S, K = experts_BSK.shape
    E = scores_BSE.shape[-1]
    counts_BE = jnp.sum(jax.nn.one_hot(experts_BSK, E, dtype=jnp.float32), axis=(1, 2))
    f_BE = lax.stop_gradient(counts_BE * E / (K * S))
    normed_BSE = scores_BSE / jnp.sum(scores_BSE, axis=-1, keepdims=True)
    return jnp.mean(jnp.sum(f_BE * jnp.mean(normed_BSE, axis=1), axis=-1))


def update_router_bias(bias_E: jax.Array, load_E: jax.Array, gamma: float) -> jax.Array:
    """V3 §2.1.2: b_i -= gamma for an overloaded expert (load above the mean), += for an
    underloaded one. Broadcasts over leading (layers) dims."""
    mean = jnp.mean(load_E, axis=-1, keepdims=True)
    return bias_E - gamma * jnp.sign(load_E - mean)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert: `tokens` when dropless (factor 0), else ceil(factor * tokens * k / E)."""
    if not factor:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def dispatch_slots(experts_TK: jax.Array, num_experts: int) -> jax.Array:
    """Slot of each assignment within its expert's buffer [T, k], in token order."""
    e_A = experts_TK.reshape(-1)
    onehot_AE = jax.nn.one_hot(e_A, num_experts, dtype=jnp.int32)
    slot_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0), e_A[:, None], axis=1)[:, 0] - 1
    return slot_A.reshape(experts_TK.shape)


def dispatch(x_TD: jax.Array, experts_TK: jax.Array, slots_TK: jax.Array, num_experts: int,
             cap: int) -> jax.Array:
    """Token copies into their experts' slots: [E, C, D]; assignments past C are dropped."""
    K = experts_TK.shape[1]
    buf_ECD = jnp.zeros((num_experts, cap, x_TD.shape[-1]), x_TD.dtype)
    # Each token's k copies by repeat, not by gathering x at token indices: a gather of x's
    # sharded token axis fails XLA's SPMD partitioner inside a pipeline's shard_map.
    return buf_ECD.at[experts_TK.reshape(-1), slots_TK.reshape(-1)].add(
        jnp.repeat(x_TD, K, axis=0), mode="drop")


def combine(y_ECD: jax.Array, experts_TK: jax.Array, slots_TK: jax.Array,
            weights_TK: jax.Array) -> jax.Array:
    """sum_k weight * (expert output of the token's slot, 0 if dropped): [T, D]."""
    y_TKD = y_ECD.at[experts_TK, slots_TK].get(mode="fill", fill_value=0)
    return jnp.einsum("TKD,TK->TD", y_TKD, weights_TK.astype(y_TKD.dtype))


class MoE(nn.Module):
    """x -> shared(x) + sum_k w_k expert_k(x); returns (y, {"load": [E], "balance": []}).

    Params: router [D, E] (float32 math), router_bias [E] (sigmoid only; moved outside the
    gradient), gate/up [E, D, F] and down [E, F, D] on the "expert" logical axis, shared (a SwiGLU
    of n_shared * F). fp8: the experts' and shared experts' gate/up/down as the policy names them
    (per-expert scaling; not with the "delayed" recipe, whose state is per matmul).
    """
    num_experts: int
    experts_per_token: int
    expert_dim: int
    n_shared: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring: str
    norm_topk_prob: bool
    capacity_factor: float
    expert_parallel: bool
    init_std: float
    impl: str  # one of MOE_IMPLS (dsjax/config/validate.py)
    tile: int  # padded: rows per tile; 0 = per backend (moe_grouped.resolve_tile)
    exchange: str  # grouped with expert parallelism: static | ragged (moe_exchange.py)
    unroll: bool = False  # padded: unroll the tile loop (benchmarks count its FLOPs so)
    dtype: Dtype = jnp.float32
    fp8_policy: Fp8Policy | None = None  # asked for gate, up, down

    def _grouped(self) -> moe_grouped.Grouped | None:
        """How this layer runs its grouped GEMMs (`ragged` or `padded`); None for the capacity
        buffers."""
        impl = moe_grouped.resolve_impl(self.impl)
        if impl not in moe_grouped.GROUPED:
            return None
        policy = self.fp8_policy
        recipes = tuple(policy.recipe if policy is not None and policy.runs(n) else None
                        for n in ("gate", "up", "down"))
        if any(recipes) and (impl != "padded" or policy.recipe == "rowwise"):
            raise NotImplementedError(f"fp8 routed experts in grouped GEMMs: moe_impl 'padded' "
                                      f"with fp8.recipe 'current' or 'delayed' only, got "
                                      f"{impl!r} and {policy.recipe!r} "
                                      f"(dsjax.config.compositions says why)")
        return moe_grouped.Grouped(impl, moe_grouped.resolve_tile(self.tile), self.unroll,
                                   recipes, self.exchange)

    def _expert_metas(self) -> dict[str, fp8.Fp8Meta]:
        """Delayed scaling: one amax history per expert and projection, `Fp8Meta` leaves with a
        leading experts dim [E, ...], for the projections the policy runs in fp8; {} otherwise.
        Read here, outside the expert-parallel shard_map, which takes them like the weights."""
        policy = self.fp8_policy
        if policy is None or not policy.delayed:
            return {}
        E = self.num_experts
        init = lambda: jax.tree.map(lambda a: jnp.broadcast_to(a, (E, *a.shape)),
                                    fp8.init_meta(policy.history))
        return {n: self.variable(fp8.META_COLLECTION, n, init).value
                for n in ("gate", "up", "down") if policy.runs(n)}

    def _expert_matmul(self, name: str, x_ECD: jax.Array, w_EDF: jax.Array,
                       metas: dict[str, fp8.Fp8Meta]) -> jax.Array:
        policy = self.fp8_policy
        if policy is not None and policy.runs(name):  # per expert: its own scales
            x_ECD = x_ECD.astype(self.dtype)
            if name in metas:
                one = lambda x, w, m: fp8.fp8_einsum("CD,DF->CF", x, w, recipe=policy.recipe,
                                                     out_dtype=self.dtype, meta=m)
                return jax.vmap(one)(x_ECD, w_EDF, metas[name])
            one = lambda x, w: fp8.fp8_einsum("CD,DF->CF", x, w, recipe=policy.recipe,
                                              out_dtype=self.dtype)
            return jax.vmap(one)(x_ECD, w_EDF)
        return jnp.einsum("ECD,EDF->ECF", x_ECD.astype(self.dtype), w_EDF.astype(self.dtype))

    def _experts(self, x_ECD, w_gate, w_up, w_down, metas):
        gate_ECF = self._expert_matmul("gate", x_ECD, w_gate, metas)
        up_ECF = self._expert_matmul("up", x_ECD, w_up, metas)
        hidden_ECF = checkpoint_name(jax.nn.silu(gate_ECF) * up_ECF, "mlp_hidden")
        return self._expert_matmul("down", hidden_ECF, w_down, metas)

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        B, S, D = x_BSD.shape
        E, K, F, std = self.num_experts, self.experts_per_token, self.expert_dim, self.init_std
        router_DE = _param(self, "router", (D, E), ("embed", None), std)
        bias_E = (self.param(BIAS, nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                             (E,), jnp.float32) if self.scoring == "sigmoid" else None)
        # Already inside a shard_map manual over the experts' mesh axis (1-bit Adam's gradient
        # block): x and the experts are this device's blocks (also when the stack's shapes are
        # derived, at apply), so the exchange runs here; a nested shard_map over the same axis
        # would split the blocks again.
        mesh = jax.sharding.get_abstract_mesh()
        manual_axis = nn.logical_to_mesh_axes((EXPERT_MANUAL,))[0]
        manual = (self.expert_parallel and manual_axis is not None and not mesh.empty
                  and manual_axis in mesh.manual_axes)
        e = E // mesh.shape[manual_axis] if manual else E
        # D unnamed: with mesh.fsdp "embed" is on `data` too, which "expert" already uses.
        w_gate = _param(self, "gate", (e, D, F), (EXPERT, None, "mlp"), std)
        w_up = _param(self, "up", (e, D, F), (EXPERT, None, "mlp"), std)
        w_down = _param(self, "down", (e, F, D), (EXPERT, "mlp", None), std)

        logits_BSE = jnp.einsum("BSD,DE->BSE", x_BSD.astype(jnp.float32), router_DE,
                                precision=lax.Precision.HIGHEST)
        experts_TK, weights_TK, scores_TE = route(
            logits_BSE.reshape(B * S, E), bias_E, k=K, n_group=self.n_group,
            topk_group=self.topk_group, scoring=self.scoring, norm_topk_prob=self.norm_topk_prob,
            scaling=self.routed_scaling_factor)
        experts_BSK = experts_TK.reshape(B, S, K)
        weights_BSK = weights_TK.reshape(B, S, K)
        stats = {"load": jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=jnp.float32), axis=(0, 1)),
                 "balance": balance_term(experts_BSK, scores_TE.reshape(B, S, E))}

        x = x_BSD.astype(self.dtype)
        # The mesh axis experts are sharded over, from the current logical rules (only
        # dsjax.sharding knows mesh axis names); None outside a mesh: all experts local.
        expert_axis = nn.logical_to_mesh_axes((EXPERT,))[0] if self.expert_parallel else None
        if expert_axis is not None and (mesh.empty or B % mesh.shape[expert_axis]
                                        or self.is_initializing()):
            expert_axis = None  # no mesh, a batch (init's dummy) that does not split: all local
        metas = self._expert_metas()
        if manual:
            # Delayed fp8 state is stored whole ([E, ...], replicated): this device's experts'
            # rows; their amax observations come back in those rows (zero elsewhere).
            start = lax.axis_index(manual_axis) * e
            metas = jax.tree.map(lambda m: lax.dynamic_slice_in_dim(m, start, e), metas)
            routed_BSD = self._exchange(manual_axis, x, experts_BSK, weights_BSK, w_gate, w_up,
                                        w_down, metas)
        elif expert_axis is None:
            routed_BSD = self._dense(x, experts_BSK, weights_BSK, w_gate, w_up, w_down, metas)
        else:
            routed_BSD = self._all_to_all(expert_axis, x, experts_BSK, weights_BSK, w_gate, w_up,
                                          w_down, metas)
        if self.n_shared:
            shared = SwiGLU(self.n_shared * F, std, self.dtype, self.fp8_policy, name="shared")
            routed_BSD = routed_BSD + shared(x)
        return routed_BSD, stats

    def _dense(self, x_BSD, experts_BSK, weights_BSK, w_gate, w_up, w_down, metas):
        """All experts local (one device, or GSPMD's choice over a mesh)."""
        B, S, D = x_BSD.shape
        E, K = self.num_experts, self.experts_per_token
        experts_TK = experts_BSK.reshape(B * S, K)
        if how := self._grouped():
            return moe_grouped.routed(x_BSD.reshape(B * S, D), experts_TK,
                                      weights_BSK.reshape(B * S, K), w_gate, w_up, w_down,
                                      how, metas).reshape(B, S, D)
        slots_TK = dispatch_slots(experts_TK, E)
        cap = capacity(B * S, K, E, self.capacity_factor)
        x_ECD = dispatch(x_BSD.reshape(B * S, D), experts_TK, slots_TK, E, cap)
        # Named for remat policies: the combine's backward (the router weights' gradient) needs
        # the experts' outputs; saving them spares recomputing dispatch and experts.
        y_ECD = checkpoint_name(self._experts(x_ECD, w_gate, w_up, w_down, metas), "moe_routed")
        return combine(y_ECD, experts_TK, slots_TK, weights_BSK.reshape(B * S, K)).reshape(B, S, D)

    def _exchange(self, axis, x_bSD, experts_bSK, weights_bSK, w_gate, w_up, w_down, metas):
        """Expert parallelism's body, inside a shard_map manual over mesh axis `axis`.

        x [B/W, S, D]: this device's tokens; experts/weights [B/W, S, K]; w_gate/w_up
        [E/W, D, F], w_down [E/W, F, D]: this device's experts (and their fp8 state, delayed
        scaling: [E/W, ...]). The gradient of a device's experts arrives through the
        all-to-alls' transposes: every device's tokens routed to them, summed.
        """
        E, K = self.num_experts, self.experts_per_token
        b, S, D = x_bSD.shape
        W = lax.axis_size(axis)
        e = E // W
        experts_TK = experts_bSK.reshape(b * S, K)
        if how := self._grouped():
            return moe_exchange.exchange(axis, x_bSD.reshape(b * S, D), experts_TK,
                                         weights_bSK.reshape(b * S, K), w_gate, w_up, w_down, E,
                                         how, metas).reshape(b, S, D)
        slots_TK = dispatch_slots(experts_TK, E)
        cap = capacity(b * S, K, E, self.capacity_factor)
        send_ECD = dispatch(x_bSD.reshape(b * S, D), experts_TK, slots_TK, E, cap)
        # [owner W, e, C, D] -> all-to-all -> [source W, e, C, D]: my experts' slots from all.
        recv_WeCD = lax.all_to_all(send_ECD.reshape(W, e, cap, D), axis, 0, 0, tiled=True)
        x_eXD = recv_WeCD.transpose(1, 0, 2, 3).reshape(e, W * cap, D)
        y_eXD = self._experts(x_eXD, w_gate, w_up, w_down, metas)
        y_WeCD = y_eXD.reshape(e, W, cap, D).transpose(1, 0, 2, 3)
        back_ECD = checkpoint_name(  # as in `_dense`; also spares both all-to-alls
            lax.all_to_all(y_WeCD, axis, 0, 0, tiled=True).reshape(E, cap, D), "moe_routed")
        return combine(back_ECD, experts_TK, slots_TK,
                       weights_bSK.reshape(b * S, K)).reshape(b, S, D)

    def _all_to_all(self, axis, x_BSD, experts_BSK, weights_BSK, w_gate, w_up, w_down, metas):
        """Expert parallelism over mesh axis `axis`: tokens and experts both split over it."""
        # Manual over `axis` only (tensor parallelism of the experts' F stays with GSPMD); the
        # blocks as `_exchange` says.
        def local(*args):
            return self._exchange(axis, *args)

        # The model's activation constraints name the batch's mesh axis; inside a shard_map
        # manual over it they may only name the others.
        local_rules = tuple((name, None if mesh_axis == axis else mesh_axis)
                            for name, mesh_axis in nn.get_logical_axis_rules())
        spec = P(axis)
        with nn.logical_axis_rules(local_rules):
            return jax.shard_map(local, in_specs=(spec,) * 6 + (jax.tree.map(lambda _: spec,
                                                                             metas),),
                                 out_specs=spec, axis_names={axis},
                                 check_vma=False)(x_BSD, experts_BSK, weights_BSK, w_gate, w_up,
                                                  w_down, metas)


# ---------------------------------------------------------------------------------------------
# Training-step hooks (dsjax.train): the bias update and the logged loads.

BIAS_STACKS = ("moe_layers", "mtp_layers")  # stacks whose MoE routers may carry a bias, in the
                                            # row order of the model's "moe_load"


def with_updated_router_bias(new_params: Any, old_params: Any, load_LE: jax.Array,
                             gamma: float) -> Any:
    """`new_params` with every router bias moved from its *old* value by `update_router_bias`
    (the optimizer's update of it, weight decay included, is discarded: no gradient reaches it).
    `load_LE`: the step's assignment counts, rows in the order of `BIAS_STACKS`' layers."""
    out, row = dict(new_params), 0
    for stack in BIAS_STACKS:
        if stack not in old_params or "moe" not in old_params[stack]:
            continue
        old = old_params[stack]["moe"]
        n = next(iter(jax.tree.leaves(old))).shape[0]
        if BIAS in old:
            bias = update_router_bias(old[BIAS], load_LE[row:row + n], gamma)
            out[stack] = {**new_params[stack], "moe": {**new_params[stack]["moe"], BIAS: bias}}
        row += n
    return out


def load_metrics(aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-step metrics of a MoE/MTP model's auxiliary terms ({} for a dense model):
    expert_load [MoE layers, E] as each expert's share of the layer's assignments (1/E each when
    balanced), its max over experts and layers, the weighted aux loss and MTP losses."""
    out = {}
    if "moe_load" in aux:
        load_LE = aux["moe_load"]
        share_LE = load_LE / jnp.maximum(jnp.sum(load_LE, axis=-1, keepdims=True), 1.0)
        out["expert_load"] = share_LE
        out["expert_load_max"] = jnp.max(share_LE) * load_LE.shape[-1]  # 1 = perfectly even
    for key in ("aux_loss", "mtp_loss"):
        if key in aux:
            out[key] = aux[key]
    return out
