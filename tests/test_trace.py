"""Stage-call recording, busy/bubble fractions, and the Chrome trace file."""

from __future__ import annotations

import json

import pytest

from dhp.stages.schedule import pipeline_schedule, simulate
from dhp.stages.trace import EventRecorder, StageEvent, busy_fractions, write_chrome_trace


def ev(stage: str, start: float, end: float, rank: int = 0, name: str = "forward", mb: int = 0) -> StageEvent:
    return StageEvent(stage=stage, rank=rank, name=name, mb=mb, start=start, end=end, step=0)


def test_recorder_records_and_drains(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 12.25, 13.0, 13.5])
    monkeypatch.setattr("dhp.stages.trace.time.time", lambda: next(clock))
    rec = EventRecorder("vision", rank=3)
    with rec.record("forward", 0):
        pass
    rec.step = 7
    with rec.record("optimizer_step"):
        pass
    events = rec.drain()
    assert events == [
        {"stage": "vision", "rank": 3, "name": "forward", "mb": 0, "start": 10.0, "end": 10.5, "step": 0},
        {"stage": "vision", "rank": 3, "name": "optimizer_step", "mb": -1, "start": 11.0, "end": 12.25, "step": 7},
    ]
    assert all(type(e) is dict for e in events)  # plain dicts: cheap through Ray
    assert rec.drain() == []
    with pytest.raises(RuntimeError, match="boom"), rec.record("backward", 2):  # a failed call is still recorded
        raise RuntimeError("boom")
    assert rec.drain() == [
        {"stage": "vision", "rank": 3, "name": "backward", "mb": 2, "start": 13.0, "end": 13.5, "step": 7}
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
    got = sorted((e["pid"], e["tid"], e["name"], e["ts"], e["dur"], *e["args"].values()) for e in complete)
    assert got == [  # ts relative to the earliest start (1000.0), microseconds
        (1, 0, "forward", 0.0, 500000.0, 0, 3),
        (1, 0, "optimizer_step", 2000000.0, 0.0, -1, 3),
        (1, 1, "forward", 0.0, 250000.0, 0, 3),
        (2, 0, "forward_backward", 500000.0, 1000000.0, 0, 3),
    ]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in pids for e in complete)
    assert all(list(e["args"]) == ["mb", "step"] for e in complete)


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
