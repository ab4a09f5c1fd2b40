"""The choice per (layer, projection) from the probe's measurements, with hysteresis.

The one idea: leaving fp8 is immediate, returning to it is earned. A projection whose measured
error (or input outliers) exceeds the bounds leaves fp8 at the probe that saw it; it comes back
only after `fp8.hysteresis` probes in a row find it under the bounds, so a projection near a
bound does not flap (and the step is not recompiled for it each time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dsjax.config import layer_map
from dsjax.config.layer_map import FLOAT32, FP8, OTHER
from dsjax.fp8_probe import STATS

SPIKE_WINDOW = 16  # steps of the loss and of each layer's gradient norm a spike is measured by
# Codes from least to most precise: a move to the right is a demotion (immediate).
ORDER = (FP8, OTHER, FLOAT32)
_I = {name: i for i, name in enumerate(STATS)}


def verdicts(stats: np.ndarray, max_rel_error: float, max_underflow: float) -> np.ndarray:
    """Per (layer, projection) of `stats` [L, P, len(STATS)]: the least precise code whose
    measured errors are within `max_rel_error` (fp8 also needs at most `max_underflow` of its
    input's values below e4m3's normal range): fp8, else other_dtype, else float32. [L, P] str.
    The output gradient's underflow is reported, not used: attention's is large from the start
    while the weight gradient's error stays small (docs/precision.md)."""
    s = np.asarray(stats, np.float64)
    fp8_ok = ((np.maximum(s[..., _I["fwd_fp8"]], s[..., _I["wgrad_fp8"]]) <= max_rel_error)
              & (s[..., _I["x_underflow"]] <= max_underflow))
    other_ok = np.maximum(s[..., _I["fwd_other"]], s[..., _I["wgrad_other"]]) <= max_rel_error
    return np.where(fp8_ok, FP8, np.where(other_ok, OTHER, FLOAT32))


@dataclasses.dataclass
class Choices:
    """The current map ([L] words of `layer_map` codes) and, per (layer, projection), how many
    probes in a row have found a less precise code than the current one good enough (its way
    back toward fp8)."""
    words: list[str]
    streaks: np.ndarray  # [L, P] int
    pinned: tuple[bool, ...]  # per layer: kept out of fp8 (fp8.keep_first/last_layers)

    @classmethod
    def start(cls, num_layers: int, num_matmuls: int, pinned: tuple[bool, ...]) -> Choices:
        return cls([OTHER * num_matmuls] * num_layers,
                   np.zeros((num_layers, num_matmuls), np.int64), pinned)

    def codes(self) -> np.ndarray:
        return np.array([list(w) for w in self.words])

    def update(self, verdict: np.ndarray, hysteresis: int, first: bool
               ) -> list[tuple[int, int, str, str]]:
        """Applies one probe's verdicts ([L, P]); returns the changes (layer, projection index,
        old code, new code). `first`: the run's first probe, adopted as it stands."""
        old = self.codes()
        verdict = np.where(np.array(self.pinned)[:, None] & (verdict == FP8), OTHER, verdict)
        rank = np.vectorize(ORDER.index)
        r_old, r_new = rank(old), rank(verdict)
        better = r_new < r_old  # toward fp8: needs `hysteresis` probes in a row
        self.streaks = np.where(better, self.streaks + 1, 0)
        take = (r_new > r_old) | (better & (self.streaks >= hysteresis)) | (first & better)
        new = np.where(take, verdict, old)
        self.streaks = np.where(take, 0, self.streaks)
        return self._apply(old, new)

    def demote_layer(self, layer: int) -> list[tuple[int, int, str, str]]:
        """Layer `layer`'s fp8 projections to other_dtype, now (a gradient-norm spike)."""
        old = self.codes()
        new = old.copy()
        new[layer] = np.where(old[layer] == FP8, OTHER, old[layer])
        self.streaks[layer] = 0
        return self._apply(old, new)

    def _apply(self, old: np.ndarray, new: np.ndarray) -> list[tuple[int, int, str, str]]:
        self.words = ["".join(row) for row in new]
        return [(int(i), int(j), str(old[i, j]), str(new[i, j]))
                for i, j in zip(*np.nonzero(old != new))]

    def get_state(self) -> dict[str, Any]:
        return {"words": list(self.words), "streaks": self.streaks.tolist()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.words = list(state["words"])
        self.streaks = np.asarray(state["streaks"], np.int64).reshape(self.streaks.shape)


def spikes(windows: list[list[float]], losses: list[float], norms: np.ndarray, loss: float,
           words: list[str], spike_factor: float, loss_spike: float) -> dict[int, str]:
    """{layer: why} of the layers with fp8 projections that leave fp8 now: a layer whose
    gradient norm exceeds `spike_factor` x the median of its last SPIKE_WINDOW (`windows`) and
    rose `spike_factor` x more than the other layers' did (the median of their ratios: when
    every layer surges at once, as early in training, the cause is the optimizer's, not one
    layer's precision); and on a loss above `loss_spike` x the median of the last SPIKE_WINDOW
    (`losses`), the layer whose norm rose most against its median. A factor of 0 turns its rule
    off; a rule needs full windows."""
    full = [len(w) == SPIKE_WINDOW for w in windows]
    ratios = [float(v) / max(float(np.median(w)), 1e-30) if ok else 0.0
              for v, w, ok in zip(norms, windows, full)]
    in_fp8 = [FP8 in w for w in words]

    def peers(i):
        others = [r for j, r in enumerate(ratios) if j != i and full[j]]
        return float(np.median(others)) if others else 1.0
    out = {i: f"gradient norm {norms[i]:.3g} > {spike_factor:g} x its median, and it rose "
              f"{r / max(peers(i), 1e-30):.1f} x more than the other layers'"
           for i, r in enumerate(ratios)
           if spike_factor and in_fp8[i] and r > spike_factor * max(1.0, peers(i))}
    if loss_spike and len(losses) == SPIKE_WINDOW and loss > loss_spike * np.median(losses):
        candidates = [i for i in range(len(words)) if in_fp8[i] and full[i]]
        if candidates:
            top = max(candidates, key=lambda i: ratios[i])
            out.setdefault(top, f"loss {loss:.4g} > {loss_spike:g} x its median; this layer's "
                                f"gradient norm rose most ({ratios[top]:.2f} x)")
    return out


def fp8_flops_fraction(words: list[str], weights: np.ndarray) -> float:
    """The share of projection FLOPs that run in fp8: `weights` [L, P] is each projection's
    FLOPs per token (its weight's size; a MoE layer's routed experts count top-k of them)."""
    in_fp8 = np.array([[c == FP8 for c in w] for w in words])
    total = float(np.sum(weights))
    return float(np.sum(weights * in_fp8)) / total if total else 0.0


def fp8_layer_shares(words: list[str], weights: np.ndarray) -> list[float]:
    """Per layer: the share of its projection FLOPs that run in fp8."""
    return [fp8_flops_fraction([w], weights[i:i + 1]) for i, w in enumerate(words)]


def describe(word: str, matmuls: tuple[str, ...]) -> str:
    """"q,k,v fp8; gate,up other_dtype" for one layer's word."""
    groups: dict[str, list[str]] = {}
    for m, c in zip(matmuls, word):
        groups.setdefault(layer_map.CODES[c], []).append(m)
    return "; ".join(f"{','.join(ms)} {name}" for name, ms in groups.items())
