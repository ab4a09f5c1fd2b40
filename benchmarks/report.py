"""Where every benchmark's result goes: one JSON object at `--out`, parent folders created."""

import json
import os
from typing import Any


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Writes `result` to `path` (no-op when no --out was given)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
