"""Stage-call recording, busy/bubble fractions, and the Chrome trace file."""

from __future__ import annotations

import json

import pytest

from dhp.models.parallel.schedule import pipeline_schedule, simulate
from dhp.stages.trace import (
    EventRecorder,
    StageEvent,
    attach_ray_transfers,
    boundary_seconds,
    busy_fractions,
    write_chrome_trace,
)


def ev(stage: str, start: float, end: float, rank: int = 0, name: str = "forward", mb: int = 0) -> StageEvent:
    return StageEvent(stage=stage, rank=rank, name=name, mb=mb, start=start, end=end, step=0)


def test_recorder_records_and_drains(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 12.25, 13.0, 13.5])
    monkeypatch.setattr("dhp.stages.trace.time.time", lambda: next(clock))
    rec = EventRecorder("vision", rank=3, worker="w3")
    with rec.record("forward", 0):
        rec.add_copy(0.125)
        rec.add_copy(0.0625)
    rec.step = 7
    with rec.record("optimizer_step"):
        pass
    events = rec.drain()
    no_ray = {"worker": "w3", "receive_s": 0.0, "send_s": 0.0}
    assert events == [
        {
            "stage": "vision",
            "rank": 3,
            "name": "forward",
            "mb": 0,
            "start": 10.0,
            "end": 10.5,
            "step": 0,
            "copy_s": 0.1875,
            **no_ray,
        },
        {
            "stage": "vision",
            "rank": 3,
            "name": "optimizer_step",
            "mb": -1,
            "start": 11.0,
            "end": 12.25,
            "step": 7,
            "copy_s": 0.0,
            **no_ray,
        },  # each call counts its own copies
    ]
    assert all(type(e) is dict for e in events)  # plain dicts: cheap through Ray
    assert rec.drain() == []
    with pytest.raises(RuntimeError, match="boom"), rec.record("backward", 2):  # a failed call is still recorded
        raise RuntimeError("boom")
    assert rec.drain() == [
        {
            "stage": "vision",
            "rank": 3,
            "name": "backward",
            "mb": 2,
            "start": 13.0,
            "end": 13.5,
            "step": 7,
            "copy_s": 0.0,
            **no_ray,
        }
    ]


def test_recorder_uses_wall_clock():
    rec = EventRecorder("text", rank=0)
    with rec.record("forward_backward", 1):
        pass
    (e,) = rec.drain()
    assert e["start"] <= e["end"] and e["start"] > 1.6e9  # seconds since the epoch, comparable across actors


def test_busy_fractions_overlaps_and_clipping():
    events = [
        ev("vision", 0.0, 2.0),
        ev("vision", 1.0, 4.0),  # overlaps the first: union [0, 4]
        ev("vision", 6.0, 12.0),  # clipped to [6, 8]
        ev("vision", 4.0, 8.0, rank=1),  # other ranks do not count
        ev("text", -5.0, 1.0),  # clipped to [0, 1]
        ev("text", 3.0, 5.0),
        ev("text", 4.0, 4.5),  # nested
        ev("text", 9.0, 10.0),  # outside the window
        ev("audio", 0.0, 8.0),  # not a pool
    ]
    expected = {"vision_busy": 6 / 8, "text_busy": 3 / 8, "bubble": 0.25}
    assert busy_fractions(events, 0.0, 8.0) == expected
    # Dicts (what EventRecorder.drain returns) work the same.
    assert busy_fractions([e.__dict__ for e in events], 0.0, 8.0) == expected


def test_busy_fractions_touching_intervals_and_perfect_pipeline():
    events = [ev("vision", 0.0, 1.0), ev("vision", 1.0, 2.0), ev("text", 0.5, 2.0)]
    assert busy_fractions(events, 0.0, 2.0) == {"vision_busy": 1.0, "text_busy": 0.75, "bubble": 0.0}


def test_busy_fractions_serial_bubble():
    # Serial: vision 3 s, then text 1 s, per micro-batch: bubble = min(Tv, Tt) / (Tv + Tt) = 1/4.
    events = []
    for i in range(4):
        events += [ev("vision", 4.0 * i, 4.0 * i + 3.0, mb=i), ev("text", 4.0 * i + 3.0, 4.0 * i + 4.0, mb=i)]
    assert busy_fractions(events, 0.0, 16.0) == {"vision_busy": 0.75, "text_busy": 0.25, "bubble": 0.25}


