"""The controller of `fp8.select=auto`: probes before the first step and every
`fp8.probe_every` steps, demotes a layer at once when its gradient norm or the loss spikes,
switches the trainer to the new map (a recompilation only when the map changes, and each map's
programs are kept), logs every change, and saves all of it with each checkpoint.

The one idea: every decision is a function of the step index, the training batches and the
saved state, so a resumed run makes the same decisions as one that never stopped.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import layer_map
from dsjax.fp8_probe import STATS
from dsjax.precision.choose import (SPIKE_WINDOW, Choices, describe, fp8_flops_fraction,
                                    fp8_layer_shares, spikes, verdicts)
from dsjax.precision.delayed import restart
from dsjax.precision.probe import Probe, flops_weights, probe_model
from dsjax.precision.speed import projection_shapes, slower_in_fp8, time_projection

_I = {name: i for i, name in enumerate(STATS)}


def running_words(model: Any) -> list[str]:
    """The map `model` runs (its fp8 policy's per-layer choices as `layer_map` words)."""
    policy, L = model.fp8_policy, model.cfg.num_layers
    return [layer_map.word(fp8_names, f32, policy.matmuls)
            for fp8_names, f32 in policy.layer_choices(L)]


class Selector:
    """Owns the precision map of a run with `fp8.select=auto` (docs/precision.md)."""

    def __init__(self, trainer: Any, log: Callable[[str], None] = print):
        cfg = trainer.cfg
        f, L = cfg.fp8, cfg.model.num_layers
        self.f, self.log = f, log
        self.matmuls = f.matmul_names
        pinned = tuple(not f.keep_first_layers <= i < L - f.keep_last_layers for i in range(L))
        self.choices = Choices.start(L, len(self.matmuls), pinned)
        self.probe = Probe(probe_model(trainer.model, f.other_dtype), trainer.mesh,
                           trainer.rules, f.probe_rows)
        abstract = trainer.abstract_state().params
        self.weights = flops_weights(abstract, self.matmuls, cfg.model.num_experts_per_tok,
                                     cfg.model.n_routed_experts)
        self.windows: list[list[float]] = [[] for _ in range(L)]
        self.changes: list[dict[str, Any]] = []  # every change of the run, in order
        self.last: dict[str, Any] = {}  # the last probe: step and stats [L, P, len(STATS)]
        self.probes = 0
        self.seconds = {"probe": 0.0, "compile": 0.0, "first_compile": 0.0}
        self.applied = False  # the run has switched to a chosen map (restored or probed)
        self._spiked: list[tuple[int, str]] = []  # (layer, why) to demote before the next step
        self.losses: list[float] = []  # the last SPIKE_WINDOW losses
        self.speed_note = ("the speed term (fp8 vs bf16 GEMM timing) needs a GPU; on "
                           f"{jax.default_backend()} it is off and fp8 is chosen on error alone"
                           if jax.default_backend() != "gpu" else "")
        self.slow: list[str] = []  # projections the speed term keeps out of fp8 (GPU)
        self.times: dict[str, tuple[float, float]] = {}
        self.data = trainer.cfg.mesh.data

    # -- decisions ----------------------------------------------------------------------------
    def due(self, step_idx: int) -> bool:
        """Is a probe due before step `step_idx` (the first, and every probe_every-th)?"""
        every = self.f.probe_every
        return step_idx == 0 or bool(every) and step_idx % every == 0

    def before_step(self, step_idx: int, trainer: Any, state: Any, batch: dict[str, Any]
                    ) -> Any:
        """Probes if `step_idx` is due, applies this probe's and any spike's changes, and
        returns `state` as the (possibly switched) trainer's step takes it."""
        for layer, why in self._spiked:
            self._record(step_idx, self.choices.demote_layer(layer), why)
        self._spiked = []
        first = self.probes == 0  # this run's map is not chosen yet (nor restored)
        if first or self.due(step_idx):
            jax.block_until_ready(state.params)  # the step in flight is not the probe's time
            t0 = time.perf_counter()
            stats = self.probe(state.params, batch)
            self.seconds["probe"] += time.perf_counter() - t0
            self.probes += 1
            self.last = {"step": step_idx, "stats": stats}
            if first and not self.speed_note:
                self._time_gemms(state.params, batch)
            verdict = verdicts(stats, self.f.max_rel_error, self.f.max_underflow)
            slow = [j for j, m in enumerate(self.matmuls) if m in self.slow]
            verdict[:, slow] = np.where(verdict[:, slow] == layer_map.FP8, layer_map.OTHER,
                                        verdict[:, slow])
            changes = self.choices.update(verdict, self.f.hysteresis, first)
            if first:  # the run's starting map, not a change
                self.log(f"precision: the probe before step {step_idx + 1} chose (fp8 where "
                         f"errors <= {self.f.max_rel_error:g} and underflow <= "
                         f"{self.f.max_underflow:g}):")
                for line in self.describe():
                    self.log(f"precision:   {line}")
                if self.speed_note:
                    self.log(f"precision: {self.speed_note}")
            else:
                self._record(step_idx, changes, "probe", stats)
        return self.apply(trainer, state, batch)

    def _time_gemms(self, params: Any, batch: dict[str, Any]) -> None:
        """The speed term (GPU): each projection's GEMM timed in fp8 and in other_dtype at this
        run's per-device tokens; where fp8 is not faster it stays out of fp8."""
        rows, seq = batch["inputs"].shape[-2:]
        tokens = max(rows // self.data, 1) * seq
        for name, (k, n) in projection_shapes(params, self.matmuls).items():
            self.times[name] = time_projection(tokens, k, n, jnp.dtype(self.f.other_dtype),
                                               self.f.recipe)
        self.slow = sorted(slower_in_fp8(self.times))
        shapes = projection_shapes(params, self.matmuls)
        for name, (t8, to) in self.times.items():
            k, n = shapes[name]
            self.log(f"precision: speed term, {name} ({tokens} x {k} x {n}, forward and "
                     f"backward): fp8 {1e3 * t8:.3f} ms, {self.f.other_dtype} {1e3 * to:.3f} ms"
                     f"{'; stays out of fp8' if name in self.slow else ''}")

    def observe(self, step_idx: int, m: dict[str, Any]) -> None:
        """Reads a finished step's loss and per-layer gradient norms (`spikes` decides which
        layers leave fp8 before the next step)."""
        norms = m.get("layer_grad_norm")
        if norms is None or not bool(m.get("finite", True)):
            return
        norms, loss = np.asarray(norms, np.float64), float(m["loss"])
        spiked = spikes(self.windows, self.losses, norms, loss, self.choices.words,
                        self.f.spike_factor, self.f.loss_spike)
        for i, value in enumerate(norms):
            if i in spiked:
                self.log(f"precision: after step {step_idx + 1}, layer {i}: {spiked[i]}")
                self._spiked.append((i, spiked[i]))
                self.windows[i] = []
            else:
                self.windows[i] = (self.windows[i] + [float(value)])[-SPIKE_WINDOW:]
        self.losses = (self.losses + [loss])[-SPIKE_WINDOW:]

    def _record(self, step_idx: int, changes: list, why: str, stats: Any = None) -> None:
        for layer, j, old, new in changes:
            entry = {"step": step_idx, "layer": layer, "matmul": self.matmuls[j],
                     "from": layer_map.CODES[old], "to": layer_map.CODES[new], "why": why}
            if stats is not None:
                entry.update({k: float(stats[layer, j, _I[k]]) for k in STATS})
            self.changes.append(entry)
            errors = (f" (fp8 error: output {entry['fwd_fp8']:.3f}, weight gradient "
                      f"{entry['wgrad_fp8']:.3f}; underflow: input {entry['x_underflow']:.3f}, "
                      f"gradient {entry['dy_underflow']:.3f})"
                      if stats is not None else "")
            self.log(f"precision: step {step_idx}, layer {layer} {entry['matmul']}: "
                     f"{entry['from']} -> {entry['to']} [{why}]{errors}")

    def apply(self, trainer: Any, state: Any, batch: dict[str, Any] | None = None) -> Any:
        """Switches `trainer` to the current map if it runs another one (compiling the step for
        `batch`'s shape now, timed); returns `state` for it."""
        words = ",".join(self.choices.words)
        if trainer.cfg.fp8.layers == words:
            return state
        t0 = time.perf_counter()
        old = running_words(trainer.model)
        switched = [(i, m) for i, (a, b) in enumerate(zip(old, self.choices.words))
                    for m, x, y in zip(self.matmuls, a, b)
                    if (x == layer_map.FP8) != (y == layer_map.FP8)]
        state = trainer.switch_precision(words, state)
        if state.fp8_meta and switched:  # delayed scaling: their histories start afresh
            state = state.replace(fp8_meta=restart(state.fp8_meta, switched,
                                                   trainer.model.stack_ranges()))
        if batch is not None:
            trainer.program_for(state, batch)  # the compile, here rather than in the step
        # The run's first map compiles a step any run compiles: not the selector's cost.
        key = "compile" if self.applied else "first_compile"
        self.seconds[key] += time.perf_counter() - t0
        self.applied = True
        self.log(f"precision: map {words} ({self.fp8_flops_fraction:.2f} of projection FLOPs "
                 f"in fp8)")
        return state

    # -- reports ------------------------------------------------------------------------------
    @property
    def fp8_flops_fraction(self) -> float:
        return fp8_flops_fraction(self.choices.words, self.weights)

    def record_fields(self) -> dict[str, Any]:
        """What each metrics.jsonl record (and TensorBoard) carries."""
        per_layer = fp8_layer_shares(self.choices.words, self.weights)
        return {"fp8_flops_fraction": self.fp8_flops_fraction,
                "precision_changes": len(self.changes),
                **{f"fp8_share/layer{i}": share for i, share in enumerate(per_layer)}}

    def layer_table(self) -> dict[str, dict[str, str]]:
        """{"0": {"q": "fp8", ...}, ...}: the map, readable."""
        return {str(i): {m: layer_map.CODES[c] for m, c in zip(self.matmuls, w)}
                for i, w in enumerate(self.choices.words)}

    def summary(self) -> dict[str, Any]:
        out = {"precision_map": self.layer_table(), "precision_layers": ",".join(
                   self.choices.words),
               "fp8_flops_fraction": self.fp8_flops_fraction,
               "precision_changes": self.changes, "precision_probes": self.probes,
               "precision_seconds": dict(self.seconds)}
        if self.last:
            out["precision_last_probe"] = {
                "step": self.last["step"],
                **{k: np.asarray(self.last["stats"])[..., _I[k]].round(5).tolist()
                   for k in STATS}}
        out["precision_speed_term"] = self.speed_note or {
            name: {"fp8_ms": 1e3 * t8, "other_ms": 1e3 * to, "fp8": name not in self.slow}
            for name, (t8, to) in self.times.items()}
        return out

    def describe(self) -> list[str]:
        return [f"layer {i}: {describe(w, self.matmuls)}"
                for i, w in enumerate(self.choices.words)]

    # -- checkpoint ---------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {**self.choices.get_state(), "windows": self.windows, "losses": self.losses,
                "changes": self.changes, "probes": self.probes, "slow": self.slow}

    def set_state(self, state: dict[str, Any]) -> None:
        self.choices.set_state(state)
        self.windows = [list(w) for w in state["windows"]]
        self.losses = list(state["losses"])
        self.changes = list(state["changes"])
        self.probes = int(state["probes"])
        self.slow = list(state["slow"])
        self.applied = True  # the restored map's compile is the resumed run's first step's
