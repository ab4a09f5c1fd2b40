"""The one compile path: each train-step program (phase x batch shape) compiled once, ahead of
time, inline or in a background thread, with its predicted memory; and the micro-batch planner
that uses those predictions to fit a batch into device memory before it ever runs."""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsjax import sharding
from dsjax.batching.shapes import Shape, abstract_batch, lr_scale
from dsjax.metrics.memory import predicted_bytes


class Programs:
    """The compiled train step per (phase, accum_steps, micro-batch rows): each compiled once,
    ahead of time, inline or in one background thread, and its predicted memory. `phase` indexes
    `phase_fns` (1-bit Adam: 0 warmup, 1 compressed). The learning-rate multiplier of a shape's
    global batch is a compile-time constant of its program: no extra compilations.

    It sees only what compiling needs: the step functions, the mesh and its logical rules, the
    state's shardings and its abstract value (`abstract_state()`, asked for at the first compile),
    the batch's shardings and media layout, and the learning-rate rule (`lr_scale`'s
    `reference` batch and `rule`)."""

    def __init__(self, phase_fns: tuple[Callable, ...], mesh: Mesh, rules: Any,
                 state_shardings: Any, abstract_state: Callable[[], Any],
                 batch_shardings: dict[str, NamedSharding],
                 media: dict[str, tuple[tuple[int, ...], Any]], seq_len: int, reference: int,
                 rule: str):
        self.phase_fns, self.mesh, self.rules = phase_fns, mesh, rules
        self.state_shardings, self.abstract_state = state_shardings, abstract_state
        self.batch_shardings, self.media = batch_shardings, media
        self.data = sharding.data_size(mesh)
        self.seq_len = seq_len
        self.reference = reference
        self.rule = rule
        self._futures: dict[tuple[int, int, int], Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.memory: dict[tuple[int, int, int], int] = {}
        self.used: set[tuple[int, int, int]] = set()  # shapes a step ran with (not just compiled)
        self.last_phase = 0

    @property
    def compilations(self) -> int:
        """Programs compiled so far (one per distinct phase and shape ever asked for)."""
        with self._lock:
            return sum(f.done() and f.exception() is None for f in self._futures.values())

    def shapes(self) -> list[tuple[int, int, int]]:
        """(phase, accum_steps, rows) of every program compiled or being compiled."""
        with self._lock:
            return sorted(self._futures)

    def jitted(self, phase: int, shape: Shape) -> Any:
        """The jitted (not yet compiled) step of `phase` for `shape`: in/out shardings, donated
        state, the shape's learning-rate multiplier bound. `.lower(...)` it to inspect HLO."""
        fn = functools.partial(self.phase_fns[phase],
                               lr_scale=lr_scale(shape.batch, self.reference, self.rule))
        batch = abstract_batch(self.batch_shardings, shape, self.seq_len, self.media)
        return jax.jit(fn, in_shardings=(self.state_shardings, {k: v.sharding
                                                                 for k, v in batch.items()}),
                       out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                       donate_argnums=0)

    def _compile(self, key: tuple[int, int, int]) -> Any:
        phase, accum, rows = key
        shape = Shape(accum * rows, accum, self.data)
        batch = abstract_batch(self.batch_shardings, shape, self.seq_len, self.media)
        with sharding.activate(self.mesh, self.rules):  # the logical rules are per thread
            compiled = self.jitted(phase, shape).lower(self.abstract_state(), batch).compile()
        self.memory[key] = predicted_bytes(compiled)
        return compiled

    def _future(self, key: tuple[int, int, int], background: bool) -> Future:
        with self._lock:
            future = self._futures.get(key)
            inline = future is None and not background
            if future is None:
                if background:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsjax-compile")
                    future = self._pool.submit(self._compile, key)
                else:
                    future = Future()
                self._futures[key] = future
        if inline:
            try:
                future.set_result(self._compile(key))
            except BaseException as e:  # the caller sees it; a later get raises it again
                future.set_exception(e)
        return future

    def get(self, phase: int, shape: Shape) -> Any:
        """The compiled step for `shape` (compiling it now, or waiting for the background)."""
        self.last_phase = phase
        key = (phase, shape.accum_steps, shape.rows)
        self.used.add(key)
        return self._future(key, background=False).result()

    def prefetch(self, shape: Shape, phase: int | None = None) -> None:
        """Starts compiling `shape` in the background (the phase last run by default)."""
        phase = self.last_phase if phase is None else phase
        self._future((phase, shape.accum_steps, shape.rows), background=True)

    def predict(self, shape: Shape, phase: int | None = None) -> int:
        """Predicted per-device bytes of the step for `shape` (compiles it if needed)."""
        phase = self.last_phase if phase is None else phase
        key = (phase, shape.accum_steps, shape.rows)
        self._future(key, background=False).result()
        return self.memory[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_micro_batch(rows_per_replica: int, predict: Callable[[int], int], budget: float
                     ) -> tuple[int, int | None, bool]:
    """(micro-batch, its predicted bytes, fits) for one global batch: the largest divisor m of
    `rows_per_replica` with predict(m) <= budget, found by bisection over the divisors (memory
    grows with m), so a ladder size costs ~log2(#divisors) compilations, all cached. With an
    infinite budget nothing is compiled here. If even m = 1 does not fit: (1, bytes, False)."""
    cands = divisors(rows_per_replica)
    if math.isinf(budget):
        return cands[-1], None, True
    lo, hi, best = 0, len(cands) - 1, None  # invariant: cands[< lo] fit, cands[> hi] do not
    while lo <= hi:
        mid = (lo + hi) // 2
        nbytes = predict(cands[mid])
        if nbytes <= budget:
            best, lo = (cands[mid], nbytes), mid + 1
        else:
            hi = mid - 1
    if best is None:
        return 1, predict(1), False
    return best[0], best[1], True
