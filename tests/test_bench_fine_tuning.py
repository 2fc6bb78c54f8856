"""`dhp bench fine-tuning --quick`: it runs every mode and its byte counts say what each mode holds (no timing
is asserted). The bench is a `dhp bench fine-tuning` subprocess with its own local Ray, started in the background
when the session's tests are chosen (tests/background.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dhp.scripts.bench.fine_tuning import MODES
from tests import background
from tests.background import scratch_dir

pytestmark = pytest.mark.slow  # a subprocess bench with its own Ray


def start_early(out: Path, fixtures: set[str]) -> None:
    """The quick bench, in the background (tests/background.py)."""
    if "quick" in fixtures:
        path = out / "ft.json"
        command = [sys.executable, "-m", "dhp.stages.cli", "bench", "fine-tuning", "--quick", "--json", str(path)]
        background.run_command("bench fine-tuning: quick", command, path)


@pytest.fixture(scope="module")
def quick() -> tuple[subprocess.CompletedProcess, Path]:
    def start() -> None:
        start_early(scratch_dir("bench_fine_tuning"), {"quick"})

    return background.succeeded("bench fine-tuning: quick", start)


def test_bench_fine_tuning_quick_rows_hold_what_each_mode_keeps(quick):
    proc, out = quick
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(MODES)

    def worst(mode: str, stage: str, key: str) -> int:
        return max(r[key] for r in rows[mode]["ranks"] if r["stage"] == stage)

    for stage in ("vision", "text"):
        assert worst("all", stage, "grads") == worst("all", stage, "params") > 0  # fp32 grads of every param
        assert worst("all", stage, "optimizer") > 0 and worst("all", stage, "activations") > 0
    for stage, mode in (("vision", "frozen ViT"), ("text", "frozen LLM")):
        assert worst(mode, stage, "grads") == worst(mode, stage, "optimizer") == 0
        assert worst(mode, stage, "params") == worst("all", stage, "params")
    assert worst("frozen ViT", "vision", "activations") == 0  # forward under no_grad: nothing kept
    assert 0 < worst("merger only", "vision", "grads") < worst("all", "vision", "grads")
    assert 0 < worst("merger only", "vision", "activations") < worst("all", "vision", "activations")
    lora = worst("LoRA r16", "text", "grads")  # the factors only: a few % of the base
    assert 0 < lora < worst("all", "text", "grads") / 10 and worst("LoRA r16", "text", "optimizer") == 2 * lora
    assert worst("LoRA r16", "text", "params") == worst("all", "text", "params") + lora
    assert "| frozen ViT |" in proc.stdout
