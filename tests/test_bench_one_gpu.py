"""`dhp bench one-gpu` at its quick size on CPU: both systems train the same batches and the JSON says what a GPU
run will report. No timing is asserted (benchmarks are scripts); the GPU figures come from a lent device."""

from __future__ import annotations

import argparse
import json

from dhp.scripts.bench_one_gpu import main


def test_one_gpu_bench_runs_both_systems_and_writes_its_rows(ray_session, tmp_path, capsys):
    path = tmp_path / "one_gpu.json"
    args = argparse.Namespace(json=str(path), quick=True, model=None, sides=None, steps=None, microbatches=2)
    assert main(args) == 0
    result = json.loads(path.read_text())
    assert result["timings"].startswith("CPU timings") and result["model"] == "tiny"
    dhp, alone = result["rows"]
    assert (dhp["system"], alone["system"]) == ("dhp", "one process")
    assert dhp["patches"] == alone["patches"] == 64 and dhp["sample_tokens"] == alone["sample_tokens"]
    assert dhp["text_tokens"] == alone["text_tokens"] == 2 * dhp["sample_tokens"]  # a step's, from run_log
    for row in (dhp, alone):
        assert len(row["steps_s"]) == 1 + result["steps"] and row["step_s"] > 0
        assert row["vision_tokens_per_s"] == 2 * 64 / row["step_s"]
        assert row["model_tflops_per_s"] > 0 and 0 < row["mfu"] < 1
        assert all(b > 0 for b in row["peak_bytes"].values())
    assert set(dhp["peak_bytes"]) == {"vision", "text"}
    assert {"vision.forward", "vision.backward", "text.forward_backward"} <= set(dhp["calls_s"])
    assert dhp["ratio"] == alone["step_s"] / dhp["step_s"]
    assert 0 <= dhp["bubble"] <= 1
    moved = dhp["boundary_s_per_microbatch"]  # Ray's transfers of the shards and gradients are always timed
    assert moved["ray_s"] > 0 and moved["boundary_s"] == moved["copy_s"] + moved["ray_s"]
    assert dhp["boundary_share"] == 2 * moved["boundary_s"] / dhp["step_s"] < 1
    assert "| 64 | dhp |" in capsys.readouterr().out
    assert ray_session.is_initialized()  # the session's Ray, left running
