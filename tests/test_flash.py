"""dsjax.model.flash against a float64 NumPy attention (explicit mask, softmax, PV, and the
gradients derived by hand), plus its block schedule, skipping, memory, dtypes and shard_map."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from dsjax.metrics import gemms
from dsjax.model.flash import block_schedule, flash_attention


def segments(lengths_per_row: list[list[int]]) -> np.ndarray:
    """[B, S] packed segment ids from document lengths, ids 1, 2, ... along each row."""
    return np.stack([np.repeat(np.arange(1, len(ls) + 1), ls) for ls in lengths_per_row]
                    ).astype(np.int32)


def reference(q, k, v, seg, scale, dout):
    """float64 attention and its vjp: P = softmax(mask(s q k^T)), O = P V; dV = P^T dO,
    dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = s dS K, dK = s dS^T Q (summed per group)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, S, H, K = q.shape
    N, U = k.shape[2], v.shape[3]
    R = H // N
    kh, vh = np.repeat(k, R, axis=2), np.repeat(v, R, axis=2)  # head h reads kv head h // R
    seg = np.asarray(seg)
    mask = np.tril(np.ones((S, S), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.einsum("bshk,bthk->bhst", q, kh) * scale
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthu->bshu", p, vh)
    dp = np.einsum("bshu,bthu->bhst", dout, vh)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhst,bthk->bshk", ds, kh)
    dk = scale * np.einsum("bhst,bshk->bthk", ds, q).reshape(B, S, N, R, K).sum(3)
    dv = np.einsum("bhst,bshu->bthu", p, dout).reshape(B, S, N, R, U).sum(3)
    return o, dq, dk, dv


def inputs(seed, B, S, H, N, K, U, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for shape in
                     ((B, S, H, K), (B, S, N, K), (B, S, N, U), (B, S, H, U)))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, dout))


@functools.partial(jax.jit, static_argnames=("block_q", "block_k"))
def run(q, k, v, dout, seg, block_q, block_k):
    """Flash forward and (dq, dk, dv) for the cotangent `dout`, as one program."""
    def f(q, k, v):
        return flash_attention(q, k, v, seg, scale=q.shape[-1] ** -0.5, block_q=block_q,
                               block_k=block_k)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout.astype(out.dtype)))


