"""The GPU MFU run's one record, `gpu_mfu.json`: every piece's row embedded, each written as soon
as it exists, so a run cut short still returns what it measured.

A piece writes a stub row (status "running") before it compiles anything and replaces it with its
result when it finishes; `gpu_mfu.sh` then marks the row ok, failed or timed out with the exit
status and the piece's limit, and copies the device kind of the preflight onto rows that lack it.
Writes are atomic (a temporary file renamed over the record), so a killed piece never leaves a
half-written JSON. No JAX import here: the shell calls `mark` between pieces.

  python benchmarks/gpu_record.py mark RECORD PIECE STATUS RC LIMIT_S
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

STATUSES = ("ok", "failed", "timed out")


def read(path: str) -> dict[str, Any]:
    """The record at `path`, or an empty one ({"rows": {}})."""
    if not os.path.exists(path):
        return {"rows": {}}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=str)
    os.replace(tmp, path)


def update(path: str, **fields: Any) -> None:
    """Sets top-level fields of the record (settings, the summary)."""
    record = read(path)
    record.update(fields)
    _write(path, record)


def put_row(path: str, name: str, row: dict[str, Any]) -> None:
    """Replaces row `name` with `row`, keeping what the shell recorded about it (limit)."""
    record = read(path)
    old = record.setdefault("rows", {}).get(name, {})
    record["rows"][name] = {**{k: old[k] for k in ("limit_s",) if k in old}, **row}
    _write(path, record)


def stub(path: str, name: str, args: dict[str, Any]) -> None:
    """The row a timeout leaves: what was asked and when it started, written before compiling."""
    put_row(path, name, {"status": "running", "started_unix": time.time(), "args": args})


def mark(path: str, name: str, status: str, rc: int, limit_s: float) -> dict[str, Any]:
    """The shell's verdict on piece `name`; a piece that wrote nothing gets a row saying so."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: one of {STATUSES}")
    record = read(path)
    rows = record.setdefault("rows", {})
    row = rows.setdefault(name, {"note": "the piece wrote no row (it failed before its stub)"})
    row.update(status=status, exit_code=rc, limit_s=limit_s)
    kind = rows.get("preflight", {}).get("device_kind")
    if kind is not None:
        row.setdefault("device_kind", kind)
    _write(path, record)
    return row


if __name__ == "__main__":
    if len(sys.argv) != 7 or sys.argv[1] != "mark":
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    mark(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
