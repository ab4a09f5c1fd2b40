"""Validation of a `Config`: each section's own values, then what does not combine.

The one idea: every check that can run before JAX touches a device runs here, and every failure is
a `ConfigError` whose message starts with the dotted name of the offending field. A section's
check covers its values and how they must divide sizes other sections set; a rule that two
features cannot be on together lives in `compositions` (compositions.py), with its reason. Checks
that need the device count live in `sharding.py` and raise the same error type.
"""

from __future__ import annotations

import os

from dsjax import remat
from dsjax.config.compositions import compositions
from dsjax.config.sections import (PIPELINE_SCHEDULES, PLAN_MODES, PROJECTORS, VISION_TOWERS,
                                   Config, ModelConfig, chunks_per_stage, global_view_tokens,
                                   trainable_groups, view_side)
from dsjax.config.stages import RECIPE_STAGES, stage_config
from dsjax.config.validate_fp8 import validate_fp8
from dsjax.errors import ConfigError, one_of
from dsjax.runtime import xla_flags

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "fp8")
NONFINITE_POLICIES = ("stop", "skip")
TRAIN_TASKS = ("pretrain", "sft", "dpo")  # docs/posttraining.md
OPTIMIZERS = ("adamw", "onebit_adam")
ONEBIT_COMPRESS = ("update", "momentum")  # 1-bit Adam: m / (sqrt(v) + eps), or m (DeepSpeed)
# arithmetic: the built-in chat task of post-training (dsjax/data/arithmetic_chat.py)
DATA_SOURCES = ("stdlib", "prepared", "vl_corpus", "arithmetic")
BATCH_POLICIES = ("fixed", "ramp", "adaptive")
LR_SCALINGS = ("none", "linear", "sqrt")
ATTENTION_KINDS = ("mha", "mla")
ATTENTION_IMPLS = ("xla", "flash", "cudnn", "pallas", "auto")  # per backend: model/attention.py
ROPE_SCALINGS = ("none", "yarn")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_IMPLS = ("capacity", "ragged", "padded", "auto")  # dispatch: model/moe.py, moe_grouped.py
MOE_EXCHANGES = ("static", "ragged")  # model/moe_exchange.py
CONTEXT_IMPLS = ("all_gather", "ring")  # model/context.py
CONTEXT_LAYOUTS = ("zigzag", "contiguous")  # model/context_layout.py


def _bounds(section: str, values: object, positive: str = "", non_negative: str = "") -> None:
    """`section.field: must be > 0` (or >= 0) for each field named, space-separated."""
    for key in positive.split():
        if getattr(values, key) <= 0:
            raise ConfigError(f"{section}.{key}: must be > 0, got {getattr(values, key)}")
    for key in non_negative.split():
        if getattr(values, key) < 0:
            raise ConfigError(f"{section}.{key}: must be >= 0, got {getattr(values, key)}")


def validate(cfg: Config) -> None:
    """Every config check but the one that needs the devices (`sharding.check_device_count`)."""
    _validate_settings(cfg)
    one_of("plan", cfg.plan, PLAN_MODES, "mode")
    if cfg.plan == "auto" and cfg.posttrain.recipe:
        raise ConfigError("plan: auto plans one run's layout, and posttrain.recipe runs stages "
                          "of their own; plan the model with `python -m dsjax.plan` and set "
                          "the layout it prints")
    if cfg.checkpoint.init_from and not os.path.isdir(cfg.checkpoint.init_from):
        raise ConfigError(f"checkpoint.init_from: {cfg.checkpoint.init_from!r} is not a directory")
    validate_posttrain(cfg)


def _validate_settings(cfg: Config) -> None:
    """validate's checks of the values and how they combine (no paths, no recipe stages)."""
    validate_model(cfg)
    validate_mesh(cfg)
    validate_data(cfg)
    validate_train(cfg)
    validate_fp8(cfg)
    validate_optim(cfg)
    validate_remat(cfg)
    validate_pipeline(cfg)
    validate_batch(cfg)
    validate_vision(cfg)
    _bounds("checkpoint", cfg.checkpoint, positive="keep", non_negative="every")
    _bounds("metrics", cfg.metrics,
            non_negative="peak_flops_per_device profile_every cost_per_gpu_hour")
    compositions(cfg)
    validate_mesh_fit(cfg)


