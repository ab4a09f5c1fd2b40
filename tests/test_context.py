"""Context parallelism (docs/context.md): the layout, the balance of causal work, the attention
over split rows against the whole-row flash, and whole models (dense GQA; MLA + MoE + MTP)
whose loss and every gradient at mesh.context 2 and 4 equal mesh.context 1's, on packed rows
whose documents cross the shard boundaries. launch.py trains the (1, 2, 2, 2) mesh to the
losses of the (2, 2, 2, 1) one."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import ROOT, random_batch, run_launch, tiny
from dsjax import config as config_lib
from dsjax import sharding, train
from dsjax.config import ConfigError
from dsjax.model import flash
from dsjax.model.context import block_pairs, context_attention
from dsjax.model.context_layout import (Layout, from_layout, layout_order, natural_order,
                                        to_layout)
from dsjax.model.loss import objective_value

ZIGZAG2 = Layout(2, "zigzag")


def test_zigzag_layout_by_hand():
    # 16 tokens, 2 devices: chunks of 4; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    order = [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert ZIGZAG2.order(16).tolist() == order
    natural = np.arange(16)[None] * 10
    assert to_layout(natural, ZIGZAG2).tolist() == [[10 * i for i in order]]
    np.testing.assert_array_equal(from_layout(to_layout(natural, ZIGZAG2), ZIGZAG2), natural)
    assert ZIGZAG2.indices(16, jnp.int32(0)).tolist() == order[:8]
    assert ZIGZAG2.indices(16, jnp.int32(1)).tolist() == order[8:]
    # On device: back to natural order and forth, by slices (no gather).
    for parts in (2, 4):
        layout = Layout(parts, "zigzag")
        row = np.arange(8 * parts)[None]
        np.testing.assert_array_equal(natural_order(jnp.asarray(to_layout(row, layout)), layout),
                                      row)
        np.testing.assert_array_equal(layout_order(jnp.asarray(row), layout),
                                      to_layout(row, layout))
    # contiguous is the natural order.
    assert Layout(2, "contiguous").order(16).tolist() == list(range(16))
    assert Layout(2, "contiguous").indices(16, jnp.int32(1)).tolist() == list(range(8, 16))


def test_ahead_shifts_along_the_natural_order():
    # MTP reads the token k places later in the text, wherever the layout put it.
    natural = np.arange(1, 17)[None]
    for k in (1, 2, 5):
        want = np.pad(natural[:, k:], ((0, 0), (0, k)))
        got = ZIGZAG2.ahead(jnp.asarray(to_layout(natural, ZIGZAG2)), k)
        np.testing.assert_array_equal(from_layout(np.asarray(got), ZIGZAG2), want)


@pytest.mark.parametrize("impl", ["all_gather", "ring"])
def test_causal_work_by_hand_and_balanced(impl):
    # 16 tokens, blocks of 2, 2 devices. A query block whose last token is p meets the key
    # blocks starting at or before p: p // 2 + 1 of them. zigzag: device 0's query blocks end
    # at 1, 3, 13, 15 (1 + 2 + 7 + 8 = 18), device 1's at 5, 7, 9, 11 (3 + 4 + 5 + 6 = 18);
    # contiguous: 1 + 2 + 3 + 4 = 10 against 5 + 6 + 7 + 8 = 26. The ring meets the same blocks
    # a shard at a time.
    assert block_pairs(ZIGZAG2, 16, 2, 2, impl) == [18, 18]
    assert block_pairs(Layout(2, "contiguous"), 16, 2, 2, impl) == [10, 26]
    for parts in (4, 8):
        zigzag = block_pairs(Layout(parts, "zigzag"), 4096, 128, 128, impl)
        assert max(zigzag) <= 1.1 * min(zigzag), zigzag
        contiguous = block_pairs(Layout(parts, "contiguous"), 4096, 128, 128, impl)
        assert max(contiguous) > 2 * min(contiguous), contiguous


def test_a_ring_step_that_hides_every_key_gives_nothing_and_stays_finite():
    # Queries at 0..7, keys at 8..15 (a later shard): no query sees any key.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32) for _ in range(3))
    seg = jnp.ones((1, 8), jnp.int32)
    pos_q, pos_k = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, 16, dtype=jnp.int32)
    out, lse = flash.forward(q, k, v, seg, seg, pos_q, pos_k, 0.5, 4, 4)
    assert not np.asarray(out).any() and np.all(np.asarray(lse) == -np.inf)
    # Its backward, with the finite logsumexp of the whole attention, gives zero gradients.
    dq, dk, dv = flash.backward(q, k, v, seg, seg, pos_q, pos_k, out, jnp.zeros_like(lse),
                                jnp.ones_like(out), 0.5, 4, 4)
    assert not any(np.asarray(x).any() for x in (dq, dk, dv))


def _attend_split(impl, layout, q, k, v, seg):
    """context_attention on 8 devices (data 2 x context 4) of natural-order inputs, its output
    and gradients back in natural order."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 1, 4), sharding.MESH_AXES)
    put = lambda x: jnp.asarray(to_layout(np.moveaxis(np.asarray(x), 1, -1), layout))

    def loss(q, k, v):
        out = context_attention(q, k, v, jnp.asarray(to_layout(np.asarray(seg), layout)),
                                scale=0.3, block_q=4, block_k=4, impl=impl, layout=layout)
        return jnp.sum(out * jnp.cos(out)), out

    args = [jnp.moveaxis(put(x), -1, 1) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*args)
    back = lambda x: np.moveaxis(from_layout(np.moveaxis(np.asarray(x), 1, -1), layout), -1, 1)
    return [back(x) for x in (out, *grads)]


