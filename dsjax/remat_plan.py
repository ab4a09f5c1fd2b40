"""Measured costs of recomputation policies, and the `remat.policy = "auto"` planner.

The one idea: compile, never run. For a policy we compile the forward+backward of the loss on
abstract inputs and read temp memory from `compiled.memory_analysis()` and FLOPs from
`compiled.cost_analysis()`. Both are measured at two small depths and extrapolated linearly to
the real depth, because:
  - `cost_analysis()` counts a scan body once whatever its trip count, so FLOPs are measured on
    *unrolled* stacks of 1 and 2 layer groups (exact) and scaled to num_layers / group;
  - temp memory of a scanned stack grows by the activations saved per group, so it is measured on
    scanned stacks of 2 and 3 groups (a trip count of 1 lets XLA drop the loop) and scaled.
This keeps a 7B-width table to a few layers' compile time and no allocation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dsjax import remat, sharding
from dsjax.config import Config, ConfigError
from dsjax.metrics.flops import compiled_flops
from dsjax.metrics.memory import device_memory_bytes
from dsjax.model.build import make_model
from dsjax.model.batch import BATCH_KEYS, abstract_arrays, media_layout
from dsjax.model.decoder import abstract_params, count_params
from dsjax.model.loss import ModelLoss, loss_fn

# (policy, layers) pairs the planner considers, from no recomputation to full recomputation.
CANDIDATES = (("none", "all"), ("dots", "all"), ("dots_no_batch", "all"),
              ("attention_core", "all"), ("attention_core", "every_2"), ("full", "every_2"),
              ("full", "all"))


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    policy: str
    layers: str
    temp_bytes: int           # predicted per-device temp memory of fwd+bwd at full depth
    flops: float              # predicted fwd+bwd FLOPs (whole program, all devices) at full depth
    per_layer_temp_bytes: float
    per_layer_flops: float


def _with_depth(cfg: Config, policy: str, layers: str, groups: int) -> tuple[Config, int]:
    per_layer = remat.layer_policies(policy, layers, cfg.model.num_layers)
    pattern = remat.group_pattern(per_layer)
    depth = len(pattern) * groups
    layers_spec = layers if layers in ("all",) or layers.startswith("every_") else \
        ",".join(pattern * groups)
    model = dataclasses.replace(cfg.model, num_layers=depth)
    rem = dataclasses.replace(cfg.remat, policy=policy, layers=layers_spec)
    return dataclasses.replace(cfg, model=model, remat=rem), len(pattern)


def compile_grad(cfg: Config, mesh: Mesh, unroll: bool = False) -> Any:
    """Compiles value_and_grad of the training loss for `cfg` on abstract, sharded inputs."""

    rules = sharding.logical_rules(cfg.mesh.fsdp)
    # for_eval: delayed fp8 scaling measured as current scaling (same GEMMs, no amax history).
    model = make_model(cfg, unroll=unroll, for_eval=True)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    boxed = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]
    shardings = sharding.param_shardings(boxed, mesh, rules)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.unbox(boxed), shardings)
    media = media_layout(cfg.vision, cfg.data.seq_len)  # a vision model's pixels
    batch = abstract_arrays({k: sharding.batch_sharding(mesh) for k in BATCH_KEYS + tuple(media)},
                            (cfg.data.global_batch,), cfg.data.seq_len, media)
    grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, ModelLoss(model), b)[0])
    with sharding.activate(mesh, rules):
        return jax.jit(grad_fn, out_shardings=(sharding.replicated(mesh), shardings)).lower(
            params, batch).compile()


def measure(cfg: Config, mesh: Mesh, policy: str, layers: str) -> PolicyCost:
    """Predicted temp memory and FLOPs of one (policy, layers) choice at cfg's full depth."""
    # The result does not depend on cfg.remat (it is overridden below): drop it from the key.
    return _measure(dataclasses.replace(cfg, remat=type(cfg.remat)()), mesh, policy, layers)