def validate_model(cfg: Config) -> None:
    m = cfg.model
    _bounds("model", m, positive="num_layers hidden_size num_heads num_kv_heads mlp_dim vocab_size "
            "rope_theta norm_eps init_std", non_negative="head_dim loss_chunk")
    if m.head_dim == 0 and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads: hidden_size {m.hidden_size} is not divisible by "
                          f"num_heads {m.num_heads}; set model.head_dim explicitly")
    if m.resolved_head_dim % 2:
        raise ConfigError(f"model.head_dim: rotary embeddings need an even head dim, got "
                          f"{m.resolved_head_dim}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads: num_heads {m.num_heads} is not a multiple of "
                          f"num_kv_heads {m.num_kv_heads}")
    validate_deepseek(m)
    one_of("model.attention_impl", m.attention_impl, ATTENTION_IMPLS, "implementation")
    _bounds("model", m, positive="attention_block_q attention_block_k")
    one_of("model.context_impl", m.context_impl, CONTEXT_IMPLS, "implementation")
    one_of("model.context_layout", m.context_layout, CONTEXT_LAYOUTS, "layout")
    if m.expert_parallel and m.n_routed_experts % cfg.mesh.data:
        raise ConfigError(f"model.n_routed_experts: {m.n_routed_experts} experts cannot be split "
                          f"over mesh.data {cfg.mesh.data} (model.expert_parallel)")


