"""`output.max_shard_size` as bytes: its own file, without torch, so that the config can check it as it loads
(`dhp config` and the command line's parser import no torch)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes of `5GB` / `500MiB` / `1000` (transformers' convention: GB = 10^9, GiB = 2^30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max shard size {size!r}: expected bytes or a number with KB/MB/GB/KiB/MiB/GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"max shard size {size!r} must be positive")
    return value
