"""What every pipeline schedule shares: the model seen as stages, the schedules' tick arithmetic,
and the pieces each stage runs (its params, the embedding, the head, the MTP modules).

The one idea: the decoder's layer stack is cut into contiguous chunks, one (or, interleaved, R)
per stage, each run by the decoder's own `run_layers`; the embedding, the head and the MTP modules
are replicated over the stages. See docs/pipeline.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax import fp8, sharding
from dsjax.config.layer_map import Choice
from dsjax.config.sections import HAND_BACKWARD_SCHEDULES, chunks_per_stage
from dsjax.model.decoder import FP8_ON, Transformer, embed_tokens
from dsjax.model.layers import RMSNorm
from dsjax.model import loss
from dsjax.model.batch import MEDIA_KEYS
from dsjax.model.vision import SiglipTower, make_projector, with_image_features

STAGE = sharding.PIPELINE  # the mesh axis the stages live on
# The MTP modules' params: replicated over the stages, run with the head (`mtp_terms`).
MTP_KEYS = ("mtp_enorm", "mtp_hnorm", "mtp_norm", "mtp_eh_proj", "mtp_layers")


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1,
                    moe: bool = False) -> float:
    """The analytic idle share of a stage's time (0 without pipelining), R = the chunks per stage:
    (S-1) / (R*M + S-1). `moe`: the hand-backward schedules cannot skip idle ticks of MoE stages
    (see `one_f_one_b._one_f_one_b`), so every tick past the R*M busy ones counts."""
    S, M, R = stages, microbatches, chunks_per_stage(schedule, repeats)
    if schedule in HAND_BACKWARD_SCHEDULES and moe:
        T = ticks(schedule, S, M, repeats)
        return (T - R * M) / T
    return (S - 1) / (R * M + S - 1)


def ticks(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> int:
    """Clock ticks (iterations of the schedule's scan). A hand-backward schedule's last backward
    leaves stage 0 (R+1)*S - 2 ticks after its R*M forward units have started there."""
    S, M, R = stages, microbatches, chunks_per_stage(schedule, repeats)
    if schedule in HAND_BACKWARD_SCHEDULES:
        return R * M + (R + 1) * S - 2
    return R * M + S - 1


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A `Transformer` cut into pipeline stages: what every schedule reads (`Pipelined` adds the
    loss). Chunk c of the pipelined stack holds its layers [c*Lc, (c+1)*Lc)."""
    model: Transformer
    stages: int
    schedule: str  # pipeline.schedule, microbatches, repeats: no defaults here, the config's
    microbatches: int  # are the only ones (`dsjax.pipeline.make`)
    repeats: int
    typed: bool = True  # shard_map check_vma; False for fp8 (see dsjax/train/onebit_step.py)
                        # and expert-parallel MoE (see `dsjax.pipeline.make`)

    @property
    def chunks(self) -> int:
        return self.stages * self.per_stage

    @property
    def per_stage(self) -> int:
        """Layer chunks each stage runs (R): `repeats` if the schedule interleaves, else 1."""
        return chunks_per_stage(self.schedule, self.repeats)

    @property
    def prefix(self) -> int:
        """Leading layers that run before the stages, on stage 0: a MoE model's dense blocks
        (`first_k_dense_replace`); 0 for a dense model."""
        cfg = self.model.cfg
        return cfg.first_k_dense_replace if cfg.is_moe else 0

    def fp8_choices(self) -> tuple[Choice, ...]:
        """Per layer of the pipelined stack: its precision choice (fp8 and float32 projections)."""
        m, k = self.model, self.prefix
        if m.fp8_policy is None:
            return (((), ()),) * (m.cfg.num_layers - k)
        return m.fp8_policy.layer_choices(m.cfg.num_layers)[k:]

    def fp8_variants(self) -> tuple[Choice, ...]:
        """The distinct choices of the pipelined stack, in a fixed order: what a layer's FP8_ON
        index counts in."""
        return tuple(sorted(set(self.fp8_choices())))

    def fp8_switch(self) -> tuple[tuple[Choice, ...], ...]:
        """Per position in a chunk: the variants where the chunks' choices differ there (the
        choice is then made at run time from the stack's FP8_ON indices,
        `Transformer.fp8_switch`), () where they agree; () if no chunk differs."""
        choices, n = self.fp8_choices(), (self.model.cfg.num_layers - self.prefix) // self.chunks
        differs = [len({choices[c * n + i] for c in range(self.chunks)}) > 1 for i in range(n)]
        variants = self.fp8_variants()
        return tuple(variants if d else () for d in differs) if any(differs) else ()

    def chunk_model(self) -> Transformer:
        """The decoder restricted to one chunk of the pipelined layers (every chunk makes the
        same remat choices; fp8 choices that differ are switched at run time; the dense prefix
        and MTP are not part of it)."""
        m, k = self.model, self.prefix
        n = (m.cfg.num_layers - k) // self.chunks
        return m.clone(parent=None, cfg=dataclasses.replace(m.cfg, num_layers=n,
                                                            first_k_dense_replace=0,
                                                            num_mtp_layers=0),
                       layer_policies=tuple(m.layer_policies)[k:k + n],
                       fp8_policy=m.fp8_policy and m.fp8_policy.layer_range(k, k + n),
                       fp8_switch=self.fp8_switch())

    @property
    def stack(self) -> str:
        """The params key of the pipelined layer stack: a MoE model's MoE blocks (its dense
        prefix, params "layers", runs on stage 0 before them, see `stage0_input`), else every
        block."""
        return "moe_layers" if self.model.cfg.is_moe else "layers"


def aux_terms(pipe: StagedModel, balance: jax.Array | None, load_LE: jax.Array | None,
              mtp: dict[str, jax.Array], mtp_count: jax.Array) -> dict[str, jax.Array]:
    """The model's "aux" terms, as the unpipelined model sows them, from the stages' balance
    terms summed over layers and microbatches, their per-layer loads [L, E] (None, None for a
    dense model) and the MTP head's sums (`mtp_terms`, summed over microbatches; {} without
    MTP). MTP blocks' loads come after the layers', as in the unpipelined model."""
    cfg = pipe.model.cfg
    aux: dict[str, jax.Array] = {}
    aux_loss = jnp.zeros((), jnp.float32)
    if balance is not None:
        if "balance" in mtp:
            balance = balance + jnp.sum(mtp["balance"])
            load_LE = jnp.concatenate([load_LE, mtp["load"]])
        aux_loss += cfg.aux_loss_alpha * balance / pipe.microbatches
        aux["moe_load"] = load_LE
    if mtp:
        aux["mtp_loss"] = mtp["nll"] / jnp.maximum(mtp_count, 1.0)
        aux_loss += cfg.mtp_loss_weight * jnp.mean(aux["mtp_loss"])
    if aux:
        aux["aux_loss"] = aux_loss
    return aux


# In `top`: the delayed-scaling state of a MoE model's dense prefix blocks (they run on stage 0
# with the embedding), beside their params "layers".
PREFIX_META = "prefix_fp8_meta"


def split_params(pipe: StagedModel, params: Any, meta: Any) -> tuple[Any, Any]:
    """(layer variables {"params", maybe "fp8_meta", maybe FP8_ON: the per-layer precision
    indices where chunks differ} of the pipelined stack, leading "layers" axis; the replicated top-level
    params, with the dense prefix's fp8 state under PREFIX_META if it has one)."""
    name = pipe.stack
    stack = {"params": params[name]}
    if meta:
        stack[fp8.META_COLLECTION] = meta[name]
    if pipe.fp8_switch():
        variants = pipe.fp8_variants()
        stack[FP8_ON] = jnp.asarray([variants.index(c) for c in pipe.fp8_choices()], jnp.int32)
    top = {k: v for k, v in params.items() if k != name}
    if pipe.prefix and meta and "layers" in meta:
        top[PREFIX_META] = meta["layers"]
    return stack, top


def run_chunk(chunk_model: Transformer, variables: Any, x_BSD: jax.Array, positions_BS,
              segment_ids_BS) -> tuple[jax.Array, Any]:
    """One chunk's layers: (y [B, S, D], MoE stats {"load": [Lc, E], "balance": [Lc]}, or None
    for a dense model)."""
    moe = chunk_model.cfg.is_moe
    y_BSD, stats = chunk_model.run_layers(x_BSD, variables, positions_BS, segment_ids_BS,
                                          moe=moe)
    if not moe:
        return y_BSD, None
    return y_BSD, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)