def validate_deepseek(m: ModelConfig) -> None:
    """MLA, MoE and MTP fields (DeepSeek-V2/V3); all off by default. Needs only the model section
    (`dsjax.convert` checks a Hugging Face config with it)."""
    one_of("model.attention", m.attention, ATTENTION_KINDS, "kind")
    _bounds("model", m, positive="routed_scaling_factor",
            non_negative="q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
            "rope_original_max_len rope_mscale rope_mscale_all_dim n_routed_experts "
            "n_shared_experts moe_intermediate_size num_experts_per_tok first_k_dense_replace "
            "aux_loss_alpha bias_update_speed capacity_factor moe_tile num_mtp_layers "
            "mtp_loss_weight")
    if m.attention == "mla":
        _bounds("model", m, positive="kv_lora_rank qk_rope_head_dim v_head_dim")
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim: rotary embeddings need an even dim, got "
                              f"{m.qk_rope_head_dim}")
    one_of("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS, "scaling")
    if m.rope_scaling == "yarn" and m.attention == "mla":  # with mha: compositions() says why not
        _bounds("model", m, positive="rope_factor rope_original_max_len rope_beta_fast "
                "rope_beta_slow")
    one_of("model.scoring", m.scoring, MOE_SCORINGS, "router scoring")
    one_of("model.moe_impl", m.moe_impl, MOE_IMPLS, "implementation")
    one_of("model.moe_exchange", m.moe_exchange, MOE_EXCHANGES, "exchange")
    if m.moe_exchange == "ragged" and (m.moe_impl == "capacity" or not m.expert_parallel):
        raise ConfigError("model.moe_exchange: 'ragged' exchanges the sorted rows of "
                          "expert parallelism; it needs model.expert_parallel=True and "
                          "moe_impl 'ragged', 'padded' or 'auto'")
    if m.moe_impl != "capacity" and m.capacity_factor:
        raise ConfigError(f"model.capacity_factor: {m.capacity_factor} drops the assignments past "
                          f"each expert's capacity, and moe_impl={m.moe_impl!r} is dropless (every "
                          f"token reaches its experts); set capacity_factor=0, or "
                          f"moe_impl='capacity'")
    if m.n_routed_experts:
        _bounds("model", m, positive="moe_intermediate_size num_experts_per_tok n_group topk_group")
        if m.num_experts_per_tok > m.n_routed_experts:
            raise ConfigError(f"model.num_experts_per_tok: {m.num_experts_per_tok} exceeds "
                              f"n_routed_experts {m.n_routed_experts}")
        if m.n_routed_experts % m.n_group:
            raise ConfigError(f"model.n_group: n_routed_experts {m.n_routed_experts} is not "
                              f"divisible by n_group {m.n_group}")
        if m.topk_group > m.n_group:
            raise ConfigError(f"model.topk_group: {m.topk_group} exceeds n_group {m.n_group}")
        if m.topk_group * (m.n_routed_experts // m.n_group) < m.num_experts_per_tok:
            raise ConfigError(f"model.topk_group: {m.topk_group} groups of "
                              f"{m.n_routed_experts // m.n_group} experts cannot hold "
                              f"num_experts_per_tok {m.num_experts_per_tok}")
        if m.scoring == "sigmoid" and m.n_group > 1 and m.n_routed_experts // m.n_group < 2:
            raise ConfigError("model.n_group: sigmoid routing scores a group by its top-2 "
                              "experts; groups need at least 2 experts")
        if m.first_k_dense_replace > m.num_layers:
            raise ConfigError(f"model.first_k_dense_replace: {m.first_k_dense_replace} exceeds "
                              f"num_layers {m.num_layers}")


def validate_mesh(cfg: Config) -> None:
    _bounds("mesh", cfg.mesh, positive="data tensor pipeline context dcn_pipeline",
            non_negative="dcn_data")
    for key in ("data", "pipeline"):
        hosts = getattr(cfg.mesh, f"dcn_{key}")
        if hosts and getattr(cfg.mesh, key) % hosts:
            raise ConfigError(f"mesh.dcn_{key}: mesh.{key} {getattr(cfg.mesh, key)} must split "
                              f"evenly over the {hosts} hosts it spans")
    one_of("mesh.xla_profile", cfg.mesh.xla_profile, xla_flags.PROFILES, "profile")


def validate_mesh_fit(cfg: Config) -> None:
    """What must divide over the mesh's axes; checked last, once every field is known good."""
    mesh, m = cfg.mesh, cfg.model
    for field, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                         ("model.mlp_dim", m.mlp_dim), ("model.vocab_size", m.vocab_size)):
        if value % mesh.tensor:
            raise ConfigError(f"{field}: {value} is not divisible by mesh.tensor {mesh.tensor}")
    if mesh.fsdp and m.hidden_size % mesh.data:
        raise ConfigError(f"model.hidden_size: {m.hidden_size} is not divisible by mesh.data "
                          f"{mesh.data} (needed by mesh.fsdp)")
    chunks = mesh.context * (2 if m.context_layout == "zigzag" else 1)
    if mesh.context > 1 and cfg.data.seq_len % chunks:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} must split into {chunks} equal "
                          f"chunks (mesh.context {mesh.context}, model.context_layout "
                          f"{m.context_layout!r})")


def validate_data(cfg: Config) -> None:
    d = cfg.data
    _bounds("data", d, positive="seq_len global_batch eval_batches", non_negative="prefetch")
    one_of("data.source", d.source, DATA_SOURCES, "source")
    if d.source == "prepared" and not d.path:
        raise ConfigError("data.path: required when data.source='prepared' (a directory written by "
                          "`python -m dsjax.data.prepare`)")
    if d.source == "arithmetic" and cfg.train.task == "pretrain":
        raise ConfigError("data.source: 'arithmetic' is a chat task (conversations for "
                          "train.task='sft', preference pairs for 'dpo'), not pretraining text")
    if d.global_batch % cfg.mesh.data:
        raise ConfigError(f"data.global_batch: {d.global_batch} is not divisible by mesh.data "
                          f"{cfg.mesh.data}")
    _bounds("data", d, positive="video_fps max_frames")
    if d.mix:
        if d.source == "stdlib":
            raise ConfigError("data.mix: mixes prepared sources (data.path/NAME) or the "
                              "vl_corpus sources; set data.source='prepared' or 'vl_corpus'")
        mix_weights(d.mix)
    if d.source == "vl_corpus":
        # Stdlib text, captioned digits and clips (dsjax/data/multimodal/vl_sources.py).
        if not d.mix:
            raise ConfigError("data.mix: data.source='vl_corpus' mixes its sources text, image "
                              "and video by weight; set e.g. 'text:0.3,image:0.5,video:0.2'")
        unknown = set(mix_weights(d.mix)) - {"text", "image", "video"}
        if unknown:
            raise ConfigError(f"data.mix: data.source='vl_corpus' has the sources text, image "
                              f"and video, not {', '.join(sorted(unknown))}")
        if d.tokenizer != "byte" or not cfg.vision.enabled:
            raise ConfigError("data.source: 'vl_corpus' is byte-tokenized images and video; it "
                              "needs data.tokenizer='byte' and a vision.tower")
        v = cfg.vision
        # A held-out clip scored whole: its frames, their separators, the longest caption.
        side = view_side(v.image_size, v.patch_size, v.projector)
        need = d.max_frames * (global_view_tokens(side, v.tiling) + 1) + 40
        if d.seq_len < need or v.max_images < d.max_frames:
            raise ConfigError(f"data.seq_len: the vl_corpus clips take {d.max_frames} frames "
                              f"and their caption, {need} tokens and {d.max_frames} image slots; "
                              f"got data.seq_len={d.seq_len}, vision.max_images={v.max_images}")


