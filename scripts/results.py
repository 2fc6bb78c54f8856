"""Where a benchmark's result goes: one JSON file, its folder made on the way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any, **dumps: Any) -> Path:
    """Write `result` to `path` as indented JSON (parent folders created); `dumps`: more json.dumps options."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, **dumps) + "\n")
    return out