def test_busy_fractions_empty():
    assert busy_fractions([], 0.0, 4.0) == {"vision_busy": 0.0, "text_busy": 0.0, "bubble": 1.0}
    assert busy_fractions([ev("vision", 0.0, 1.0)], 2.0, 2.0) == {"vision_busy": 0.0, "text_busy": 0.0, "bubble": 1.0}
    with pytest.raises(ValueError, match="before its start"):
        busy_fractions([], 3.0, 2.0)


def test_busy_fractions_agree_with_the_simulator():
    timeline = simulate(pipeline_schedule(6, 2), 0.5, 1.0, 0.5)
    events = [ev(op.stage, s, e, mb=op.mb) for op, (s, e) in timeline.spans.items()]
    fractions = busy_fractions(events, 0.0, timeline.makespan)
    assert fractions["bubble"] == timeline.bubble() == 1 - 6 / 7
    assert fractions["text_busy"] == 6 / 7


def test_chrome_trace(tmp_path):
    events = [
        StageEvent("text", 0, "forward_backward", 0, 1000.5, 1001.5, 3),
        StageEvent("vision", 0, "forward", 0, 1000.0, 1000.5, 3),
        {"stage": "vision", "rank": 1, "name": "forward", "mb": 0, "start": 1000.0, "end": 1000.25, "step": 3},
        StageEvent("vision", 0, "optimizer_step", -1, 1002.0, 1002.0, 3),
    ]
    path = tmp_path / "trace.json"
    write_chrome_trace(events, path)
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    pids = {e["args"]["name"]: e["pid"] for e in meta if e["name"] == "process_name"}
    assert pids == {"vision": 1, "text": 2}  # integer pids, labelled; vision first
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {(1, 0): "rank 0", (1, 1): "rank 1", (2, 0): "rank 0"}
    assert len(complete) == 4
    got = sorted(
        (e["pid"], e["tid"], e["name"], e["ts"], e["dur"], e["args"]["mb"], e["args"]["step"]) for e in complete
    )
    assert got == [  # ts relative to the earliest start (1000.0), microseconds
        (1, 0, "forward", 0.0, 500000.0, 0, 3),
        (1, 0, "optimizer_step", 2000000.0, 0.0, -1, 3),
        (1, 1, "forward", 0.0, 250000.0, 0, 3),
        (2, 0, "forward_backward", 500000.0, 1000000.0, 0, 3),
    ]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in pids for e in complete)
    assert all(list(e["args"]) == ["mb", "step", "copy_s"] for e in complete)


def _ray_task(tid: str, start: float, receive: float, execute: float, send: float) -> list[dict]:
    """One task as `ray.timeline()` lists it: microseconds since the epoch, its parts inside its slice."""
    us = 1e6

    def part(cat: str, s: float, d: float) -> dict:
        return {
            "cat": cat,
            "name": cat,
            "ph": "X",
            "pid": "192.0.2.2",
            "tid": tid,
            "ts": s * us,
            "dur": d * us,
            "args": {},
        }

    return [
        part("task:deserialize_arguments", start, receive),
        part("task:execute", start + receive, execute),
        part("task:store_outputs", start + receive + execute, send),
        {**part("task::TextWorker.forward_backward", start, receive + execute + send), "name": "forward_backward"},
    ]


def test_ray_transfers_attach_to_the_call_of_the_same_worker_and_time():
    ray_events = [
        *_ray_task("worker:w1", 100.0, 0.25, 1.0, 0.5),
        *_ray_task("worker:w1", 102.0, 0.125, 1.0, 0.0625),
        *_ray_task("worker:w2", 100.0, 3.0, 1.0, 3.0),
        {"ph": "i", "name": "instant"},
    ]
    events = [
        ev("text", 100.25, 101.25, name="forward_backward"),
        ev("text", 102.125, 103.125, mb=1),
        ev("text", 104.0, 104.5, mb=2),
    ]  # a call Ray has not reported yet
    for e in events:
        e.worker = "w1"
    events.append(ev("vision", 100.1, 100.2))  # no worker id: cannot be matched
    got, missing = attach_ray_transfers(events, ray_events)
    assert missing == 2
    assert [(e["receive_s"], e["send_s"]) for e in got] == [(0.25, 0.5), (0.125, 0.0625), (0.0, 0.0), (0.0, 0.0)]
    assert [e["start"] for e in got] == [e.start for e in events] and all(type(e) is dict for e in got)

    # what the trainer waits for: the latest step's calls not found yet; one found whose transfers both read 0 (a
    # task with nothing to deserialize or store, at the timeline's microsecond rounding) is not among them
    events[2].step = 1
    late = StageEvent("text", 0, "forward_backward", 3, 106.0, 106.5, 1, "w1")
    _, missing = attach_ray_transfers(
        [*events, late], [*ray_events, *_ray_task("worker:w1", 106.0, 0.0, 0.5, 0.0)], missing_of_step=1
    )
    assert missing == 1  # events[2]; not `late`, nor the step-0 calls


