"""Validation of the `fp8` section: the recipe, the projections, the per-layer map, and the
automatic selection's bounds (`fp8.select=auto`, docs/precision.md)."""

from __future__ import annotations

from dsjax.config import layer_map
from dsjax.config.sections import Config
from dsjax.errors import ConfigError, one_of

FP8_RECIPES = ("current", "delayed", "rowwise")
FP8_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
FP8_OTHER_DTYPES = ("float32", "bfloat16", "float16")
FP8_SELECT = ("policy", "auto")


def validate_fp8(cfg: Config) -> None:
    f, L = cfg.fp8, cfg.model.num_layers
    one_of("fp8.recipe", f.recipe, FP8_RECIPES, "recipe")
    one_of("fp8.select", f.select, FP8_SELECT, "mode")
    for key in ("history_len", "max_rel_error", "hysteresis"):
        if getattr(f, key) <= 0:
            raise ConfigError(f"fp8.{key}: must be > 0, got {getattr(f, key)}")
    for key in ("keep_first_layers", "keep_last_layers", "probe_every", "probe_rows", "spike_factor",
                "loss_spike", "max_underflow"):
        if getattr(f, key) < 0:
            raise ConfigError(f"fp8.{key}: must be >= 0, got {getattr(f, key)}")
    for name in f.matmul_names:
        one_of("fp8.matmuls", name, FP8_MATMULS, "matmul")
    if f.keep_first_layers + f.keep_last_layers > L:
        raise ConfigError(f"fp8.keep_first_layers: keep_first_layers + keep_last_layers = "
                          f"{f.keep_first_layers + f.keep_last_layers} exceeds model.num_layers "
                          f"{L}")
    one_of("fp8.other_dtype", f.other_dtype, FP8_OTHER_DTYPES, "dtype")
    layer_map.parse(f.layers, f.matmul_names, L)
    if f.layers.strip() and (f.keep_first_layers or f.keep_last_layers):
        raise ConfigError("fp8.layers: a per-layer map says every layer's precision itself; "
                          "leave fp8.keep_first_layers and keep_last_layers at 0 with it")
    if f.select == "auto":
        if cfg.train.compute_dtype != "fp8":
            raise ConfigError(f"fp8.select: 'auto' chooses among fp8, fp8.other_dtype and "
                              f"float32 per projection; it needs train.compute_dtype='fp8', "
                              f"got {cfg.train.compute_dtype!r}")
        if f.layers.strip():
            raise ConfigError("fp8.layers: fp8.select='auto' writes the per-layer map itself; "
                              "leave fp8.layers empty (or use fp8.select='policy' with it)")
    if f.test_outlier_layer >= L or f.test_outlier_layer < -1:
        raise ConfigError(f"fp8.test_outlier_layer: -1 (off) or a layer in [0, {L}), got "
                          f"{f.test_outlier_layer}")
    if f.test_outlier_layer >= 0 and cfg.mesh.pipeline > 1:
        raise ConfigError("fp8.test_outlier_layer: the planted-outlier test hook runs on "
                          "unpipelined meshes only (mesh.pipeline=1)")
