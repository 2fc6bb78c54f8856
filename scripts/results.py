"""Where a benchmark's result goes: one JSON file, its folder made on the way, and its table on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any, **dumps: Any) -> Path:
    """Write `result` to `path` as indented JSON (parent folders created); `dumps`: more json.dumps options."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, **dumps) + "\n")
    return out


def report(path: str | Path | None, result: Any, table: Callable[[Any], str]) -> int:
    """A benchmark's ending: `result` written to `path` when one is given, its table printed; exit status 0."""
    if path:
        write_json(path, result)
    print(table(result))
    return 0
