"""A stage actor killed mid-run: the driver notices, rebuilds both pools, resumes from the last checkpoint.

`dhp train` runs as a user runs it (a subprocess with its own local Ray); the test kills one vision
actor's process (its pid is in the start-up placement lines) once step 3 is on disk.
"""

from __future__ import annotations

import json

from dhp.scripts.bench_recovery import kill_vision_actor_after_step, start_run

STEPS = 8


def _start(tmp_path, name: str, *extra: str):
    return start_run(tmp_path, name, STEPS, 2, *extra)


def test_killed_actor_is_replaced_and_training_resumes(tmp_path):
    run = tmp_path / "runs" / "fault"
    proc = _start(tmp_path, "fault")
    killed_at = kill_vision_actor_after_step(proc, run, 3)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "rebuilding both pools" in out

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once, in order
    summary = json.loads((run / "summary.json").read_text())
    (fault,) = summary["restarts"]
    assert 0 <= fault["detected_at"] - killed_at < 60  # noticed within seconds, not a collective timeout
    assert summary["resumed_from"].endswith(("step_000002", "step_000004"))


def test_restarts_used_up_exits_nonzero_with_one_line(tmp_path):
    proc = _start(tmp_path, "fatal", "training.max_restarts=0")
    kill_vision_actor_after_step(proc, tmp_path / "runs" / "fatal", 1)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("dhp: error: a stage actor died and training.max_restarts=0"), err[-2000:]
    assert "Traceback" not in err


def test_bench_recovery_reports_its_figures(tmp_path):
    from dhp.stages.cli import main

    assert main(["bench", "recovery", "--quick", "--json", str(tmp_path / "r.json")]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert 0 <= row["detect_s"] <= row["recover_s"]
    assert 0 <= row["steps_lost"] <= row["checkpoint_every"] and row["resumed_from_step"] % row["checkpoint_every"] == 0
