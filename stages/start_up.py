"""What a run prints while it starts: each phase and how long it took, and a line every `EVERY_S` while it waits.

Starting a stage rank is a process, its torch and transformers imports and its build (on a cluster, reading its
part of the checkpoint): seconds on a laptop, minutes at 72B. Without a line in between, such a start reads as a
hang, and nothing says which phase took the time.
"""

from __future__ import annotations

import time

import ray

EVERY_S = 30.0


def wait_all(refs: list[ray.ObjectRef], waiting: str, timeout_s: float | None = None, every_s: float = EVERY_S) -> list:
    """`ray.wait` for every one of `refs`, for at most `timeout_s` (None: as long as it takes); the ready ones.

    While some are not ready, a line every `every_s`: `waiting` formatted with `ready`, `total` and `seconds`
    (e.g. "text pool: {ready} of {total} ranks built after {seconds:.0f} s")."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        wait_s = every_s if timeout_s is None else max(0.0, min(every_s, timeout_s - elapsed))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        elapsed = time.monotonic() - start
        if len(ready) == len(refs) or (timeout_s is not None and elapsed >= timeout_s):
            return ready
        print(waiting.format(ready=len(ready), total=len(refs), seconds=elapsed), flush=True)
