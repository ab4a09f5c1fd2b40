"""What every benchmark shares: config overrides from the command line, the machine's load around
a timed part, and one JSON object at `--out`.

A timing taken while other work shares the cores measures the sharing, not the code: every timing
benchmark records the load average when it starts and when its timed part ends, with the core
count, and the share of the cores that other processes used meanwhile; it says `"contended":
true` (and prints a warning) when that share passes `OTHERS_MAX` (docs/observability.md,
"Conditions").
"""

import json
import math
import os
import time
from typing import Any

from dsjax.config.load import parse_value  # the one parser of command-line values

# Contended: other processes used more than this share of the machine's cores during the timed
# part. The load average cannot say it alone: a benchmark's own threads (XLA's pool, 8 simulated
# devices, PyTorch's OpenMP) lift the 1-minute load past the core count on an idle machine.
OTHERS_MAX = 0.10
# A candidate whose final loss is more than this fraction above its baseline's (or not finite)
# diverged: its speed is not a result, faster or slower.
DIVERGED_LOSS_GAP = 0.05


def diverged(baseline_loss: float, candidate_loss: float) -> bool:
    """True when the candidate's final loss is not finite or more than DIVERGED_LOSS_GAP above
    the baseline's."""
    return not math.isfinite(candidate_loss) or (
        math.isfinite(baseline_loss) and candidate_loss > baseline_loss * (1 + DIVERGED_LOSS_GAP))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["section.field=value", ...]` as `dsjax.config.load` takes them; ValueError names a bad
    item."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r}: expected SECTION.FIELD=VALUE")
        overrides[key] = parse_value(value)
    return overrides


def _busy_seconds() -> float | None:
    """CPU seconds every process on the machine has run (the /proc/stat total less idle and
    iowait), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timing_start() -> dict[str, Any]:
    """The start of a timed part: the machine's 1-, 5- and 15-minute load averages and CPU
    counters now. Pass it to `load_record` when the timed part ends."""
    return {"load": list(os.getloadavg()), "busy": _busy_seconds(), "own": _own_seconds(),
            "wall": time.monotonic()}


def load_record(start: dict[str, Any]) -> dict[str, Any]:
    """The conditions of a timed part that began at `start` (from `timing_start()`) and ends now:
    {"load_before", "load_after", "cores", "others_cpu_share", "contended"}. others_cpu_share:
    the CPU time other processes used meanwhile, as a share of the cores' time (None without
    /proc/stat). Contended: that share passes OTHERS_MAX, so the timing is not trustworthy;
    without /proc/stat, a 1-minute load past the core count at either end. (The load before is
    no test where the share is known: it lags by a minute, so it still counts a job that ended.)"""
    cores, busy = os.cpu_count() or 1, _busy_seconds()
    share = None
    if busy is not None and start["busy"] is not None:
        wall = max(time.monotonic() - start["wall"], 1e-9)
        others = (busy - start["busy"]) - (_own_seconds() - start["own"])
        # Clamped: /proc/stat counts in 1/SC_CLK_TCK s per core, so a window of a few ticks
        # can read past every core's time.
        share = round(min(max(others, 0.0) / (wall * cores), 1.0), 4)
    before, after = start["load"], list(os.getloadavg())
    return {"load_before": before, "load_after": after, "cores": cores,
            "others_cpu_share": share,
            "contended": (share > OTHERS_MAX if share is not None
                          else max(before[0], after[0]) > cores)}


def describe_load(record: dict[str, Any]) -> str:
    """'load average 0.4 -> 1.9 on 2 cores, others used 1% of them' (1-minute figures)."""
    share = record.get("others_cpu_share")
    others = "" if share is None else f", others used {share:.0%} of them"
    return (f"load average {record['load_before'][0]:.1f} -> {record['load_after'][0]:.1f} on "
            f"{record['cores']} cores{others}")


def warn_if_contended(record: dict[str, Any], name: str) -> None:
    """Prints one warning line when `record` (from `load_record`) says the cores were shared."""
    if record["contended"]:
        print(f"WARNING: {name}: {describe_load(record)}: other work shared the cores, so these "
              f"timings are not trustworthy (\"contended\": true); re-run on an idle machine")


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Writes `result` to `path` (no-op when no --out was given), parent folders created."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