def stage_specs(tree: Any) -> Any:
    """The layer stack's leading axis over the stages: stage s holds layers [s*L/S, (s+1)*L/S)."""
    return jax.tree.map(lambda _: P(STAGE), tree)


def interleave_tables(S: int, R: int, inverse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Index tables that move chunk c = s*R + j (stage s's j-th contiguous chunk) to stage
    c % S, slot c // S (`inverse`: back). send[s, d, p]: the local chunk stage s sends to stage d
    in slot p (R: padding); recv[d, r]: (source stage, slot) of stage d's r-th chunk."""
    P_ = -(-R // S)  # slots per (source, destination) pair
    send = np.full((S, S, P_), R, np.int32)
    recv = np.zeros((S, R, 2), np.int32)
    used = np.zeros((S, S), np.int32)
    for c in range(R * S):
        contiguous, circular = divmod(c, R), (c % S, c // S)
        (src, j), (dst, r) = (circular, contiguous) if inverse else (contiguous, circular)
        send[src, dst, used[src, dst]] = j
        recv[dst, r] = (src, used[src, dst])
        used[src, dst] += 1
    return send, recv


def interleave(local: Any, S: int, R: int, inverse: bool = False) -> Any:
    """This stage's contiguous chunks [R, Lc, ...] (chunk s*R + j at j) -> its circular chunks
    (chunk r*S + s at r), with one all_to_all over `pipeline`; `inverse`: back. Checkpoints keep
    the natural layer order; the weights move here every step, and their gradients back."""
    if R == 1:
        return local
    send, recv = interleave_tables(S, R, inverse)
    s = lax.axis_index(STAGE)
    send_row, recv_row = jnp.asarray(send)[s], jnp.asarray(recv)[s]

    def move(a):
        padded = jnp.concatenate([a, jnp.zeros_like(a[:1])])  # index R is padding
        got = lax.all_to_all(padded[send_row], STAGE, 0, 0, tiled=True)  # [S, P, Lc, ...]
        return got[recv_row[:, 0], recv_row[:, 1]]

    return jax.tree.map(move, local)


def index(tree: Any, i: jax.Array) -> Any:
    """Entry i of every leaf's leading axis."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


# The top-level params stage 0 differentiates before the stages: the embedding, a MoE model's
# dense prefix blocks ("layers"; with delayed fp8 their state), a vision model's tower and
# projector.
FRONT_KEYS = ("embedding", "layers", PREFIX_META, "vision_tower", "projector")


def front_params(pipe: StagedModel, top: Any) -> Any:
    """What stage 0 differentiates: the embedding alone, or a dict of FRONT_KEYS."""
    if not (pipe.prefix or pipe.model.vision):
        return top["embedding"]
    return {k: top[k] for k in FRONT_KEYS if k in top}


def heavy_front(pipe: StagedModel) -> bool:
    """Whether stage 0's input costs more than an embedding lookup (dense prefix blocks, a
    vision tower): then only stage 0 computes it."""
    return bool(pipe.prefix or pipe.model.vision)


def stage0_input(pipe: StagedModel, top: Any, mb: dict[str, jax.Array]) -> jax.Array:
    """Stage 0's input for microbatch arrays `mb` (inputs, positions, segment_ids; a vision
    model's `MEDIA_KEYS`): the embedding with image features at the placeholders, then a MoE
    model's dense prefix blocks (whose params, "layers", are replicated over the stages like the
    embedding). [B, S] -> [B, S, D]."""
    model = pipe.model
    front = top if isinstance(top, dict) else {"embedding": top}
    tokens_BS = mb["inputs"]
    x_BSD = embed_tokens(front["embedding"], tokens_BS, model.dtype)
    if model.vision is not None:
        x_BSD = _with_images(model, front, x_BSD, tokens_BS, mb)
    if not pipe.prefix:
        return x_BSD
    prefix = {"params": front["layers"]}
    if PREFIX_META in front:
        prefix[fp8.META_COLLECTION] = front[PREFIX_META]
    x_BSD, _ = model.run_layers(x_BSD, prefix, mb["positions"], mb["segment_ids"], 0,
                                pipe.prefix)
    return x_BSD


def _with_images(model: Transformer, front: Any, x_BSD, tokens_BS, mb):
    """x with the tower's projected image features at the placeholder tokens (the decoder's own
    `_with_images`, from the params held outside a bound module)."""
    spec = model.vision
    tower = SiglipTower(**spec.tower_fields(), dtype=model.dtype, parent=None)
    projector = make_projector(spec, model.cfg.hidden_size, model.dtype, name=None)

    def encode(x_NHWC):
        f_NPV = tower.apply({"params": front["vision_tower"]}, x_NHWC)
        return projector.apply({"params": front["projector"]}, f_NPV)
    return with_image_features(x_BSD, tokens_BS, spec, encode, lambda: front["projector"],
                               mb["pixels"], mb["image_mask"], mb.get("feature_index"))


# The microbatch arrays stage 0's input reads.
FRONT_BATCH_KEYS = ("inputs", "positions", "segment_ids") + MEDIA_KEYS


def mtp_terms(pipe: StagedModel, top: Any, x_BSD: jax.Array, mb: dict[str, jax.Array],
              rows_in: int = 1) -> dict[str, jax.Array]:
    """The MTP modules on final-stage activations x [B, S, D] (before final_norm) of rows `mb`
    (`BATCH_KEYS` arrays [B, S]) that hold `rows_in` microbatches: {"nll": summed weighted NLL
    per module [n]; MoE models also "balance" [n] (each module's balance term, summed over the
    microbatches) and "load" [n, E]}. {} without MTP."""
    model = pipe.model
    if not model.cfg.num_mtp_layers:
        return {}
    sums, _, stats = model.mtp_sums({k: top[k] for k in MTP_KEYS}, x_BSD, top["embedding"],
                                    top["lm_head"], mb["inputs"], mb["positions"],
                                    mb["segment_ids"], mb["targets"], mb["weights"])
    out = {"nll": sums}
    if stats:  # per module a mean over rows: x rows_in = the sum of the microbatches' means
        out["balance"] = jnp.concatenate([s["balance"] for s in stats]) * rows_in
        out["load"] = jnp.concatenate([s["load"] for s in stats])
    return out


def head_nll(model: Transformer, top: Any, x_BSD: jax.Array, targets_BS: jax.Array,
             weights_BS: jax.Array) -> jax.Array:
    """Final norm, output head and summed weighted NLL of final-stage activations."""
    x_BSD = RMSNorm(model.cfg.norm_eps, parent=None).apply({"params": top["final_norm"]}, x_BSD)
    return loss.head_nll(x_BSD, top["lm_head"], targets_BS, weights_BS, dtype=model.dtype,
                         chunk=model.cfg.loss_chunk)[0]
