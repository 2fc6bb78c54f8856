"""Recording stage calls inside the actors, and turning the records into pipeline numbers and a timeline.

Times are `time.time()` wall clock: actors are separate processes, and only the wall clock is comparable
across them (on one node exactly; across nodes up to clock skew).

The boundary's cost (the time per micro-batch moving embeddings and their gradients between the
pools) has two parts. Inside a call, the device<->host copies of the crossing tensors: the actor adds them
to the call's `copy_s` (`EventRecorder.add_copy`). Outside it, Ray's own work: deserializing the call's
arguments (fetching the sender's tensors from the object store) before the body runs, and storing its
return values after; Ray records both per task (`ray.timeline()`), and `attach_ray_transfers` copies them
onto the calls as `receive_s` / `send_s`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
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
    worker: str = ""  # Ray's worker id of the actor: the key of its tasks in `ray.timeline()`
    copy_s: float = 0.0  # of [start, end]: boundary tensors copied between the device and the host
    receive_s: float = 0.0  # before start: Ray deserializing the call's arguments (attach_ray_transfers)
    send_s: float = 0.0  # after end: Ray storing the call's return values


class EventRecorder:
    """One per actor: `with recorder.record("forward", mb): ...` times the body; set `recorder.step = n`."""

    def __init__(self, stage: str, rank: int, worker: str = ""):
        self.stage, self.rank, self.step, self.worker = stage, rank, 0, worker
        self._events: list[StageEvent] = []
        self._copy_s = 0.0

    @contextmanager
    def record(self, name: str, mb: int = -1) -> Iterator[None]:
        start, self._copy_s = time.time(), 0.0
        try:
            yield
        finally:  # a failed call still occupied the actor: keep it on the timeline
            self._events.append(
                StageEvent(self.stage, self.rank, name, mb, start, time.time(), self.step, self.worker, self._copy_s)
            )

    def add_copy(self, seconds: float) -> None:
        """Count `seconds` of the call being recorded as boundary copies (device <-> host)."""
        self._copy_s += seconds

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


# what crosses; `gradient`: the text rank's shard gradients under a Ray Direct Transport boundary (boundary.py)
BOUNDARY_CALLS = {("vision", "forward"), ("text", "forward_backward"), ("text", "gradient"), ("vision", "backward")}


ROUNDING_S = 1e-5  # microsecond floats of epoch seconds: comparisons allow for their rounding, nothing more


def attach_ray_transfers(
    events: Iterable[StageEvent | dict[str, Any]], ray_events: list[dict[str, Any]], missing_of_step: int | None = None
) -> tuple[list[dict[str, Any]], int]:
    """`events` with `receive_s` / `send_s` taken from Ray's task profile, and how many found no Ray task (of
    step `missing_of_step` only, when given: a found task's transfers may both read 0 and still be found).

    `ray_events` is `ray.timeline()`: per task, one "task::<Class>.<method>" slice on the thread
    "worker:<worker id>", spanning "task:deserialize_arguments", "task:execute" and "task:store_outputs"
    (microseconds since the epoch, the clock `time.time()` reads). A call belongs to the latest task of its
    actor's worker that started before it and contains it: a heartbeat (another concurrency group of the same
    worker) that started in between is passed over. Its receive is the deserialization that opens that task's
    slice, its send the store that closes it: never a neighbour's, however short the calls. `receive_s` is the
    deserializing: a pull of the arguments from another node's object store comes before it and is not in it.
    Workers report to Ray about once a second, so the latest calls may not be there yet: the count lets a
    caller wait for them.
    """
    tasks: dict[str, list[tuple[float, float]]] = {}
    parts: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in ray_events:
        if r.get("ph") != "X":
            continue
        span = (r["ts"] / 1e6, (r["ts"] + r["dur"]) / 1e6)
        if str(r.get("cat", "")).startswith("task::"):
            tasks.setdefault(r["tid"], []).append(span)
        elif r.get("cat") in ("task:deserialize_arguments", "task:store_outputs"):
            parts.setdefault((r["tid"], r["cat"]), []).append(span)
    for spans in (*tasks.values(), *parts.values()):
        spans.sort()

    def inside(tid: str, cat: str, lo: float, hi: float) -> list[tuple[float, float]]:
        spans = parts.get((tid, cat), [])
        out = []
        for s, e in spans[bisect.bisect_left(spans, (lo - ROUNDING_S,)) :]:
            if s > hi + ROUNDING_S:
                break
            if e <= hi + ROUNDING_S:
                out.append((s, e))
        return out

    def length(span: tuple[float, float] | None) -> float:
        return span[1] - span[0] if span else 0.0

    out, missing = [], 0
    for e in map(_as_event, events):
        tid = f"worker:{e.worker}"
        spans = tasks.get(tid, []) if e.worker else []
        i = bisect.bisect_right(spans, (e.start + ROUNDING_S, float("inf"))) - 1
        for _ in range(8):  # past heartbeats that started after the call's task and ended before the call
            if i < 0 or spans[i][1] + ROUNDING_S >= e.end:
                break
            i -= 1
        if i >= 0 and spans[i][1] + ROUNDING_S >= e.end:
            lo, hi = spans[i]
            received = inside(tid, "task:deserialize_arguments", lo, e.start)
            sent = inside(tid, "task:store_outputs", e.end, hi)
            # the task's own parts open and close its slice; a heartbeat's fall in between
            e = dataclasses.replace(
                e,
                receive_s=length(min(received, default=None)),
                send_s=length(max(sent, key=lambda se: se[1], default=None)),
            )
        elif missing_of_step is None or e.step == missing_of_step:
            missing += 1
        out.append(asdict(e))
    return out, missing


def with_ray_transfers(
    events: list[dict[str, Any]], read_timeline: Callable[[], list[dict[str, Any]]], wait_s: float = 5.0
) -> list[dict[str, Any]]:
    """`events` (every stage call so far) with Ray's argument and return transfers attached
    (`attach_ray_transfers`). `read_timeline` is `ray.timeline`. Workers report to Ray about once a second: this
    waits up to `wait_s` for the latest step's calls. Ray keeps a bounded number of task events
    (RAY_task_events_max_num_task_in_gcs, 100 000 by default): calls older than that keep transfers of 0."""
    state_log = logging.getLogger("ray._private.state")
    level, deadline = state_log.level, time.monotonic() + wait_s
    state_log.setLevel(logging.ERROR)  # its notice that ray.timeline() will read from the dashboard later on
    try:
        latest = max((e["step"] for e in events), default=0)
        while True:
            try:
                timeline = read_timeline()
            except Exception as e:  # (Ray Client, the GCS unreachable): dhp's own timings stay, and the run
                print(
                    f"warning: Ray's timeline could not be read ({type(e).__name__}: {e}); the trace's "
                    "receive/send read 0",
                    flush=True,
                )
                return attach_ray_transfers(events, [])[0]
            # only the latest step's calls can still arrive: older unmatched ones are gone for good
            attached, late = attach_ray_transfers(events, timeline, missing_of_step=latest)
            if not late:
                return attached
            if time.monotonic() > deadline:
                print(
                    f"warning: {late} of the latest step's calls found no Ray task in Ray's timeline within "
                    f"{wait_s:g} s: their receive/send read 0",
                    flush=True,
                )
                return attached
            time.sleep(0.25)
    finally:
        state_log.setLevel(level)


def boundary_seconds(events: Iterable[StageEvent | dict[str, Any]]) -> dict[str, float]:
    """Seconds per micro-batch that rank 0 of each pool spends moving embeddings and their gradients across
    the boundary: `copy_s` (device <-> host inside the calls) and `ray_s` (Ray storing the vision forward's
    and the text call's outputs, deserializing the text call's and the vision backward's arguments; the text
    call's arguments also carry its token ids, a few KiB). The vision forward's arguments (pixels from the
    loader) are not the boundary's. Ray's parts need `attach_ray_transfers` first; else they read 0. Per micro-batch
    of text rank 0; with several data-parallel replicas, vision rank 0 encodes only its share of them, so the sum
    is one replica's view, exact for one actor per pool (`dhp bench one-gpu`).
    """
    copy_s = ray_s = 0.0
    microbatches = set()
    for e in map(_as_event, events):
        if e.rank != 0 or e.mb < 0 or (e.stage, e.name) not in BOUNDARY_CALLS:
            continue
        copy_s += e.copy_s
        ray_s += (e.name != "forward") * e.receive_s + (e.name != "backward") * e.send_s
        if e.stage == "text":
            microbatches.add((e.step, e.mb))
    n = max(1, len(microbatches))
    return {"copy_s": copy_s / n, "ray_s": ray_s / n, "boundary_s": (copy_s + ray_s) / n}


def write_chrome_trace(events: Iterable[StageEvent | dict[str, Any]], path: str | Path) -> None:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per pool, one thread per rank.

    pids are small integers labelled by "process_name" metadata rather than the stage name itself:
    Perfetto's JSON importer keys processes by integer pid, and pid 0 is special there, so they start at 1.
    ts/dur are microseconds from the earliest start (of a call, or of Ray's receive before it).
    """
    evs = sorted(map(_as_event, events), key=lambda e: e.start)
    origin = min((e.start - e.receive_s for e in evs), default=0.0)
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
        # Ray's argument and return transfers, where attached, as slices just before and after the call.
        for name, start, end in (
            ("receive", e.start - e.receive_s, e.start),
            (e.name, e.start, e.end),
            ("send", e.end, e.end + e.send_s),
        ):
            if end > start or name == e.name:
                trace.append(
                    {
                        "name": name,  # not per-mb: Perfetto aggregates slices by name; mb is in args
                        "cat": e.stage,
                        "ph": "X",
                        "pid": pids[e.stage],
                        "tid": e.rank,
                        "ts": (start - origin) * 1e6,
                        "dur": max(0.0, end - start) * 1e6,
                        "args": {
                            "mb": e.mb,
                            "step": e.step,
                            **({"copy_s": e.copy_s} if name == e.name else {"call": e.name}),
                        },
                    }
                )
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