def mix_weights(mix: str) -> dict[str, float]:
    """`data.mix` ("name:weight,...") -> {name: weight}, in order; ConfigError naming the entry."""
    weights = {}
    for item in (s.strip() for s in mix.split(",")):
        name, sep, weight = item.partition(":")
        name = name.strip()
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not name or not value > 0 or name in weights:
            raise ConfigError(f"data.mix: {item!r} is not NAME:WEIGHT with a new name and a "
                              f"weight > 0 (e.g. 'text:0.5,image:0.3,video:0.2')")
        weights[name] = value
    return weights


def validate_posttrain(cfg: Config) -> None:
    """The recipe's own values, then each stage's config (config/stages.py) as it will train."""
    p = cfg.posttrain
    one_of("posttrain.recipe", p.recipe, ("",) + tuple(RECIPE_STAGES), "recipe")
    _bounds("posttrain", p, positive="pretrain_steps sft_steps sft_lr dpo_steps dpo_lr "
            "eval_prompts")
    if not p.recipe:
        return
    if cfg.train.task != "pretrain":
        raise ConfigError(f"train.task: {cfg.train.task!r}, but posttrain.recipe={p.recipe!r} "
                          f"sets each stage's task itself; leave train.task='pretrain'")
    if cfg.data.source not in ("stdlib", "prepared"):
        raise ConfigError(f"data.source: the recipe pretrains on text ('stdlib' or 'prepared', "
                          f"byte-tokenized like its chat task), got {cfg.data.source!r}")
    for stage in RECIPE_STAGES[p.recipe]:
        try:
            _validate_settings(stage_config(cfg, stage))
        except ConfigError as err:
            raise ConfigError(f"{err} (the recipe's {stage} stage)") from None


def validate_train(cfg: Config) -> None:
    t = cfg.train
    _bounds("train", t, positive="steps log_every max_consecutive_skips loss_scale_init "
            "loss_scale_growth", non_negative="eval_every sample_tokens")
    one_of("train.nonfinite", t.nonfinite, NONFINITE_POLICIES, "policy")
    one_of("train.compute_dtype", t.compute_dtype, COMPUTE_DTYPES, "dtype")
    one_of("train.task", t.task, TRAIN_TASKS, "task")
    trainable_groups(t.trainable)
    if not t.sample_temperature >= 0:
        raise ConfigError(f"train.sample_temperature: must be >= 0 (0 = greedy), got "
                          f"{t.sample_temperature}")
    if not 0 < t.sample_top_p <= 1:
        raise ConfigError(f"train.sample_top_p: must be in (0, 1] (1 = off), got {t.sample_top_p}")
    if t.sample_top_k < 0:
        raise ConfigError(f"train.sample_top_k: must be >= 0 (0 = off), got {t.sample_top_k}")
    if not t.dpo_beta > 0:
        raise ConfigError(f"train.dpo_beta: must be > 0, got {t.dpo_beta}")


