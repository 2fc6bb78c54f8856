"""Faults on purpose, for the fault-tolerance tests and `dhp bench recovery`; off unless DHP_INJECT_FAULT is set.

DHP_INJECT_FAULT=KIND@STAGE:RANK:STEP makes that rank's checkpoint write of that step fail after its first
file, once per run (a marker file in the checkpoint root remembers it fired):
  enospc  the write raises the OSError a full disk gives (errno ENOSPC)
  eacces  the write raises the OSError a refused write gives (errno EACCES)
  die     the rank's process exits at once, mid-save (as if its node lost power)
The variable is read by the stage actors, so it must be in their environment (a local Ray started by the
driver inherits the driver's).

DHP_INJECT_MISROUTE=1, read by the driver, sends each vision backward to the next vision replica instead of
the one that encoded its micro-batch (`misrouted`): a gradient that goes nowhere, which the ranks' step
ledgers must stop the run on (stages/step_ledger.py).

Both hooks take the environment to read as an argument (default: the process's): a test of the hooks in the
test process passes its own, so that no process started beside it in the meantime inherits a planted fault.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dhp.models.parallel.schedule import VISION_BACKWARD

VARIABLE = "DHP_INJECT_FAULT"
MISROUTE = "DHP_INJECT_MISROUTE"
_SPEC = re.compile(r"^(enospc|eacces|die)@(vision|text):(\d+):(\d+)$")
_STEP = re.compile(r"step_(\d+)$")


def save_fault(stage: str, rank: int, staging: Path, environ: Mapping[str, str] = os.environ) -> None:
    """Called by a rank between the files of its checkpoint write into `staging` (`.tmp-step_N`); `environ`: the
    environment that plants the fault."""
    spec = environ.get(VARIABLE, "")
    m = _SPEC.match(spec)
    step = _STEP.search(staging.name)
    if not m or not step or (m.group(2), int(m.group(3)), int(m.group(4))) != (stage, rank, int(step.group(1))):
        return
    marker = staging.parent / f".fault-injected-{m.group(1)}-{stage}{rank}-step{step.group(1)}"
    if marker.exists():
        return
    marker.touch()
    kind = m.group(1)
    if kind == "die":
        os._exit(1)
    code = errno.ENOSPC if kind == "enospc" else errno.EACCES
    raise OSError(code, os.strerror(code), str(staging / f"{stage}-rank{rank}"))


def misrouted(calls: list[Any], num_vision: int, environ: Mapping[str, str] = os.environ) -> list[Any]:
    """The routing's calls (models/parallel/routing.py), each vision backward moved to the next vision replica
    when DHP_INJECT_MISROUTE=1 in `environ` (with one replica nothing moves);
    else `calls` as they are. Meant for a pool that is not lockstep: a lockstep pool's padding has the same id
    on every replica, so a moved one would run."""
    if environ.get(MISROUTE, "") != "1":
        return calls
    return [
        dataclasses.replace(c, members=tuple(((r + 1) % num_vision, k) for r, k in c.members))
        if c.kind == VISION_BACKWARD
        else c
        for c in calls
    ]


def never_join(module: str, collective: str) -> None:
    """A test hook, run in a stage actor (`handle.__ray_call__`): from now on this rank never joins the collective
    `collective` of `module` (e.g. dhp.models.parallel.sequence_parallel's all_to_all_single_autograd): the call
    waits forever instead, while the process runs on and answers its heartbeats, and its peers wait in the
    collective. What the step watchdog must name as a hang, not take for a slow step (stages/watchdog.py)."""
    import importlib
    import threading

    def never(*args: object, **kwargs: object) -> None:
        threading.Event().wait()

    setattr(importlib.import_module(module), collective, never)
