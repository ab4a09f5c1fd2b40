"""Invariant 1: the mesh shape never changes the math."""

import ast
import json
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import FLAT_MESH, ROOT, random_batch, tiny
from dsjax import config as config_lib
from dsjax import sharding
from dsjax.train import build_trainer

TINY = tiny({"data.seq_len": 32, "data.global_batch": 8, "train.steps": 3,
             "optim.warmup_steps": 1, "optim.lr": 1e-2}, FLAT_MESH)


def _losses(overrides, devices, batches):
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **overrides})
    trainer = build_trainer(cfg, sharding.make_mesh(cfg, devices))
    state = trainer.init()
    losses = []
    for b in batches:
        state, m = trainer.step(state, trainer.device_batch(b))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("mesh, model", [
    ((4, 2, False), {}),
    ((8, 1, True), {}),
    ((2, 4, True), {"model.num_kv_heads": 4}),  # MHA: kv heads must divide over tensor = 4
], ids=["dp4-tp2", "dp8-fsdp", "dp2-tp4-fsdp"])
def test_sharded_run_matches_single_device(mesh, model):
    data, tensor, fsdp = mesh
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, 8, 32)] * 3  # one batch repeated, so the loss must fall
    single, p1 = _losses({"mesh.data": 1, "mesh.tensor": 1, **model}, jax.devices()[:1], batches)
    sharded, p8 = _losses({"mesh.data": data, "mesh.tensor": tensor, "mesh.fsdp": fsdp, **model},
                          jax.devices(), batches)
    assert single[-1] < single[0] - 1e-3  # it trains
    # float32: only the summation order differs between meshes.
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    # Adam divides by sqrt(v): for an element whose gradient is ~0, float32 rounding of the
    # gradient can flip the update's sign, so a handful of elements may differ by ~lr. Compare
    # whole tensors (relative Frobenius norm; measured <= 1.2e-5 here), which any sharding bug
    # (a wrong head or shard mapping) would move by O(1).
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-4


def test_parameters_are_sharded_as_the_rules_say():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"),
                          {**TINY, "mesh.fsdp": True})
    trainer = build_trainer(cfg)
    specs = jax.tree.map(lambda s: tuple(s.spec), trainer.state_shardings.params)
    assert specs["layers"]["attn"]["q"] == (None, "data", "tensor", None)  # [L, D, H, K]
    assert specs["layers"]["mlp"]["down"] == (None, "tensor", "data")        # [L, F, D]
    assert specs["embedding"] == ("tensor", "data")                           # [V, D]
    assert specs["layers"]["attn_norm"]["scale"] in ((None, None), (None,), ())
    mu = trainer.state_shardings.opt_state[1][0].mu  # Adam's first moment mirrors the params
    assert tuple(mu["layers"]["attn"]["q"].spec) == (None, "data", "tensor", None)


def _load(overrides):
    return config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"), {**TINY, **overrides})


