"""What every benchmark shares: config overrides from the command line, the machine's load around
a timed part, and one JSON object at `--out`.

A timing taken while other work shares the cores measures the sharing, not the code: every timing
benchmark records the load average when it starts and when its timed part ends, with the core
count, and says `"contended": true` (and prints a warning) when either 1-minute figure exceeds it.
"""

import ast
import json
import os
from typing import Any


def parse_value(text: str) -> Any:
    """A command-line value as a config field expects it: 4, 0.5, true, onebit_adam."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


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


def load_average() -> list[float]:
    """The machine's 1-, 5- and 15-minute load averages now."""
    return list(os.getloadavg())


def load_record(before: list[float]) -> dict[str, Any]:
    """The conditions of a timed part that began at load `before` (from `load_average()`) and
    ends now: {"load_before", "load_after", "cores", "contended"}. Contended: either 1-minute
    load exceeds the core count, so the cores were shared and the timing is not trustworthy. The
    figure counts this process's own runnable threads too."""
    after, cores = load_average(), os.cpu_count() or 1
    return {"load_before": list(before), "load_after": after, "cores": cores,
            "contended": max(before[0], after[0]) > cores}


def describe_load(record: dict[str, Any]) -> str:
    """'load average 0.4 -> 1.9 on 2 cores' (1-minute figures)."""
    return (f"load average {record['load_before'][0]:.1f} -> {record['load_after'][0]:.1f} on "
            f"{record['cores']} cores")


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