@pytest.mark.parametrize("impl", ["all_gather", "ring"])
def test_split_attention_equals_whole_row_flash(impl):
    # GQA (4 query heads on 2 kv heads), 32 tokens over 4 devices (zigzag chunks of 4), three
    # documents whose boundaries (at 6 and 19) fall inside shards.
    rng = np.random.default_rng(1)
    B, S = 2, 32
    q = rng.normal(size=(B, S, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(B, S, 2, 8)).astype(np.float32) for _ in range(2))
    seg = np.ones((B, S), np.int32)
    seg[:, 6:] += 1
    seg[1, 19:] += 1

    def loss(q, k, v):
        out = flash.flash_attention(q, k, v, jnp.asarray(seg), scale=0.3, block_q=4, block_k=4)
        return jnp.sum(out * jnp.cos(out)), out

    (_, want), want_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    for layout in (Layout(4, "zigzag"), Layout(4, "contiguous")):
        got = _attend_split(impl, layout, q, k, v, seg)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *want_grads)):
            err = np.max(np.abs(g - np.asarray(w))) / np.max(np.abs(np.asarray(w)))
            assert err < 1e-5, (layout.kind, name, err)


# Whole models: loss and every gradient of one batch of packed rows (2 documents a row, cut at
# random points, so boundaries cross shards), context 2 and 4 against 1.
SEQ = 32
DENSE = ("configs/cpu_tiny.py", tiny({"model.attention_block_q": 4,
                                      "model.attention_block_k": 4, "model.loss_chunk": 0}))
MLA_MOE_MTP = ("configs/cpu_moe.py", {"model.num_layers": 3, "model.hidden_size": 64,
                                      "model.attention_block_q": 4, "model.attention_block_k": 4,
                                      "model.loss_chunk": 0, "model.vocab_size": 512})


def loss_and_grads(config, overrides, mesh):
    data, tensor, context = mesh
    cfg = config_lib.load(os.path.join(ROOT, config), {
        "data.seq_len": SEQ, "data.global_batch": 4, "mesh.data": data, "mesh.tensor": tensor,
        "mesh.pipeline": 1, "mesh.context": context, **overrides})
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:cfg.mesh.size]))
    state = trainer.init()
    batch = trainer.device_batch(random_batch(np.random.default_rng(7), 4, SEQ, vocab=512))

    def objective(params):
        loss, _, aux = state.objective.loss_and_aux(params, batch, state.fp8_meta or None)
        return objective_value(loss, aux)

    with sharding.activate(trainer.mesh, trainer.rules):
        loss, grads = jax.jit(jax.value_and_grad(objective))(state.params)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def reference():
    return {name: loss_and_grads(config, overrides, (2, 1, 1))
            for name, (config, overrides) in (("dense", DENSE), ("mla_moe_mtp", MLA_MOE_MTP))}


