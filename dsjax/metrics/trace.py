"""Communication share of a step, measured from a profiler trace, and its bytes from the HLO.

The one idea: time is read from the trace as intervals per device, never summed blindly. Each XLA
op the profiler recorded (an event carrying an `hlo_op`) becomes an interval on its device; ops
that merely contain other ops (a `while` around a scanned layer stack) are dropped so nothing is
counted twice. Per device, the union of collective intervals over the union of all op intervals
is the communication share, and the part of the collective union that no compute interval
overlaps is the exposed share: what an asynchronous, overlapped collective would hide.

Where the time comes from: on CPU the simulated devices' thunks run on XLA's CPU client threads
(`device_ordinal` names the device); on GPU the device planes hold the kernels and XLA ops. A CPU
collective's interval includes waiting at the rendezvous for the slowest device, so with simulated
devices sharing a few cores it measures synchronisation skew more than bytes on a wire.

Collectives are recognised by the opcode of the HLO instruction the event names (from the
compiled program's text when given) or else by the name itself: XLA's own names
(`all-reduce.3`), JAX's (`psum_invariant.7`, `all_gather.3`, `ppermute.1`) and NCCL kernels
(`ncclDevKernel_AllReduce_...`).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import re
from typing import Any, Callable, Iterable

import jax
import numpy as np

from dsjax.metrics.hlo import KINDS, collective_kind, hlo_collective_ops

HLO_FILE = "hlo.txt"  # compiled HLO text saved beside the trace: exact opcodes for op names


def trace_step(fn: Callable, *args: Any, logdir: str, hlo_text: str | None = None,
               **kwargs: Any) -> tuple[Any, str]:
    """Calls `fn(*args, **kwargs)` once under `jax.profiler.trace` and waits for its result.

    Returns (fn's output, the run directory holding the trace). The trace is TensorBoard's
    profile plugin layout (`logdir/plugins/profile/RUN/*.xplane.pb` and `*.trace.json.gz`, the
    latter loads in Perfetto). Call it on an already compiled step, or compilation lands in the
    trace. `hlo_text` (the compiled program, `jitted.lower(...).compile().as_text()`) is saved
    beside the trace so `comm_share` classifies ops by their exact opcode. `fn` may donate its
    arguments: it is called exactly once.
    """
    os.makedirs(logdir, exist_ok=True)
    before = set(_run_dirs(logdir))
    with jax.profiler.trace(logdir):
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
    new = [d for d in _run_dirs(logdir) if d not in before]
    run_dir = max(new or _run_dirs(logdir), key=os.path.getmtime)
    if hlo_text is not None:
        with open(os.path.join(run_dir, HLO_FILE), "w", encoding="utf-8") as f:
            f.write(hlo_text)
    return out, run_dir


def comm_share(trace_dir: str, hlo_text: str | None = None) -> dict[str, Any]:
    """Communication share of the traced device time.

    `trace_dir`: a run directory from `trace_step`, or a log directory above it (its latest run
    is read). Fractions are of the busy time of all devices that ran XLA ops together; times
    are means per device:
      comm_fraction          collective time / busy time (union of all op intervals)
      exposed_comm_fraction  collective time that no compute op overlaps / busy time
      rendezvous_wait_fraction  collective time spent waiting for the other participants /
                             busy time (CPU traces mark it; 0 where the trace does not)
      kinds                  {kind: microseconds} for the collective kinds seen
      device_time_us         busy time
      devices                how many devices the figures average over
    All zeros (and no kinds) when the trace holds no XLA op.
    """
    run_dir = _latest_run(trace_dir)
    if hlo_text is None and os.path.exists(os.path.join(run_dir, HLO_FILE)):
        with open(os.path.join(run_dir, HLO_FILE), encoding="utf-8") as f:
            hlo_text = f.read()
    opcodes = hlo_collective_ops(hlo_text) if hlo_text else {}
    events = [ev for ev in _trace_events(run_dir) if ev.get("ph") in ("X", "M")]
    process = {ev["pid"]: ev["args"]["name"] for ev in events
               if ev["ph"] == "M" and ev.get("name") == "process_name"}
    # GPU traces hold the ops on device planes; host threads may echo op names while they
    # launch them, which is not device time. CPU traces have only the host plane.
    on_device = {pid for pid in {ev.get("pid") for ev in events}
                 if str(process.get(pid, pid)).startswith("/device:")}
    ops: dict[Any, list[tuple[float, float, Any, str | None]]] = collections.defaultdict(list)
    waits: dict[Any, list[tuple[float, float]]] = collections.defaultdict(list)
    for ev in events:
        if ev["ph"] != "X" or not ev.get("dur"):
            continue
        start, args = float(ev["ts"]), ev.get("args") or {}
        end, thread = start + float(ev["dur"]), (ev.get("pid"), ev.get("tid"))
        op = args.get("hlo_op")
        if op is None:
            if ev.get("name") == "Rendezvous":  # CPU: a collective waiting for its peers
                waits[thread].append((start, end))
            continue
        if on_device and ev.get("pid") not in on_device:
            continue
        kind = opcodes.get(op) or opcodes.get(ev.get("name")) or collective_kind(op) \
            or collective_kind(ev.get("name", ""))
        ops[args.get("device_ordinal", ev.get("pid"))].append((start, end, thread, kind))

    waits = {thread: _union(ivs) for thread, ivs in waits.items()}
    busy = comm = exposed = waited = 0.0
    kinds: dict[str, float] = collections.defaultdict(float)
    for device_ops in ops.values():
        leaves = _leaves(device_ops)
        collective = _union((s, e) for s, e, _, k in leaves if k is not None)
        busy += _length(_union((s, e) for s, e, _, _ in leaves))
        comm += _length(collective)
        exposed += _length(collective) - _length(
            _intersect(collective, _union((s, e) for s, e, _, k in leaves if k is None)))
        for kind in {k for _, _, _, k in leaves if k is not None}:
            kinds[kind] += _length(_union((s, e) for s, e, _, k in leaves if k == kind))
        waiting = []  # per thread: its collectives' time inside rendezvous events
        for thread in {t for _, _, t, k in leaves if k is not None and t in waits}:
            mine = _union((s, e) for s, e, t, k in leaves if k is not None and t == thread)
            waiting += _intersect(mine, waits[thread])
        waited += _length(_union(waiting))
    n = max(len(ops), 1)
    share = (lambda x: x / busy) if busy else (lambda x: 0.0)
    return {"comm_fraction": share(comm), "exposed_comm_fraction": share(exposed),
            "rendezvous_wait_fraction": share(waited),
            "kinds": {k: v / n for k, v in sorted(kinds.items())},
            "device_time_us": busy / n, "devices": len(ops)}


# ---------------------------------------------------------------------------------------------
# Trace files and interval arithmetic.


def _run_dirs(logdir: str) -> list[str]:
    return [d for d in glob.glob(os.path.join(logdir, "plugins", "profile", "*"))
            if os.path.isdir(d)]


def _latest_run(trace_dir: str) -> str:
    if glob.glob(os.path.join(trace_dir, "*.xplane.pb")):
        return trace_dir
    runs = _run_dirs(trace_dir)
    if not runs:
        raise FileNotFoundError(f"{trace_dir}: no profiler trace (expected *.xplane.pb here or "
                                f"under plugins/profile/)")
    return max(runs, key=os.path.getmtime)


def _trace_events(run_dir: str) -> Iterable[dict[str, Any]]:
    """Chrome-trace events of a run: from `*.trace.json.gz` where the profiler wrote one, else
    converted from `*.xplane.pb` with `jax.profiler.ProfileData` (same fields)."""
    jsons = sorted(glob.glob(os.path.join(run_dir, "*.trace.json.gz")))
    if jsons:
        for path in jsons:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                yield from json.load(f).get("traceEvents", [])
        return
    yield from xplane_events(run_dir)


def xplane_events(run_dir: str) -> Iterable[dict[str, Any]]:
    """`*.xplane.pb` events as chrome-trace dicts (ts and dur in microseconds)."""
    for path in sorted(glob.glob(os.path.join(run_dir, "*.xplane.pb"))):
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
            for line in plane.lines:
                for ev in line.events:
                    yield {"ph": "X", "pid": plane.name, "tid": line.name, "name": ev.name,
                           "ts": ev.start_ns / 1e3, "dur": ev.duration_ns / 1e3,
                           "args": {k: v for k, v in ev.stats}}


def _leaves(events: list[tuple[float, float, Any, str | None]]
            ) -> list[tuple[float, float, Any, str | None]]:
    """Drops events that enclose another event of the same thread (control flow around ops)."""
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[event[2]].append(event)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda x: (x[0], -x[1]))
        for i, event in enumerate(evs):
            # Sorted by start (longest first on ties), an enclosed event comes right after.
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is not None and nxt[0] < event[1] and nxt[1] <= event[1]:
                continue
            out.append(event)
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]
               ) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)
