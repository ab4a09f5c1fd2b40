"""Crash safety: a complete step is *sealed* with a manifest of every file's size and CRC-32, and
checked against it before it is restored (docs/reliability.md).

The one idea: Orbax writes a step into `N.orbax-checkpoint-tmp` and renames it to `N` when
complete, so a process killed mid-save leaves only a temporary directory; once complete, dsjax
writes `dsjax_manifest.json`, so a truncated or altered file is reported by step and path instead
of restoring wrong values (Orbax itself notices truncation but not altered bytes). A failed seal,
or a file that cannot be read, is what corruption means; nothing else is.
"""

from __future__ import annotations

import json
import os
import zlib

MANIFEST = "dsjax_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step that is still being written


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names if n != MANIFEST]
    return sorted(out)


def seal(step_dir: str) -> None:
    """Writes the manifest (size and CRC-32 of every file) of a complete step, atomically."""
    files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc32(os.path.join(step_dir, rel))]
             for rel in _files(step_dir)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": "crc32-v1", "files": files}, f)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify(step_dir: str) -> str | None:
    """None if the step matches its manifest (or has none: sealed steps only are checked), else
    what is wrong, naming the file."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its manifest {path} is unreadable ({e})"
    for rel, (size, crc) in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"{full} is missing"
        if os.path.getsize(full) != size:
            return f"{full} has {os.path.getsize(full)} bytes, {size} were written"
        if _crc32(full) != crc:
            return f"{full} does not match the checksum written when it was saved"
    return None


def incomplete_entries(directory: str) -> list[str]:
    """Step directories a killed save left behind (Orbax ignores them when listing steps)."""
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if TMP_SUFFIX in n)

