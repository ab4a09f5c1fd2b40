"""Dynamic global batch size: a ladder of sizes, gradient accumulation, memory predicted from the
compiled program, and the controller that moves along the ladder.

The one idea: in JAX every batch shape is its own compiled program, so the global batch moves on a
fixed ladder (`batch.ladder`) and each size G is realised as

    G = micro_batch (rows per data-parallel replica per micro-step) x accum_steps x mesh.data.

A step's input is [accum_steps, G / accum_steps, S] (micro-batch first, each micro-batch sharded
over `data`; a 2-D [G, S] batch when accum_steps = 1), and `accumulate` sums the micro-batches'
gradients with `lax.scan` inside the one compiled step. `Programs` compiles each (phase, shape)
once, ahead of time (`jit(...).lower(...).compile()`, cached, counted), on demand or in a
background thread, and the compiled program's `memory_analysis()` is the memory prediction:
`plan_micro_batch` picks the largest micro-batch predicted to fit `batch.mem_fraction` of device
memory before it ever runs. `Controller` decides the size (fixed; a tokens-seen ramp like
DeepSeek-V3's; or the recipe's adaptive grow x1.5 / shrink x0.8 rule with hysteresis) and
`Batcher` connects it to the sample stream (a global sample cursor, `dsjax.data.SampleStream`) and
the training loop. docs/batching.md has the details and measurements.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from dsjax.config import BatchConfig, ConfigError
from dsjax.metrics.memory import device_memory_bytes, memory_stats, predicted_bytes

# ---------------------------------------------------------------------------------------------
# Shapes, learning-rate rescaling, and the accumulated gradient (inside the compiled step).


@dataclasses.dataclass(frozen=True)
class Shape:
    """One realisation of a global batch: batch = micro_batch x accum_steps x data."""
    batch: int  # global rows per optimizer step
    accum_steps: int  # micro-batches summed by one step
    data: int  # data-parallel replicas

    @property
    def micro_batch(self) -> int:
        """Rows per data-parallel replica per micro-step."""
        return self.batch // (self.accum_steps * self.data)

    @property
    def rows(self) -> int:
        """Global rows of one micro-batch."""
        return self.batch // self.accum_steps


def lr_scale(batch: int, reference: int, rule: str) -> float:
    """The learning-rate multiplier for `batch` rows against `reference`: 1, B/B0 or sqrt(B/B0)."""
    ratio = batch / reference
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def _no_observation(tree: Any) -> Any:
    """Zeros shaped like a gradient tree, except fp8 amax observations: -inf ("unused"), the
    identity of the maximum that combines them (dsjax.fp8.combine)."""
    from dsjax import fp8  # pylint: disable=import-outside-toplevel

    def unused(m):
        return m.replace(amax=jnp.full(m.amax.shape, -jnp.inf, m.amax.dtype))

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    return jax.tree.map(lambda n: unused(n) if isinstance(n, fp8.Fp8Meta) else n, zeros,
                        is_leaf=lambda n: isinstance(n, fp8.Fp8Meta))


def accumulate(grad_fn: Callable[[dict], tuple[Any, Any, Any]], batch: dict[str, jax.Array],
               vary: Callable[[Any], Any] = lambda x: x) -> tuple[Any, Any, Any]:
    """`grad_fn(micro_batch) -> (sums, grads, fp8 observations)` over every micro-batch of
    `batch`, with `lax.scan` over its leading axis ([k, b, S] arrays; a [b, S] batch is one
    micro-batch and calls `grad_fn` once). `sums` and `grads` are added, the fp8 amax
    observations max-combined (dsjax.fp8.combine), so with `grad_fn` differentiating each
    micro-batch's share of the *whole* batch's mean loss, the result is the big batch's gradient.
    `vary`: applied to the zero carry; inside a typed `shard_map` it must make it varying over the
    axes `grad_fn`'s outputs vary over (scan needs equal carry types)."""
    from dsjax import fp8  # pylint: disable=import-outside-toplevel

    if batch["inputs"].ndim == 2:
        return grad_fn(batch)
    first = jax.tree.map(lambda x: x[0], batch)
    init = vary(_no_observation(jax.eval_shape(grad_fn, first)))

    def body(carry, micro):
        sums, grads, seen = grad_fn(micro)
        acc_sums, acc_grads, acc_seen = carry
        return (jax.tree.map(jnp.add, acc_sums, sums), jax.tree.map(jnp.add, acc_grads, grads),
                fp8.combine(acc_seen, seen)), None

    out, _ = lax.scan(body, init, batch)
    return out


