"""Who used this machine's CPU while a bench measured: the benches that hold a measured time to a predicted one
(`dhp bench time-model`) assume each busy actor has a core, and on a 2-core machine one other busy process
breaks that for a pool whose ranks wait for each other in collectives.

Linux only (/proc); elsewhere every function says it cannot tell (None, or an empty list). Seconds are CPU
seconds (user + system; the machine's also counts interrupts and the time a hypervisor stole).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dhp.scripts.local_head import TICKS_PER_S, proc_stat


def machine_busy_s() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine since boot, from /proc/stat's first line: busy counts
    user, nice, system, irq, softirq and steal (time a hypervisor gave another guest), not idle or iowait."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS_PER_S, steal / TICKS_PER_S


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used; 0 when it is gone."""
    stat = proc_stat(pid)
    return 0.0 if stat is None else stat.cpu_s


@dataclass
class CpuWindow:
    """The machine's CPU over a stretch of wall time, split into what `pids` used and what every other process
    (and a hypervisor's steal) used: `with CpuWindow(pids) as w: ...`, then `w.others_cores`."""

    pids: Iterable[int]
    wall_s: float = 0.0
    own_cores: float | None = None
    others_cores: float | None = None
    stolen_cores: float | None = None

    def __enter__(self) -> CpuWindow:
        self.pids = list(self.pids)
        self._start = time.perf_counter(), machine_busy_s(), sum(process_cpu_s(p) for p in self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, machine0, own0 = self._start
        self.wall_s = time.perf_counter() - wall0
        machine1 = machine_busy_s()
        if machine0 is None or machine1 is None or self.wall_s <= 0:
            return
        own = sum(process_cpu_s(p) for p in self.pids) - own0
        self.own_cores = own / self.wall_s
        self.others_cores = max(0.0, machine1[0] - machine0[0] - own) / self.wall_s
        self.stolen_cores = (machine1[1] - machine0[1]) / self.wall_s


def busiest(seconds: float = 2.0, n: int = 5) -> list[tuple[int, str, float]]:
    """The `n` processes that used the most CPU over the next `seconds`: (pid, name, cores), busiest first."""

    def snapshot() -> dict[int, tuple[str, float]]:
        pids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()] if Path("/proc").is_dir() else []
        return {pid: (s.name, s.cpu_s) for pid, s in ((pid, proc_stat(pid)) for pid in pids) if s is not None}

    before = snapshot()
    time.sleep(seconds)
    after = snapshot()
    used = [(pid, name, (cpu - before[pid][1]) / seconds) for pid, (name, cpu) in after.items() if pid in before]
    return sorted((u for u in used if u[2] > 0), key=lambda u: -u[2])[:n]


def wait_quiet(below_cores: float = 0.3, window_s: float = 2.0, max_s: float = 60.0) -> dict:
    """Wait until the whole machine is busy less than `below_cores` over a `window_s` window, at most `max_s`:
    {"quiet": bool, "waited_s", "busy_cores" (the last window's), "busiest" (its processes, when not quiet)}."""
    start = time.perf_counter()
    while True:
        with CpuWindow([]) as w:
            time.sleep(window_s)
        waited = time.perf_counter() - start
        if w.others_cores is None or w.others_cores < below_cores:
            return {"quiet": True, "waited_s": round(waited, 1), "busy_cores": w.others_cores}
        if waited >= max_s:
            return {
                "quiet": False,
                "waited_s": round(waited, 1),
                "busy_cores": round(w.others_cores, 2),
                "busiest": busiest(window_s),
            }
