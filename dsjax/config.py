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

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "fp8")
FP8_RECIPES = ("current", "delayed", "rowwise")
FP8_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
NONFINITE_POLICIES = ("stop", "skip")
OPTIMIZERS = ("adamw", "onebit_adam")
DATA_SOURCES = ("stdlib", "prepared")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


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

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    fsdp: bool = False  # also shard parameters and optimizer state over `data` (ZeRO-3 style)


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
    # Owned by issue #7 (dsjax/pipeline.py); used when mesh.pipeline > 1.
    schedule: str = "gpipe"  # gpipe | circular | 1f1b
    microbatches: int = 1
    repeats: int = 1  # circular: layer groups per stage


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    # Owned by issue #8 (dsjax/batching.py).
    policy: str = "fixed"  # fixed | ramp | adaptive
    ladder: str = ""  # allowed global batch sizes, comma-separated ("" = data.global_batch only)


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

    for key in ("data", "tensor", "pipeline"):
        _positive(f"mesh.{key}", getattr(cfg.mesh, key))
    if cfg.mesh.pipeline > 1:
        raise ConfigError(f"mesh.pipeline: pipeline parallelism is not implemented yet (issue #7); "
                          f"got {cfg.mesh.pipeline}, use 1")

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
    if o.name == "onebit_adam":
        if not 1 <= o.freeze_step < t.steps:
            raise ConfigError(f"optim.freeze_step: 1-bit Adam needs 1 <= freeze_step < train.steps "
                              f"= {t.steps} (exact Adam steps before compression, e.g. 20% of "
                              f"them), got {o.freeze_step}")
        if cfg.mesh.fsdp:
            raise ConfigError("mesh.fsdp: optim.name='onebit_adam' needs parameters and optimizer "
                              "state replicated over `data` (each worker compresses its own "
                              "momentum of the whole model); set mesh.fsdp=False")

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
