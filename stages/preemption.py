"""Preemption: SIGTERM or SIGINT to the driver (and `ray job stop`, which sends SIGTERM) end a run at a step
boundary, with a checkpoint.

The handler only records the signal; the training loop asks `requested` after each step, finishes that
step, writes a checkpoint (unless the step just wrote one), prints `preempted at step N, checkpoint DIR`
and raises `Preempted`; `dhp train` then exits with PREEMPTED_EXIT, so a scheduler can tell "run me again"
from a failure, and `training.resume=auto` continues where it stopped. A second SIGINT interrupts at once.

The grace a platform gives (`training.preempt_grace_s`: spot VMs 30-120 s; `ray job stop` 3 s unless the
job's runtime env sets RAY_JOB_STOP_WAIT_TIME_S) must cover the rest of a step plus one checkpoint write;
the loop warns at the first checkpoint when it does not.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, the caller is invited to retry


class Preempted(Exception):
    """The run stopped at a step boundary because it was asked to; `checkpoint` continues it."""

    def __init__(self, step: int, checkpoint: Path | None, signal_name: str):
        where = checkpoint if checkpoint is not None else "none"
        super().__init__(f"preempted at step {step}, checkpoint {where}")
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


class Preemption:
    """Records SIGTERM / SIGINT while installed (`with preemption.installed():`); `requested` says if one came."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self.at = 0.0

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def elapsed_s(self) -> float:
        return time.monotonic() - self.at

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if not self.requested:
            self.signal_name, self.at = signal.Signals(signum).name, time.monotonic()
            print(
                f"{self.signal_name} received: finishing the current step, then a checkpoint (grace "
                f"{self.grace_s:g} s; Ctrl-C again to stop at once)",
                flush=True,
            )

    @contextmanager
    def installed(self) -> Iterator[Preemption]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        before = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
