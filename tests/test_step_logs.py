"""stages/step_logs.py: a run's per-step files, and what a resumed run keeps of them."""

from __future__ import annotations

import json
from types import SimpleNamespace

from dhp.stages.step_logs import StepLogs


def _batch(ids: list, quarantined: list[dict] | None = None) -> SimpleNamespace:
    return SimpleNamespace(ids=ids, quarantined=quarantined or [])


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_keeps_the_steps_before_its_resume_point_and_rewrites_the_rest(tmp_path):
    with StepLogs(tmp_path, 1) as logs:
        for step in (1, 2, 3):
            bad = [{"source": f"train.jsonl:{step}", "reason": "unreadable image"}] if step == 2 else []
            batches = [_batch([[0, f"a{step}"]], bad), _batch([[0, f"b{step}"]])]
            logs.skipped(step, batches)
            logs.trained(step, batches, {"step": step, "loss": 10.0 - step})
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert _read(tmp_path / "quarantine.jsonl") == [
        {"step": 2, "source": "train.jsonl:2", "reason": "unreadable image"}
    ]
    assert [(r["step"], r["replica"]) for r in _read(tmp_path / "samples.jsonl")] == [
        (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)
    ]  # fmt: skip

    # resumed from the checkpoint of step 1: step 2 and 3 are trained again, their old lines dropped
    with StepLogs(tmp_path, 2) as logs:
        assert logs.losses == [9.0]
        logs.skipped(2, [_batch([[0, "a2"]])])
        logs.trained(2, [_batch([[0, "a2"]])], {"step": 2, "loss": 7.5})
        assert logs.losses == [9.0, 7.5]
    assert [(r["step"], r["loss"]) for r in _read(tmp_path / "metrics.jsonl")] == [(1, 9.0), (2, 7.5)]
    assert _read(tmp_path / "quarantine.jsonl") == []
    assert [(r["step"], r["ids"]) for r in _read(tmp_path / "samples.jsonl")] == [
        (1, [[0, "a1"]]), (1, [[0, "b1"]]), (2, [[0, "a2"]])
    ]  # fmt: skip


def test_a_fresh_run_starts_its_files_empty(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with StepLogs(tmp_path, 1) as logs:
        assert logs.losses == []
    assert (tmp_path / "metrics.jsonl").read_text() == ""
