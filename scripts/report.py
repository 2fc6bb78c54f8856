"""`dhp report RUN_DIR [--out DIR]`: PNG plots of a run's metrics.jsonl and a summary table on stdout.

Plots (into RUN_DIR/report unless --out): `loss.png` (train loss per step, eval loss points),
`throughput.png` (tokens/s; MFU and achieved model TFLOP/s), `pipeline.png` (busy fraction of each
pool and the bubble per step). Runs that predate a field simply lack its curve and show "-" in the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from dhp.stages.config import ConfigError


def load_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """(records in step order, lines that were not JSON objects with a step, e.g. a line cut by a crash)."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (is it a run directory of `dhp train`?)")
    records, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("loss"), (int, float)):
            records.append(rec)
        else:
            bad += 1
    if not records:
        raise ConfigError(f"{path} holds no step records" + (f" ({bad} unreadable lines)" if bad else " (empty)"))
    return sorted(records, key=lambda r: r["step"]), bad


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def summarize(records: list[dict[str, Any]], run_summary: dict[str, Any] | None, bad_lines: int = 0) -> dict:
    evals = [r["eval_loss"] for r in records if isinstance(r.get("eval_loss"), (int, float))]
    out = {
        "steps": len(records),
        "first_step": records[0]["step"],
        "last_step": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "eval_loss": evals[-1] if evals else None,
        "eval_points": len(evals),
        **{
            f"mean_{k}": _mean(records, k)
            for k in ("tokens_per_s", "mfu", "model_tflops_per_s", "vision_busy", "text_busy", "bubble", "step_time_s")
        },
        "unreadable_lines": bad_lines,
        "skipped": None,
    }
    skipped = (run_summary or {}).get("skipped")
    if isinstance(skipped, dict) and isinstance(skipped.get("counts"), dict):
        out["skipped"] = skipped["counts"]
    return out


def _fmt(value: Any, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def table(s: dict[str, Any]) -> str:
    skipped = s["skipped"]
    rows = [
        ("steps", f"{s['steps']} (step {s['first_step']} to {s['last_step']})"),
        ("first loss", _fmt(s["first_loss"])),
        ("last loss", _fmt(s["last_loss"])),
        ("eval loss (last)", _fmt(s["eval_loss"]) + (f" ({s['eval_points']} evals)" if s["eval_points"] else "")),
        ("mean tokens/s", _fmt(s["mean_tokens_per_s"], ".1f")),
        ("mean MFU", _fmt(s["mean_mfu"], ".3%")),
        ("mean model TFLOP/s", _fmt(s["mean_model_tflops_per_s"])),
        ("mean step time (s)", _fmt(s["mean_step_time_s"])),
        ("mean vision busy", _fmt(s["mean_vision_busy"], ".3f")),
        ("mean text busy", _fmt(s["mean_text_busy"], ".3f")),
        ("mean bubble", _fmt(s["mean_bubble"], ".3f")),
        (
            "skipped records",
            "- (no summary.json)"
            if skipped is None
            else f"{sum(skipped.values())}"
            + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))})" if skipped else ""),
        ),
    ]
    if s["unreadable_lines"]:
        rows.append(("unreadable lines", str(s["unreadable_lines"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the three PNGs; returns their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)

    def new(rows: int = 1) -> tuple[Figure, list]:
        fig = Figure(figsize=(8, 3.2 * rows), layout="constrained")
        FigureCanvasAgg(fig)
        return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]

    def save(fig: Figure, name: str) -> Path:
        path = out_dir / name
        fig.savefig(path, dpi=100)
        return path

    paths = []
    fig, (ax,) = new()
    ax.plot(*_series(records, "loss"), label="train loss", linewidth=1)
    steps, evals = _series(records, "eval_loss")
    if steps:
        ax.plot(steps, evals, "o-", color="C3", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend()
    paths.append(save(fig, "loss.png"))

    fig, (top, bottom) = new(2)
    top.plot(*_series(records, "tokens_per_s"), linewidth=1)
    top.set(ylabel="tokens/s", title="throughput")
    steps, mfu = _series(records, "mfu")
    bottom.plot(steps, [100 * m for m in mfu], color="C2", linewidth=1, label="MFU")
    bottom.set(xlabel="step", ylabel="MFU (%)")
    twin = bottom.twinx()
    twin.plot(*_series(records, "model_tflops_per_s"), color="C1", linewidth=0.8, alpha=0.6)
    twin.set_ylabel("model TFLOP/s")
    paths.append(save(fig, "throughput.png"))

    fig, (ax,) = new()
    for key, label in (("vision_busy", "vision busy"), ("text_busy", "text busy"), ("bubble", "bubble")):
        ax.plot(*_series(records, key), label=label, linewidth=1)
    ax.set(xlabel="step", ylabel="fraction of step", ylim=(0, 1.05), title="per-stage busy time and bubble")
    ax.legend()
    paths.append(save(fig, "pipeline.png"))
    return paths


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    records, bad = load_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    run_summary = None
    if summary_path.is_file():
        try:
            run_summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError:
            run_summary = None  # a summary cut by a crash: the table says "no summary.json"
    out_dir = Path(args.out) if args.out else run_dir / "report"
    paths = plot(records, out_dir)
    print(table(summarize(records, run_summary, bad)))
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0