def scale_updates(updates: Any, scale: float) -> Any:
    """Optimizer updates times the lr multiplier (Adam's update is -lr x direction, weight decay
    included, so this is the same as scaling the learning rate). No-op at 1."""
    if scale == 1.0:
        return updates
    return jax.tree.map(lambda u: u * jnp.asarray(scale, u.dtype), updates)


# ---------------------------------------------------------------------------------------------
# Host batches and their device layout.


def step_sharding(base: NamedSharding, ndim: int) -> NamedSharding:
    """The sharding of one batch array with `ndim` dims: `base` ([B, S], B over `data`), with a
    leading unsharded micro-batch axis for [k, B/k, S]."""
    return base if ndim == 2 else NamedSharding(base.mesh, P(None, *base.spec))


def host_layout(host_batch: dict[str, np.ndarray], accum_steps: int, workers: int
                ) -> dict[str, np.ndarray]:
    """This process's [R, S] rows -> [k, R/k, S] for k accumulation steps over its `workers`
    data-parallel shards. Without accumulation worker w holds rows [w R/W, (w+1) R/W); here
    micro-batch i holds each worker's i-th stretch of those same rows, so every worker sums
    exactly the rows it would have had (1-bit Adam compresses per worker: its result depends on
    it). k = 1 keeps [R, S]."""
    if accum_steps == 1:
        return host_batch
    out = {}
    for key, v in host_batch.items():
        m = v.shape[0] // (workers * accum_steps)
        per_worker = v.reshape(workers, accum_steps, m, *v.shape[1:])
        out[key] = per_worker.swapaxes(0, 1).reshape(accum_steps, workers * m, *v.shape[1:])
    return out


