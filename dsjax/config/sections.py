"""The config sections: frozen dataclasses, and the only place a default lives.

A config file (`configs/NAME.py`) starts from these defaults (`dsjax.config.defaults()`) and sets
only what differs, so a value written in a config file is always a choice that config makes.
Fields without a default (the model's shape) must be set by every config.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from dsjax.errors import ConfigError, unknown_choice


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int  # decoder blocks (scanned)
    hidden_size: int  # model width D
    num_heads: int  # query heads H
    num_kv_heads: int  # key/value heads (< num_heads: grouped-query attention)
    mlp_dim: int  # SwiGLU hidden width F of the dense MLP
    vocab_size: int  # embedding rows (pad it so it divides mesh.tensor)
    head_dim: int = 0  # 0 means hidden_size // num_heads
    rope_theta: float = 10000.0  # rotary base
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # normal init std of every matrix (HF: initializer_range)
    loss_chunk: int = 1024  # sequence positions per cross-entropy chunk (docs/loss.md); 0 = off
    # DeepSeek-V2/V3 (docs/moe.md). Every default means "off": standard attention, dense MLP.
    attention: str = "mha"  # mha (grouped-query, DeepSeek-LLM) | mla (latent attention, V2 §2.1)
    q_lora_rank: int = 0  # mla: query compression rank; 0 = one plain q projection
    kv_lora_rank: int = 0  # mla: width of the compressed KV latent
    qk_nope_head_dim: int = 0  # mla: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0  # mla: per-head query/key dims with decoupled RoPE (shared key)
    v_head_dim: int = 0  # mla: per-head value dim
    rope_scaling: str = "none"  # mla: none | yarn (frequency interpolation, long context)
    rope_factor: float = 1.0  # yarn: context extension factor
    rope_original_max_len: int = 0  # yarn: the pretraining context length
    rope_beta_fast: float = 32.0  # yarn: ramp boundary in rotations (extrapolate above)
    rope_beta_slow: float = 1.0  # yarn: ramp boundary in rotations (interpolate below)
    rope_mscale: float = 1.0  # yarn: RoPE'd q/k scale mscale(factor, this) / mscale(.., all_dim)
    rope_mscale_all_dim: float = 0.0  # yarn: softmax scale *= mscale(factor, this)^2; 0 = off
    n_routed_experts: int = 0  # MoE: routed experts per MoE layer; 0 = dense everywhere
    n_shared_experts: int = 0  # MoE: shared experts (one SwiGLU of n_shared * moe_intermediate)
    moe_intermediate_size: int = 0  # MoE: hidden width of one expert
    num_experts_per_tok: int = 0  # MoE: routed experts per token (top-k)
    n_group: int = 1  # MoE: expert groups of group-limited routing (1 = unlimited)
    topk_group: int = 1  # MoE: groups a token may route to
    routed_scaling_factor: float = 1.0  # MoE: multiplier of the routed experts' output
    scoring: str = "softmax"  # MoE router: softmax (V2) | sigmoid + correction bias (V3)
    norm_topk_prob: bool = False  # MoE: normalise the top-k weights to sum to 1
    first_k_dense_replace: int = 0  # MoE: the first k layers keep the dense MLP (mlp_dim)
    aux_loss_alpha: float = 0.0  # MoE balance loss weight (per sequence, V2/V3 form); 0 = off
    bias_update_speed: float = 0.001  # sigmoid: aux-loss-free bias step gamma (V3 §2.1.2); 0 = off
    expert_parallel: bool = False  # MoE: all-to-all dispatch, experts over the "expert" axis
    capacity_factor: float = 0.0  # MoE capacity: slots per expert = factor * tokens * k / E;
                                  # 0 = dropless ([E, tokens, D] buffers)
    moe_impl: str = "capacity"  # MoE: capacity (buffers) | ragged | padded (dropless sorted rows,
                                # grouped GEMMs) | auto (padded; ragged on TPU); docs/moe.md
    moe_tile: int = 0  # padded: rows per tile; 0 = per backend (model/moe_grouped.py)
    moe_exchange: str = "static"  # grouped + expert_parallel: static (A-row slots per peer) |
                                  # ragged (ragged_all_to_all, GPU/TPU; model/moe_exchange.py)
    num_mtp_layers: int = 0  # multi-token prediction modules (V3 §2.2); 0 = off
    mtp_loss_weight: float = 0.3  # MTP: weight of the mean MTP loss in the training loss
    # docs/attention.md: the attention core's implementation and flash's tile sizes
    attention_impl: str = "auto"  # xla | flash | cudnn | pallas | auto (per backend, dtype, S)
    attention_block_q: int = 512  # flash: query rows per block
    attention_block_k: int = 512  # flash: key rows per block
    context_impl: str = "all_gather"  # mesh.context > 1: all_gather | ring (docs/context.md)
    context_layout: str = "zigzag"  # mesh.context > 1: zigzag (each device holds chunks i and
                                    # 2C-1-i: equal causal work) | contiguous (unbalanced)
    scan_layers: bool = True  # False unrolls the layer stack: no stacked residual buffers
                              # (cpu_tiny's CPU step -13%), compile time grows with depth
                              # (docs/performance.md)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # data-parallel size
    tensor: int = 1  # tensor-parallel size (heads, MLP, vocab)
    pipeline: int = 1  # pipeline stages (docs/pipeline.md)
    context: int = 1  # context parallelism: each sequence split over this many devices
                      # (docs/context.md); data * tensor * pipeline * context = the device count
    fsdp: bool = False  # also shard parameters and optimizer state over `data` (ZeRO-3 style)
    # Topology (docs/multihost.md): which axes span hosts. `tensor` never does; a host is a
    # process (or, with fewer processes than hosts, a block of one process's devices).
    dcn_data: int = 0  # hosts the data axis spans; 0: every process is a host, data spans all
    dcn_pipeline: int = 1  # hosts the pipeline axis spans (only when data cannot cover them)
    xla_profile: str = "none"  # XLA flags set before JAX starts: none | overlap (runtime/xla_flags.py)

    @property
    def size(self) -> int:
        """The device count the mesh needs."""
        return self.data * self.tensor * self.pipeline * self.context


@dataclasses.dataclass(frozen=True)
class DataConfig:
    seq_len: int = 256  # tokens per row
    global_batch: int = 8  # rows per step across all devices (batch.ladder's starting size)
    source: str = "stdlib"  # stdlib (the Python standard library's .py files) | prepared |
                            # vl_corpus (stdlib text + the cpu_vl images and clips)
    path: str = ""  # prepared: the `dsjax.data.prepare` directory; stdlib: corpus cache
                    # ("" = WORKDIR/data/stdlib)
    tokenizer: str = "byte"  # byte-level tokens (a prepared split records its own tokenizer)
    eval_batches: int = 8  # held-out batches per evaluation
    prefetch: int = 2  # batches prefetched by Grain
    # Mixing and media (docs/multimodal.md).
    mix: str = ""  # "name:weight,..." prepared sources under data.path/NAME, sampled by weight
                   # (e.g. "text:0.5,image:0.3,video:0.2"); "" = data.path alone
    video_fps: float = 2.0  # video frames sampled per second of video (at prepare time)
    max_frames: int = 4  # video frames kept per clip, each one image slot


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps
    log_every: int = 10  # steps between progress lines / metrics.jsonl records
    seed: int = 0  # init and data-order seed
    compute_dtype: str = "float32"  # float32 | bfloat16 | float16 | fp8 (master weights float32)
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    sample_prompt: str = "def "  # prompt of the sample printed after training
    sample_tokens: int = 64  # tokens of that sample (0: no sample)
    # Sampling of that sample and of `python -m dsjax.generate` (docs/posttraining.md): greedy
    # decoding of a small model loops, so the default samples.
    sample_temperature: float = 0.8  # softmax temperature; 0 = greedy (argmax)
    sample_top_p: float = 0.9  # nucleus: the smallest set of tokens with this much mass; 1 = off
    sample_top_k: int = 0  # only the k most likely tokens; 0 = off
    task: str = "pretrain"  # pretrain | sft (completion-only loss on a chat split) | dpo
                            # (preference pairs against the frozen starting policy)
    dpo_beta: float = 0.1  # dpo: the KL penalty strength beta of the DPO loss
    nonfinite: str = "stop"  # non-finite loss/gradient: stop, or skip the step (float16 always
                             # skips and halves its loss scale)
    max_consecutive_skips: int = 10  # then stop anyway
    loss_scale_init: float = 32768.0  # float16 dynamic loss scale: start
    loss_scale_growth: int = 2000  # float16: double the scale after this many finite steps
    trainable: str = "all"  # parameter groups that learn: all, or a comma list of vision,
                            # projector, lm (the others and their optimizer state stay as they
                            # are; docs/multimodal.md)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | onebit_adam
    lr: float = 3e-4  # peak learning rate (at batch.reference_batch)
    warmup_steps: int = 100  # linear warmup steps, then cosine decay
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay (not on norms)
    clip_norm: float = 1.0  # global-norm gradient clipping (0 = off)
    # 1-bit Adam only (name = "onebit_adam"; Tang et al. 2021, DeepSpeed's OnebitAdam):
    freeze_step: int = 0  # exact Adam steps before v freezes and compression starts (>= 1;
                          # configs set ~20% of train.steps)
    bucket_mb: float = 0.0  # MiB of momentum per compressed all-reduce; 0: one per tensor
    bias_correction: bool = False  # Adam's bias correction (DeepSpeed: off)
    error_feedback: bool = True  # carry each step's compression error into the next
    compress: str = "update"  # what the 1-bit all-reduce carries: update (m / sqrt(v)) | momentum
    refresh_every: int = 10  # after the freeze every N-th step is exact and updates v (0: never,
                             # DeepSpeed); 10, as every config had: docs/onebit.md measures
                             # +8.2% (0) vs +0.5% (10) over AdamW's held-out loss on cpu_tiny
    refresh_catchup: bool = True  # a refresh weighs g^2 as the N steps since the last (1 - b2^N)
    update_bound: bool = True  # after the freeze clip |m / sqrt(v)| to exact Adam's bound
    hierarchical: bool = False  # exact mean inside a host, 1-bit across hosts (mesh.dcn_data)


@dataclasses.dataclass(frozen=True)
class FP8Config:
    recipe: str = "current"  # current | delayed | rowwise (used when train.compute_dtype = fp8)
    history_len: int = 1024  # delayed: amax history length
    margin: float = 0.0  # delayed: scale headroom, in powers of two
    matmuls: str = "q,k,v,o,gate,up,down"  # projections that run as fp8 GEMMs
    keep_first_layers: int = 0  # the first N decoder layers stay in other_dtype
    keep_last_layers: int = 0  # the last N decoder layers stay in other_dtype
    other_dtype: str = "bfloat16"  # everything not in fp8 (embedding, head, attention core)
    layers: str = ""  # per-layer map, one code per matmul: 8 fp8, o other_dtype, f float32, e.g.
                      # "8888888,8888oo8" (layer_map.py); "" = matmuls in every layer but keep_*
    select: str = "policy"  # policy (the map above, fixed) | auto (chosen per layer and matmul
                            # from measured error, revisited: docs/precision.md)
    max_rel_error: float = 0.12  # auto: fp8 only where the output's and the weight gradient's
                                 # relative error are both under this (e4m3/e5m2 give ~0.04/0.06)
    max_underflow: float = 0.05  # auto: fp8 only where at most this share of the input's
                                 # values falls below e4m3's normal range once scaled: what
                                 # outliers do to the rest (docs/precision.md)
    probe_every: int = 200  # auto: steps between probes (the first runs before step 1)
    probe_rows: int = 8  # auto: rows of the step's first micro-batch the probe measures (0: all)
    hysteresis: int = 2  # auto: probes in a row under the bounds before a matmul returns to fp8
    spike_factor: float = 4.0  # auto: a layer whose gradient norm exceeds this x its median of
                               # the last 16 steps leaves fp8 at once (0: never)
    loss_spike: float = 1.5  # auto: a loss above this x its median of the last 16 steps takes the
                             # layer whose gradient norm rose most out of fp8 at once (0: never)
    test_outlier_layer: int = -1  # test hook: this layer's MLP input gets a 1e3 outlier channel

    @property
    def matmul_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.matmuls.split(",") if m.strip())


@dataclasses.dataclass(frozen=True)
class RematConfig:
    policy: str = "none"  # see dsjax/remat.py; "auto" picks one under memory_budget_gb
    layers: str = "all"   # all | every_N | one policy per layer, comma-separated
    memory_budget_gb: float = 0.0  # "auto" only: per-device budget for temporaries (0 = 90% of
                                   # the device's memory where it reports it)


PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
# The schedules that run `pipeline.repeats` layer chunks per stage, and the ones that compute
# their own backward (docs/pipeline.md).
INTERLEAVED_SCHEDULES = ("circular", "interleaved_1f1b")
HAND_BACKWARD_SCHEDULES = ("1f1b", "interleaved_1f1b")


def chunks_per_stage(schedule: str, repeats: int) -> int:
    """Layer chunks each pipeline stage runs: `pipeline.repeats` if the schedule interleaves."""
    return repeats if schedule in INTERLEAVED_SCHEDULES else 1


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    # dsjax/pipeline/; used when mesh.pipeline > 1 (docs/pipeline.md).
    schedule: str = "1f1b"  # one of PIPELINE_SCHEDULES; 1f1b, as every pipelined config had:
                            # activation memory flat in the microbatch count (every schedule
                            # takes float16: 1f1b's backward starts from the loss scale)
    microbatches: int = 1  # per step; a multiple of mesh.pipeline
    repeats: int = 1  # circular, interleaved_1f1b: layer chunks per stage; 1 for the others


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    # Dynamic batch size (dsjax/batching/, docs/batching.md).
    policy: str = "fixed"  # fixed | ramp | adaptive
    ladder: str = ""  # allowed global batch sizes, comma-separated ("" = data.global_batch only)
    reference_batch: int = 0  # the global batch optim.lr is tuned for (0 = data.global_batch)
    lr_scaling: str = "sqrt"  # lr x (batch / reference_batch) ** p: none p=0, linear 1, sqrt 1/2
    micro_batch: int = 0  # rows per data-parallel replica per micro-step (0 = largest that fits)
    mem_fraction: float = 0.9  # memory budget as a fraction of device memory (micro-batch choice,
                               # adaptive's threshold)
    device_memory_gb: float = 0.0  # per-device memory (0 = the device's own limit; none on CPU)
    ramp: str = ""  # ramp: "tokens:batch,..." points, linear between, snapped down to the ladder
    grow: float = 1.5  # adaptive: grow factor (snapped down to the ladder, at least one rung)
    shrink: float = 0.8  # adaptive: shrink factor (snapped down to the ladder, at least one rung)
    target_step_ms: float = 0.0  # adaptive: grow only while steps are faster (0 = no time rule)
    patience: int = 3  # adaptive: agreeing readings before a change; ramp: steps of lookahead
    cooldown: int = 10  # adaptive: steps after a change before the next one can happen

    def sizes(self, global_batch: int) -> tuple[int, ...]:
        """The ladder, ascending ("" = just `global_batch`). ValueError if unparsable."""
        sizes = [int(s) for s in self.ladder.split(",") if s.strip()]
        return tuple(sorted(set(sizes))) if sizes else (global_batch,)

    @property
    def ramp_points(self) -> tuple[tuple[float, int], ...]:
        """((tokens seen, batch), ...) from `ramp`. ValueError if unparsable."""
        points = []
        for item in (s.strip() for s in self.ramp.split(",")):
            if item:
                tokens, batch = item.split(":")
                points.append((float(tokens), int(batch)))
        return tuple(points)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0: only at the end)
    keep: int = 3  # checkpoints kept
    async_save: bool = True  # save in the background
    init_from: str = ""  # an Orbax checkpoint dir (e.g. from `dsjax.convert`) to start a fresh run from


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    peak_flops_per_device: float = 0.0  # 0: look up the device kind, or measure on CPU
    tensorboard: bool = True  # write tensorboard/ event files
    profile_every: int = 0  # trace one step every N steps for the communication share (0 = off)
    cost_per_gpu_hour: float = 0.0  # price of one device-hour: records cost_per_mtok (0 = off)


VISION_TOWERS = ("none", "siglip")
PROJECTORS = ("mlp", "downsample_mlp")  # DeepSeek-VL's aligner | VL2's downsample_mlp_gelu
TRAINABLE_GROUPS = ("vision", "projector", "lm")


def view_side(image_size: int, patch_size: int, projector: str) -> int:
    """Feature rows per side of one view (an image, a video frame or a tile) after the projector:
    its patches, or with downsample_mlp its 2 x 2 groups of patches (an odd grid padded, as
    DeepSeek-VL2 does)."""
    side = image_size // patch_size
    return side if projector == "mlp" else -(-side // 2)


def tokens_per_image(image_size: int, patch_size: int, projector: str) -> int:
    """Decoder positions one view takes without tiling (the square of `view_side`)."""
    return view_side(image_size, patch_size, projector) ** 2


def global_view_tokens(side: int, tiling: bool) -> int:
    """Decoder positions of a global view (a video frame's only view) of `side` x `side` feature
    rows: with DeepSeek-VL2 tiling each row ends in the row-newline embedding."""
    return side * (side + 1) if tiling else side * side


def trainable_groups(trainable: str) -> tuple[str, ...]:
    """`train.trainable` -> the parameter groups that learn (TRAINABLE_GROUPS order)."""
    names = [s.strip() for s in trainable.split(",") if s.strip()]
    if names == ["all"]:
        return TRAINABLE_GROUPS
    if not names:
        raise ConfigError("train.trainable: names no parameter group; use 'all' or a comma "
                          f"list of {', '.join(TRAINABLE_GROUPS)}")
    for name in names:
        if name not in TRAINABLE_GROUPS:
            raise ConfigError(unknown_choice("parameter group", name,
                                             TRAINABLE_GROUPS + ("all (alone)",),
                                             "train.trainable"))
    return tuple(g for g in TRAINABLE_GROUPS if g in names)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    # A vision tower and projector in front of the decoder (DeepSeek-VL; docs/multimodal.md).
    # The defaults are DeepSeek-VL's SigLIP-L/16 at 384 pixels; tower "none" is a text model.
    tower: str = "none"  # none | siglip
    image_size: int = 384  # pixels per image side (media are resized to it when prepared)
    patch_size: int = 16  # pixels per patch side: (image_size / patch_size)^2 patches per image
    hidden_size: int = 1024  # tower width
    num_layers: int = 24  # tower blocks (scanned)
    num_heads: int = 16  # tower attention heads
    mlp_dim: int = 4096  # tower MLP hidden width
    norm_eps: float = 1e-6  # tower LayerNorm epsilon
    projector: str = "mlp"  # mlp (DeepSeek-VL: Linear, GELU, Linear) | downsample_mlp
                            # (DeepSeek-VL2: 2x2 pixel-unshuffle, then the MLP; 4x fewer tokens;
                            # an odd patch grid is zero-padded)
    max_images: int = 4  # view slots per row: images and video frames a row may hold (with
                         # tiling, each global view and each tile takes a slot)
    # DeepSeek-VL2's dynamic tiling: a global view plus up to max_tiles local tiles per image,
    # on the best-fitting grid, with learned row-newline and view-separator embeddings. The
    # split must be prepared with the same --max_tiles (docs/multimodal.md, "Tiling").
    tiling: bool = False
    max_tiles: int = 9  # local tiles per image at most (VL2: 9, grids up to 3 x 3)
    # The placeholder and frame-separator ids: `python -m dsjax.data.prepare` gives them the
    # first ids after the text tokenizer's (byte: 257, 258) and records them in the split; a
    # split whose ids differ from these is refused.
    image_token_id: int = 257  # the placeholder each image feature row replaces
    frame_token_id: int = 258  # the separator between video frames

    @property
    def enabled(self) -> bool:
        return self.tower != "none"


@dataclasses.dataclass(frozen=True)
class PosttrainConfig:
    # A staged recipe (dsjax/posttrain): each stage a run of its own under WORKDIR/<stage>,
    # started from the previous stage's weights, with exact match on held-out chat prompts
    # before SFT, after SFT and after DPO. "" = one run of train.task.
    recipe: str = ""  # "" | pretrain,sft,dpo (config/stages.py)
    start_from: str = ""  # a pretrained run of this model to skip the pretrain stage with, used
                          # when it holds a checkpoint (e.g. runs/cpu_tiny); "" = always pretrain
    pretrain_steps: int = 100  # pretrain stage: steps on data.source (the model's first text)
    sft_steps: int = 300  # sft stage: steps on the built-in arithmetic chat task
    sft_lr: float = 1e-3  # sft stage: peak learning rate
    dpo_steps: int = 60  # dpo stage: steps on its preference pairs
    dpo_lr: float = 1e-5  # dpo stage: peak learning rate
    eval_prompts: int = 100  # held-out prompts scored by exact match after each stage


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: ModelConfig
    mesh: MeshConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig
    fp8: FP8Config
    remat: RematConfig
    pipeline: PipelineConfig
    batch: BatchConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    vision: VisionConfig
    posttrain: PosttrainConfig
    # auto: the mesh, schedule, recomputation and micro-batch come from the planner, for the
    # devices this run has (launch.py; docs/planner.md); off: from the sections above
    plan: str = "off"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# section name -> its dataclass, in Config's order
SECTIONS: dict[str, type] = {key: cls for key, cls in typing.get_type_hints(Config).items()
                             if key not in ("name", "plan")}
PLAN_MODES = ("off", "auto")
