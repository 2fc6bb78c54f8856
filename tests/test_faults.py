"""A stage actor killed mid-run: the driver notices, rebuilds both pools, resumes from the last checkpoint.

`dhp train` runs as a user runs it (a subprocess with its own local Ray); the test kills one vision
actor's process (its pid is in the start-up placement lines) once step 3 is on disk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

STEPS = 8


def _start(tmp_path, name: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dhp.stages.cli", "train", f"output.dir={tmp_path}/runs", f"output.name={name}",
           f"data.synthetic.dir={tmp_path}/synth", "data.synthetic.num=48", "data.synthetic.eval_num=8",
           f"training.steps={STEPS}", "training.checkpoint_every=2", "training.eval_every=0",
           "training.eval_batches=1", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _kill_a_vision_actor_after_step(proc: subprocess.Popen, run, step: int) -> float:
    lines = []
    for line in proc.stdout:  # the placement summary comes first
        lines.append(line)
        if m := re.search(r"vision rank 1: .* pid (\d+)", line):
            pid = int(m.group(1))
            break
    else:
        raise AssertionError("no placement line: " + "".join(lines))
    deadline = time.time() + 600
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return time.time()


def test_killed_actor_is_replaced_and_training_resumes(tmp_path):
    run = tmp_path / "runs" / "fault"
    proc = _start(tmp_path, "fault")
    killed_at = _kill_a_vision_actor_after_step(proc, run, 3)
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
    _kill_a_vision_actor_after_step(proc, tmp_path / "runs" / "fatal", 1)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("dhp: error: a stage actor died and training.max_restarts=0"), err[-2000:]
    assert "Traceback" not in err
