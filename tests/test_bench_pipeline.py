"""`dhp bench pipeline --quick`: the rows' schema, the traces beside the JSON, the scenario planning.

Timing goals are never asserted (a shared 2-core machine makes them noise); the JSON carries them as flags.
Both bench runs (`--quick`, `--mix long-tail --quick`) are `dhp bench pipeline` subprocesses, each with its own
local Ray, started in the background when the session's tests are chosen (tests/background.py); the fixtures wait
for their JSON.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dhp.scripts.bench import pipeline as bench
from dhp.stages.cli import main as cli_main
from tests import background
from tests.background import scratch_dir

SCENARIOS = ["balanced", "vision_heavy", "text_heavy"]
REQUIRED = {"scenario", "vision_s", "text_s", "serial_step_s", "pipelined_step_s", "driver_overhead_ms"}
POSITIVE = REQUIRED - {"scenario"} | {
    "predicted_step_s",
    "predicted_serial_step_s",
    "ratio_to_max",
    "serial_ratio",
    "speedup",
    "tv_over_tt",
    "vision_ms_per_mb",
    "text_ms_per_mb",
    "serial_vision_s",
    "serial_text_s",
    "pipelined_vision_s",
    "pipelined_text_s",
}
FRACTIONS = {f"{mode}_{k}" for mode in ("serial", "pipelined") for k in ("vision_busy", "text_busy", "bubble")}


pytestmark = pytest.mark.slow  # the bench run once for the module: minutes on 2 cores

RUNS = {"quick": ("pipeline.json", []), "long_tail": ("long_tail.json", ["--mix", "long-tail"])}


def start_early(out: Path, fixtures: set[str]) -> None:
    """Each bench run the chosen tests ask for, in the background (tests/background.py)."""
    for name in RUNS.keys() & fixtures:
        json_name, args = RUNS[name]
        path = out / json_name
        command = [sys.executable, "-m", "dhp.stages.cli", "bench", "pipeline", *args, "--quick", "--json", str(path)]
        background.run_command(f"bench pipeline: {name}", command, path)


def _early(name: str) -> tuple[int, Path, list]:
    def start() -> None:
        start_early(scratch_dir("bench_pipeline"), {name})

    proc, path = background.succeeded(f"bench pipeline: {name}", start)
    return proc.returncode, path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def quick():
    return _early("quick")


def test_rows(quick):
    rc, _, rows = quick
    assert rc == 0
    assert [r["scenario"] for r in rows] == SCENARIOS + ["vision_bound_scaling"]
    rows = rows[:-1]
    for r in rows:
        assert REQUIRED | POSITIVE | FRACTIONS <= r.keys(), sorted(REQUIRED | POSITIVE | FRACTIONS - r.keys())
        for k in POSITIVE:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] > 0, (r["scenario"], k, r[k])
        for k in FRACTIONS:
            assert 0.0 <= r[k] <= 1.0, (r["scenario"], k, r[k])
        assert r["microbatches"] == bench.QUICK["microbatches"]
        for pool in ("vision", "text"):  # each pool alone: the less disturbed of its two measurements
            assert r[f"{pool}_s"] == min(r[f"serial_{pool}_s"], r[f"pipelined_{pool}_s"])
        bound = max(r["vision_s"], r["text_s"])
        assert r["ratio_to_max"] == pytest.approx(r["pipelined_step_s"] / bound, rel=1e-2)
        assert r["speedup"] == pytest.approx(r["serial_step_s"] / r["pipelined_step_s"], rel=1e-2)
        assert r["vision_depth"] >= 1 and r["text_layers"] >= 1
        # Both orders run the same batch; at lr 1e-6 a few steps apart they give (almost) the same loss.
        assert math.isfinite(r["serial_loss"]) and abs(r["pipelined_loss"] / r["serial_loss"] - 1) < 1e-2, r
        assert set(r["goal"]) == {"ratio_to_max", "speedup", "driver_overhead"}
        assert (r["goal"]["speedup"] is None) == (r["scenario"] != "balanced")


def test_scaling_row_compares_the_same_actors_split_two_ways(quick):
    """The vision-bound scenario: 4 actors as 2 + 2 replicas and as 3 vision + 1 text (fan-in)."""
    row = quick[2][-1]
    assert row["actors"] == 4 and row["microbatches"] == 4
    even, fan = row["layouts"]
    assert [(r["vision_replicas"], r["text_replicas"]) for r in (even, fan)] == [(2, 2), (3, 1)]
    for r in (even, fan):
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and math.isfinite(r["loss"])
    assert abs(fan["loss"] / even["loss"] - 1) < 1e-2  # the same samples, however they were routed
    assert row["speedup"] == pytest.approx(even["step_s"] / fan["step_s"], rel=1e-3)
    assert row["predicted_speedup"] == pytest.approx(even["predicted_step_s"] / fan["predicted_step_s"], rel=1e-3)


def test_traces_and_timelines_beside_the_json(quick):
    _, out, rows = quick
    m = bench.QUICK["microbatches"]
    for name in SCENARIOS:
        for mode in ("serial", "pipelined"):
            trace = json.loads(out.with_name(f"{out.stem}.{name}.{mode}.trace.json").read_text())
            calls = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            names = [e["name"] for e in calls]
            # one step: every micro-batch through both pools, then each pool's optimizer step
            assert names.count("forward") == names.count("backward") == names.count("forward_backward") == m
            assert names.count("optimizer_step") == 2
            assert all(e["dur"] >= 0 for e in calls)
    assert out.with_name(f"{out.stem}.timelines.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.with_name(f"{out.stem}.timelines.txt").read_text()
    assert all(name in text for name in SCENARIOS) and text.count("vision |") == 2 * len(SCENARIOS)


def test_plan_reaches_the_ratios_when_depth_allows():
    fits = {"vision": (0.004, 0.006), "text": (0.010, 0.005)}  # seconds = a + b * depth
    cost = {s: (lambda n, f=f: f[0] + f[1] * n) for s, f in fits.items()}
    for name, (depth, layers, intended) in bench.plan(fits, unit=0.03, cap=48).items():
        ratio = cost["vision"](depth) / cost["text"](layers)
        assert abs(ratio / intended - 1) < 0.15, (name, depth, layers, ratio, intended)
    capped = bench.plan(fits, unit=10.0, cap=4)
    assert all(1 <= d <= 4 and 1 <= n <= 4 for d, n, _ in capped.values())


def test_bad_arguments_exit_2(capsys):
    assert cli_main(["bench", "pipeline", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.fixture(scope="module")
def long_tail():
    rc, _, rows = _early("long_tail")
    return rc, rows


def test_long_tail_rows_off_then_on(long_tail):
    """`--mix long-tail --quick`: a row per grouping, off first; the bound is the pools' work over their ranks."""
    rc, rows = long_tail
    assert rc == 0 and [r["balance"] for r in rows] == [False, True]
    for r in rows:
        for k in ("step_s", "vision_work_s", "text_work_s", "bound_s", "step_over_bound", "loss"):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and r[k] > 0, (r["balance"], k, r[k])
        bound = max(r["vision_work_s"] / r["vision_ranks"], r["text_work_s"] / r["text_ranks"])
        assert r["bound_s"] == pytest.approx(bound, rel=1e-3)
        assert r["step_over_bound"] == pytest.approx(r["step_s"] / r["bound_s"], rel=1e-2)
        assert r["goal"] == (r["step_over_bound"] <= 1.10)
        assert r["samples"] == bench.QUICK["mix_samples"] and r["tail_samples"] == 1
    off, on = rows
    # the same samples either way, grouped otherwise: no costlier micro-batch, about the same loss (lr 1e-6)
    assert (off["patches"], off["tokens"]) == (on["patches"], on["tokens"])
    assert on["predicted"]["max_cost"] <= off["predicted"]["max_cost"]
    assert abs(on["loss"] / off["loss"] - 1) < 1e-2


def test_long_tail_mix_is_the_shard_plus_a_larger_tail(tmp_path):
    """The mix's photos are the shard's, in turn, one in eight enlarged 8-16x in area (no Ray)."""
    from dhp.scripts.bench import long_tail

    photos = long_tail.shard_photos()
    assert len(photos) == 32 and all(caption for _, _, caption in photos)
    path, sizes = long_tail.write_mix(tmp_path, 64, scale=0.25)
    assert len(path.read_text().splitlines()) == 64 and sum(s["tail"] for s in sizes) == 8
    for s in sizes:
        assert (8 <= s["area_x"] <= 16) if s["tail"] else s["area_x"] == 1
    assert [s["photo"] for s in sizes[:32]] == [s["photo"] for s in sizes[32:]] == [k for k, _, _ in photos]
