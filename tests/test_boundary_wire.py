"""What crosses between the pools: a shard as bytes + dtype + shape (stages/boundary.py), exact both ways."""

from __future__ import annotations

import pytest
import ray
import torch

from dhp.stages.boundary import WireTensor, from_wire, to_wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wire_round_trip_is_exact(dtype):
    t = torch.randn(7, 5).to(dtype)
    w = to_wire(t)
    assert w.data.dtype.name == "uint8" and w.data.nbytes == t.numel() * t.element_size()
    back = from_wire(w)
    assert back.dtype == dtype and back.shape == (7, 5) and torch.equal(back, t)


def test_wire_takes_views_and_empty_shards():
    t = torch.randn(6, 4)
    assert torch.equal(from_wire(to_wire(t.t())), t.t())  # a transposed view goes as its values
    assert torch.equal(from_wire(to_wire(t[1:5:2])), t[1:5:2])
    empty = from_wire(to_wire(torch.zeros(0, 64, dtype=torch.bfloat16)))  # an empty SP shard
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16
    grad = torch.randn(3, 2, requires_grad=True) * 2  # part of a graph: only the values travel
    assert not from_wire(to_wire(grad)).requires_grad


def test_through_the_object_store_the_reader_gets_a_writable_copy(ray_session):
    """Ray maps a stored numpy array read-only into the reader (no copy on read); `from_wire` copies it once, so
    the stage may write into the tensor (text: requires_grad_ and its .grad) without touching the store."""
    t = torch.randn(64, 16).to(torch.bfloat16)
    ref = ray.put(to_wire(t))
    got = ray.get(ref)
    assert isinstance(got, WireTensor) and not got.data.flags.writeable
    back = from_wire(got)
    back.add_(1)  # writable, and its own memory
    assert torch.equal(from_wire(ray.get(ref)), t) and not torch.equal(back, t)


def test_bench_boundary_quick_writes_both_formats(ray_session, tmp_path, capsys):
    import argparse
    import json

    from dhp.scripts.bench_boundary import main

    path = tmp_path / "boundary.json"
    assert main(argparse.Namespace(quick=True, json=str(path), reps=3)) == 0
    result = json.loads(path.read_text())
    assert result["timings"].startswith("CPU timings")
    assert [(r["rows"], r["format"]) for r in result["rows"]] == [(16, "tensor"), (16, "wire"), (64, "tensor"),
                                                                   (64, "wire")]
    for r in result["rows"]:
        assert r["bytes_per_microbatch"] == 2 * r["rows"] * 64 * 2 and r["boundary_s"] > 0 and r["chain_s"] > 0
        assert r["gb_per_s"] == r["bytes_per_microbatch"] / r["boundary_s"] / 1e9
    assert all("speedup" in r for r in result["rows"] if r["format"] == "wire")
    assert "| 64 x 64 |" in capsys.readouterr().out
    assert ray_session.is_initialized()  # the session's Ray, left running
