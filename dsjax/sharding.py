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
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsjax.config import Config, ConfigError

# The mesh axes: spelled here only; everything else names them through these constants.
DATA, TENSOR, PIPELINE, CONTEXT = "data", "tensor", "pipeline", "context"
MESH_AXES = (DATA, TENSOR, PIPELINE, CONTEXT)

# Logical name -> mesh axis (or None: replicated). Parameters first, then activations.
# Keep it short and free of duplicate keys; `fsdp` and `pipeline` each add exactly one override
# (see `logical_rules`).
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", TENSOR),
    ("embed", None),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("head_dim", None),
    ("mlp", TENSOR),
    ("norm", None),
    # MoE experts over the data axis, as DeepSpeed-MoE and MaxText do: tokens are already split
    # over it, so the all-to-all stays inside the data-parallel group (docs/moe.md).
    ("expert", DATA),
    ("layers", None),  # with mesh.pipeline > 1: "pipeline" (stages, dsjax/pipeline/)
    ("extra_layers", None),  # stacks every stage holds whole: MoE's dense first blocks, MTP
    ("vision_embed", None),  # the SigLIP tower and projector (dsjax/model/vision/)
    ("vision_heads", TENSOR),
    ("vision_mlp", TENSOR),
    ("vision_layers", None),
    ("act_batch", DATA),
    ("act_seq", None),  # with mesh.context > 1: "context" (the sequence split, docs/context.md)
    ("act_embed", None),
    ("act_heads", TENSOR),
    ("act_kv_heads", TENSOR),
    ("act_mlp", TENSOR),
    ("act_vocab", TENSOR),
)


def logical_rules(fsdp: bool = False, pipeline: bool = False, context: bool = False
                  ) -> tuple[tuple[str, str | None], ...]:
    """The rules table; with `fsdp` the parameters' "embed" axis is also sharded over `data`,
    with `pipeline` (mesh.pipeline > 1) the "layers" axis is split into contiguous stages, with
    `context` (mesh.context > 1) the activations' sequence axis is split over `context`."""
    overrides = {**({"embed": DATA} if fsdp else {}),
                 **({"layers": PIPELINE} if pipeline else {}),
                 **({"act_seq": CONTEXT} if context else {})}
    return tuple((name, overrides.get(name, axis)) for name, axis in RULES)


def data_size(mesh: Mesh) -> int:
    """Data-parallel replicas: the size of the mesh's `data` axis."""
    return int(mesh.shape[DATA])


def rules_for(cfg: Config) -> tuple[tuple[str, str | None], ...]:
    """The rules table for a training config's mesh."""
    return logical_rules(cfg.mesh.fsdp, pipeline=cfg.mesh.pipeline > 1,
                         context=cfg.mesh.context > 1)


def check_device_count(cfg: Config, num_devices: int) -> None:
    """The one mesh check that needs the devices (the rest are `dsjax.config.validate`'s)."""
    mesh = cfg.mesh
    if mesh.size != num_devices:
        raise ConfigError(
            f"mesh: data*tensor*pipeline*context = {mesh.data}*{mesh.tensor}*{mesh.pipeline}*"
            f"{mesh.context} = {mesh.size} must equal the device count {num_devices} (set "
            f"mesh.data, mesh.tensor, mesh.pipeline, mesh.context)")


