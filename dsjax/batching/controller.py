"""The batch-size controller: host-side policy (fixed, a tokens-seen ramp, or the adaptive grow /
shrink rule with hysteresis), deterministic in its readings so a resumed run decides the same."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable

from dsjax.config import BatchConfig, ConfigError


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
                "changes": [dataclasses.asdict(c) for c in self.changes],
                "policy": self.cfg.policy, "ladder": list(self.ladder)}

    def set_state(self, state: dict[str, Any]) -> str | None:
        """Restores a checkpoint's state (None), or keeps this run's starting state and says why:
        a state written under another batch.policy means nothing here (its size, streak and
        ceiling were that rule's). Under the same policy a size off the ladder is an error."""
        policy = state.get("policy", self.cfg.policy)  # not recorded before: assume unchanged
        if policy != self.cfg.policy:
            return (f"the batch-size controller starts fresh at batch {self.size}: batch.policy "
                    f"changed from {policy} to {self.cfg.policy} (the data cursor is restored)")
        if state["size"] not in self.ladder:
            raise ConfigError(f"batch.ladder: the checkpoint was written at batch size "
                              f"{state['size']}, which is not on this run's ladder "
                              f"{','.join(map(str, self.ladder))}; add it to batch.ladder")
        self.size, self.streak, self.direction = state["size"], state["streak"], state["direction"]
        self.since_change, self.ceiling = state["since_change"], state["ceiling"]
        self.changes = [Change(**c) for c in state.get("changes", [])]
        return None
