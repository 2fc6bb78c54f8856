"""`dhp bench memory` (scripts/bench/memory.py) on its quick size, the released shapes it counts, and the
per-rank checkpoint hashing (stages/checkpoint_files.py)."""

from __future__ import annotations

import json
import math

import pytest

from dhp.models.architectures import architecture_config
from dhp.models.parallel.layouts import make_layout
from dhp.models.precision import precision_of
from dhp.scripts.bench.memory import full_shapes
from dhp.stages.checkpoint_files import commit, file_entry, verify
from dhp.stages.cli import main


@pytest.mark.slow  # a subprocess or a measured bench run
def test_quick_bench_counts_match_the_layouts_and_a_measured_build(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--quick", "--json", str(out)]) == 0
    assert "peak RSS" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {r["model"] for r in rows} == {"tiny", "qwen3_vl_tiny"}
    for r in rows:
        shapes = full_shapes(r["model"], r["stage"])
        config = architecture_config(r["model"])
        layout = make_layout(r["stage"], r["layout"], r["degree"], r["num_actors"], config)
        prec = precision_of(r["precision"])
        n = layout.state_numel(shapes, 0)
        assert r["params_bytes"] == r["held_bytes"] == n * prec.param_bytes, r
        assert r["optimizer_bytes"] == round(n * layout.optimizer_fraction * prec.optimizer_bytes), r
        assert r["state_bytes"] == r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
        assert r["largest_tensor_bytes"] == 4 * max(math.prod(s) for s in shapes.values())
        if r["layout"] == "none" and r["num_actors"] == 2:  # ZeRO-1 over the two replicas halves the moments
            assert r["optimizer_bytes"] == n * prec.optimizer_bytes // 2
    measured = [r for r in rows if r["peak_rss_bytes"] is not None]
    assert {(r["model"], r["stage"], r["layout"]) for r in measured} == {
        ("tiny", "text", "tensor"),
        ("tiny", "vision", "sequence"),
        ("qwen3_vl_tiny", "vision", "sequence"),
    }
    for r in measured:  # the measured build (from the bench's own bf16 checkpoint) held what the plan says
        assert r["precision"] == "fp32" and r["peak_rss_bytes"] > r["held_bytes"] and r["build_s"] >= 0


def test_released_shapes_have_their_published_sizes():
    """Parameter counts of the shapes the bench counts (published: 3.75B, 8.29B, 33.5B, 73.4B; Qwen3-VL's model
    cards: 2B, 8B, 32B, whose checkpoints hold 2.13 B, 8.77 B and 33.4 B)."""
    published = {"qwen2_5_vl_3b": 3.75e9, "qwen2_5_vl_7b": 8.29e9, "qwen2_5_vl_32b": 33.5e9, "qwen2_5_vl_72b": 73.4e9}
    published |= {"qwen3_vl_2b": 2.13e9, "qwen3_vl_8b": 8.77e9, "qwen3_vl_32b": 33.4e9}
    for model, want in published.items():
        total = 0
        for stage in ("vision", "text"):  # a tied lm_head is counted once
            total += sum(math.prod(s) for s in full_shapes(model, stage).values())
        assert abs(total - want) / want < 0.01, (model, total)


def test_commit_uses_the_writers_hashes_and_verify_checks_them(tmp_path):
    tmp = tmp_path / ".tmp-step_000001"
    tmp.mkdir()
    (tmp / "a.bin").write_bytes(b"rank zero")
    (tmp / "b.json").write_text("{}")
    entry = file_entry(tmp / "a.bin")
    ckpt = commit(tmp, keep_last=0, hashed={"a.bin": entry})
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    assert manifest["a.bin"] == entry and manifest["b.json"] == file_entry(ckpt / "b.json")
    assert verify(ckpt) is None
    (ckpt / "a.bin").write_bytes(b"rank 0ero")  # same size, other bytes: only the hash can tell
    assert verify(ckpt) == "a.bin does not match its checksum"

    tmp = tmp_path / ".tmp-step_000002"
    tmp.mkdir()
    (tmp / "a.bin").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="changed after its writer hashed it"):
        commit(tmp, keep_last=0, hashed={"a.bin": {"size": 2, "sha256": "0"}})
