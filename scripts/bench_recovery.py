"""`dhp bench recovery`: how long a tiny run takes to notice a killed stage actor and to train again.

A real `dhp train` subprocess (its own local Ray, the default layout: vision SP2, text TP2, pipelined)
checkpoints every `--checkpoint-every` steps; once step `--kill-after` is on disk the script SIGKILLs
vision rank 1's process (its pid is in the start-up placement lines) and reads the rest from the run:

  detect_s    kill -> the driver's fault record (`summary.json` restarts[].detected_at)
  recover_s   kill -> the first step finished after the restart (`metrics.jsonl` wall `time`), i.e. both
              pools rebuilt, checkpoint loaded, data stream repositioned, one step trained
  steps_lost  steps finished before the kill that the restart trained again (kill step - checkpoint step)

Usage: dhp bench recovery [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dhp.scripts.results import write_json


def start_run(out: Path, name: str, steps: int, checkpoint_every: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dhp.stages.cli", "train", f"output.dir={out}/runs", f"output.name={name}",
           f"data.synthetic.dir={out}/synth", "data.synthetic.num=48", "data.synthetic.eval_num=8",
           f"training.steps={steps}", f"training.checkpoint_every={checkpoint_every}", "training.eval_every=0",
           "training.eval_batches=1", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def kill_vision_actor_after_step(proc: subprocess.Popen, run: Path, step: int, timeout_s: float = 600) -> float:
    """SIGKILL vision rank 1 once `step` steps are in metrics.jsonl; returns the kill's wall time."""
    seen = []
    for line in proc.stdout:  # the placement summary comes first
        seen.append(line)
        if m := re.search(r"vision rank 1: .* pid (\d+)", line):
            pid = int(m.group(1))
            break
    else:
        raise RuntimeError("the run printed no placement line:\n" + "".join(seen))
    deadline, metrics = time.time() + timeout_s, run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the run ended or stalled before step {step}")
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return time.time()


def measure(out: Path, steps: int, checkpoint_every: int, kill_after: int) -> dict:
    run = out / "runs" / "recovery"
    proc = start_run(out, "recovery", steps, checkpoint_every)
    killed_at = kill_vision_actor_after_step(proc, run, kill_after)
    _, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed after the kill:\n{err[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed_step = int(re.search(r"step_(\d+)", summary["resumed_from"] or "step_0").group(1))
    after = [r for r in records if r["step"] == resumed_step + 1]
    done_before_kill = max(r["step"] for r in records if r["time"] < killed_at) if records else 0
    return {
        "detect_s": round(summary["restarts"][0]["detected_at"] - killed_at, 3),
        "recover_s": round(after[0]["time"] - killed_at, 3),
        "steps_lost": max(0, done_before_kill - resumed_step),
        "killed_after_step": kill_after,
        "resumed_from_step": resumed_step,
        "checkpoint_every": checkpoint_every,
        "steps": steps,
        "step_time_s": round(sorted(r["step_time_s"] for r in records)[len(records) // 2], 3),
    }


def main(args: argparse.Namespace) -> int:
    steps, every, kill = (6, 2, 3) if args.quick else (12, 4, 7)
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(Path(tmp), steps, every, kill)
    print(f"{'detect_s':>9} {'recover_s':>10} {'steps_lost':>10} {'step_time_s':>11}")
    print(f"{row['detect_s']:>9.2f} {row['recover_s']:>10.2f} {row['steps_lost']:>10d} {row['step_time_s']:>11.3f}")
    if args.json:
        write_json(args.json, [row])
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    sys.exit(main(parser.parse_args()))