@pytest.mark.parametrize("model, mesh, impl", [
    ("dense", (2, 1, 2), "all_gather"),
    ("dense", (1, 2, 2), "ring"),  # heads over `tensor` too
    ("dense", (2, 1, 4), "ring"),
    ("dense", (2, 1, 4), "all_gather"),
    ("mla_moe_mtp", (2, 1, 2), "all_gather"),
    ("mla_moe_mtp", (2, 1, 4), "ring"),
    ("dense", (1, 1, 2), "ring_gpipe"),  # inside 2 gpipe stages: (1, 1, 2, 2)
])
def test_context_parallel_loss_and_gradients_equal_unsplit(reference, model, mesh, impl):
    config, overrides = {"dense": DENSE, "mla_moe_mtp": MLA_MOE_MTP}[model]
    want_loss, want = reference[model]
    if impl == "ring_gpipe":
        impl, overrides = "ring", {**overrides, "mesh.pipeline": 2, "pipeline.schedule": "gpipe",
                                   "pipeline.microbatches": 2}
    loss, grads = loss_and_grads(config, {**overrides, "model.context_impl": impl}, mesh)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g in zip(flat_want, jax.tree.leaves(grads)):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name:  # moved by the balancing rule, not by gradients
            continue
        scale = np.max(np.abs(w))
        assert scale > 0, name  # every other parameter is trained
        err = np.max(np.abs(g - w)) / scale
        assert err < 1e-5, (name, err)


def test_ring_traffic_counted_from_the_compiled_program():
    """The bytes one device sends along `context` for forward + backward, read from the HLO with
    each collective times its loop's trip count, against the ring by hand: C - 1 shards of k, v
    (and ids) forward; C - 1 of k, v and C of float32 dk, dv backward."""
    C, S, N, K = 4, 64, 2, 8
    mesh = Mesh(np.array(jax.devices()[:C]).reshape(1, 1, 1, C), sharding.MESH_AXES)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, sharding.CONTEXT))
    q = jax.ShapeDtypeStruct((1, S, N, K), jnp.float32, sharding=split)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=split)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(context_attention(
        q, k, v, s, scale=0.3, block_q=8, block_k=8, impl="ring", layout=Layout(C, "zigzag"))),
        (0, 1, 2))
    with jax.set_mesh(mesh):
        hlo = jax.jit(grad).lower(q, q, q, seg).compile().as_text()
    shard, ids = S // C * N * K * 4, S // C * 4  # bytes of one device's k (or v), its ids
    forward = (C - 1) * (2 * shard + ids)
    backward = (C - 1) * (2 * shard + ids) + C * 2 * shard
    from dsjax.metrics import looped_axis_bytes
    assert looped_axis_bytes(hlo, mesh, sharding.CONTEXT) == forward + backward


def test_launch_trains_context_2_inside_a_pipeline_to_the_same_losses(tmp_path):
    """cpu_tiny at (data, tensor, pipeline, context) = (1, 2, 2, 2) through launch.py, 5 steps,
    against (2, 2, 2, 1) with the same flags and global batch (1f1b, all_gather)."""
    flags = {"train.steps": 5, "metrics.profile_every": 0, "train.sample_tokens": 0}
    runs = {}
    for name, mesh in (("context", {"mesh.data": 1, "mesh.context": 2}), ("base", {})):
        runs[name] = str(tmp_path / name)
        proc = run_launch(runs[name], {**flags, **mesh})
        assert proc.returncode == 0, proc.stderr[-3000:]
    read = lambda d: [json.loads(line)["loss"] for line in open(os.path.join(d, "metrics.jsonl"))
                      if "loss" in json.loads(line)]
    assert len(read(runs["base"])) == 5
    np.testing.assert_allclose(read(runs["context"]), read(runs["base"]), rtol=1e-4)
    with open(os.path.join(runs["context"], "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["mesh"] == {"data": 1, "tensor": 2, "pipeline": 2, "context": 2}
    assert np.isfinite(summary["eval_loss"])


@pytest.mark.parametrize("overrides, message", [
    ({"model.attention_impl": "xla"}, r"^model.attention_impl: mesh.context > 1 runs the flash"),
    ({"model.context_impl": "ring", "mesh.pipeline": 2},
     r"^model.context_impl: 'ring' inside the '1f1b' schedule crashes XLA:CPU"),
    ({"data.seq_len": 36}, r"^data.seq_len: 36 must split into 8 equal chunks"),
    ({"model.context_impl": "rings"}, r"^model.context_impl"),
])
def test_what_does_not_combine_with_context(overrides, message):
    flags = {"mesh.data": 2, "mesh.pipeline": 1, "mesh.context": 4, **overrides}
    with pytest.raises(ConfigError, match=message):
        config_lib.load(os.path.join(ROOT, "configs/cpu_tiny.py"), flags)
    with pytest.raises(ConfigError, match=r"^mesh.context: vision-language rows"):
        config_lib.load(os.path.join(ROOT, "configs/cpu_vl.py"), {"mesh.context": 2,
                                                                   "mesh.data": 1})
