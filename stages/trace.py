"""Recording stage calls inside the actors, and turning the records into pipeline numbers and a timeline.

Times are `time.time()` wall clock: actors are separate processes, and only the wall clock is comparable
across them (on one node exactly; across nodes up to clock skew).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STAGES = ("vision", "text")
STEP_TAIL = ("grad_norm", "optimizer_step")  # per-step calls after the forward/backward phase


@dataclass
class StageEvent:
    stage: str  # "vision" or "text"
    rank: int  # the actor's rank in its pool
    name: str  # "forward", "backward", "forward_backward", "optimizer_step", ...
    mb: int  # micro-batch index, -1 for calls not tied to one
    start: float  # time.time() seconds
    end: float
    step: int


class EventRecorder:
    """One per actor: `with recorder.record("forward", mb): ...` times the body; set `recorder.step = n`."""

    def __init__(self, stage: str, rank: int):
        self.stage, self.rank, self.step = stage, rank, 0
        self._events: list[StageEvent] = []

    @contextmanager
    def record(self, name: str, mb: int = -1) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:  # a failed call still occupied the actor: keep it on the timeline
            self._events.append(StageEvent(self.stage, self.rank, name, mb, start, time.time(), self.step))

    def drain(self) -> list[dict[str, Any]]:
        """The events so far as plain dicts (cheap to send through Ray), forgetting them here."""
        events, self._events = self._events, []
        return [asdict(e) for e in events]


def _as_event(e: StageEvent | dict[str, Any]) -> StageEvent:
    return e if isinstance(e, StageEvent) else StageEvent(**e)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)  # the part already counted by an earlier, overlapping interval
        if end > start:
            total += end - start
            reach = end
    return total


def busy_fractions(events: Iterable[StageEvent | dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """How busy each pool was in the window [start, end], and the pipeline bubble.

    `vision_busy` / `text_busy`: fraction of the window during which rank 0 of that pool was inside some
    recorded call (union of its intervals, clipped to the window; rank 0 stands for the pool because the
    ranks of a model-parallel replica run in lock-step). Which calls count is up to the caller's window:
    pass the accumulate phase's bounds to leave the optimizer step out.

    `bubble` = 1 - max(vision_busy, text_busy): the fraction of the window the busiest pool spent waiting.
    0 means the bottleneck pool never idled (perfectly pipelined); with the serial order F0,T0,B0,F1,...
    the pools never overlap, so it is about min(Tv, Tt) / (Tv + Tt) for per-micro-batch times Tv (vision
    forward + backward) and Tt (text forward + backward). An empty window gives bubble 1.
    """
    if end < start:
        raise ValueError(f"window end {end} is before its start {start}")
    intervals: dict[str, list[tuple[float, float]]] = {s: [] for s in STAGES}
    for e in map(_as_event, events):
        if e.rank == 0 and e.stage in intervals:
            lo, hi = max(e.start, start), min(e.end, end)
            if hi > lo:
                intervals[e.stage].append((lo, hi))
    width = end - start
    busy = {s: _union_length(iv) / width if width > 0 else 0.0 for s, iv in intervals.items()}
    return {"vision_busy": busy["vision"], "text_busy": busy["text"], "bubble": 1.0 - max(busy.values())}


def write_chrome_trace(events: Iterable[StageEvent | dict[str, Any]], path: str | Path) -> None:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per pool, one thread per rank.

    pids are small integers labelled by "process_name" metadata rather than the stage name itself:
    Perfetto's JSON importer keys processes by integer pid, and pid 0 is special there, so they start at 1.
    ts/dur are microseconds from the earliest event's start.
    """
    evs = sorted(map(_as_event, events), key=lambda e: e.start)
    origin = evs[0].start if evs else 0.0
    seen = {e.stage for e in evs}
    order = [s for s in STAGES if s in seen] + sorted(seen - set(STAGES))  # pools in pipeline order
    pids = {stage: i + 1 for i, stage in enumerate(order)}
    trace: list[dict[str, Any]] = []
    for stage, pid in pids.items():
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": stage}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for stage, rank in sorted({(e.stage, e.rank) for e in evs}):
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": pids[stage], "tid": rank, "args": {"name": f"rank {rank}"}}
        )
    for e in evs:
        trace.append(
            {
                "name": e.name,  # not per-mb: Perfetto aggregates slices by name; mb is in args
                "cat": e.stage,
                "ph": "X",
                "pid": pids[e.stage],
                "tid": e.rank,
                "ts": (e.start - origin) * 1e6,
                "dur": max(0.0, e.end - e.start) * 1e6,
                "args": {"mb": e.mb, "step": e.step},
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