@pytest.mark.parametrize("overrides, match", [
    ({"mesh.dcn_data": 3}, r"^mesh.dcn_data: mesh.data 4 must split evenly over the 3 hosts"),
    ({"mesh.dcn_data": -1}, r"^mesh.dcn_data: must be >= 0"),
    ({"mesh.dcn_pipeline": 0}, r"^mesh.dcn_pipeline: must be > 0"),
    ({"optim.hierarchical": True}, r"^optim.hierarchical: only optim.name='onebit_adam'"),
])
def test_topology_fields_are_validated(overrides, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        _load({"mesh.data": 4, "mesh.tensor": 2, **overrides})


def test_simulated_hosts_and_their_data_view():
    # One process, mesh.dcn_data = 2: each simulated host is a block of 4 consecutive devices.
    cfg = _load({"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2})
    mesh = sharding.make_mesh(cfg)
    view = sharding.hierarchical_view(cfg, mesh)
    assert dict(view.shape) == {"data_hosts": 2, "data_local": 2, "tensor": 2, "pipeline": 1,
                                "context": 1}
    ids = np.vectorize(lambda d: d.id)(view.devices)
    assert set(ids[0].flat) == {0, 1, 2, 3} and set(ids[1].flat) == {4, 5, 6, 7}
    # One sharding under two names: the view's (hosts, local) is the mesh's `data`.
    spec = P(("data_hosts", "data_local"), "tensor")
    assert sharding.from_host_view(spec) == P("data", "tensor")
    shape = (8, 4)
    assert (NamedSharding(view, spec).devices_indices_map(shape)
            == NamedSharding(mesh, P("data", "tensor")).devices_indices_map(shape))
    with pytest.raises(config_lib.ConfigError, match="^optim.hierarchical: the data axis spans 1"):
        sharding.hierarchical_view(_load({"mesh.data": 4, "mesh.tensor": 2}),
                                   sharding.make_mesh(cfg))


def _replica_groups(text, op):
    """Every replica group of the StableHLO collective `op` in a lowered program."""
    groups = []
    for line in text.splitlines():
        if f'"stablehlo.{op}"' in line:
            groups += json.loads(re.search(r"replica_groups = dense<(\[\[.*?\]\])>", line)[1])
    return groups


def _onebit_losses(overrides, batches):
    trainer = build_trainer(_load({"mesh.data": 4, "mesh.tensor": 2, "mesh.dcn_data": 2,
                                   "optim.name": "onebit_adam", "optim.freeze_step": 2,
                                   "train.steps": 4, **overrides}))
    state, losses, compressed = trainer.init(), [], []
    for b in batches:
        state, m = trainer.step(state, trainer.device_batch(b))
        losses.append(float(m["loss"]))
        compressed.append(int(m["onebit_compressed"]))
    return trainer, state, np.array(losses), compressed


def test_hierarchical_onebit_is_exact_inside_a_host_and_1bit_across_hosts():
    rng = np.random.default_rng(1)
    batches = [random_batch(rng, 8, 32) for _ in range(4)]
    _, flat_state, flat, _ = _onebit_losses({}, batches)
    trainer, state, hier, compressed = _onebit_losses({"optim.hierarchical": True}, batches)
    assert compressed == [0, 0, 1, 1]
    # Warmup steps average gradients exactly either way (one all-reduce over 4 workers vs over
    # 2 x 2): the losses after them differ by float32 summation order only.
    np.testing.assert_allclose(hier[:3], flat[:3], rtol=1e-5)
    assert np.all(np.isfinite(hier))
    # Error buffers: each worker keeps 1/L (L = 2 workers per host) of a bucket's error; the
    # server error stays n / (L * hosts) = n / 4, as flat's n / W.
    hier_w = [x.shape for x in jax.tree.leaves(state.opt_state.worker_error)]
    flat_w = [x.shape for x in jax.tree.leaves(flat_state.opt_state.worker_error)]
    assert [(r, 2 * c) for r, c in hier_w] == flat_w
    assert ([x.shape for x in jax.tree.leaves(state.opt_state.server_error)]
            == [x.shape for x in jax.tree.leaves(flat_state.opt_state.server_error)])
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(state.opt_state.worker_error))

    # Where the compressed step's collectives go (device index // 4 = its simulated host): the
    # 1-bit exchange (all-to-all of packed signs) pairs the two hosts; the exact mean
    # (reduce-scatter) stays inside one.
    with sharding.activate(trainer.mesh, trainer.rules):
        text = trainer.jitted(1).lower(trainer.abstract_state(),
                                       trainer.abstract_batch()).as_text()
    to_all, scatter = _replica_groups(text, "all_to_all"), _replica_groups(text, "reduce_scatter")
    assert to_all and all(sorted(i // 4 for i in g) == [0, 1] for g in to_all)
    assert scatter and all(len({i // 4 for i in g}) == 1 and len(g) == 2 for g in scatter)


# --- only sharding.py spells a mesh axis -------------------------------------------------------

AXIS_CALLS = {"P", "PartitionSpec", "NamedSharding", "Mesh", "psum", "pmean", "pmax", "ppermute",
              "all_gather", "all_to_all", "psum_scatter", "axis_index", "axis_size", "pcast",
              "shard_map"}


def _call_name(node):
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def mesh_axis_spellings(source: str) -> list[int]:
    """Lines where a mesh axis name is written as a string in a mesh context: an index into a
    `.shape`, an argument of a PartitionSpec / collective / function of a mesh, an `axis*`
    argument or default, a constant bound to a name, or a (name, None) spec tuple. Other uses of
    the words (config sections, source names, directories, checkpoint items) are not axes."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in sharding.MESH_AXES):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.keyword):
            flagged = "axis" in (parent.arg or "")
        elif isinstance(parent, ast.Subscript):
            flagged = isinstance(parent.value, ast.Attribute) and parent.value.attr == "shape"
        elif isinstance(parent, ast.Call):
            flagged = _call_name(parent) in AXIS_CALLS or any(
                "mesh" in ast.unparse(a) for a in parent.args if a is not node)
        elif isinstance(parent, (ast.Assign, ast.AnnAssign)):
            flagged = True
        elif isinstance(parent, ast.arguments):
            args = parent.posonlyargs + parent.args
            named = dict(zip(map(id, parent.defaults), args[len(args) - len(parent.defaults):]))
            named.update((id(d), a) for d, a in zip(parent.kw_defaults, parent.kwonlyargs) if d)
            flagged = "axis" in named[id(node)].arg if id(node) in named else False
        elif isinstance(parent, ast.Tuple):
            flagged = any(isinstance(e, ast.Constant) and e.value is None for e in parent.elts)
        else:
            flagged = False
        if flagged:
            hits.append(node.lineno)
    return hits


def test_no_mesh_axis_name_is_spelled_outside_sharding():
    package = os.path.join(ROOT, "dsjax")
    found = {}
    for d, _, names in os.walk(package):
        for n in names:
            path = os.path.join(d, n)
            if n.endswith(".py") and path != os.path.join(package, "sharding.py"):
                lines = mesh_axis_spellings(open(path, encoding="utf-8").read())
                if lines:
                    found[os.path.relpath(path, ROOT)] = lines
    assert not found, f"use sharding.DATA / TENSOR / PIPELINE (or data_size) instead: {found}"


@pytest.mark.parametrize("line", [
    'n = mesh.shape["data"]', 'spec = P("data", None)', 'DATA = "data"',
    'axes = ("tensor", None)', 'y = lax.psum(x, "pipeline")', 'f(x, axis_name="data")',
    'def f(x, axis_name="data"): pass', 'ok = processes_per_group(mesh, "tensor")',
])
def test_the_axis_check_sees_each_spelling(line):
    assert mesh_axis_spellings(line) == [1]


def test_the_axis_check_leaves_other_words_alone():
    source = ('_bounds("data", d, positive="seq_len")\npaths = {"data": train}\n'
              'os.path.join(workdir, "data", "vl")\nITEMS = ("params", "data")\n')
    assert mesh_axis_spellings(source) == []
