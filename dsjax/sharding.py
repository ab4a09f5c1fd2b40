"""The device mesh and THE logical-axis -> mesh-axis rules table.

The one idea: the model names every parameter and block-boundary activation with logical axes
("embed", "heads", "act_batch", ...); this module alone knows the mesh axes ("data", "tensor",
"pipeline") and how logical names map onto them.

Axis types: the mesh is built with `AxisType.Auto` on every axis, deliberately. Current JAX makes
`jax.make_mesh` default to Explicit axes (sharding in the type system), but Flax's logical
partitioning (`nn.with_logical_partitioning`, `nn.with_logical_constraint`) assumes GSPMD-style
Auto axes where XLA propagates shardings from our annotations. Collectives we want to control by
hand (1-bit reduction, pipeline transfers) go inside `jax.shard_map` instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsjax.config import Config, ConfigError

MESH_AXES = ("data", "tensor", "pipeline")

# Logical name -> mesh axis (or None: replicated). Parameters first, then activations.
# Keep it short and free of duplicate keys; `fsdp` adds exactly one override (see `logical_rules`).
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    ("act_batch", "data"),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def logical_rules(fsdp: bool = False) -> tuple[tuple[str, str | None], ...]:
    """The rules table; with `fsdp` the parameters' "embed" axis is also sharded over `data`."""
    if not fsdp:
        return RULES
    return tuple((name, "data" if name == "embed" else axis) for name, axis in RULES)


def validate_mesh(cfg: Config, num_devices: int) -> None:
    """Checks that need the device count; each failure names the field."""
    mesh, m = cfg.mesh, cfg.model
    product = mesh.data * mesh.tensor * mesh.pipeline
    if product != num_devices:
        raise ConfigError(
            f"mesh: data*tensor*pipeline = {mesh.data}*{mesh.tensor}*{mesh.pipeline} = {product} "
            f"must equal the device count {num_devices} (set mesh.data, mesh.tensor, mesh.pipeline)")
    for field, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                         ("model.mlp_dim", m.mlp_dim), ("model.vocab_size", m.vocab_size)):
        if value % mesh.tensor:
            raise ConfigError(f"{field}: {value} is not divisible by mesh.tensor {mesh.tensor}")
    if cfg.data.global_batch % mesh.data:
        raise ConfigError(f"data.global_batch: {cfg.data.global_batch} is not divisible by "
                          f"mesh.data {mesh.data}")
    if mesh.fsdp and m.hidden_size % mesh.data:
        raise ConfigError(f"model.hidden_size: {m.hidden_size} is not divisible by mesh.data "
                          f"{mesh.data} (needed by mesh.fsdp)")


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "tensor", "pipeline") mesh over `devices` (default: all), Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    validate_mesh(cfg, len(devices))
    shape = (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_sharding(logical_tree: Any, mesh: Mesh, rules) -> Any:
    """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_tree, mesh, rules)


def param_shardings(abstract_boxed: Any, mesh: Mesh, rules) -> Any:
    """NamedShardings for a pytree of `nn.LogicallyPartitioned` abstract values (from eval_shape)."""
    return logical_to_sharding(nn.get_partition_spec(abstract_boxed), mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Input batches: [batch, seq] with batch over `data`."""
    return NamedSharding(mesh, P("data", None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(mesh: Mesh) -> dict[str, int]:
    return {name: int(size) for name, size in mesh.shape.items()}


def device_grid(mesh: Mesh) -> np.ndarray:
    """Device ids laid out as the mesh, for logs."""
    return np.vectorize(lambda d: d.id)(mesh.devices)


@contextlib.contextmanager
def activate(mesh: Mesh, rules) -> Iterator[None]:
    """Makes `mesh` and the logical rules current, so the model's activation constraints apply.

    Tracing (the first call of a jitted function) must happen inside this context.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
