"""`dhp bench ops` (scripts/bench/ops.py) on its quick sizes: a complete profile of measured rates."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from dhp.scripts.bench.ops import CPU_MATMUL_SIZES, FIELDS, main

RATES = (
    "matmul_tflops",
    "attention_tflops",
    "window_attention_tflops",
    "causal_attention_tflops",
    "attention_backward_ratio",
    "optimizer_s_per_param",
    "op_latency_s",
    "memory_gbps",
    "all_reduce_gbps",
    "all_gather_gbps",
    "all_to_all_gbps",
    "collective_latency_s",
    "h2d_gbps",
    "object_store_gbps",
    "call_latency_s",
)


@pytest.fixture(scope="module")
def profile(quick_ops_profile):
    """The session's one quick run (conftest), on the session's Ray, after the background runs (the tests that ask
    for it are marked `measures_speed`: beside those runs its rates are the contention's)."""
    return json.loads(quick_ops_profile.read_text())


@pytest.mark.measures_speed
def test_profile_has_every_field_measured(profile):
    assert set(profile) == {key for key, _ in FIELDS}
    assert profile["kind"] == "cpu" and profile["quick"] is True and profile["threads"] == 1
    assert profile["name"].startswith("measured:") and profile["memory_gib"] > 0
    for key in RATES:  # on a CPU machine the collectives and the object store are measured, never null
        value = profile[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    eff = profile["efficiency"]  # op rates need no factor; the real stages' calls are measured against them
    assert {k: eff.pop(k) for k in ("matmul", "attention", "comm")} == {"matmul": 1.0, "attention": 1.0, "comm": 1.0}
    assert set(eff) == {"vision_forward", "vision_backward", "text"}
    assert all(0.05 < v < 5 for v in eff.values()), eff
    for key in ("zero3_unit_s", "zero3_s_per_byte"):  # [forward, backward]: per unit (vision), per byte (text)
        assert len(profile[key]) == 2 and all(v >= 0 for v in profile[key]) and sum(profile[key]) > 0, key
    for key in ("zero3_optimizer_s_per_tensor", "zero1_step_s_per_tensor"):
        assert isinstance(profile[key], float) and profile[key] >= 0, key
    assert all(isinstance(n, str) for n in profile["notes"]) and profile["notes"]


@pytest.mark.measures_speed
def test_matmul_by_size_is_sorted_and_ends_with_the_headline(profile):
    sizes = [n for n, _ in profile["matmul_by_size"]]
    assert sizes == sorted(sizes) == list(CPU_MATMUL_SIZES)
    assert all(math.isfinite(r) and r > 0 for _, r in profile["matmul_by_size"])
    assert profile["matmul_tflops"] == profile["matmul_by_size"][-1][1]
    dims = [d for d, _ in profile["attention_by_head_dim"]]
    assert dims == sorted(dims) and profile["attention_head_dim"] in dims


def test_unwritable_json_path_fails_before_measuring(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(FileExistsError, match="is a file, not a directory"):
        main(argparse.Namespace(json=str(blocker / "profile.json"), quick=True))
    with pytest.raises(FileExistsError, match="is a directory"):
        main(argparse.Namespace(json=str(tmp_path), quick=True))