def test_ray_transfers_of_back_to_back_short_calls_stay_their_own():
    """Calls of microseconds (a vision backward of a text-only micro-batch) between tasks a fraction of a millisecond
    apart take their own task's transfers, not a neighbour's; a heartbeat (another concurrency group of the same
    worker) that started after the call's task is passed over."""
    ms = 1e-3
    ray_events = [
        *_ray_task("worker:w", 100.0, 0.2 * ms, 0.05 * ms, 0.1 * ms),  # ends at 100.00035
        *_ray_task("worker:w", 100.0 + 0.65 * ms, 0.3 * ms, 1.0 * ms, 0.3 * ms),
        *_ray_task("worker:w", 100.0 + 2.3 * ms, 0.4 * ms, 5.0 * ms, 0.5 * ms),
        *_ray_task("worker:w", 100.0 + 2.8 * ms, 0.01 * ms, 0.01 * ms, 0.01 * ms),
    ]  # a heartbeat
    calls = [
        StageEvent("vision", 0, "backward", 0, 100.0 + 0.2 * ms, 100.0 + 0.25 * ms, 0, "w"),
        StageEvent("vision", 0, "forward", 1, 100.0 + 0.95 * ms, 100.0 + 1.95 * ms, 0, "w"),
        StageEvent("vision", 0, "forward", 2, 100.0 + 2.9 * ms, 100.0 + 7.7 * ms, 0, "w"),
    ]
    got, missing = attach_ray_transfers(calls, ray_events)
    assert missing == 0
    assert [t for e in got for t in (e["receive_s"], e["send_s"])] == pytest.approx(
        [0.2 * ms, 0.1 * ms, 0.3 * ms, 0.3 * ms, 0.4 * ms, 0.5 * ms], abs=1e-9
    )


def test_boundary_seconds_per_microbatch():
    def call(stage: str, name: str, mb: int, rank: int = 0, step: int = 0) -> StageEvent:
        return StageEvent(stage, rank, name, mb, 0.0, 1.0, step, "w", copy_s=0.01, receive_s=0.1, send_s=0.2)

    events = []
    for step in (2, 3):
        for mb in (0, 1):
            events += [
                call("vision", "forward", mb, step=step),
                call("text", "forward_backward", mb, step=step),
                call("vision", "backward", mb, step=step),
                call("text", "forward_backward", mb, 1, step),
            ]
        events.append(call("vision", "optimizer_step", -1, step=step))
    got = boundary_seconds(events)
    # per micro-batch: 3 calls' copies; vision forward's send + text's receive and send + vision backward's receive
    assert got["copy_s"] == pytest.approx(0.03) and got["ray_s"] == pytest.approx(0.2 + 0.1 + 0.2 + 0.1)
    assert got["boundary_s"] == pytest.approx(got["copy_s"] + got["ray_s"])
    assert boundary_seconds([]) == {"copy_s": 0.0, "ray_s": 0.0, "boundary_s": 0.0}


def test_chrome_trace_shows_ray_transfers_around_the_call(tmp_path):
    e = StageEvent("text", 0, "forward_backward", 0, 1000.5, 1001.5, 3, "w", copy_s=0.125, receive_s=0.25, send_s=0.5)
    write_chrome_trace([e, StageEvent("vision", 0, "forward", 0, 1000.5, 1000.75, 3)], tmp_path / "t.json")
    complete = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    got = sorted((e["cat"], e["name"], e["ts"], e["dur"]) for e in complete)
    assert got == [
        ("text", "forward_backward", 250000.0, 1000000.0),
        ("text", "receive", 0.0, 250000.0),
        ("text", "send", 1250000.0, 500000.0),
        ("vision", "forward", 250000.0, 250000.0),
    ]
    assert next(e for e in complete if e["name"] == "forward_backward")["args"]["copy_s"] == 0.125
    assert {e["args"]["call"] for e in complete if e["name"] in ("receive", "send")} == {"forward_backward"}


def test_chrome_trace_of_recorded_events_and_empty(tmp_path):
    rec = EventRecorder("text", rank=0)
    for i in range(3):
        with rec.record("forward_backward", i):
            pass
    write_chrome_trace(rec.drain(), tmp_path / "t.json")
    complete = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["mb"] for e in complete] == [0, 1, 2] and complete[0]["ts"] == 0.0
    write_chrome_trace([], tmp_path / "empty.json")
    assert json.loads((tmp_path / "empty.json").read_text())["traceEvents"] == []