def validate_vision(cfg: Config) -> None:
    v = cfg.vision
    one_of("vision.tower", v.tower, VISION_TOWERS, "tower")
    one_of("vision.projector", v.projector, PROJECTORS, "projector")
    _bounds("vision", v, positive="image_size patch_size hidden_size num_layers num_heads "
            "mlp_dim norm_eps max_images max_tiles")
    if v.tiling and not v.enabled:
        raise ConfigError("vision.tiling: needs a vision.tower (it tiles the tower's input)")
    if v.tiling and v.max_images < 2:
        raise ConfigError(f"vision.max_images: {v.max_images} view slots cannot hold a tiled "
                          f"image (a global view and at least one tile); use >= 2")
    if v.image_size % v.patch_size:
        raise ConfigError(f"vision.image_size: {v.image_size} is not a multiple of "
                          f"vision.patch_size {v.patch_size}")
    if v.hidden_size % v.num_heads:
        raise ConfigError(f"vision.hidden_size: {v.hidden_size} is not divisible by "
                          f"vision.num_heads {v.num_heads}")
    for key in ("image_token_id", "frame_token_id"):
        value = getattr(v, key)
        if v.enabled and not 0 <= value < cfg.model.vocab_size:
            raise ConfigError(f"vision.{key}: {value} is outside the vocabulary [0, "
                              f"model.vocab_size={cfg.model.vocab_size})")
    if v.enabled and v.image_token_id == v.frame_token_id:
        raise ConfigError(f"vision.frame_token_id: equals vision.image_token_id "
                          f"{v.image_token_id}; they must differ")
    groups = trainable_groups(cfg.train.trainable)
    if not v.enabled and cfg.train.trainable.strip() != "all" and set(groups) - {"lm"}:
        raise ConfigError(f"train.trainable: {cfg.train.trainable!r} names vision parameter "
                          f"groups, and vision.tower is 'none' (a text model has only 'lm')")


def validate_optim(cfg: Config) -> None:
    o = cfg.optim
    one_of("optim.name", o.name, OPTIMIZERS, "optimizer")
    _bounds("optim", o, positive="lr eps",
            non_negative="warmup_steps weight_decay clip_norm bucket_mb")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
    for key in ("b1", "b2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optim.{key}: must be in [0, 1), got {getattr(o, key)}")
    one_of("optim.compress", o.compress, ONEBIT_COMPRESS, "mode")
    if o.refresh_every < 0 or o.refresh_every == 1:
        raise ConfigError(f"optim.refresh_every: 0 (v stays frozen) or >= 2 (every N-th step after "
                          f"the freeze is exact Adam), got {o.refresh_every}")
    if o.name == "onebit_adam":
        if not 1 <= o.freeze_step < cfg.train.steps:
            raise ConfigError(f"optim.freeze_step: 1-bit Adam needs 1 <= freeze_step < train.steps "
                              f"= {cfg.train.steps} (exact Adam steps before compression, e.g. 20% "
                              f"of them), got {o.freeze_step}")
        if o.update_bound and not o.b1 < o.b2 ** 0.5:
            raise ConfigError(f"optim.update_bound: needs b1 < sqrt(b2) (Adam's update has no "
                              f"bound otherwise), got b1={o.b1}, b2={o.b2}; or set "
                              f"optim.update_bound=False")


def validate_remat(cfg: Config) -> None:
    if cfg.remat.policy != "auto":
        try:
            remat.layer_policies(cfg.remat.policy, cfg.remat.layers, cfg.model.num_layers)
        except remat.RematError as e:
            raise ConfigError(str(e)) from None
    _bounds("remat", cfg.remat, non_negative="memory_budget_gb")


