"""Config: an `ml_collections.ConfigDict` in, frozen and validated dataclasses out.

The one idea: every check that can run before JAX touches a device runs here, and every failure is
a `ConfigError` whose message starts with the dotted name of the offending field. Checks that need
the device count live in `sharding.py` but raise the same error type.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any

import ml_collections

from dsjax import remat
from dsjax.runtime import xla_flags
from dsjax.errors import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "fp8")
FP8_RECIPES = ("current", "delayed", "rowwise")
FP8_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
NONFINITE_POLICIES = ("stop", "skip")
OPTIMIZERS = ("adamw", "onebit_adam")
ONEBIT_COMPRESS = ("update", "momentum")  # 1-bit Adam: m / (sqrt(v) + eps), or m (DeepSpeed)
DATA_SOURCES = ("stdlib", "prepared")
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")
BATCH_POLICIES = ("fixed", "ramp", "adaptive")
LR_SCALINGS = ("none", "linear", "sqrt")
ATTENTION_KINDS = ("mha", "mla")
ROPE_SCALINGS = ("none", "yarn")
MOE_SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    vocab_size: int
    head_dim: int = 0  # 0 means hidden_size // num_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
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
    capacity_factor: float = 0.0  # MoE: slots per expert = factor * tokens * k / E; 0 = dropless
    num_mtp_layers: int = 0  # multi-token prediction modules (V3 §2.2); 0 = off
    mtp_loss_weight: float = 0.3  # MTP: weight of the mean MTP loss in the training loss

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    fsdp: bool = False  # also shard parameters and optimizer state over `data` (ZeRO-3 style)
    # Topology (docs/multihost.md): which axes span hosts. `tensor` never does; a host is a
    # process (or, with fewer processes than hosts, a block of one process's devices).
    dcn_data: int = 0  # hosts the data axis spans; 0: every process is a host, data spans all
    dcn_pipeline: int = 1  # hosts the pipeline axis spans (only when data cannot cover them)
    xla_profile: str = "none"  # XLA flags set before JAX starts: none | overlap (runtime/xla_flags.py)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    seq_len: int = 256
    global_batch: int = 8
    source: str = "stdlib"
    path: str = ""
    tokenizer: str = "byte"
    eval_batches: int = 8
    prefetch: int = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    log_every: int = 10
    seed: int = 0
    compute_dtype: str = "float32"
    eval_every: int = 0
    sample_prompt: str = "def "
    sample_tokens: int = 64
    nonfinite: str = "stop"  # non-finite loss/gradient: stop, or skip the step (float16 always
                             # skips and halves its loss scale)
    max_consecutive_skips: int = 10  # then stop anyway
    loss_scale_init: float = 32768.0  # float16 dynamic loss scale: start
    loss_scale_growth: int = 2000  # float16: double the scale after this many finite steps


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # 1-bit Adam only (name = "onebit_adam"; Tang et al. 2021, DeepSpeed's OnebitAdam):
    freeze_step: int = 0  # exact Adam steps before v freezes and compression starts (>= 1)
    bucket_mb: float = 0.0  # MiB of momentum per compressed all-reduce; 0: one per tensor
    bias_correction: bool = False  # Adam's bias correction (DeepSpeed: off)
    error_feedback: bool = True  # carry each step's compression error into the next
    compress: str = "update"  # what the 1-bit all-reduce carries: update (m / sqrt(v)) | momentum
    refresh_every: int = 0  # after the freeze every N-th step is exact and updates v (0: never)
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

    @property
    def matmul_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.matmuls.split(",") if m.strip())


@dataclasses.dataclass(frozen=True)
class RematConfig:
    policy: str = "none"  # see dsjax/remat.py; "auto" picks one under memory_budget_gb
    layers: str = "all"   # all | every_N | one policy per layer, comma-separated
    memory_budget_gb: float = 0.0  # "auto" only: per-device budget for temporaries (0 = 90% of
                                   # the device's memory where it reports it)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    # dsjax/pipeline.py; used when mesh.pipeline > 1 (docs/pipeline.md).
    schedule: str = "gpipe"  # gpipe | circular | 1f1b
    microbatches: int = 1  # per step; a multiple of mesh.pipeline
    repeats: int = 1  # circular: layer chunks per stage (interleaved); 1 for gpipe and 1f1b


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    # Owned by issue #8 (dsjax/batching.py, docs/batching.md).
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
    every: int = 0  # 0: only at the end
    keep: int = 3
    async_save: bool = True
    init_from: str = ""  # an Orbax checkpoint dir (e.g. from `dsjax.convert`) to start a fresh run from


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    peak_flops_per_device: float = 0.0  # 0: look up the device kind, or measure on CPU
    tensorboard: bool = True
    profile_every: int = 0  # trace one step every N steps for the communication share (0 = off)


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_SECTIONS = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "fp8": FP8Config,
    "remat": RematConfig,
    "pipeline": PipelineConfig,
    "batch": BatchConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    raw = dict(raw.to_dict() if isinstance(raw, ml_collections.ConfigDict) else raw)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown config key; valid keys of `{name}` are "
                          f"{', '.join(sorted(fields))}")
    kwargs = {}
    for key, field in fields.items():
        if key not in raw:
            if field.default is dataclasses.MISSING:
                raise ConfigError(f"{name}.{key}: required but missing")
            continue
        value = raw[key]
        expected = field.default if field.default is not dataclasses.MISSING else None
        kwargs[key] = _coerce(f"{name}.{key}", value, field.type, expected)
    return cls(**kwargs)


def _coerce(path: str, value: Any, type_name: Any, default: Any) -> Any:
    # Field annotations are strings under `from __future__ import annotations`.
    kind = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", "")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _positive(path: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{path}: must be > 0, got {value}")


def _non_negative(path: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{path}: must be >= 0, got {value}")


def _validate_deepseek(m: ModelConfig) -> None:
    """MLA, MoE and MTP fields (DeepSeek-V2/V3); all off by default."""
    if m.attention not in ATTENTION_KINDS:
        raise ConfigError(f"model.attention: unknown kind {m.attention!r}; valid: "
                          f"{', '.join(ATTENTION_KINDS)}")
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "rope_original_max_len", "n_routed_experts", "n_shared_experts",
                "moe_intermediate_size", "num_experts_per_tok", "first_k_dense_replace",
                "num_mtp_layers"):
        _non_negative(f"model.{key}", getattr(m, key))
    if m.attention == "mla":
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            _positive(f"model.{key}", getattr(m, key))
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim: rotary embeddings need an even dim, got "
                              f"{m.qk_rope_head_dim}")
        if m.num_kv_heads != m.num_heads:
            raise ConfigError(f"model.num_kv_heads: mla expands its latent to every head; set it "
                              f"to num_heads {m.num_heads}, got {m.num_kv_heads}")
    if m.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"model.rope_scaling: unknown scaling {m.rope_scaling!r}; valid: "
                          f"{', '.join(ROPE_SCALINGS)}")
    if m.rope_scaling == "yarn":
        if m.attention != "mla":
            raise ConfigError("model.rope_scaling: yarn is implemented for attention='mla' only")
        _positive("model.rope_factor", m.rope_factor)
        _positive("model.rope_original_max_len", m.rope_original_max_len)
        _positive("model.rope_beta_fast", m.rope_beta_fast)
        _positive("model.rope_beta_slow", m.rope_beta_slow)
    _non_negative("model.rope_mscale", m.rope_mscale)
    _non_negative("model.rope_mscale_all_dim", m.rope_mscale_all_dim)
    if m.scoring not in MOE_SCORINGS:
        raise ConfigError(f"model.scoring: unknown router scoring {m.scoring!r}; valid: "
                          f"{', '.join(MOE_SCORINGS)}")
    _positive("model.routed_scaling_factor", m.routed_scaling_factor)
    _non_negative("model.aux_loss_alpha", m.aux_loss_alpha)
    _non_negative("model.bias_update_speed", m.bias_update_speed)
    _non_negative("model.capacity_factor", m.capacity_factor)
    _non_negative("model.mtp_loss_weight", m.mtp_loss_weight)
    if m.n_routed_experts:
        _positive("model.moe_intermediate_size", m.moe_intermediate_size)
        _positive("model.num_experts_per_tok", m.num_experts_per_tok)
        _positive("model.n_group", m.n_group)
        _positive("model.topk_group", m.topk_group)
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
    elif m.expert_parallel:
        raise ConfigError("model.expert_parallel: needs routed experts (model.n_routed_experts)")


def _validate_batch(cfg: Config) -> None:
    """The `batch` section (dynamic batch size, dsjax/batching.py)."""
    b, g, data = cfg.batch, cfg.data.global_batch, cfg.mesh.data
    if b.policy not in BATCH_POLICIES:
        raise ConfigError(f"batch.policy: unknown policy {b.policy!r}; valid: "
                          f"{', '.join(BATCH_POLICIES)}")
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
    if b.lr_scaling not in LR_SCALINGS:
        raise ConfigError(f"batch.lr_scaling: unknown rule {b.lr_scaling!r}; valid: "
                          f"{', '.join(LR_SCALINGS)}")
    _non_negative("batch.reference_batch", b.reference_batch)
    _non_negative("batch.micro_batch", b.micro_batch)
    if b.micro_batch:
        bad = [s for s in sizes if (s // data) % b.micro_batch]
        if bad:
            raise ConfigError(f"batch.micro_batch: {b.micro_batch} rows per data-parallel "
                              f"replica must divide every ladder size / mesh.data; "
                              f"{bad[0]} / {data} = {bad[0] // data} is not divisible")
    if not 0 < b.mem_fraction <= 1:
        raise ConfigError(f"batch.mem_fraction: must be in (0, 1], got {b.mem_fraction}")
    _non_negative("batch.device_memory_gb", b.device_memory_gb)
    if b.grow <= 1:
        raise ConfigError(f"batch.grow: must be > 1, got {b.grow}")
    if not 0 < b.shrink < 1:
        raise ConfigError(f"batch.shrink: must be in (0, 1), got {b.shrink}")
    _non_negative("batch.target_step_ms", b.target_step_ms)
    _positive("batch.patience", b.patience)
    _non_negative("batch.cooldown", b.cooldown)
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


def _validate_pipeline(cfg: Config) -> None:
    """The pipeline section, and what must hold for the layers to split into stages."""
    p, S = cfg.pipeline, cfg.mesh.pipeline
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline.schedule: unknown schedule {p.schedule!r}; valid: "
                          f"{', '.join(PIPELINE_SCHEDULES)}")
    _positive("pipeline.microbatches", p.microbatches)
    _positive("pipeline.repeats", p.repeats)
    if p.repeats > 1 and p.schedule != "circular":
        raise ConfigError(f"pipeline.repeats: only the circular schedule interleaves layer "
                          f"chunks; got repeats={p.repeats} with schedule {p.schedule!r}")
    if S == 1:
        return
    m = cfg.model
    # A MoE model's dense first blocks run on stage 0 before the stages (dsjax/pipeline.py).
    k = m.first_k_dense_replace if m.is_moe else 0
    L, R = m.num_layers - k, p.repeats
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
        raise ConfigError(f"batch.micro_batch: {cfg.batch.micro_batch} rows per replica do not "
                          f"split into pipeline.microbatches {p.microbatches}")
    # Every stage runs one program, so every chunk of layers must make the same choices.
    chunk = L // (S * R)
    if cfg.remat.policy != "auto":
        per_layer = remat.layer_policies(cfg.remat.policy, cfg.remat.layers, L + k)[k:]
        if per_layer != per_layer[:chunk] * (S * R):
            raise ConfigError(f"remat.layers: the per-layer pattern {cfg.remat.layers!r} differs "
                              f"between pipeline chunks of {chunk} layers; use a period that "
                              f"divides {chunk}")
    if cfg.train.compute_dtype == "fp8":
        for key in ("keep_first_layers", "keep_last_layers"):
            if getattr(cfg.fp8, key):
                raise ConfigError(f"fp8.{key}: must be 0 with mesh.pipeline > 1 (every stage "
                                  f"runs the same program, so no layer can leave fp8)")
        if cfg.fp8.recipe == "delayed" and p.schedule != "1f1b":
            # jax.grad would sum each stage's amax observations over the ticks, not max them.
            raise ConfigError(f"fp8.recipe: 'delayed' needs pipeline.schedule '1f1b' (which "
                              f"max-combines its amax observations itself), got "
                              f"{p.schedule!r}; or use 'current' / 'rowwise'")
    if cfg.mesh.fsdp:
        raise ConfigError("mesh.fsdp: not with mesh.pipeline > 1 yet (XLA's SPMD partitioner "
                          "fails on data-sharded weights inside the pipeline's shard_map); the "
                          "stages already split the layer weights")
    if cfg.train.compute_dtype == "float16" and p.schedule == "1f1b":
        raise ConfigError("train.compute_dtype: float16 loss scaling does not reach inside the "
                          "1f1b schedule's own backward; use bfloat16, or pipeline.schedule "
                          "gpipe/circular")
    if k and cfg.train.compute_dtype == "fp8" and cfg.fp8.recipe == "delayed":
        raise ConfigError(f"fp8.recipe: 'delayed' keeps no amax state for the dense prefix blocks "
                          f"that run before the pipeline stages (model.first_k_dense_replace = "
                          f"{k}); use 'current' or 'rowwise', or mesh.pipeline = 1")
    if m.is_moe and not m.expert_parallel and cfg.mesh.data > 1 and cfg.mesh.tensor > 1:
        raise ConfigError("model.expert_parallel: the dense fallback (experts sharded over "
                          "`data` under GSPMD) fails XLA's SPMD partitioner inside the "
                          "pipeline's shard_map when mesh.tensor > 1; set expert_parallel=True")


def validate(cfg: Config) -> None:
    """Device-independent checks. Mesh-vs-devices checks are in `sharding.validate_mesh`."""
    m = cfg.model
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        _positive(f"model.{key}", getattr(m, key))
    _non_negative("model.head_dim", m.head_dim)
    if m.head_dim == 0 and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.num_heads: hidden_size {m.hidden_size} is not divisible by "
                          f"num_heads {m.num_heads}; set model.head_dim explicitly")
    if m.resolved_head_dim % 2:
        raise ConfigError(f"model.head_dim: rotary embeddings need an even head dim, got "
                          f"{m.resolved_head_dim}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads: num_heads {m.num_heads} is not a multiple of "
                          f"num_kv_heads {m.num_kv_heads}")
    _positive("model.rope_theta", m.rope_theta)
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _validate_deepseek(m)

    for key in ("data", "tensor", "pipeline", "dcn_pipeline"):
        _positive(f"mesh.{key}", getattr(cfg.mesh, key))
    _non_negative("mesh.dcn_data", cfg.mesh.dcn_data)
    for key in ("data", "pipeline"):
        hosts = getattr(cfg.mesh, f"dcn_{key}")
        if hosts and getattr(cfg.mesh, key) % hosts:
            raise ConfigError(f"mesh.dcn_{key}: mesh.{key} {getattr(cfg.mesh, key)} must split "
                              f"evenly over the {hosts} hosts it spans")
    if cfg.mesh.xla_profile not in xla_flags.PROFILES:
        raise ConfigError(f"mesh.xla_profile: unknown profile {cfg.mesh.xla_profile!r}; valid: "
                          f"{', '.join(xla_flags.PROFILES)}")

    d = cfg.data
    _positive("data.seq_len", d.seq_len)
    _positive("data.global_batch", d.global_batch)
    _positive("data.eval_batches", d.eval_batches)
    _non_negative("data.prefetch", d.prefetch)
    if d.source not in DATA_SOURCES:
        raise ConfigError(f"data.source: unknown source {d.source!r}; valid: {', '.join(DATA_SOURCES)}")
    if d.source == "prepared" and not d.path:
        raise ConfigError("data.path: required when data.source='prepared' (a directory written by "
                          "`python -m dsjax.data.prepare`)")
    if m.expert_parallel and m.n_routed_experts % cfg.mesh.data:
        raise ConfigError(f"model.n_routed_experts: {m.n_routed_experts} experts cannot be split "
                          f"over mesh.data {cfg.mesh.data} (model.expert_parallel)")
    if d.global_batch % cfg.mesh.data:
        raise ConfigError(f"data.global_batch: {d.global_batch} is not divisible by mesh.data "
                          f"{cfg.mesh.data}")

    t = cfg.train
    _positive("train.steps", t.steps)
    _positive("train.log_every", t.log_every)
    _non_negative("train.eval_every", t.eval_every)
    _non_negative("train.sample_tokens", t.sample_tokens)
    if t.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"train.nonfinite: unknown policy {t.nonfinite!r}; valid: "
                          f"{', '.join(NONFINITE_POLICIES)}")
    _positive("train.max_consecutive_skips", t.max_consecutive_skips)
    _positive("train.loss_scale_init", t.loss_scale_init)
    _positive("train.loss_scale_growth", t.loss_scale_growth)
    if t.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"train.compute_dtype: unknown dtype {t.compute_dtype!r}; valid: "
                          f"{', '.join(COMPUTE_DTYPES)}")

    f = cfg.fp8
    if f.recipe not in FP8_RECIPES:
        raise ConfigError(f"fp8.recipe: unknown recipe {f.recipe!r}; valid: {', '.join(FP8_RECIPES)}")
    _positive("fp8.history_len", f.history_len)
    unknown = [n for n in f.matmul_names if n not in FP8_MATMULS]
    if unknown:
        raise ConfigError(f"fp8.matmuls: unknown matmul {unknown[0]!r}; valid: "
                          f"{', '.join(FP8_MATMULS)}")
    _non_negative("fp8.keep_first_layers", f.keep_first_layers)
    _non_negative("fp8.keep_last_layers", f.keep_last_layers)
    if f.keep_first_layers + f.keep_last_layers > m.num_layers:
        raise ConfigError(f"fp8.keep_first_layers: keep_first_layers + keep_last_layers = "
                          f"{f.keep_first_layers + f.keep_last_layers} exceeds model.num_layers "
                          f"{m.num_layers}")
    if f.other_dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"fp8.other_dtype: must be float32, bfloat16 or float16, got "
                          f"{f.other_dtype!r}")
    expert_fp8 = [n for n in f.matmul_names if n in ("gate", "up", "down")]
    if (m.is_moe and t.compute_dtype == "fp8" and f.recipe == "delayed" and expert_fp8
            and m.first_k_dense_replace < m.num_layers):
        # Delayed scaling keeps one amax history per matmul; experts scale per expert.
        raise ConfigError(f"fp8.recipe: 'delayed' does not cover MoE experts (fp8.matmuls has "
                          f"{','.join(expert_fp8)}, which would run in fp8.other_dtype in the "
                          f"MoE blocks); use 'current' or 'rowwise', or drop gate,up,down from "
                          f"fp8.matmuls")

    o = cfg.optim
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer {o.name!r}; valid: {', '.join(OPTIMIZERS)}")
    _positive("optim.lr", o.lr)
    _non_negative("optim.warmup_steps", o.warmup_steps)
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
    for key in ("b1", "b2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optim.{key}: must be in [0, 1), got {getattr(o, key)}")
    _positive("optim.eps", o.eps)
    _non_negative("optim.weight_decay", o.weight_decay)
    _non_negative("optim.clip_norm", o.clip_norm)
    _non_negative("optim.bucket_mb", o.bucket_mb)
    if o.compress not in ONEBIT_COMPRESS:
        raise ConfigError(f"optim.compress: unknown {o.compress!r}; valid: "
                          f"{', '.join(ONEBIT_COMPRESS)}")
    if o.refresh_every < 0 or o.refresh_every == 1:
        raise ConfigError(f"optim.refresh_every: 0 (v stays frozen) or >= 2 (every N-th step after "
                          f"the freeze is exact Adam), got {o.refresh_every}")
    if o.hierarchical and o.name != "onebit_adam":
        raise ConfigError(f"optim.hierarchical: only optim.name='onebit_adam' has a hierarchical "
                          f"reduction; got optim.name={o.name!r}")
    if o.name == "onebit_adam":
        if not 1 <= o.freeze_step < t.steps:
            raise ConfigError(f"optim.freeze_step: 1-bit Adam needs 1 <= freeze_step < train.steps "
                              f"= {t.steps} (exact Adam steps before compression, e.g. 20% of "
                              f"them), got {o.freeze_step}")
        if o.update_bound and not o.b1 < o.b2 ** 0.5:
            raise ConfigError(f"optim.update_bound: needs b1 < sqrt(b2) (Adam's update has no "
                              f"bound otherwise), got b1={o.b1}, b2={o.b2}; or set "
                              f"optim.update_bound=False")
        if cfg.mesh.fsdp:
            raise ConfigError("mesh.fsdp: optim.name='onebit_adam' needs parameters and optimizer "
                              "state replicated over `data` (each worker compresses its own "
                              "momentum of the whole model); set mesh.fsdp=False")
        if m.n_routed_experts:
            raise ConfigError("model.n_routed_experts: optim.name='onebit_adam' needs every "
                              "parameter replicated over `data`, and experts are sharded over it; "
                              "use optim.name='adamw' for MoE models")

    try:
        if cfg.remat.policy == "auto":
            if cfg.remat.layers != "all":
                raise ConfigError("remat.layers: 'auto' chooses the layer pattern too; leave "
                                  "remat.layers at 'all'")
        else:
            remat.layer_policies(cfg.remat.policy, cfg.remat.layers, m.num_layers)
    except remat.RematError as e:
        raise ConfigError(str(e)) from None
    _non_negative("remat.memory_budget_gb", cfg.remat.memory_budget_gb)
    _validate_pipeline(cfg)
    _validate_batch(cfg)
    _non_negative("checkpoint.every", cfg.checkpoint.every)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    if cfg.checkpoint.init_from and not os.path.isdir(cfg.checkpoint.init_from):
        raise ConfigError(f"checkpoint.init_from: {cfg.checkpoint.init_from!r} is not a directory")
    _non_negative("metrics.peak_flops_per_device", cfg.metrics.peak_flops_per_device)
    _non_negative("metrics.profile_every", cfg.metrics.profile_every)


def from_config_dict(raw: ml_collections.ConfigDict | dict, name: str = "config") -> Config:
    """Turns a ConfigDict (as loaded from `configs/NAME.py`) into a validated `Config`."""
    raw = dict(raw.to_dict() if isinstance(raw, ml_collections.ConfigDict) else raw)
    name = raw.pop("name", name)
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config section; valid sections are "
                          f"{', '.join(sorted(_SECTIONS))}")
    if "model" not in raw:
        raise ConfigError("model: the config has no model section")
    sections = {key: _build_section(key, cls, raw.get(key)) for key, cls in _SECTIONS.items()}
    cfg = Config(name=name, **sections)
    validate(cfg)
    return cfg


def load(path_and_arg: str, overrides: dict[str, Any] | None = None) -> Config:
    """Loads `configs/NAME.py[:ARG]` the way `launch.py --config` does; `overrides` maps dotted keys."""
    path, _, arg = path_and_arg.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such config file {path!r}")
    spec = importlib.util.spec_from_file_location(f"dsjax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg_dict = module.get_config(arg) if arg else module.get_config()
    for dotted, value in (overrides or {}).items():
        node = cfg_dict
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    default_name = os.path.splitext(os.path.basename(path))[0] + (f":{arg}" if arg else "")
    return from_config_dict(cfg_dict, name=cfg_dict.get("name", default_name))


def check_command_line(argv: list[str], default_path: str) -> None:
    """Checks `--config` and every `--config.a.b=v` of a launch.py command line before
    ml_collections parses them (its own errors are tracebacks): the file exists and loads, and
    every overridden key exists. Raises ConfigError naming the flag."""
    path_and_arg, overrides = default_path, []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path_and_arg = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path_and_arg = argv[i + 1]
        elif arg.startswith("--config."):
            overrides.append(arg[len("--config."):].split("=", 1)[0])
    path, _, variant = path_and_arg.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such config file {path!r}")
    spec = importlib.util.spec_from_file_location(f"dsjax_config_check_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        raw = module.get_config(variant) if variant else module.get_config()
    except Exception as e:  # pylint: disable=broad-except  # the user's file; say which
        raise ConfigError(f"--config: {path_and_arg} failed to load: {type(e).__name__}: {e}"
                          ) from None
    for dotted in overrides:
        node, walked = raw, []
        for part in dotted.split("."):
            keys = node.keys() if isinstance(node, (ml_collections.ConfigDict, dict)) else []
            if part not in keys:
                where = ".".join(walked) or "the config"
                raise ConfigError(f"{dotted}: unknown config key (from --config.{dotted}); valid "
                                  f"keys of {where} are {', '.join(sorted(keys))}")
            node, walked = node[part], walked + [part]
