"""scripts/bench/cpu_load.py: the CPU a window's own processes used is told from what every other process used."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dhp.scripts.bench.cpu_load import CpuWindow, busiest, machine_busy_s, process_cpu_s, wait_quiet

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

SPIN = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"


@pytest.fixture
def spinner():
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    time.sleep(0.3)  # past its interpreter's start
    yield proc
    proc.kill()
    proc.wait()


def test_a_busy_process_beside_the_window_is_counted_as_others(spinner):
    with CpuWindow([os.getpid()]) as w:
        time.sleep(1.0)
    assert w.wall_s >= 1.0
    assert w.others_cores > 0.3  # the spinner, whatever else the machine runs
    assert w.own_cores < 0.2  # this process slept
    assert w.stolen_cores >= 0


def test_the_windows_own_work_is_not_others(spinner):
    with CpuWindow([os.getpid(), spinner.pid]) as w:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass
    assert w.own_cores > 0.5  # this loop and the spinner, each on a core when the machine has them
    assert process_cpu_s(spinner.pid) > 0 and process_cpu_s(-1) == 0.0


def test_busiest_names_the_spinning_process(spinner):
    top = busiest(1.0, n=50)
    assert spinner.pid in [pid for pid, _, _ in top]
    assert all(cores > 0 for _, _, cores in top) and top == sorted(top, key=lambda t: -t[2])


def test_a_machine_kept_busy_is_not_quiet(spinner):
    quiet = wait_quiet(below_cores=0.3, window_s=0.5, max_s=1.0)
    assert quiet["quiet"] is False and quiet["busy_cores"] > 0.3
    assert quiet["busiest"]  # the processes that kept it busy (the spinner among them, when few others run)
    busy, stolen = machine_busy_s()
    assert busy > 0 and 0 <= stolen <= busy