def abstract_batch(batch_shardings: dict[str, NamedSharding], shape: Shape, seq_len: int
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """A step's input for `shape` as abstract arrays with their shardings (for lowering)."""
    dims = (shape.batch, seq_len) if shape.accum_steps == 1 else (
        shape.accum_steps, shape.rows, seq_len)
    return {k: jax.ShapeDtypeStruct(dims, jnp.float32 if k == "weights" else jnp.int32,
                                    sharding=step_sharding(s, len(dims)))
            for k, s in batch_shardings.items()}


def batch_shape(batch: dict[str, Any], data: int) -> Shape:
    """The `Shape` of a device or host batch."""
    dims = batch["inputs"].shape
    return Shape(dims[0], 1, data) if len(dims) == 2 else Shape(dims[0] * dims[1], dims[0], data)


# ---------------------------------------------------------------------------------------------
# Compiled programs and the memory prediction.


class Programs:
    """The compiled train step per (phase, accum_steps, micro-batch rows): each compiled once,
    ahead of time, inline or in one background thread, and its predicted memory. `phase` indexes
    `trainer.phase_fns` (1-bit Adam: 0 warmup, 1 compressed). The learning-rate multiplier of a
    shape's global batch is a compile-time constant of its program: no extra compilations."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        cfg = trainer.cfg
        self.data = cfg.mesh.data
        self.seq_len = cfg.data.seq_len
        self.reference = cfg.batch.reference_batch or cfg.data.global_batch
        self.rule = cfg.batch.lr_scaling
        self._futures: dict[tuple[int, int, int], Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._abstract_state = None
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

    def _compile(self, key: tuple[int, int, int]) -> Any:
        from dsjax import sharding  # pylint: disable=import-outside-toplevel
        from dsjax.train import abstract_state  # pylint: disable=import-outside-toplevel

        phase, accum, rows = key
        t = self.trainer
        if self._abstract_state is None:
            self._abstract_state = abstract_state(t)
        shape = Shape(accum * rows, accum, self.data)
        fn = functools.partial(t.phase_fns[phase],
                               lr_scale=lr_scale(shape.batch, self.reference, self.rule))
        batch = abstract_batch(t.batch_shardings, shape, self.seq_len)
        jitted = jax.jit(fn, in_shardings=(t.state_shardings, {k: v.sharding
                                                                for k, v in batch.items()}),
                         out_shardings=(t.state_shardings, NamedSharding(t.mesh, P())),
                         donate_argnums=0)
        with sharding.activate(t.mesh, t.rules):  # the logical rules are per thread
            compiled = jitted.lower(self._abstract_state, batch).compile()
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

    def phase_at(self, step: int) -> int:
        """The phase step `step` (0-based, no skipped steps) runs in: 1-bit Adam compresses from
        optim.freeze_step on."""
        return int(len(self.trainer.phase_fns) > 1 and step >= self.trainer.cfg.optim.freeze_step)

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


# ---------------------------------------------------------------------------------------------
# The controller: host-side policy, deterministic in its readings.


@dataclasses.dataclass
class Change:
    """One batch-size change, as logged and recorded."""
    step: int  # the first step that runs at the new size
    old: int
    new: int
    reason: str


class Controller:
    """Chooses the global batch on the ladder.

    fixed: data.global_batch. ramp: the `batch.ramp` schedule of tokens seen, linear between its
    points and snapped down to the ladder. adaptive: the recipe's rule, one reading per step:
    shrink x`shrink` when memory passes `threshold`; grow x`grow` when it is below and the step
    time is below `target_step_ms` (0: no time rule) and the target's *predicted* memory is below
    too. Snapped down to the ladder, at least one rung. Hysteresis: `patience` agreeing readings in
    a row, `cooldown` readings after a change, and a size that had to be shrunk from (or whose
    prediction vetoed a growth) becomes a ceiling that is never grown to again, so the size
    cannot oscillate. A reading with an unknown step time (a step that compiled) under a time
    rule neither counts nor breaks a streak. All of it is a function of the readings, so a
    resumed run (state restored) decides exactly as the uninterrupted one would.
    """

    def __init__(self, cfg: BatchConfig, ladder: tuple[int, ...], start: int,
                 predict_fraction: Callable[[int], float | None] = lambda size: None,
                 prefetch: Callable[[int], None] = lambda size: None):
        self.cfg = cfg
        self.ladder = ladder
        self.threshold = cfg.mem_fraction
        self.predict_fraction = predict_fraction  # predicted memory / budget base of a size
        self.prefetch = prefetch  # start compiling a size we may switch to
        self.size = start
        self.streak = 0  # consecutive readings proposing `direction`
        self.direction = 0  # +1 grow, -1 shrink, 0 hold
        self.since_change = 0  # readings since the last change
        self.ceiling: int | None = None  # sizes >= this are never grown to
        self.changes: list[Change] = []

    # -- sizes ------------------------------------------------------------------------------
    def snap(self, target: float, direction: int) -> int:
        """The largest ladder size <= target, moved at least one rung from `self.size`."""
        i = self.ladder.index(self.size)
        j = bisect.bisect_right(self.ladder, target) - 1
        j = max(j, i + 1) if direction > 0 else min(j, i - 1)
        return self.ladder[min(max(j, 0), len(self.ladder) - 1)]

    def ramp_size(self, tokens: float) -> int:
        """The ramp schedule's size at `tokens` seen (linear between points, snapped down)."""
        points = self.cfg.ramp_points
        if tokens <= points[0][0]:
            target = points[0][1]
        elif tokens >= points[-1][0]:
            target = points[-1][1]
        else:
            k = bisect.bisect_right([t for t, _ in points], tokens)
            (t0, b0), (t1, b1) = points[k - 1], points[k]
            target = b0 + (b1 - b0) * (tokens - t0) / (t1 - t0)
        return self.ladder[max(bisect.bisect_right(self.ladder, target) - 1, 0)]

    # -- decisions --------------------------------------------------------------------------
    def update_ramp(self, step: int, tokens: float, lookahead_tokens: float) -> Change | None:
        """ramp: the size for a step that starts at `tokens` seen; prefetches the next size."""
        upcoming = self.ramp_size(tokens + lookahead_tokens)
        if upcoming != self.ramp_size(tokens):
            self.prefetch(upcoming)
        return self._apply(step, self.ramp_size(tokens), f"ramp: {tokens:.4g} tokens seen")

    def observe(self, step: int, mem_fraction: float | None, step_ms: float | None
                ) -> Change | None:
        """adaptive: one step's reading (memory as a fraction of device memory, None if unknown;
        step time, None if not timed). A change applies from `step` on."""
        if self.cfg.policy != "adaptive":
            return None
        b = self.cfg
        self.since_change += 1
        mem_ok = mem_fraction is None or mem_fraction < self.threshold
        if not mem_ok and self.size > self.ladder[0]:
            direction, target = -1, self.snap(self.size * b.shrink, -1)
        elif mem_ok and self.size < self.ladder[-1]:
            if b.target_step_ms and step_ms is None:
                return None  # no time reading: neither counts nor breaks the streak
            fast = not b.target_step_ms or step_ms < b.target_step_ms
            target = self.snap(self.size * b.grow, +1)
            capped = self.ceiling is not None and target >= self.ceiling
            direction = +1 if fast and not capped else 0
        else:
            direction, target = 0, self.size
        if direction != self.direction:
            self.direction, self.streak = direction, 0
            if direction:
                self.prefetch(target)  # compiled in the background while the streak builds
        if not direction:
            return None
        self.streak += 1
        if self.streak < b.patience or self.since_change <= b.cooldown:
            return None
        mem = "unknown" if mem_fraction is None else f"{100 * mem_fraction:.0f}%"
        if direction < 0:
            self.ceiling = self.size
            return self._apply(step, target, f"shrink x{b.shrink}: memory {mem} >= "
                                             f"{100 * self.threshold:.0f}% for {self.streak} steps")
        predicted = self.predict_fraction(target)
        if predicted is not None and predicted >= self.threshold:
            self.ceiling, self.direction, self.streak = target, 0, 0
            return Change(step, self.size, self.size, f"no growth to {target}: predicted memory "
                                                      f"{100 * predicted:.0f}% >= "
                                                      f"{100 * self.threshold:.0f}%")
        timing = f", step {step_ms:.0f} ms < {b.target_step_ms:.0f} ms" if b.target_step_ms else ""
        pred = "" if predicted is None else f", predicted at {target}: {100 * predicted:.0f}%"
        return self._apply(step, target, f"grow x{b.grow}: memory {mem} < "
                                         f"{100 * self.threshold:.0f}%{timing}{pred} for "
                                         f"{self.streak} steps")

    def _apply(self, step: int, size: int, reason: str) -> Change | None:
        if size == self.size:
            return None
        change = Change(step, self.size, size, reason)
        self.size, self.streak, self.direction, self.since_change = size, 0, 0, 0
        self.changes.append(change)
        return change

    # -- checkpointing ----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {"size": self.size, "streak": self.streak, "direction": self.direction,
                "since_change": self.since_change, "ceiling": self.ceiling,
                "changes": [dataclasses.asdict(c) for c in self.changes]}

    def set_state(self, state: dict[str, Any]) -> None:
        if state["size"] not in self.ladder:
            raise ConfigError(f"batch.ladder: the checkpoint was written at batch size "
                              f"{state['size']}, which is not on this run's ladder "
                              f"{','.join(map(str, self.ladder))}; add it to batch.ladder")
        self.size, self.streak, self.direction = state["size"], state["streak"], state["direction"]
        self.since_change, self.ceiling = state["since_change"], state["ceiling"]
        self.changes = [Change(**c) for c in state.get("changes", [])]


