"""What crosses between the pools: a shard as bytes + dtype + shape (stages/boundary.py), exact both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from dhp.stages.boundary import WireTensor, from_wire, to_wire
from tests import background
from tests.background import scratch_dir


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

    from dhp.scripts.bench.boundary import main

    path = tmp_path / "boundary.json"
    assert main(argparse.Namespace(quick=True, json=str(path), reps=3)) == 0
    result = json.loads(path.read_text())
    assert result["timings"].startswith("CPU timings")
    assert [(r["rows"], r["format"]) for r in result["rows"]] == [
        (16, "tensor"),
        (16, "wire"),
        (64, "tensor"),
        (64, "wire"),
    ]
    for r in result["rows"]:
        assert r["bytes_per_microbatch"] == 2 * r["rows"] * 64 * 2 and r["boundary_s"] > 0 and r["chain_s"] > 0
        assert r["gb_per_s"] == r["bytes_per_microbatch"] / r["boundary_s"] / 1e9
    assert all("speedup" in r for r in result["rows"] if r["format"] == "wire")
    assert "| 64 x 64 |" in capsys.readouterr().out
    assert ray_session.is_initialized()  # the session's Ray, left running


@pytest.mark.parametrize("name", ["host", "cuda_ipc"])
def test_a_transport_delivers_the_values_in_memory_of_the_receivers_own(name):
    """`pipeline.boundary`: what `send` hands Ray comes back from `receive` as the same values in a tensor the
    receiver owns (cuda_ipc's `receive` gets a mapping of the sender's memory on a GPU: it must copy)."""
    from dhp.stages.boundary import transport_of

    transport = transport_of(name)
    t = (torch.randn(5, 3, requires_grad=True) * 2).to(torch.bfloat16)
    sent = transport.send(t)
    back = transport.receive(sent, "cpu")
    assert torch.equal(back, t.detach()) and back.dtype == torch.bfloat16 and not back.requires_grad
    back.add_(1)  # writing into what the receiver got leaves what was sent as it was
    assert torch.equal(transport.receive(sent, "cpu"), t.detach())


def test_cuda_ipc_needs_both_pools_on_one_gpu():
    """CUDA IPC maps memory only between actors Ray gave the same GPU: the one shared-GPU layout passes, the CPU
    default and a layout across GPUs are refused before anything starts, saying what would run."""
    from dhp.models.parallel.checks import check_layout
    from dhp.stages.config import ConfigError, load_config
    from tests.conftest import ONE_GPU_POOLS

    one_gpu = [*ONE_GPU_POOLS, "training.global_batch_size=2", "pipeline.boundary=cuda_ipc"]
    cfg = load_config("tiny", one_gpu)
    assert cfg.pipeline.transport.ray_transport == "CUDA_IPC"
    check_layout(cfg)
    for refused in (
        ["pipeline.boundary=cuda_ipc"],  # the CPU default: 2 + 2 actors, no GPUs
        [*one_gpu, "pipeline.placement=disjoint"],
        [*one_gpu, "vision.num_actors=2"],  # two vision replicas: the second on another bundle's GPU
        [*one_gpu, "text.num_gpus_per_actor=0.6"],
    ):  # 1.1 GPUs: not one device
        with pytest.raises(ConfigError, match=r"pipeline.boundary=cuda_ipc maps GPU memory .* pipeline.boundary=host"):
            check_layout(load_config("tiny", refused))
    with pytest.raises(Exception, match="pipeline.boundary"):
        load_config("tiny", ["pipeline.boundary=nccl"])


def start_early(out: Path, fixtures: set[str]) -> None:
    """The RDT run starts in the background when the session's tests are chosen (tests/background.py)."""
    if "rdt_run" in fixtures:
        background.start("boundary wire: the RDT path", lambda: _rdt_run(out))


def _rdt_run(out: Path) -> tuple[subprocess.CompletedProcess, Path]:
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "DHP_TEST_RDT_LOG": str(out / "rdt.log"),
    }
    command = [sys.executable, "-m", "tests.rdt_on_cpu", "--build", str(out / "run")]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1800), out


@pytest.fixture(scope="module")
def rdt_run() -> tuple[subprocess.CompletedProcess, Path]:
    return background.result(
        "boundary wire: the RDT path", lambda: start_early(scratch_dir("boundary_wire"), {"rdt_run"})
    )


@pytest.mark.slow  # its own Ray in a subprocess
def test_the_ray_direct_transport_path_trains_as_the_host_path(rdt_run):
    """`pipeline.boundary=cuda_ipc`'s calls (one return each, the shard gradients as `gradient` calls, RDT
    references passed actor to actor) with Ray's RDT machinery, on a CPU: only the mover is a stand-in
    (tests/rdt_on_cpu.py). One global batch under each boundary, one vision + one text actor (a text-only
    micro-batch included) and SP 2 / TP 2: the same loss, gradients and evaluation loss, and the tensors did
    take the RDT path. A subprocess (the stand-in is installed in every actor at its start) on the parity model
    and samples, started in the background."""
    from tests.rdt_on_cpu import LAYOUTS

    proc, tmp_path = rdt_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "run" / "out.pt", weights_only=False)
    for name in LAYOUTS:
        host, rdt = out[f"{name}/host"], out[f"{name}/cuda_ipc"]
        assert rdt["loss"] == pytest.approx(host["loss"], rel=1e-6)
        assert rdt["eval"] == pytest.approx(host["eval"], rel=1e-6)
        assert set(rdt["grads"]) == set(host["grads"])
        for param, g in host["grads"].items():
            torch.testing.assert_close(rdt["grads"][param], g, rtol=1e-5, atol=1e-8, msg=f"{name}: {param}")
    lines = (tmp_path / "rdt.log").read_text().splitlines()
    sends = [ln for ln in lines if " send " in ln]
    # 1v1t: 3 micro-batches' shards (the text-only one's has 0 rows) and their 3 gradients, 1 eval shard;
    # sp2-tp2: 2 micro-batches x 2 SP shards and their 4 gradients, 2 eval shards
    assert len(sends) == (3 + 3 + 1) + (4 + 4 + 2), lines
    # each shard by every text rank of its replica, each gradient by its vision rank: 1v1t 3 + 3 + 1,
    # sp2-tp2 4 x 2 + 4 + 2 x 2
    assert sum(ln.endswith(" receive") for ln in lines) == (3 + 3 + 1) + (8 + 4 + 4), lines
