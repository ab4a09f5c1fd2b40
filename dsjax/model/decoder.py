"""The DeepSeek-LLM decoder: embedding, a scanned stack of pre-norm blocks, final norm, output head.

Layers are scanned (`lax.scan` over groups of layers), so every block parameter carries a leading
"layers" axis and compile time does not grow with depth. The input embedding and the output head
are untied.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dsjax import fp8, fp8_probe, remat
from dsjax.config import ModelConfig
from dsjax.config.layer_map import Choice
from dsjax.fp8_policy import Fp8Policy
from dsjax.model.attention import current_backend, resolve_impl
from dsjax.model.chunked_loss import output_logits
from dsjax.model.context_layout import Layout, row_layout
from dsjax.model.loss import AUX, head_nll
from dsjax.model.layers import (ROUTED_EXPERTS, Attention, AttentionCore, RMSNorm, SwiGLU,
                                _param, prepare_fp8_weights, probe_tokens, rms_norm)
from dsjax.model.mla import MLA, mla_fields
from dsjax.model.moe import MoE, moe_fields
from dsjax.model.vision import SiglipTower, VisionSpec, make_projector, with_image_features
from dsjax.sharding import context_size

RESIDUAL = ("act_batch", "act_seq", "act_embed")
# The logical axis of layer stacks that a pipeline does not split into stages: a MoE model's
# leading dense blocks and the MTP modules (every stage holds them whole; dsjax.pipeline).
EXTRA_LAYERS = "extra_layers"
# The per-layer precision switch of a pipeline chunk's stack: where chunks differ (fp8.layers,
# keep_*_layers, fp8.select=auto), each layer's choice is data, [layers] int32 indices into the
# variants beside its params (`Transformer.fp8_switch`).
FP8_ON = "fp8_on"
# The test hook fp8.test_outlier_layer: that layer's MLP input channel 0 is multiplied by this.
PLANTED_OUTLIER = 1e3


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); shaped for `nn.scan`: returns (carry, MoE stats
    {"load": [E], "balance": []} or None). With a `cache` (decoding, dsjax.model.decode) also
    the updated cache: (carry, stats, cache)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    norm_eps: float
    init_std: float
    dtype: Any = jnp.float32
    fp8_policy: Fp8Policy | None = None  # projections run as fp8 GEMMs; None: none do
    mla: tuple[tuple[str, Any], ...] = ()  # MLA fields (mla.mla_fields); () = `Attention`
    moe: tuple[tuple[str, Any], ...] = ()  # MoE fields (moe.moe_fields); () = dense `SwiGLU`
    attention_impl: str = "xla"  # concrete: attention.resolve_impl (model.attention_impl)
    attention_blocks: tuple[int, int] = (512, 512)  # flash (block_q, block_k)
    context: tuple[str, str] = ("all_gather", "zigzag")  # model.context_impl, context_layout
    planted_outlier: bool = False  # test hook: MLP input channel 0 x PLANTED_OUTLIER

    @nn.compact
    def __call__(self, x_BSD, positions_BS, segment_ids_BS, cache=None):
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)
        core = AttentionCore(self.attention_impl, *self.attention_blocks, *self.context)
        if self.mla:
            attn = MLA(**dict(self.mla), dtype=self.dtype, fp8_policy=self.fp8_policy, core=core,
                       name="attn")
        else:
            attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta,
                             self.init_std, self.dtype, self.fp8_policy, core, name="attn")
        attn_BSD = attn(RMSNorm(self.norm_eps, name="attn_norm")(x_BSD), positions_BS,
                        segment_ids_BS, cache)
        if cache is not None:
            attn_BSD, cache = attn_BSD
        h_BSD = nn.with_logical_constraint(x_BSD + attn_BSD, RESIDUAL)
        stats = None
        mlp_in = RMSNorm(self.norm_eps, name="mlp_norm")(h_BSD)
        if self.planted_outlier:
            mlp_in = mlp_in.at[..., 0].multiply(PLANTED_OUTLIER)
        if self.moe:
            mlp = MoE(**dict(self.moe), dtype=self.dtype, fp8_policy=self.fp8_policy,
                      name=ROUTED_EXPERTS)
            mlp_BSD, stats = mlp(mlp_in)
        else:
            mlp = SwiGLU(self.mlp_dim, self.init_std, self.dtype, self.fp8_policy, name="mlp")
            mlp_BSD = mlp(mlp_in)
        out_BSD = nn.with_logical_constraint(h_BSD + mlp_BSD, RESIDUAL)
        return (out_BSD, stats) if cache is None else (out_BSD, stats, cache)


class Transformer(nn.Module):
    """tokens [B, S] -> float32 logits [B, S, V].

    Per-layer choices: `layer_policies` (remat policy of each layer, see dsjax/remat.py; empty =
    none) and `fp8_policy` (which projections of which layers run as fp8 GEMMs; None = none).
    The stack is split into contiguous segments of equal fp8 choice, and each segment is a
    `lax.scan` over groups of layers (the shortest repeating period of its remat policies), so
    per-layer patterns keep the loop a scan. Params keep one layout whatever the choices: every
    block parameter has a leading "layers" axis of length num_layers. With the "delayed" fp8
    recipe, the `fp8_meta` collection holds one `Fp8Meta` per projection and layer, same layout.
    """
    cfg: ModelConfig
    dtype: Any = jnp.float32
    layer_policies: tuple[str, ...] = ()
    scan_unroll: bool = False  # straight-line code, for exact `cost_analysis` FLOPs
    fp8_policy: Fp8Policy | None = None
    # Per layer: () = its precision choice is static; else the choices (variants) one of which
    # the stack's FP8_ON index picks at run time (a pipeline chunk whose layer differs between
    # stages).
    fp8_switch: tuple[tuple[Choice, ...], ...] = ()
    planted_outlier: int = -1  # test hook (fp8.test_outlier_layer): this layer's MLP input
                               # gets an outlier channel; -1 = none
    # DeepSeek-VL image input (dsjax.model.vision): params "vision_tower" and "projector";
    # None = a text-only model.
    vision: VisionSpec | None = None

    def _block(self, choice: Choice, moe: bool = False, attention_impl: str = "xla",
               planted: bool = False) -> DecoderBlock:
        cfg, policy = self.cfg, self.fp8_policy
        return DecoderBlock(cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                            cfg.rope_theta, cfg.norm_eps, cfg.init_std, self.dtype,
                            None if policy is None else policy.for_choice(choice),
                            mla=mla_fields(cfg) if cfg.attention == "mla" else (),
                            moe=moe_fields(cfg) if moe else (),
                            attention_impl=attention_impl,
                            attention_blocks=(cfg.attention_block_q, cfg.attention_block_k),
                            context=(cfg.context_impl, cfg.context_layout),
                            planted_outlier=planted,
                            parent=None)  # detached: `run_layers` works on an unbound module too

    @property
    def layers_unrolled(self) -> bool:
        """The layer scan runs as straight-line code: `scan_unroll` (FLOP counting) or
        `model.scan_layers=False`."""
        return bool(self.scan_unroll) or not self.cfg.scan_layers

    def seq_layout(self, seq_len: int) -> Layout:
        """The order of a traced row's tokens: split over `context` (model.context_layout) or
        natural (`context_layout.row_layout`)."""
        return row_layout(context_size(), self.cfg.context_layout, seq_len)

    def attention_impl(self, seq_len: int) -> str:
        """The attention core's implementation at this sequence length (model.attention_impl,
        "auto" resolved for this backend and compute dtype)."""
        return resolve_impl(self.cfg, current_backend(), self.dtype, seq_len)

    def _stacks(self) -> list[tuple[str, int, int, bool]]:
        """(param name, first layer, end layer, MoE?) of each scanned stack. Dense models have one,
        "layers"; MoE models "layers" (the first_k_dense_replace dense blocks, if any), then
        "moe_layers". Layer indices (remat and fp8 choices) count across both."""
        cfg, L = self.cfg, self.cfg.num_layers
        if not cfg.is_moe:
            return [("layers", 0, L, False)]
        k = cfg.first_k_dense_replace
        return ([("layers", 0, k, False)] if k else []) + (
            [("moe_layers", k, L, True)] if k < L else [])

    def stack_ranges(self) -> dict[str, tuple[int, int]]:
        """{param name: (first layer, end layer)} of each scanned stack (`_stacks`)."""
        return {name: (lo, hi) for name, lo, hi, _ in self._stacks()}

    def _init_stack(self, rng: jax.Array, collection: str, moe: bool = False,
                    count: int | None = None, axis: str = "layers") -> Any:
        """Per-layer block variables of `collection` stacked on a new leading logical `axis`
        ("layers": the stack a pipeline splits into stages; `EXTRA_LAYERS`: one it does not)."""
        cfg = self.cfg
        x = jnp.zeros((1, 1, cfg.hidden_size), self.dtype)
        pos, seg = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)
        keys = jax.random.split(rng, cfg.num_layers if count is None else count)
        # every layer carries fp8 state: one layout; params do not depend on the attention impl
        block = self._block(self._every_matmul(), moe=moe)
        stacked = jax.vmap(lambda k: block.init(k, x, pos, seg)[collection])(keys)
        boxed = lambda b: isinstance(b, nn.LogicallyPartitioned)
        # fp8 meta leaves are not boxed: they stay replicated (small, and every device needs them).
        return jax.tree.map(lambda b: b.replace(names=(axis,) + tuple(b.names)) if boxed(b)
                            else b, stacked, is_leaf=boxed)

    def _every_matmul(self) -> Choice:
        """The choice that runs every matmul the policy may put in fp8 (no policy: none)."""
        return ((), ()) if self.fp8_policy is None else (self.fp8_policy.matmuls, ())

    def _layer_fn(self, policy: str, choice: Choice, positions_BS, segment_ids_BS,
                  moe: bool = False, planted: bool = False):
        """(x, layer variables) -> (x, MoE stats or None)."""
        impl = self.attention_impl(positions_BS.shape[1])
        block = self._block(choice, moe, impl, planted)

        def apply(x_BSD, variables):
            if fp8.META_COLLECTION in variables:
                # Per layer, after the stack is sliced: the max-combining amax dtype does not
                # survive slicing. A layer used several times in one grad still max-combines.
                variables = {**variables, fp8.META_COLLECTION:
                             fp8.with_max_grad(variables[fp8.META_COLLECTION])}
            return block.apply(variables, x_BSD, positions_BS, segment_ids_BS)

        use_remat, checkpoint_policy = remat.checkpoint_policy(policy, impl)
        if not use_remat:
            return apply
        # Inside a scan, CSE cannot merge the recomputation away, so the barrier is not needed.
        return jax.checkpoint(apply, policy=checkpoint_policy, prevent_cse=self.layers_unrolled)

    def _switch_fn(self, policy: str, variants: tuple[Choice, ...], positions_BS,
                   segment_ids_BS, moe: bool = False):
        """A layer whose precision is its FP8_ON index into `variants`: every form compiled, one
        run (a `lax.switch`; its backward keeps the residuals of all)."""
        fns = [self._layer_fn(policy, v, positions_BS, segment_ids_BS, moe) for v in variants]

        def apply(x_BSD, variables):
            rest = {k: v for k, v in variables.items() if k != FP8_ON}
            return jax.lax.switch(variables[FP8_ON], fns, x_BSD, rest)
        return apply

    def _segments(self, lo: int = 0, hi: int | None = None
                  ) -> list[tuple[int, int, Any, tuple[str, ...]]]:
        """(start, end, key, group pattern) of each contiguous run of layers in [lo, hi) that
        make the same choices. key: (precision choice, planted outlier?), or None where the
        choice is the layer's FP8_ON index (`fp8_switch`)."""
        L = self.cfg.num_layers
        hi = L if hi is None else hi
        policies = tuple(self.layer_policies) or ("none",) * L
        choices = (self.fp8_policy.layer_choices(L) if self.fp8_policy is not None
                   else (((), ()),) * L)
        keys = [(c, i == self.planted_outlier) for i, c in enumerate(choices)]
        if self.fp8_switch:
            keys = [None if switch else k for k, switch in zip(keys, self.fp8_switch)]
        if len(policies) != L or len(keys) != L:
            raise ValueError(f"per-layer choices must have num_layers={L} entries")
        segments, start = [], lo
        for i in range(lo + 1, hi + 1):
            if i == hi or keys[i] != keys[start]:
                segments.append((start, i, keys[start],
                                 remat.group_pattern(policies[start:i])))
                start = i
        return segments

    @nn.compact
    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                 segment_ids_BS: jax.Array | None = None, targets_BS: jax.Array | None = None,
                 weights_BS: jax.Array | None = None, head_inputs: bool = False,
                 pixels_BMHWC: jax.Array | None = None, image_mask_BM: jax.Array | None = None,
                 feature_index_BS: jax.Array | None = None) -> Any:
        """Logits [B, S, V]; with `head_inputs`, (final-normed x [B, S, D], head [D, V]) instead,
        for a loss that applies the head itself (`loss.head_nll`). With targets and weights
        (training), MTP modules also run; MoE and MTP models sow their auxiliary terms into the
        "aux" collection (`AUX_KEYS`), which
        `apply(..., mutable=["aux"])` returns: "aux_loss" (the weighted sum to add to the mean
        next-token loss), "moe_load" [MoE layers, E] and "mtp_loss" [num_mtp_layers]."""
        cfg = self.cfg
        if positions_BS is None:
            order = self.seq_layout(tokens_BS.shape[1]).order(tokens_BS.shape[1])
            positions_BS = jnp.broadcast_to(jnp.asarray(order, jnp.int32), tokens_BS.shape)
        if segment_ids_BS is None:
            segment_ids_BS = jnp.ones_like(tokens_BS)
        embedding_VD = _param(self, "embedding", (cfg.vocab_size, cfg.hidden_size),
                              ("vocab", "embed"), cfg.init_std)
        x_BSD = embed_tokens(embedding_VD, tokens_BS, self.dtype)
        if self.vision is not None:
            x_BSD = self._with_images(x_BSD, tokens_BS, pixels_BMHWC, image_mask_BM,
                                      feature_index_BS)

        moe_stats = []  # per segment of MoE layers: {"load": [l, E], "balance": [l]}
        for name, lo, hi, moe in self._stacks():
            # A MoE model pipelines its MoE stack; the dense blocks before it stay whole.
            axis = EXTRA_LAYERS if cfg.is_moe and not moe else "layers"
            stack = {"params": self.param(name, self._init_stack, "params", moe, hi - lo, axis)}
            if self.fp8_policy is not None and self.fp8_policy.delayed:
                stack[fp8.META_COLLECTION] = self.variable(
                    fp8.META_COLLECTION, name,
                    lambda moe=moe, n=hi - lo: self._init_stack(jax.random.key(0),
                                                                fp8.META_COLLECTION, moe, n)).value
            if self.fp8_policy is not None and self.fp8_policy.probe:
                stack[fp8_probe.COLLECTION] = self.variable(
                    fp8_probe.COLLECTION, name, probe_tokens, nn.unbox(stack["params"]),
                    self.fp8_policy.matmuls).value
            x_BSD, stats = self.run_layers(x_BSD, stack, positions_BS, segment_ids_BS, lo, hi,
                                           moe)
            moe_stats += stats
        head_DV = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                         cfg.init_std)
        aux_loss = jnp.zeros((), jnp.float32)
        if cfg.num_mtp_layers:
            mtp_losses, mtp_stats = self._mtp(x_BSD, embedding_VD, head_DV, tokens_BS,
                                              positions_BS, segment_ids_BS, targets_BS,
                                              weights_BS)
            moe_stats += mtp_stats
            if mtp_losses is not None:
                self.sow(AUX, "mtp_loss", mtp_losses)
                aux_loss += cfg.mtp_loss_weight * jnp.mean(mtp_losses)
        if moe_stats:
            # The sequence-wise balance loss of every MoE layer (DeepSeek-V3 eq. 17), and the
            # per-expert load the training step logs and balances the router bias with.
            balance = jnp.concatenate([s["balance"] for s in moe_stats])
            aux_loss += cfg.aux_loss_alpha * jnp.sum(balance)
            self.sow(AUX, "moe_load", jnp.concatenate([s["load"] for s in moe_stats]))
        if moe_stats or cfg.num_mtp_layers:
            self.sow(AUX, "aux_loss", aux_loss)

        x_BSD = RMSNorm(cfg.norm_eps, name="final_norm")(x_BSD)
        if head_inputs:
            return x_BSD, head_DV
        return output_logits(x_BSD, head_DV, self.dtype)

    def _with_images(self, x_BSD, tokens_BS, pixels_BMHWC, image_mask_BM, feature_index_BS):
        """x with the projected image features at the placeholder tokens; x as it is without
        pixels (the vision params are still created at init, so one layout serves both)."""
        spec = self.vision
        tower = SiglipTower(**spec.tower_fields(), dtype=self.dtype, name="vision_tower")
        projector = make_projector(spec, self.cfg.hidden_size, self.dtype, name="projector")
        if pixels_BMHWC is None:
            if self.is_initializing():
                side, C = spec.image_size, spec.num_channels
                projector(tower(jnp.zeros((1, side, side, C), self.dtype)))
            return x_BSD
        return with_image_features(x_BSD, tokens_BS, spec, lambda x: projector(tower(x)),
                                   lambda: projector.variables["params"], pixels_BMHWC,
                                   image_mask_BM, feature_index_BS)

    def _mtp(self, h_BSD, embedding_VD, head_DV, tokens_BS, positions_BS, segment_ids_BS,
             targets_BS, weights_BS):
        """Multi-token prediction (DeepSeek-V3 §2.2), see `mtp_sums`. Params exist always; the
        modules run only with targets (training): (mean loss per module [n] or None, MoE stats
        of the modules' blocks)."""
        cfg, n, D = self.cfg, self.cfg.num_mtp_layers, self.cfg.hidden_size
        params = {f"mtp_{k}": self.param(f"mtp_{k}", nn.with_logical_partitioning(
            nn.initializers.ones, (EXTRA_LAYERS, "norm")), (n, D), jnp.float32)
                  for k in ("enorm", "hnorm", "norm")}
        params["mtp_eh_proj"] = _param(self, "mtp_eh_proj", (n, 2 * D, D),
                                       (EXTRA_LAYERS, None, "embed"), cfg.init_std)
        params["mtp_layers"] = self.param("mtp_layers", self._init_stack, "params", cfg.is_moe, n,
                                          EXTRA_LAYERS)
        if targets_BS is None or weights_BS is None:
            return None, []
        sums, counts, stats = self.mtp_sums(params, h_BSD, embedding_VD, head_DV, tokens_BS,
                                            positions_BS, segment_ids_BS, targets_BS, weights_BS)
        return sums / jnp.maximum(counts, 1.0), stats

    def mtp_sums(self, params, h_BSD, embedding_VD, head_DV, tokens_BS, positions_BS,
                 segment_ids_BS, targets_BS, weights_BS):
        """The MTP modules on h^0 = the main model's last hidden state [B, S, D] (before
        final_norm): module k maps [enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)] through eh_proj and
        one decoder block to h^k_i, whose norm and the shared head predict t_{i+k+1}. `params`:
        the "mtp_*" entries of the model's params. Returns (summed weighted NLL per module [n],
        its weight sum [n], MoE stats of the modules' blocks). Needs no bound module: a pipeline
        runs it on its last stage's outputs (dsjax.pipeline)."""
        cfg, n = self.cfg, self.cfg.num_mtp_layers
        block = self._layer_fn("none", ((), ()), positions_BS, segment_ids_BS, cfg.is_moe)
        sums, stats = [], []
        layout = self.seq_layout(tokens_BS.shape[1])
        valid_NBS = mtp_weights(weights_BS, n, layout)
        for k in range(1, n + 1):
            e_BSD = embed_tokens(embedding_VD, layout.ahead(tokens_BS, k), self.dtype)
            cat_BSE = jnp.concatenate([rms_norm(e_BSD, params["mtp_enorm"][k - 1], cfg.norm_eps),
                                       rms_norm(h_BSD, params["mtp_hnorm"][k - 1], cfg.norm_eps)],
                                      axis=-1)
            h_BSD = jnp.einsum("BSE,ED->BSD", cat_BSE,
                               params["mtp_eh_proj"][k - 1].astype(self.dtype))
            h_BSD, s = block(h_BSD, {"params": jax.tree.map(lambda a, k=k: a[k - 1],
                                                            params["mtp_layers"])})
            if s is not None:
                stats.append(jax.tree.map(lambda a: a[None], s))
            # Target t_{i+k+1} = targets[i + k].
            sums.append(head_nll(rms_norm(h_BSD, params["mtp_norm"][k - 1], cfg.norm_eps),
                                 head_DV, layout.ahead(targets_BS, k), valid_NBS[k - 1],
                                 dtype=self.dtype, chunk=cfg.loss_chunk)[0])
        return jnp.stack(sums), jnp.sum(valid_NBS, axis=(1, 2)), stats

    def run_layers(self, x_BSD: jax.Array, stack: Any, positions_BS: jax.Array,
                   segment_ids_BS: jax.Array, lo: int = 0, hi: int | None = None,
                   moe: bool = False) -> tuple[jax.Array, list[Any]]:
        """Layers [lo, hi) (default: all) on x [B, S, D]. `stack` holds their variables
        ({"params": ...}, with delayed fp8 also {"fp8_meta": ...}) on a leading axis of hi - lo.
        The fp8 layers' projection weights are quantised here, before the layer loop.
        Returns x and the MoE stats of each segment (empty for dense layers). Needs no bound
        module: a pipeline stage runs its slice of the stack through it (dsjax.pipeline)."""
        hi = self.cfg.num_layers if hi is None else hi
        moe_stats = []
        for start, end, key, pattern in self._segments(lo, hi):
            if key is None:  # run-time choice: prepare the weights any variant runs in fp8
                variants = self.fp8_switch[start]
                fns = [self._switch_fn(p, variants, positions_BS, segment_ids_BS, moe)
                       for p in pattern]
                in_fp8 = tuple(sorted({m for v in variants for m in v[0]}))
            else:
                fns = [self._layer_fn(p, key[0], positions_BS, segment_ids_BS, moe, key[1])
                       for p in pattern]
                in_fp8 = key[0][0]
            G = len(pattern)
            segment = jax.tree.map(lambda a: a[start - lo:end - lo], stack)
            if key is not None:
                segment.pop(FP8_ON, None)  # a static choice needs no flags
            policy = self.fp8_policy
            if (in_fp8 and policy is not None and not policy.probe
                    and policy.recipe in ("current", "delayed")):
                segment[fp8.WEIGHTS_COLLECTION] = prepare_fp8_weights(
                    segment, policy.for_choice((in_fp8, ())))
            grouped = jax.tree.map(
                lambda a: a.reshape((end - start) // G, G, *a.shape[1:]), segment)

            def group_body(x_BSD, group_vars, fns=fns):
                stats = []
                for g, fn in enumerate(fns):
                    x_BSD, s = fn(x_BSD, jax.tree.map(lambda a, g=g: a[g], group_vars))
                    stats.append(s)
                return x_BSD, stats

            x_BSD, stats = jax.lax.scan(group_body, x_BSD, grouped,
                                        unroll=self.layers_unrolled)
            if moe:  # [groups] per member -> layer order [groups * G]
                moe_stats.append(jax.tree.map(
                    lambda *m: jnp.stack(m, axis=1).reshape(-1, *m[0].shape[1:]), *stats))
        return x_BSD, moe_stats


def mtp_weights(weights_BS: jax.Array, n: int, layout: Layout = Layout()) -> jax.Array:
    """[n, B, S]: MTP module k's loss weights. Position i predicts t_{i+k+1}; it counts while
    positions i..i+k each predict within one document (their weights are all 1). `layout`: the
    row's order (`Transformer.seq_layout`)."""
    out, valid_BS = [], weights_BS
    for k in range(1, n + 1):
        valid_BS = valid_BS * layout.ahead(weights_BS, k)
        out.append(valid_BS)
    return jnp.stack(out) if out else jnp.zeros((0, *weights_BS.shape), weights_BS.dtype)


def embed_tokens(embedding_VD: jax.Array, tokens_BS: jax.Array, dtype: Any) -> jax.Array:
    """tokens [B, S] -> x [B, S, D] in the compute dtype."""
    x_BSD = jnp.take(embedding_VD, tokens_BS, axis=0).astype(dtype)
    return nn.with_logical_constraint(x_BSD, RESIDUAL)


def abstract_params(cfg: ModelConfig, seq_len: int = 8) -> Any:
    """Boxed (logically partitioned) abstract params; allocates nothing."""
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]


def count_params(params: Any) -> int:
    """Number of scalars in a (possibly abstract, possibly boxed) params pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params))))
