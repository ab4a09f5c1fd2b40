"""The decoder a config describes: compute dtype, fp8 precision policy, per-layer remat."""

from __future__ import annotations

import jax.numpy as jnp

from dsjax import remat
from dsjax.config import Config
from dsjax.model.decoder import Transformer

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_model(cfg: Config, layer_policies: tuple[str, ...] | None = None, unroll: bool = False,
               for_eval: bool = False) -> Transformer:
    """The decoder `cfg` describes. `layer_policies`: per-layer remat policy names (default: from
    `cfg.remat`); `unroll`: unroll the layer scan (FLOP counting); `for_eval`: delayed fp8
    scaling evaluates with current scaling (its amax history is training state)."""
    L = cfg.model.num_layers
    if layer_policies is None:
        layer_policies = remat.layer_policies(cfg.remat.policy, cfg.remat.layers, L)
    if cfg.train.compute_dtype != "fp8":
        return Transformer(cfg.model, dtype=COMPUTE_DTYPES[cfg.train.compute_dtype],
                           layer_policies=layer_policies, scan_unroll=unroll)
    f = cfg.fp8
    fp8_layers = tuple(f.keep_first_layers <= i < L - f.keep_last_layers for i in range(L))
    recipe = "current" if for_eval and f.recipe == "delayed" else f.recipe
    return Transformer(cfg.model, dtype=COMPUTE_DTYPES[f.other_dtype],
                       layer_policies=layer_policies, scan_unroll=unroll,
                       fp8_matmuls=f.matmul_names, fp8_recipe=recipe,
                       fp8_history=f.history_len, fp8_layers=fp8_layers)
