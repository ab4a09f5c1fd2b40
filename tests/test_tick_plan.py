"""The hand-backward schedules' tick arithmetic (`one_f_one_b.tick_plan`), simulated for many
stage, chunk and microbatch counts: every unit runs once forward and once backward on every
stage, after its inputs, and finds its own residuals in the stash ring. The JAX tests in
test_pipeline.py check the numbers at a few small sizes; this checks the plan at larger ones."""

import itertools

import pytest

from dsjax import pipeline
from dsjax.pipeline.one_f_one_b import stash_slots, tick_plan

SIZES = [(S, R, M) for S, R, g in itertools.product((2, 3, 4), (1, 2, 3), (1, 2, 3))
         for M in (S * g,)]


@pytest.mark.parametrize("S, R, M", SIZES, ids=lambda v: str(v))
def test_every_unit_runs_after_its_inputs_and_finds_its_residuals(S, R, M):
    T, K = pipeline.ticks("interleaved_1f1b" if R > 1 else "1f1b", S, M, R), stash_slots(S, R)
    fwd, bwd = {}, {}  # (stage, microbatch, chunk) -> tick
    ring = [[None] * K for _ in range(S)]
    last_busy = -1
    for t in range(T + 3):  # a few ticks past the end: nothing may be left to do
        for s in range(S):
            p = tick_plan(t, s, S, R, M)
            unit_f = (int(p.mf), int(p.rf))
            ring[s][int(p.put_at)] = unit_f if p.on_f else "idle"  # idle ticks write too
            if p.on_f:
                assert (s, *unit_f) not in fwd, ("forward twice", s, unit_f)
                fwd[s, *unit_f] = t
                m, r = unit_f
                if s > 0:  # from the previous stage, the tick before
                    assert fwd.get((s - 1, m, r)) == t - 1, (s, m, r, t)
                elif r > 0:  # stage 0, a later chunk: from the last stage's earlier chunk
                    assert fwd.get((S - 1, m, r - 1)) == t - 1, (s, m, r, t)
            if p.on_b:
                m, r = int(p.mb), int(p.rb)
                assert (s, m, r) not in bwd, ("backward twice", s, m, r)
                bwd[s, m, r] = t
                if s < S - 1:
                    assert bwd.get((s + 1, m, r)) == t - 1, (s, m, r, t)
                elif r < R - 1:  # the last stage: from stage 0's later chunk
                    assert bwd.get((0, m, r + 1)) == t - 1, (s, m, r, t)
                else:  # the unit leaving the pipeline turns around in its forward's tick
                    assert fwd.get((s, m, r)) == t, (s, m, r, t)
                # Its residuals, stashed by its forward and not overwritten since.
                assert ring[s][int(p.take_at)] == (m, r), (s, m, r, t, ring[s])
            if p.on_f or p.on_b:
                last_busy = max(last_busy, t)
    every = {(s, m, r) for s in range(S) for m in range(M) for r in range(R)}
    assert set(fwd) == every and set(bwd) == every
    assert last_busy == T - 1  # `ticks` is exactly the schedule's length


def test_ticks_and_bubble_fractions():
    # Interleaving: R*M units per stage; the bubble (S-1)/(R*M + S-1) (Megatron-LM's).
    assert pipeline.ticks("1f1b", 4, 8) == 8 + 2 * 3
    assert pipeline.ticks("interleaved_1f1b", 4, 8, 2) == 16 + 3 * 4 - 2
    assert pipeline.ticks("circular", 4, 8, 2) == 16 + 3
    assert pipeline.bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert pipeline.bubble_fraction("interleaved_1f1b", 4, 8, 1) == pytest.approx(3 / 11)
    # MoE stages run every tick: (R+1)S - 2 idle ticks of R*M + (R+1)S - 2.
    assert pipeline.bubble_fraction("interleaved_1f1b", 4, 8, 2, moe=True) == pytest.approx(
        10 / 26)
    # repeats mean nothing to the non-interleaved schedules
    assert pipeline.bubble_fraction("1f1b", 4, 8, 3) == pytest.approx(3 / 11)