def rel(got, want):
    """max |got - want| / max |want|: entries near zero make elementwise ratios meaningless."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# (B, S, H, N, K, U, block_q, block_k, document lengths per row)
CASES = {
    # MHA (N == H) with MLA's K = 24 != U = 16; blocks of 512 clamp to one 48-row block.
    "mha_mla_clamped": (1, 48, 4, 4, 24, 16, 512, 512, [[20, 28]]),
    "gqa_8_2": (1, 64, 8, 2, 16, 16, 16, 16, [[40, 24]]),
    "packed": (2, 64, 4, 2, 16, 16, 16, 16, [[20, 1, 43], [1, 30, 33]]),
    # S = 50 is no multiple of the blocks; block_q != block_k both ways.
    "bq_gt_bk": (2, 50, 4, 2, 24, 16, 16, 8, [[9, 1, 40], [50]]),
    "bq_lt_bk": (2, 50, 8, 2, 24, 16, 8, 16, [[25, 24, 1], [3, 47]]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_float64_reference(case):
    B, S, H, N, K, U, bq, bk, lengths = case
    seg = segments(lengths)
    q, k, v, dout = inputs(0, B, S, H, N, K, U)
    got = run(q, k, v, dout, seg, bq, bk)
    want = reference(q, k, v, seg, K ** -0.5, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        assert np.isfinite(np.asarray(g)).all(), name
        # float32 blockwise sums vs float64: a few ulps of the largest entry.
        assert rel(g, w) < 1e-5, (name, rel(g, w))


def pairs(segment_ids, block_q, block_k):
    """The (q block, k block) pairs the forward and the backward schedules visit."""
    pos = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    schedule = jax.jit(block_schedule, static_argnums=(4, 5))
    lo_i, hi_i, lo_j, hi_j = (np.asarray(x) for x in schedule(segment_ids, segment_ids, pos, pos,
                                                               block_q, block_k))
    fwd = {(i, j) for i in range(len(lo_i)) for j in range(lo_i[i], hi_i[i])}
    bwd = {(i, j) for j in range(len(lo_j)) for i in range(lo_j[j], hi_j[j])}
    return fwd, bwd


def tri(n):
    return {(i, j) for i in range(n) for j in range(i + 1)}


SCHEDULES = {
    # One document, block_q == block_k: the triangle, 4 * 5 / 2 = 10 pairs.
    "triangle": ([[64]], 16, 16, tri(4)),
    # block_q = 2 block_k: q block i sees key blocks 0 .. 2i + 1 (2 + 4 + 6 + 8 = 20).
    "bq_2bk": ([[64]], 16, 8, {(i, j) for i in range(4) for j in range(2 * i + 2)}),
    # block_k = 2 block_q: q blocks 2m, 2m + 1 see key blocks 0 .. m (1+1+2+2+3+3+4+4 = 20).
    "bk_2bq": ([[64]], 8, 16, {(i, j) for i in range(8) for j in range(i // 2 + 1)}),
    # S = 50: the last q block holds rows 48, 49 only; still the triangle.
    "ragged": ([[50]], 16, 16, tri(4)),
    # Two documents of 32: q blocks 2, 3 (document 2) skip key blocks 0, 1: 6 pairs, not 10.
    "two_docs": ([[32, 32]], 16, 16, {(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3)}),
    # A document boundary inside a block keeps the pair that straddles it: (2, 1) is needed
    # by rows 32.. of document 2 (it starts at 24), (2, 0) and (3, 0) are not.
    "straddle": ([[24, 40]], 16, 16, {(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 1), (3, 2),
                                       (3, 3)}),
    # A pair is skipped only if no row of the batch needs it: the union of both rows.
    "batch_union": ([[32, 32], [64]], 16, 16, tri(4)),
}


@pytest.mark.parametrize("sched", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_block_schedule_is_hand_derived(sched):
    lengths, bq, bk, want = sched
    fwd, bwd = pairs(segments(lengths), bq, bk)
    assert fwd == want
    assert bwd == want


def test_skipped_blocks_are_never_computed():
    """NaN in v poisons every block pair that is computed, even where it is masked (0 * NaN):
    query blocks that must skip the poisoned key block stay finite, forward and dq."""
    B, S, H, N, K, U = 1, 64, 4, 2, 16, 16
    q, k, v, dout = inputs(1, B, S, H, N, K, U)
    # Causal: key blocks 6, 7 (keys 48..63, block_k 8) lie above the diagonal of q blocks 0..2
    # (rows 0..47, block_q 16); block 6 is the first one past q block 2's last key block.
    seg = segments([[64]])
    out, dq, _, _ = run(q, k, v.at[:, 48:].set(jnp.nan), dout, seg, 16, 8)
    want_out, want_dq, _, _ = reference(q, k, v, seg, K ** -0.5, dout)
    assert rel(out[:, :48], want_out[:, :48]) < 1e-5
    assert rel(dq[:, :48], want_dq[:, :48]) < 1e-5
    assert np.isnan(np.asarray(out[:, 48:])).all()  # the poison does reach who sees it
    # Documents: key blocks 0, 1 are all document 1; q blocks 1..3 are all document 2.
    seg = segments([[16, 48]])
    out, dq, _, _ = run(q, k, v.at[:, :16].set(jnp.nan), dout, seg, 16, 8)
    want_out, want_dq, _, _ = reference(q, k, v, seg, K ** -0.5, dout)
    assert rel(out[:, 16:], want_out[:, 16:]) < 1e-5
    assert rel(dq[:, 16:], want_dq[:, 16:]) < 1e-5


def test_bfloat16_is_close_and_has_no_float32_dots():
    B, S, H, N, K, U = 2, 50, 4, 2, 24, 16
    seg = segments([[20, 1, 29], [50]])
    q, k, v, dout = inputs(2, B, S, H, N, K, U, jnp.bfloat16)
    got = run(q, k, v, dout, seg, 16, 8)
    want = reference(q, k, v, seg, K ** -0.5, dout)  # on the same bf16-rounded inputs
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.bfloat16, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        # bf16 keeps 8 bits: P and dS are rounded to bf16 before the dots (~0.4% each) and the
        # results once more; 3% of the largest entry leaves room for that and nothing more.
        assert rel(np.asarray(g, np.float32), w) < 3e-2, (name, rel(np.asarray(g, np.float32), w))

    dots = gemms.dot_general_dtypes(run.lower(q, k, v, dout, seg, 16, 8).as_text())
    # qk and pv forward; dv, dp, dk, dq backward; the recomputed qk: 7 dots.
    assert len(dots) == 7, dots
    assert all(lhs == rhs == "bf16" and out == "f32" for lhs, rhs, out in dots), dots


def temp_bytes(S, heads=2, block=256):
    """Compiled temp bytes of flash forward + backward at sequence length S (no execution)."""
    shapes = [jax.ShapeDtypeStruct((1, S, heads, 16), jnp.float32)] * 3
    grad = jax.grad(lambda q, k, v, seg: jnp.sum(flash_attention(
        q, k, v, seg, scale=0.25, block_q=block, block_k=block) ** 2), (0, 1, 2))
    compiled = jax.jit(grad).lower(*shapes, jax.ShapeDtypeStruct((1, S), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temp_memory_grows_linearly():
    small, large = temp_bytes(1024), temp_bytes(2048)
    # Measured 2.5 MB -> 2.8 MB (block buffers dominate); the xla path's [H, S, S] logits grow 4x
    # (33.6 MB -> 134 MB temp measured for the same shapes).
    assert large / small < 3.0, (small, large)
    assert large < 2 * 2048 * 2048 * 4 / 4, large  # a quarter of one float32 [H, S, S] buffer


def test_primal_and_saved_residuals(capsys):
    """Without differentiation the primal runs (and matches); under it the residuals are
    q, k, v (and the segment ids and token indices), the named output and the named
    logsumexp, nothing else."""
    q, k, v, dout = inputs(3, 2, 32, 4, 2, 16, 16)
    seg = jnp.asarray(segments([[32], [10, 22]]))
    attend = lambda q, k, v: flash_attention(q, k, v, seg, scale=0.25, block_q=16, block_k=16)
    want, *_ = reference(q, k, v, seg, 0.25, dout)
    assert rel(jax.jit(attend)(q, k, v), want) < 1e-5
    print_saved_residuals(lambda q, k, v: jnp.sum(attend(q, k, v)), q, k, v)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7, lines
    assert sum("from the argument" in line for line in lines) == 3, lines
    assert sum(line.startswith("i32[") for line in lines) == 2, lines  # ids, indices [S]
    assert any("named 'attn_context'" in line and "f32[2,32,4,16]" in line for line in lines)
    assert any("named 'attn_lse'" in line and "f32[2,4,32]" in line for line in lines)


def test_sharded_heads_and_typed_shard_map():
    """Heads over 'tensor', batch over 'data' under jit; and inside a check_vma shard_map manual
    over 'pipeline' (how the pipeline runs stages). Both match the float64 reference."""
    B, S, H, N, K, U = 4, 40, 4, 2, 16, 16
    seg = segments([[40], [12, 28], [1, 39], [20, 20]])
    q, k, v, dout = inputs(4, B, S, H, N, K, U)
    want = reference(q, k, v, seg, 0.25, dout)

    def grads(q, k, v, seg, dout):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg, scale=0.25,
                                                           block_q=16, block_k=16), q, k, v)
        return (out, *vjp(dout))

    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "pipeline"),
                         axis_types=(AxisType.Auto,) * 3)
    heads = NamedSharding(mesh, P("data", None, "tensor"))
    args = [jax.device_put(x, heads) for x in (q, k, v)]
    got = jax.jit(grads)(*args, jnp.asarray(seg), jax.device_put(dout, heads))
    staged = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P("pipeline"),) * 5,
                                   out_specs=(P("pipeline"),) * 4, axis_names={"pipeline"},
                                   check_vma=True))
    got_staged = staged(q, k, v, jnp.asarray(seg), dout)
    for name, g, s, w in zip(("out", "dq", "dk", "dv"), got, got_staged, want):
        assert rel(g, w) < 1e-5, (name, rel(g, w))
        assert rel(s, w) < 1e-5, (name, rel(s, w))
