"""The README's main command, `dhp train` on its embedded default, run as a user runs it.

Only the output locations are redirected into a temporary directory; everything else is the default (tiny model,
synthetic data written on first use, local Ray, vision sequence-parallel 2, text tensor-parallel 2, vision forwards
pipelined ahead of the text stage, 100 steps). The run starts in the background when the session's tests are chosen
(tests/background.py); the test reads what it wrote.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.stages import step_logs
from tests import background
from tests.background import scratch_dir

pytestmark = pytest.mark.slow  # subprocess runs of dhp or its own Ray cluster (tests/README.md)

REQUIRED = {
    "step",
    "loss",
    "lr",
    "tokens",
    "step_time_s",
    "tokens_per_s",
    "grad_norm",
    "vision_busy",
    "text_busy",
    "bubble",
    "driver_ms_per_microbatch",
    "vision_tokens",
    "text_tokens",
    "model_tflops_per_s",
    "mfu",
}


def start_early(out: Path, fixtures: set[str]) -> None:
    """The run starts in the background at the start of the session (tests/background.py); the test reads it."""
    if "default_run" in fixtures:
        background.start("train job: default run", lambda: _default_run(out))


def _default_run(out: Path) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "dhp.stages.cli",
        "train",
        f"output.dir={out}/runs",
        "output.name=default",
        f"data.synthetic.dir={out}/synth",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800), out


@pytest.fixture(scope="module")
def default_run() -> tuple[subprocess.CompletedProcess, Path]:
    return background.result("train job: default run", lambda: start_early(scratch_dir("train_job"), {"default_run"}))


def test_default_run_learns_and_writes_its_outputs(default_run, capsys):
    proc, out = default_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = out / "runs" / "default"

    records = step_logs.read(run)
    assert [r["step"] for r in records] == list(range(1, 101))
    for r in records:
        assert REQUIRED <= set(r) and all(math.isfinite(r[k]) for k in REQUIRED)
        assert r["tokens"] > 0 and r["step_time_s"] > 0
        assert 0 < r["vision_busy"] <= 1 and 0 < r["text_busy"] <= 1 and 0 <= r["bubble"] < 1
        assert r["text_tokens"] == r["tokens"] and r["vision_tokens"] > 0 and 0 < r["mfu"] < 1
    first = records[0]["loss"]
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last <= first / 2, f"train loss {first:.3f} -> {last:.3f}: did not fall by half"
    lrs = [r["lr"] for r in records]
    assert lrs[0] < lrs[9] and lrs[-1] < max(lrs)  # warmup, then cosine decay

    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(e) for e in evals) and evals[-1] < first

    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped"]["counts"] == {} and summary["skipped"]["good"] > 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["training"]["steps"] == 100 and saved["model"]["name"] == "tiny"
    assert (saved["vision"]["parallelism"], saved["vision"]["degree"]) == ("sequence", 2)
    assert (saved["text"]["parallelism"], saved["text"]["degree"]) == ("tensor", 2)
    assert saved["pipeline"]["max_in_flight"] >= 2
    # A user reads an ERROR as a failure: no ERROR-level line from Ray's internals (its C++ logs print ` E `,
    # e.g. Ray Data's map actors restarting with object-store arguments, dataflow/loader.py), no deprecations.
    # One exception: the raylet's disk monitor (`file_system_monitor.cc`, "... is over 95% full") reports the
    # host's free disk, which no run of dhp causes or can silence; a CI host near full must not fail this test.
    output = proc.stdout + proc.stderr
    noisy = [
        line
        for line in output.splitlines()
        if re.search(r"\bERROR\b|\[\d{4}-\d\d-\d\d [\d:,]+ E \d+ \d+\]|DeprecationWarning", line)
        and "file_system_monitor.cc" not in line
    ]
    # whole lines, with the output's path: a C++ stack trace from a Ray worker is many such lines, and its first
    # lines say why
    kept = default_run[1] / "output.txt"
    kept.write_text(output)
    assert not noisy, f"{len(noisy)} lines, the whole output in {kept}:\n" + "\n".join(noisy[:20])
    # The console is dhp's: no Ray notices at the start, no Ray Data advice blocks while the streams run.
    for notice in ("Started a local Ray instance", "Token authentication is enabled", "consider setting `memory="):
        assert notice not in output, notice
    # What is placed where is printed at start: two ranks per pool, sharing bundles. Before it, each phase of the
    # start-up and its seconds, in the order they end.
    assert "placement: shared" in proc.stdout and proc.stdout.count("vision rank") == 2
    starts = ["ray: started a local Ray (1 node, ", "vision pool: 2 ranks started and built in ", "text pool: 2 ranks "]
    starts += ["data: 2 streams read their first rows ", "placement: shared"]
    firsts = [next((n for n, line in enumerate(proc.stdout.splitlines()) if line.startswith(s)), -1) for s in starts]
    assert -1 not in firsts and firsts == sorted(firsts), dict(zip(starts, firsts))
    assert (out / "synth" / "train.jsonl").exists() and (out / "synth" / "val.jsonl").exists()

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "checkpoint")
    assert model.config.text_config.hidden_size == 64
    # Not on a terminal (as in a Ray Job): periodic progress lines instead of a bar, with MFU and an ETA.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{s}/100" for s in (1, *range(10, 101, 10))]
    assert all(" mfu " in line and " eta " in line for line in lines) and "eta 0:00:00" in lines[-1]
    assert proc.stdout.count("layout: vision sequence x2") == 1 and proc.stdout.count("peak for MFU:") == 1
    # TensorBoard holds the same per-step numbers as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    loss = board.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 101))
    assert all(math.isclose(e.value, r["loss"], rel_tol=1e-6) for e, r in zip(loss, records))
    assert [e.step for e in board.Scalars("eval/loss")] == [50, 100]
    assert [e.step for e in board.Scalars("throughput/mfu")] == list(range(1, 101))
    # `dhp report` on the real run: plots and a table. Its command line in this process: a process of its own
    # would spend about 5 CPU-s importing what this one has imported already.
    from dhp.stages.cli import main

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    report = capsys.readouterr().out
    assert re.search(r"^steps +100 \(step 1 to 100\)$", report, re.M) and "mean MFU" in report, report[-2000:]
    assert {p.name for p in (run / "report").iterdir()} == {"loss.png", "throughput.png", "pipeline.png"}