def validate_pipeline(cfg: Config) -> None:
    """The pipeline section, and what must hold for the layers to split into stages."""
    p, S = cfg.pipeline, cfg.mesh.pipeline
    one_of("pipeline.schedule", p.schedule, PIPELINE_SCHEDULES, "schedule")
    _bounds("pipeline", p, positive="microbatches repeats")
    if S == 1:
        return
    m = cfg.model
    # A MoE model's dense first blocks run on stage 0 before the stages (dsjax/pipeline/).
    k = m.first_k_dense_replace if m.is_moe else 0
    # repeats > 1 belongs to the interleaved schedules (compositions() says so)
    L, R = m.num_layers - k, chunks_per_stage(p.schedule, p.repeats)
    if L % (S * R):
        what = f"{L} MoE layers (after {k} dense)" if k else f"{L} layers"
        raise ConfigError(f"model.num_layers: {what} do not split into mesh.pipeline x "
                          f"pipeline.repeats = {S} x {R} equal chunks")
    if p.microbatches % S:
        raise ConfigError(f"pipeline.microbatches: {p.microbatches} is not a multiple of "
                          f"mesh.pipeline {S} (every stage needs work in the steady state)")
    if cfg.data.global_batch % (cfg.mesh.data * p.microbatches):
        raise ConfigError(f"data.global_batch: {cfg.data.global_batch} is not divisible by "
                          f"mesh.data x pipeline.microbatches = {cfg.mesh.data} x "
                          f"{p.microbatches}")
    if cfg.batch.micro_batch % p.microbatches:
        near = -(-cfg.batch.micro_batch // p.microbatches) * p.microbatches
        raise ConfigError(f"batch.micro_batch: {cfg.batch.micro_batch} rows per replica do not "
                          f"split into pipeline.microbatches {p.microbatches}; use a multiple "
                          f"of {p.microbatches}, e.g. {near}")


def validate_batch(cfg: Config) -> None:
    """The `batch` section (dynamic batch size, dsjax/batching/)."""
    b, g, data = cfg.batch, cfg.data.global_batch, cfg.mesh.data
    one_of("batch.policy", b.policy, BATCH_POLICIES, "policy")
    _bounds("batch", b, positive="patience", non_negative="reference_batch micro_batch "
            "device_memory_gb target_step_ms cooldown")
    try:
        sizes = b.sizes(g)
    except ValueError:
        raise ConfigError(f"batch.ladder: expected comma-separated integers, got {b.ladder!r}"
                          ) from None
    bad = [s for s in sizes if s <= 0 or s % data]
    if bad:
        raise ConfigError(f"batch.ladder: every size must be a positive multiple of mesh.data "
                          f"{data}; {bad[0]} is not")
    if g not in sizes:
        raise ConfigError(f"batch.ladder: must contain data.global_batch {g} (the size a run "
                          f"starts at), got {b.ladder!r}")
    one_of("batch.lr_scaling", b.lr_scaling, LR_SCALINGS, "rule")
    if b.micro_batch:
        bad = [s for s in sizes if (s // data) % b.micro_batch]
        if bad:
            raise ConfigError(f"batch.micro_batch: {b.micro_batch} rows per data-parallel "
                              f"replica must divide every ladder size / mesh.data; "
                              f"{bad[0]} / {data} = {bad[0] // data} is not divisible")
    if not 0 < b.mem_fraction <= 1:
        raise ConfigError(f"batch.mem_fraction: must be in (0, 1], got {b.mem_fraction}")
    if b.grow <= 1:
        raise ConfigError(f"batch.grow: must be > 1, got {b.grow}")
    if not 0 < b.shrink < 1:
        raise ConfigError(f"batch.shrink: must be in (0, 1), got {b.shrink}")
    try:
        points = b.ramp_points
    except ValueError:
        raise ConfigError(f"batch.ramp: expected 'tokens:batch,...' (e.g. '0:512,1e9:2048'), "
                          f"got {b.ramp!r}") from None
    if b.policy == "ramp" and not points:
        raise ConfigError("batch.ramp: policy 'ramp' needs a schedule of 'tokens:batch' points, "
                          "e.g. '0:512,1e9:2048'")
    for i, (tokens, batch) in enumerate(points):
        if batch not in sizes:
            raise ConfigError(f"batch.ramp: batch {batch} is not on batch.ladder {sizes}")
        if tokens < 0 or (i and tokens < points[i - 1][0]):
            raise ConfigError(f"batch.ramp: token counts must be >= 0 and non-decreasing, got "
                              f"{b.ramp!r}")
