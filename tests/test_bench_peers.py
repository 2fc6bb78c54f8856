"""`dhp bench peers` (scripts/bench/peers.py) at its quick size: every system runs, the memory search is
consistent with the cap it states, and the byte counts hold the structural claim (a DeepSpeed ZeRO-3 rank keeps
a whole sample's activations, a dhp sequence / tensor rank a share). No wall-clock time is asserted. The bench runs
in a process of its own, started in the background when the session's tests are chosen (tests/background.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dhp.scripts.bench.peers import BASE, bench_config, gpu_settings, plot, run, systems, table
from dhp.scripts.peers.probe import SIDE_UNIT, ladder, largest_fitting, patches
from tests import background
from tests.background import scratch_dir


def test_largest_fitting_climbs_then_bisects():
    sides = ladder(112, 1568)
    assert sides[0] == 112 and all(b > a and b % SIDE_UNIT == 0 for a, b in zip(sides, sides[1:]))
    limit = 700
    asked: list[int] = []

    def fits(side: int) -> bool:
        asked.append(side)
        return side <= limit

    best = largest_fitting(fits, sides)
    assert best is not None and best <= limit and best > 644  # bisected past the last fitting rung (644)
    assert largest_fitting(lambda s: False, sides) is None
    assert largest_fitting(lambda s: True, sides) == sides[-1]  # the ceiling: a lower bound
    assert patches(112) == 64


def start_early(out: Path, fixtures: set[str]) -> None:
    """The quick bench runs in the background when the session's tests are chosen (tests/background.py):
    `run(quick=True)` in a process of its own (its Ray, DeepSpeed's ranks), by this module's `__main__`."""
    if "quick_bench" in fixtures:
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "tests.test_bench_peers", str(out / "peers.json")]
        background.run_command("bench peers: quick", command, out / "peers.json", cwd=root, env=env)


@pytest.fixture(scope="module")
def quick_bench() -> tuple[list, dict]:
    _, path = background.succeeded(
        "bench peers: quick", lambda: start_early(scratch_dir("bench_peers"), {"quick_bench"})
    )
    ran = json.loads(path.read_text())
    return ran["partial"], ran["result"]


@pytest.mark.slow  # a bench run with its own Ray
def test_quick_bench_runs_every_system_under_its_cap(quick_bench, tmp_path):
    partial, result = quick_bench  # partial: what a time-limited run keeps, the JSON after each system
    names = [r["name"] for r in result["systems"]]
    assert names == list(systems(result["ranks"]))
    assert [p[0] for p in partial] == [names[:i] for i in range(1, len(names) + 1)]
    assert [p[1] for p in partial] == [False] * (len(names) - 1) + [True] and result["complete"]
    assert partial[0][2] is None and partial[-1][2] is not None  # a goal is judged once its systems have run
    for r in result["systems"]:
        assert r["step_s"] > 0 and r["peak_activation_bytes"] > 0 and r["peak_rss_bytes"] > 0, r["name"]
        for p in r["probes"]:  # the search's verdicts are the cap's
            fits = p["peak_bytes"] <= result["cap_bytes"]
            assert fits == (r["largest_side"] is not None and p["side"] <= r["largest_side"]), (r["name"], p)
    rows = {r["name"]: r for r in result["systems"]}
    assert rows["deepspeed zero3"]["probes"] and rows["deepspeed zero3"]["jit_built"] is not None
    assert rows["dhp sequence / tensor, pipelined"]["probes"] == []  # timed only, as documented
    assert (
        rows["deepspeed zero3"]["peak_activation_bytes"]
        > 2 * rows["dhp sequence / tensor, serial"]["peak_activation_bytes"]
    )
    assert "DeepSpeed" in table(result)
    plot(result, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_on_gpus_every_system_takes_one_gpu_per_rank():
    """What `dhp bench peers` asks of a GPU machine, checked without one: nothing on a CPU, vision and text actor r
    sharing GPU r, and N > GPUs refused up front (NCCL would refuse it at the first collective)."""
    from dhp.models.parallel.checks import check_layout
    from dhp.stages.config import load_config

    assert gpu_settings(4, 0) == []
    with pytest.raises(ValueError, match="--ranks 4 needs 4 GPUs .* has 1: pass --ranks 1"):
        gpu_settings(4, 1)
    for overrides in filter(None, systems(1).values()):  # one GPU: every layout at one rank per pool
        cfg = load_config("tiny", BASE + overrides + ["training.global_batch_size=1"] + gpu_settings(1, 1))
        check_layout(cfg, bench_config())
        assert cfg.pipeline.shared and cfg.vision.num_gpus_per_actor == cfg.text.num_gpus_per_actor == 0.5


if __name__ == "__main__":  # the quick bench for `start_early`: its result and what it handed `on_system`
    from dhp.scripts.results import write_json

    seen: list = []
    ran = run(
        quick=True,
        on_system=lambda r: seen.append(
            ([s["name"] for s in r["systems"]], r["complete"], r["goals"]["sp_tp_not_slower_than_uniform_tp"])
        ),
    )
    write_json(sys.argv[1], {"partial": seen, "result": ran})
