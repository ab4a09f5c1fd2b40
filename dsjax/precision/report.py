"""The precision map as a picture: a layer x projection heat map, coloured by the chosen
precision and annotated with the last probe's fp8 error, written into the run directory."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from matplotlib import colors, patches
from matplotlib.figure import Figure

from dsjax.config import layer_map
from dsjax.fp8_probe import STATS

COLOURS = {layer_map.FP8: "#4caf50", layer_map.OTHER: "#ffb300", layer_map.FLOAT32: "#e53935"}
FILENAME = "precision_map.png"


def fp8_error(stats: np.ndarray) -> np.ndarray:
    """[L, P]: the larger of a projection's two fp8 errors (output, weight gradient)."""
    return np.maximum(stats[..., STATS.index("fwd_fp8")], stats[..., STATS.index("wgrad_fp8")])


def write_heat_map(workdir: str, words: list[str], matmuls: tuple[str, ...],
                   stats: np.ndarray | None, title: str) -> str:
    """Writes FILENAME in `workdir`; returns its path."""
    codes = list(COLOURS)
    grid = np.array([[codes.index(c) for c in w] for w in words])
    L, P = grid.shape
    fig = Figure(figsize=(1.0 + 0.9 * P, 1.0 + 0.45 * L))  # no pyplot: no GUI backend
    ax = fig.subplots()
    ax.imshow(grid, cmap=colors.ListedColormap(list(COLOURS.values())), vmin=-0.5,
              vmax=len(codes) - 0.5, aspect="auto")
    if stats is not None:
        err = fp8_error(np.asarray(stats))
        for i in range(L):
            for j in range(P):
                ax.text(j, i, f"{err[i, j]:.3f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(P), matmuls)
    ax.set_yticks(range(L), [str(i) for i in range(L)])
    ax.set_xlabel("projection (cell: fp8 relative error, larger of output and weight gradient)")
    ax.set_ylabel("layer")
    handles = [patches.Patch(color=COLOURS[c], label=layer_map.CODES[c])
               for c in codes]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(workdir, FILENAME)
    fig.savefig(path, dpi=100)
    return path


def write_report(workdir: str, selector: Any) -> str:
    """The heat map of a run's final map and last probe."""
    stats = selector.last.get("stats") if selector.last else None
    return write_heat_map(workdir, selector.choices.words, selector.matmuls, stats,
                          f"fp8.select=auto: {selector.fp8_flops_fraction:.2f} of projection "
                          f"FLOPs in fp8")