def host_split(cfg: Config, num_devices: int, num_processes: int) -> tuple[int, int]:
    """(hosts `data` spans, hosts `pipeline` spans): mesh.dcn_data/dcn_pipeline resolved and
    checked against the process and device counts; each failure names the field.

    A host is a group of whole processes (one process per node, or one per GPU in node order).
    With fewer processes than hosts (one process simulating several, for tests) a host is a
    block of consecutive devices. `tensor` never spans hosts: it all-reduces in every layer.
    """
    mesh = cfg.mesh
    if not mesh.dcn_data and num_processes % mesh.dcn_pipeline:
        raise ConfigError(f"mesh.dcn_pipeline: {num_processes} processes do not split evenly over "
                          f"the {mesh.dcn_pipeline} hosts pipeline spans")
    dcn_data = mesh.dcn_data or max(num_processes // mesh.dcn_pipeline, 1)
    hosts = dcn_data * mesh.dcn_pipeline
    if num_processes > 1 and num_processes % hosts:
        raise ConfigError(f"mesh.dcn_data: dcn_data*dcn_pipeline = {hosts} hosts must divide the "
                          f"{num_processes} processes (a host is a group of whole processes)")
    if num_devices % hosts:
        raise ConfigError(f"mesh.dcn_data: {num_devices} devices do not split evenly over "
                          f"dcn_data*dcn_pipeline = {hosts} hosts")
    per_host = num_devices // hosts
    if per_host % mesh.tensor:
        raise ConfigError(f"mesh.tensor: {mesh.tensor} must fit inside one host ({per_host} "
                          f"devices per host = {num_devices} devices / {hosts} hosts): tensor "
                          f"groups all-reduce in every layer and stay on intra-host links (one "
                          f"process per GPU? set mesh.dcn_data to the number of nodes)")
    if per_host % (mesh.tensor * mesh.context):
        raise ConfigError(f"mesh.context: tensor x context = {mesh.tensor} x {mesh.context} must "
                          f"fit inside one host ({per_host} devices per host): context groups "
                          f"exchange keys and values in every layer, and a host loads whole "
                          f"rows")
    # An explicit dcn_data (and dcn_pipeline) is checked against mesh.data by the config's
    # validation; only the one resolved here from the process count is new.
    if not mesh.dcn_data and mesh.data % dcn_data:
        raise ConfigError(f"mesh.dcn_data: mesh.data {mesh.data} must split evenly over the "
                          f"{dcn_data} hosts it spans (0: one host per process); raise "
                          f"mesh.data or set mesh.dcn_pipeline")
    return dcn_data, mesh.dcn_pipeline


def hybrid_device_grid(devices: Sequence[Any], ici_shape: Sequence[int],
                       dcn_shape: Sequence[int]) -> np.ndarray:
    """Devices in a mesh of shape ici_shape * dcn_shape where each host holds one contiguous
    `ici_shape` block: `mesh_utils.create_hybrid_device_mesh(process_is_granule=True)`'s layout,
    except that a host may be several consecutive processes, or (one process simulating several
    hosts) a block of consecutive devices. Needs only `.process_index`, `.id` and what
    `create_device_mesh` reads, so tests can pass stand-in devices."""
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

    hosts = math.prod(dcn_shape)
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    processes = sorted({d.process_index for d in devices})
    if len(processes) >= hosts:
        host_of = {p: i * hosts // len(processes) for i, p in enumerate(processes)}
        granules = [[d for d in devices if host_of[d.process_index] == h] for h in range(hosts)]
    else:
        size = len(devices) // hosts
        granules = [devices[h * size:(h + 1) * size] for h in range(hosts)]
    blocks = np.empty(tuple(dcn_shape), dtype=object)
    for h, index in enumerate(np.ndindex(*dcn_shape)):
        blocks[index] = mesh_utils.create_device_mesh(ici_shape, granules[h],
                                                      allow_split_physical_axes=True)
    return np.block(blocks.tolist())


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "tensor", "pipeline", "context") mesh over `devices` (default: all), Auto axes.

    Topology-aware: each host holds a contiguous block with whole `tensor` groups, and `data`
    (then `pipeline`, mesh.dcn_pipeline) spans hosts (see `host_split`). Data index =
    host * (data / hosts) + index inside the host, which `host_view` relies on.
    """
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(mesh_devices(cfg, devices), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_devices(cfg: Config, devices: Sequence[Any]) -> np.ndarray:
    """`make_mesh`'s device array (data, tensor, pipeline, context), checked against the
    config. `context`, like `tensor`, stays inside a host."""
    check_device_count(cfg, len(devices))
    dcn_data, dcn_pipeline = host_split(cfg, len(devices),
                                        len({d.process_index for d in devices}))
    ici = (cfg.mesh.data // dcn_data, cfg.mesh.tensor, cfg.mesh.pipeline // dcn_pipeline,
           cfg.mesh.context)
    return hybrid_device_grid(devices, ici, (dcn_data, 1, dcn_pipeline, 1))


def describe_layout(mesh: Mesh) -> str:
    """Which process owns each mesh position, for the start-of-run log.

    One line per process (its devices and their mesh coordinates), then how many processes each
    axis's groups span, and whether every `tensor` group lies inside one process: tensor
    parallelism all-reduces every layer, so a group that spans processes puts that traffic on
    the slow inter-host links. `mesh` needs only `devices`, `axis_names` and `shape`.
    """
    owner = _owners(mesh)
    names = list(mesh.axis_names)
    lines = [f"mesh {dict(mesh.shape)} over {owner.max() + 1} process(es)"]
    for p in range(int(owner.max()) + 1):
        coords = [tuple(int(c) for c in idx) for idx in zip(*np.nonzero(owner == p))]
        devices = [int(mesh.devices[c].id) for c in coords]
        where = ", ".join(f"{d}@({','.join(map(str, c))})" for d, c in zip(devices, coords))
        lines.append(f"  process {p}: {len(devices)} devices, id@({','.join(names)}): {where}")
    spans = ", ".join(f"{name} {processes_per_group(mesh, name)}" for name in names)
    lines.append(f"  processes per group along each axis: {spans}")
    lines.append(f"  tensor groups within one process: "
                 f"{'yes' if tensor_groups_local(mesh) else 'NO (tensor all-reduces cross hosts)'}")
    return "\n".join(lines)


def _owners(mesh):
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def processes_per_group(mesh, axis: str) -> int:
    """The most processes any group along `axis` (all other coordinates fixed) spans."""
    owner = np.moveaxis(_owners(mesh), list(mesh.axis_names).index(axis), -1)
    rows = owner.reshape(-1, owner.shape[-1])
    return max(len(set(row.tolist())) for row in rows)


def tensor_groups_local(mesh) -> bool:
    """True if the devices of every `tensor` group (all else fixed) share one process."""
    return processes_per_group(mesh, TENSOR) == 1


# 1-bit Adam's hierarchical reduction sees `data` as two axes: hosts (slow links, 1-bit) x data
# workers inside a host (fast links, exact mean).
DATA_HOSTS, DATA_LOCAL = "data_hosts", "data_local"


def host_view(mesh: Mesh, hosts: int) -> Mesh:
    """`mesh` with `data` split into (DATA_HOSTS, DATA_LOCAL) = (hosts, data / hosts).

    The same devices in the same order, so P((DATA_HOSTS, DATA_LOCAL), ...) on the view and
    P("data", ...) on `mesh` are one sharding and nothing moves between them. With make_mesh's
    layout a DATA_LOCAL group is the data workers of one host.
    """
    sizes = dict(mesh.shape)
    if sizes[DATA] % hosts:
        raise ConfigError(f"mesh.dcn_data: mesh.data {sizes[DATA]} must split evenly over "
                          f"{hosts} hosts")
    shape = (hosts, sizes[DATA] // hosts) + tuple(sizes[a] for a in MESH_AXES[1:])
    return Mesh(mesh.devices.reshape(shape), (DATA_HOSTS, DATA_LOCAL) + MESH_AXES[1:],
                axis_types=(AxisType.Auto,) * (len(MESH_AXES) + 1))


def hierarchical_view(cfg: Config, mesh: Mesh) -> Mesh:
    """`host_view` at the host boundary `make_mesh` used, for hierarchical 1-bit Adam."""
    processes = len({d.process_index for d in mesh.devices.flat})
    hosts, _ = host_split(cfg, mesh.size, processes)
    if hosts < 2:
        raise ConfigError("optim.hierarchical: the data axis spans 1 host, so no slow link is "
                          "left to compress (1-bit would only distort the exact mean); run "
                          "several processes or set mesh.dcn_data >= 2, or turn it off")
    return host_view(mesh, hosts)


def from_host_view(spec: P) -> P:
    """A PartitionSpec on `host_view`'s axes -> the same sharding on the mesh's axes."""
    return P(*(DATA if entry == (DATA_HOSTS, DATA_LOCAL) else entry for entry in spec))


@contextlib.contextmanager
def on_view(view: Mesh | None) -> Iterator[None]:
    """While tracing under `mesh`: lets `jax.shard_map(..., mesh=view)` run (jax checks that a
    shard_map's mesh is the context mesh; the view has the same devices). None: no-op."""
    if view is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(view.abstract_mesh):
        yield


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which `x` may differ inside shard_map (check_vma); empty
    outside shard_map."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # ManualAxisType in current JAX, `vma` before
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def logical_to_sharding(logical_tree: Any, mesh: Mesh, rules) -> Any:
    """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_tree, mesh, rules)


def param_shardings(abstract_boxed: Any, mesh: Mesh, rules) -> Any:
    """NamedShardings for a pytree of `nn.LogicallyPartitioned` abstract values (from eval_shape)."""
    return logical_to_sharding(nn.get_partition_spec(abstract_boxed), mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Input batches: [batch, seq] with batch over `data`, and seq over `context` where the
    mesh has that axis (the rows arrive in the context layout, dsjax.model.context_layout)."""
    return NamedSharding(mesh, P(DATA, CONTEXT if CONTEXT in mesh.axis_names else None))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays of rows (any rank) split over `data` only: decoding, whose rows stay whole."""
    return NamedSharding(mesh, P(DATA))


def context_size(mesh: Any = None) -> int:
    """How many devices the activations' sequence axis is split over, under the current rules
    and mesh (1: not split). Read while tracing: the attention core picks its form from it."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    spec = nn.logical_to_mesh_axes(("act_seq",))
    if mesh is None or mesh.empty or spec[0] != CONTEXT or CONTEXT not in mesh.axis_names:
        return 1
    return int(dict(mesh.shape)[CONTEXT])


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
