"""Subprocess runs a module starts as soon as the tests are chosen, in the background beside the other tests.

Why: the full tier leaves the two cores idle a fifth of its time (Ray starting, step deadlines waited out,
the bubbles of one-thread actors), and some modules' checks read nothing but finished subprocess runs that no
other test touches: `tests/test_faults.py` (ten `dhp train` runs), `tests/test_train_job.py` (the default run),
`tests/test_ray_job.py` (two Ray Jobs on a head of its own), `tests/test_gpu_bundle.py` (the bundle's build),
`tests/test_bench_peers.py` (the quick peers bench), `tests/test_boundary_wire.py` (the Ray Direct Transport run),
`tests/test_bench_pipeline.py` and `tests/test_bench_fine_tuning.py` (their quick benches),
`tests/test_bench_one_gpu.py` (the GPU script at its tiny size). A module that defines
`start_early(out: Path, fixtures: set[str])` has it called once the session's tests are chosen
(`pytest_collection_finish` in conftest.py) and its tests run last; the function starts jobs (`start`) and the
module's fixtures or tests wait on their results (`result`).

The jobs run one after another, in the order they were started (two at once would need the memory of both
beside the tests'). A job's thread runs at nice 10 (Linux keeps a nice value per thread), and every process it
starts inherits it. The kernel applies nice values only within one process session (an autogroup): a job that
starts a session of its own (test_faults.py's recovery bench does, so that it can be killed with its runs; so does
the Ray head of test_ray_job.py) shares the CPU with the tests about equally whatever its nice value, and the tests
beside it take longer (docs/testing.md).

A job's processes inherit the test process's environment as it is when they start, whatever test runs then: a
test never plants in `os.environ` what changes a run (the fault hooks of stages/fault_injection.py take the
environment to read as an argument; tests/test_step_invariants.py plants a misroute in its own trainer alone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NICE = 10


class Background:
    """`fn()` on a thread of its own at nice `NICE`; `result()` waits for it and returns or raises what it did.
    `after`: a job that must end first (the runs of two jobs at once would need twice the memory)."""

    def __init__(self, name: str, fn: Callable[[], Any], after: Background | None = None):
        self.name, self._fn, self._after = name, fn, after
        self._value: Any = None
        self._error: BaseException | None = None
        self.began = self.ended = None  # time.monotonic() at the job's start and end (after `after` ended)
        self._thread = threading.Thread(target=self._run, name=f"background-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        try:
            if self._after is not None:
                self._after._thread.join()
            self.began = time.monotonic()
            self._value = self._fn()
        except BaseException as e:  # raised by result(), on the test's thread
            self._error = e
        finally:
            self.ended = time.monotonic()

    def result(self, timeout_s: float = 3600) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"background job {self.name} still running after {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._value


_JOBS: dict[str, Background] = {}


def start(name: str, fn: Callable[[], Any]) -> None:
    """Job `name` runs `fn()` once every job started before it has ended; starting it again does nothing."""
    if name not in _JOBS:
        _JOBS[name] = Background(name, fn, after=next(reversed(_JOBS.values()), None))


def timeline() -> list[str]:
    """One line per job: when it began and ended, in seconds after the first job began (it waits on none)."""
    began = [job for job in _JOBS.values() if job.began is not None]
    origin = began[0].began if began else 0.0
    lines = []
    for job in began:
        end = f"{job.ended - origin:.0f} s ({job.ended - job.began:.0f} s)" if job.ended else "still running"
        lines.append(f"  {job.name}: {job.began - origin:.0f} s -> {end}")
    return lines


def result(name: str, start_early: Callable[[], None]) -> Any:
    """Wait for job `name` and return what it returned (or raise what it raised). `start_early` starts it if
    nothing has (the module's tests were chosen after collection, by a plugin reordering them)."""
    if name not in _JOBS:
        start_early()
    return _JOBS[name].result()


def run_command(name: str, command: list[str], out: Path, timeout_s: float = 1800, **kwargs: Any) -> None:
    """Job `name`: `command` as a subprocess with its output captured (`kwargs` go to `subprocess.run`); its
    result is the finished process and `out`, the file or directory the module's checks read."""
    start(name, lambda: (subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, **kwargs), out))


def succeeded(name: str, start_early: Callable[[], None]) -> tuple[subprocess.CompletedProcess, Path]:
    """`result` of a `run_command` job, whose process must have exited 0 (else the tails of its output say why)."""
    proc, out = result(name, start_early)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


_SCRATCH: list[Path] = []
_AT_STOP: list[Callable[[], None]] = []


def scratch_dir(name: str) -> Path:
    """A directory for a background job's runs; removed when the session ends (`stop_all`)."""
    path = Path(tempfile.mkdtemp(prefix=f"dhp-{name}-"))
    _SCRATCH.append(path)
    return path


def at_stop(fn: Callable[[], None]) -> None:
    """`fn` runs when the session ends, before the scratch directories go: it kills what a job left running
    (a session stopped by a failure or Ctrl-C must not leave `dhp train` runs and their Ray behind)."""
    _AT_STOP.append(fn)


def stop_all() -> None:
    for fn in _AT_STOP:
        fn()
    for path in _SCRATCH:
        shutil.rmtree(path, ignore_errors=True)
