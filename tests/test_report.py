"""`dhp report` on a metrics.jsonl written here, its errors, and the progress output and TensorBoard writer
of the training loop (stages/run_log.py) on their own."""

from __future__ import annotations

import argparse
import io
import json
import time

import pytest
from PIL import Image

from dhp.scripts.report import main as report
from dhp.stages.cli import main as cli
from dhp.stages.config import ConfigError
from dhp.stages.run_log import Progress, TensorBoard, fmt_duration


def _record(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 10.0 / step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 100.0 * step,
        "mfu": 0.01 * step,
        "model_tflops_per_s": 0.5,
        "vision_busy": 0.5,
        "text_busy": 0.25,
        "bubble": 0.1,
        "step_time_s": 2.0,
        **extra,
    }


def _write_run(run, n: int = 4, summary: dict | None = None):
    run.mkdir(parents=True, exist_ok=True)
    records = [_record(s, **({"eval_loss": 3.0 / s} if s % 2 == 0 else {})) for s in range(1, n + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "lo')
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return records


def _args(run, out=None) -> argparse.Namespace:
    return argparse.Namespace(run_dir=str(run), out=None if out is None else str(out))


def _table(text: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in text.splitlines() if "  " in line)}


def test_report_writes_pngs_and_a_table(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, summary={"skipped": {"counts": {"image_missing": 2, "bad_json": 1}, "examples": []}})
    assert report(_args(run)) == 0
    rows = _table(capsys.readouterr().out)
    assert rows["steps"] == "4 (step 1 to 4)"
    assert rows["first loss"] == "10" and rows["last loss"] == "2.5"
    assert rows["eval loss (last)"] == "0.75 (2 evals)"
    assert rows["mean tokens/s"] == "250.0"  # (100 + 200 + 300 + 400) / 4
    assert rows["mean MFU"] == "2.500%"  # (1 + 2 + 3 + 4) % / 4
    assert rows["mean vision busy"] == "0.500" and rows["mean text busy"] == "0.250" and rows["mean bubble"] == "0.100"
    assert rows["skipped records"] == "3 (bad_json: 1, image_missing: 2)"
    assert rows["unreadable lines"] == "1"  # the last line, cut off mid-write
    for name in ("loss.png", "throughput.png", "pipeline.png"):
        path = run / "report" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.size[0] >= 400 and image.size[1] >= 200


def test_report_out_dir_and_a_run_without_summary_or_new_fields(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    old = [{"step": s, "loss": 1.0, "tokens_per_s": 10.0} for s in (1, 2)]  # a run from before mfu existed
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert cli(["report", str(run), "--out", str(tmp_path / "plots")]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows["mean MFU"] == "-" and rows["skipped records"] == "- (no summary.json)"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss.png", "pipeline.png", "throughput.png"]
    assert not (run / "report").exists()


def test_report_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="run directory not found"):
        report(_args(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        report(_args(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no step records"):
        report(_args(tmp_path))
    assert cli(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dhp: error:") and "metrics.jsonl holds no step records (empty)" in err
    assert len(err.strip().splitlines()) == 1


def test_log_lines_after_a_resume_pace_the_eta_on_this_process_steps():
    """Resumed at step 5 of 10: steps 1-5 took no time here, and step 6 carries start-up (a slow first step)."""
    out = io.StringIO()
    with Progress(10, done=5, every=2, interactive=False, file=out) as bar:
        time.sleep(0.5)  # start-up before the first step here
        bar.update(_record(6))
        etas = []
        for step in (7, 8):
            time.sleep(0.1)
            bar.update(_record(step, **({"eval_loss": 0.5} if step == 8 else {})))
            etas.append(bar.eta(step))
        for step in (9, 10):
            bar.update(_record(step))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["6/10", "8/10", "10/10"]  # first, every 2nd, last
    assert lines[1].startswith("step 8/10 loss 1.2500 tok/s 800 mfu 8.00% busy vision/text 0.50/0.25 bubble 0.10 eta ")
    assert lines[1].endswith(" eval_loss 0.5000")
    # 2 steps left at ~0.1 s per step: neither diluted by the 5 restored steps nor inflated by start-up.
    assert 0.15 <= etas[1] <= 0.5, etas
    assert fmt_duration(3725.4) == "1:02:05" and fmt_duration(None) == "?"


def test_the_terminal_bar_counts_from_the_resume_point():
    out = io.StringIO()
    with Progress(10, done=5, interactive=True, file=out) as bar:
        bar.update(_record(6))
        bar.update(_record(7, eval_loss=0.5))
    text = out.getvalue()
    assert "7/10" in text and "loss=1.429" in text and "tok_s=700" in text and "mfu=7.00%" in text
    assert "eval=0.500" in text


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tensorboard"
    with TensorBoard(log_dir, first_step=1) as tb:  # the first process: steps 1-6
        for step in range(1, 7):
            tb.log(_record(step, **({"eval_loss": 7.0} if step == 6 else {})))
    with TensorBoard(log_dir, first_step=4) as tb:  # resumed from the step-3 checkpoint
        for step in range(4, 7):
            tb.log({**_record(step), "loss": 100.0 + step})
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 10.0), (2, 5.0), (pytest.approx(3), pytest.approx(10 / 3)), (4, 104.0), (5, 105.0), (6, 106.0)]
    # Only the first process logged an eval loss, at step 6: purged with the rest of its steps >= 4.
    assert "eval/loss" not in acc.Tags()["scalars"] or acc.Scalars("eval/loss") == []
    assert {
        "train/lr",
        "train/grad_norm",
        "throughput/tokens_per_s",
        "throughput/mfu",
        "pipeline/vision_busy",
        "pipeline/text_busy",
        "pipeline/bubble",
    } <= set(acc.Tags()["scalars"])
    with TensorBoard(None, first_step=1) as off:  # output.tensorboard=false
        off.log(_record(1))
    assert len(list(log_dir.iterdir())) == 2