# ---------------------------------------------------------------------------------------------
# The training loop's view: which shape the next step has, its host batch, its record.


class Batcher:
    """Connects the controller, the compiled programs and the sample stream for `train.run`.

    Per step the loop calls `next_batch()` (the host batch of the next shape, read at the
    stream's cursor), runs it with `trainer.step`, and after reading the step's metrics calls
    `observe` (adaptive). `get_state()` is what the checkpoint's `data` item holds: the stream
    cursor and the controller.
    """

    def __init__(self, trainer: Any, stream: Any, log: Callable[[str], None] = print):
        cfg = trainer.cfg
        self.cfg = cfg.batch
        self.data = cfg.mesh.data
        self.workers = max(self.data // jax.process_count(), 1)  # data shards of this process
        self.seq_len = cfg.data.seq_len
        self.stream = stream
        self.programs: Programs = trainer.programs
        self.log = log
        self.capacity = device_memory_bytes(trainer.mesh.local_devices[0],
                                            self.cfg.device_memory_gb)
        self.budget = self.cfg.mem_fraction * self.capacity
        self.device = trainer.mesh.local_devices[0]
        self._plans: dict[int, Shape] = {}
        self._calibration = 1.0  # measured peak / predicted, where the device reports a peak
        self._largest_run = 0
        self.step = 0  # batches made so far = the next step's index (run() sets it on resume)
        self._changes_reported = 0
        ladder = self.cfg.sizes(cfg.data.global_batch)
        start = cfg.data.global_batch
        self.controller = Controller(self.cfg, ladder, start, self._predicted_fraction,
                                     self._prefetch)
        if self.cfg.policy == "ramp":
            self.controller.size = self.controller.ramp_size(0)

    # -- plans ------------------------------------------------------------------------------
    def plan(self, batch: int) -> Shape:
        """The shape of global batch `batch`: `batch.micro_batch`, or the largest micro-batch
        predicted to fit the budget (compiles candidates; cached)."""
        if batch not in self._plans:
            per_replica = batch // self.data
            if self.cfg.micro_batch:
                micro, nbytes, fits = self.cfg.micro_batch, None, True
            else:
                phase = self.programs.phase_at(self.step)
                micro, nbytes, fits = plan_micro_batch(
                    per_replica, lambda m: self.programs.predict(
                        Shape(batch, per_replica // m, self.data), phase), self.budget)
            shape = Shape(batch, per_replica // micro, self.data)
            if not fits:
                self.log(f"warning: batch {batch}: even micro-batch 1 is predicted at "
                         f"{nbytes / 2**30:.2f} GiB, over the budget {self.budget / 2**30:.2f} "
                         f"GiB (batch.mem_fraction x device memory)")
            elif nbytes is not None:
                self.log(f"batch {batch}: micro-batch {micro} x {shape.accum_steps} accumulation "
                         f"x {self.data} data-parallel, predicted {nbytes / 2**30:.2f} GiB of a "
                         f"{self.budget / 2**30:.2f} GiB budget ({self.programs.compilations} "
                         f"programs compiled so far)")
            self._plans[batch] = shape
        return self._plans[batch]

    def _prefetch(self, batch: int) -> None:
        # The earliest step the switch can apply to: after the streak (adaptive) or within the
        # lookahead (ramp). If 1-bit Adam changes phase before then, compile when it is needed.
        c = self.controller
        ahead = self.cfg.patience if self.cfg.policy == "ramp" else max(
            self.cfg.patience - 1, self.cfg.cooldown + 1 - c.since_change, 0)
        phase = self.programs.phase_at(self.step + ahead)
        if phase != self.programs.phase_at(self.step):
            return
        shape = self._plans.get(batch)
        if shape is None and (self.cfg.micro_batch or math.isinf(self.budget)):
            shape = self.plan(batch)  # no compilation needed to plan
        if shape is not None:
            self.programs.prefetch(shape, phase)
        # else: planning compiles; the decision point plans (and waits) when it needs the shape

    def _predicted_fraction(self, batch: int) -> float | None:
        if math.isinf(self.capacity):
            return None
        shape = self.plan(batch)
        return (self.programs.predict(shape, self.programs.phase_at(self.step)) *
                self._calibration / self.capacity)

    # -- the loop ---------------------------------------------------------------------------
    def shape(self) -> Shape:
        """The shape of the next step (ramp: from the tokens the stream has yielded)."""
        if self.cfg.policy == "ramp":
            tokens = self.stream.cursor * self.seq_len
            ahead = self.cfg.patience * self.controller.size * self.seq_len
            change = self.controller.update_ramp(self.step, tokens, ahead)
            self._report(change)
        return self.plan(self.controller.size)

    def next_batch(self) -> tuple[dict[str, np.ndarray], Shape]:
        """The next step's host batch (this process's rows of the stream, micro-batch first)."""
        shape = self.shape()
        rows = self.stream.take(shape.batch)
        self.step += 1
        return host_layout(rows, shape.accum_steps, self.workers), shape

    def observe(self, fields: dict[str, Any], step_ms: float | None) -> None:
        """One finished step's reading (`fields`: its `record`; step time None if untimed).
        Memory: the program's prediction, scaled by how far the device's measured peak has
        exceeded predictions (where the device reports a peak)."""
        predicted = fields.get("predicted_mem_bytes")
        self._calibrate(predicted)
        fraction = (None if predicted is None or math.isinf(self.capacity) else
                    predicted * self._calibration / self.capacity)
        # The step after the one in flight is the next batch this object makes.
        self._report(self.controller.observe(self.step, fraction, step_ms))

    def _calibrate(self, predicted: int | None) -> None:
        # The allocator's peak is a lifetime peak: attribute it only to the largest program run.
        stats = memory_stats(self.device)
        if not predicted or not stats or "peak_bytes_in_use" not in stats:
            return
        if predicted >= self._largest_run:
            self._largest_run = predicted
            self._calibration = max(1.0, stats["peak_bytes_in_use"] / predicted)

    def _report(self, change: Change | None) -> None:
        if change is None:
            return
        if change.new == change.old:
            self.log(f"batch size stays {change.old}: {change.reason}")
            return
        shape = self.plan(change.new)
        self.log(f"batch size {change.old} -> {change.new} from step {change.step + 1} "
                 f"(micro-batch {shape.micro_batch} x {shape.accum_steps} accumulation x "
                 f"{self.data} data-parallel): {change.reason}")

    def record(self, shape: Shape) -> dict[str, Any]:
        """A dispatched step's batch fields (host values, carried with its metrics)."""
        key = (self.programs.last_phase, shape.accum_steps, shape.rows)
        out = {"batch_size": shape.batch, "micro_batch": shape.micro_batch,
               "accum_steps": shape.accum_steps, "compilations": self.programs.compilations}
        if key in self.programs.memory:
            out["predicted_mem_bytes"] = self.programs.memory[key]
        return out

    def record_fields(self, fields: dict[str, Any], step_idx: int) -> dict[str, Any]:
        """The batch part of step `step_idx`'s metrics.jsonl record: its `record`, the changes
        that took effect since the last record (with reasons), and measured peak / predicted
        where the device has a peak."""
        out = {k: fields[k] for k in ("batch_size", "micro_batch", "accum_steps",
                                      "predicted_mem_bytes", "compilations") if k in fields}
        changes = self.controller.changes
        new = [c for c in changes[self._changes_reported:] if c.step <= step_idx]
        self._changes_reported += len(new)
        if new:
            out["batch_changes"] = [dataclasses.asdict(c) for c in new]
        if self._largest_run:
            out["mem_peak_over_predicted"] = self._calibration
        return out

    def summary(self) -> dict[str, Any]:
        """For summary.json: every change, the compilations, and each compiled shape (phase,
        accumulation, micro-batch rows, predicted bytes, whether a step ran it: a prefetched
        size whose streak broke, or a planning candidate, was compiled but not run)."""
        return {"batch_changes": [dataclasses.asdict(c) for c in self.controller.changes],
                "compilations": self.programs.compilations,
                "batch_shapes": [{"phase": p, "accum_steps": k, "rows": r,
                                  "predicted_mem_bytes": self.programs.memory.get((p, k, r)),
                                  "used": (p, k, r) in self.programs.used}
                                 for p, k, r in self.programs.shapes()]}

    # -- checkpointing ----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The checkpoint's `data` item: {"cursor": samples consumed, "batch": controller}."""
        return {**self.stream.get_state(), "batch": self.controller.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)
        if "batch" in state:
            self.controller.set_state(state["batch"])
            self._changes_reported = len(self.controller.changes)