@functools.lru_cache(maxsize=64)  # configs and meshes are hashable; compiling is the cost
def _measure(cfg: Config, mesh: Mesh, policy: str, layers: str) -> PolicyCost:
    costs = {}
    for groups in (1, 2):
        small, group = _with_depth(cfg, policy, layers, groups)
        costs[("flops", groups)] = compiled_flops(compile_grad(small, mesh, unroll=True))
    for groups in (2, 3):
        small, group = _with_depth(cfg, policy, layers, groups)
        costs[("temp", groups)] = compile_grad(small, mesh).memory_analysis().temp_size_in_bytes
    n_groups = cfg.model.num_layers / group
    per_group_flops = costs[("flops", 2)] - costs[("flops", 1)]
    flops = costs[("flops", 1)] + (n_groups - 1) * per_group_flops
    per_group_temp = costs[("temp", 3)] - costs[("temp", 2)]
    temp = costs[("temp", 2)] + (n_groups - 2) * per_group_temp
    return PolicyCost(policy, layers, int(temp), flops, per_group_temp / group,
                      per_group_flops / group)


def cost_analysis_flops(cfg: Any, mesh: Any) -> float:
    """XLA's FLOPs for one forward + backward of the training loss of `cfg` (a `Config`) at its
    global batch, summed over `mesh`'s devices.

    The layer stack is unrolled, because `cost_analysis()` counts a scan body once whatever its
    trip count. What it counts is what the program does: every dot as 2*M*N*K, attention over
    the full S x S (the causal mask is a select, not skipped work), elementwise ops, and any
    recomputation `cfg.remat` asks for. A partitioned program is one device's, so it is scaled
    by the device count (work replicated across tensor shards counts once per device).
    """
    return compiled_flops(compile_grad(cfg, mesh, unroll=True)) * mesh.devices.size


def static_bytes_per_device(cfg: Config, mesh: Mesh) -> float:
    """Params + gradients + two Adam moments in float32, over the devices that shard them."""
    n = count_params(abstract_params(cfg.model))
    shards = mesh.shape[sharding.TENSOR] * (sharding.data_size(mesh) if cfg.mesh.fsdp else 1)
    return 16.0 * n / shards


def choose(cfg: Config, mesh: Mesh, log=print, candidates=CANDIDATES
           ) -> tuple[str, str, list[PolicyCost]]:
    """The cheapest (fewest FLOPs) candidate whose predicted memory fits the budget."""
    if cfg.remat.memory_budget_gb:
        budget = cfg.remat.memory_budget_gb * 2 ** 30
    else:
        limit = device_memory_bytes(jax.devices()[0])
        if math.isinf(limit):
            raise ConfigError("remat.memory_budget_gb: required for remat.policy='auto' on "
                              "devices that do not report their memory (e.g. CPU)")
        budget = 0.9 * limit
    static = static_bytes_per_device(cfg, mesh)
    rows = [measure(cfg, mesh, p, l) for p, l in candidates]
    fitting = [r for r in rows if r.temp_bytes + static <= budget]
    if not fitting:
        table = "; ".join(f"{r.policy}/{r.layers}: {(r.temp_bytes + static) / 2**30:.2f} GiB"
                          for r in rows)
        raise ConfigError(f"remat.memory_budget_gb: no policy fits {budget / 2**30:.2f} GiB per "
                          f"device ({table})")
    best = min(fitting, key=lambda r: (r.flops, r.temp_bytes))
    base = next(r for r in rows if r.policy == "none")
    log(f"remat auto: chose policy={best.policy} layers={best.layers}: predicted "
        f"{(best.temp_bytes + static) / 2**30:.3f} GiB per device of a "
        f"{budget / 2**30:.3f} GiB budget (temp {best.temp_bytes / 2**20:.1f} MiB + "
        f"params/grads/Adam {static / 2**20:.1f} MiB), FLOPs x{best.flops / base.flops:.3f} "
        f"vs none")
    return best.policy, best.layers, rows
