"""The decoder a config describes: compute dtype, fp8 precision policy, per-layer remat."""

from __future__ import annotations

import jax.numpy as jnp

from dsjax import remat
from dsjax.config import Config, layer_map
from dsjax.fp8_policy import Fp8Policy
from dsjax.model.decoder import Transformer
from dsjax.model.vision import VisionSpec

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_model(cfg: Config, layer_policies: tuple[str, ...] | None = None, unroll: bool = False,
               for_eval: bool = False) -> Transformer:
    """The decoder `cfg` describes. `layer_policies`: per-layer remat policy names (default: from
    `cfg.remat`); `unroll`: unroll the layer scan (FLOP counting); `for_eval`: delayed fp8
    scaling evaluates with current scaling (its amax history is training state). An attention
    impl the backend cannot run is a ConfigError here, before anything is allocated."""
    if layer_policies is None:
        layer_policies = remat.layer_policies(cfg.remat.policy, cfg.remat.layers,
                                              cfg.model.num_layers)
    policy = fp8_policy(cfg, for_eval)
    dtype = cfg.train.compute_dtype if policy is None else cfg.fp8.other_dtype
    model = Transformer(cfg.model, dtype=COMPUTE_DTYPES[dtype], layer_policies=layer_policies,
                        scan_unroll=unroll, fp8_policy=policy, vision=vision_spec(cfg),
                        planted_outlier=cfg.fp8.test_outlier_layer)
    model.attention_impl(cfg.data.seq_len)  # an impl this backend cannot run: ConfigError here
    return model


def fp8_policy(cfg: Config, for_eval: bool = False) -> Fp8Policy | None:
    """The precision policy `cfg.fp8` describes for the decoder's layers; None unless
    `train.compute_dtype` is "fp8". `for_eval`: as in `make_model`."""
    if cfg.train.compute_dtype != "fp8":
        return None
    f, L = cfg.fp8, cfg.model.num_layers
    words = layer_map.parse(f.layers, f.matmul_names, L) or layer_map.uniform(
        f.matmul_names, tuple(f.keep_first_layers <= i < L - f.keep_last_layers
                              for i in range(L)))
    return Fp8Policy(
        matmuls=f.matmul_names,
        recipe="current" if for_eval and f.recipe == "delayed" else f.recipe,
        history=f.history_len,
        layers=tuple(layer_map.choice(w, f.matmul_names) for w in words),
        margin=f.margin)


def vision_spec(cfg: Config) -> VisionSpec | None:
    """The image input `cfg.vision` describes (a SigLIP tower and projector); None for a text
    model."""
    v = cfg.vision
    if not v.enabled:
        return None
    return VisionSpec(image_size=v.image_size, patch_size=v.patch_size,
                      hidden_size=v.hidden_size, num_layers=v.num_layers,
                      num_heads=v.num_heads, mlp_dim=v.mlp_dim,
                      image_token_id=v.image_token_id, frame_token_id=v.frame_token_id,
                      projector=v.projector, norm_eps=v.norm_eps, init_std=cfg.model.init_std,
                      tiling=v.tiling)
