"""`dhp bench one-gpu` at its quick size on CPU: the three systems train the same packed micro-batches of real photos
(the same counts, the same losses from the same weights) and the JSON says what a GPU run will report. No timing is
asserted (benchmarks are scripts); the GPU figures come from a GPU run.

The quick bench runs as the GPU machine runs it: `scripts/gpu_session.sh all` with `MODEL=tiny` and the steps
`one_gpu peers` (the quick one-gpu bench, then `dhp bench peers --ranks 1 --quick`) on one Ray the script starts
and ends, each step under its own time limit, in the background from the start of the session
(tests/background.py). `BUNDLE=none`: this environment's Python, not an unpacked bundle."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dhp.scripts.bench.one_gpu import main, profile_summary
from tests import background
from tests.background import scratch_dir

SYSTEMS = ["dhp", "one process", "one process, dhp kernels"]
ROOT = Path(__file__).resolve().parents[1]


def start_early(out: Path, fixtures: set[str]) -> None:
    """The GPU script's run starts in the background when the session's tests are chosen (tests/background.py)."""
    if "gpu_session" in fixtures:
        env = {
            **os.environ,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),  # python3: ours
            "BUNDLE": "none",
            "MODEL": "tiny",
            "STEPS": "one_gpu peers",
            "BENCH_STEPS": "1",
            "BOUNDARIES": "host,cuda_ipc",
            "PROFILE": "1",
            "OUT": str(out),
        }
        command = ["bash", "scripts/gpu_session.sh", "all"]
        background.run_command("gpu session: MODEL=tiny", command, out, timeout_s=900, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def gpu_session() -> Path:
    """The directory of the GPU script's run (its `OUT`), which exited 0."""
    _, out = background.succeeded(
        "gpu session: MODEL=tiny", lambda: start_early(scratch_dir("bench_one_gpu"), {"gpu_session"})
    )
    return out


@pytest.mark.slow  # the GPU script's run, with a Ray of its own
def test_gpu_script_runs_every_step_on_one_ray_and_ends_it(gpu_session):
    """What a 600-s call on the GPU machine relies on: both steps end in time (rc 0) on the one Ray the script
    started (a second start after a stop failed on GPU machines), the versions and each step's status are written,
    and the Ray is gone when the script ends (its port refuses)."""
    out = gpu_session
    steps = (out / "steps.txt").read_text()
    (address,) = re.findall(r"^Ray started at (127\.0\.0\.1:\d+) in \d+ s$", steps, flags=re.M)
    assert re.findall(r"^== (\w+): rc=(\d+) ", steps, flags=re.M) == [("one_gpu", "0"), ("peers", "0")], steps
    assert "torch" in (out / "versions.txt").read_text()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(address.split(":")[1]))) != 0, f"Ray still listens at {address}"
    peers = json.loads((out / "peers_gpu.json").read_text())
    assert peers["complete"] and peers["ranks"] == 1 and all(r["step_s"] > 0 for r in peers["systems"])


def _args(path, **changes) -> argparse.Namespace:
    args = dict(
        json=str(path),
        quick=True,
        model=None,
        sides=None,
        steps=1,
        microbatches=2,
        precision=None,
        profile=1,
        boundaries=("host",),
        photos=None,
        compile="none",
        shard=None,
        describe=False,
    )
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.slow  # reads the GPU script's run
def test_three_systems_train_the_same_packed_photos(gpu_session):
    """The one_gpu step of the GPU script's run: `dhp bench one-gpu --quick --steps 1 --profile 1 --boundaries
    host,cuda_ipc`."""
    run_dir = gpu_session
    result = json.loads((run_dir / "one_gpu.json").read_text())
    assert result["complete"] and "failed" not in result
    # CUDA IPC needs both pools on one GPU: refused up front on a CPU, recorded apart, and the other rows kept
    (failed,) = result["failed_boundaries"]
    assert (failed["boundary"], failed["workload"], failed["system"]) == ("cuda_ipc", "photos", "dhp cuda_ipc")
    assert "pipeline.boundary=cuda_ipc maps GPU memory" in failed["error"]
    assert result["timings"].startswith("CPU timings") and result["model"] == "tiny"
    assert result["text_attention"] == "sdpa_segments"  # no GPU: torch's varlen kernel runs on CUDA only
    assert result["precision"] == "fp32" and result["device_gib"] is None  # no device: the preset's
    # the first 4 photos of the shard, packed into micro-batches of at most 256 tokens: several a step
    (workload,) = result["workloads"]
    assert workload["name"] == "photos" and workload["samples"] == 4
    assert len(workload["microbatches"]) == 2 and all(0 < m["tokens"] <= 256 for m in workload["microbatches"])
    assert sum(m["images"] for m in workload["microbatches"]) == 4
    rows = {r["system"]: r for r in result["rows"]}
    assert [r["system"] for r in result["rows"]] == SYSTEMS
    dhp, stock, kernels = (rows[s] for s in SYSTEMS)
    assert result["compile"] == "none" and all(dhp["compiled"][s]["units"] == 0 for s in ("vision", "text"))

    # the same batches: every count but the padded slots, which only the stock loop has
    counts = [{k: v for k, v in r["trained"].items() if k != "padded_tokens"} for r in (dhp, stock, kernels)]
    assert counts[0] == counts[1] == counts[2]
    assert counts[0]["samples"] == counts[0]["images"] == 4 and counts[0]["microbatches"] == 2
    assert counts[0]["patches"] == sum(m["patches"] for m in workload["microbatches"]) == dhp["patches"]
    assert dhp["trained"]["padded_tokens"] == kernels["trained"]["padded_tokens"] == counts[0]["tokens"]
    assert stock["trained"]["padded_tokens"] > counts[0]["tokens"] and stock["padding_share"] > 0
    assert dhp["padding_share"] == kernels["padding_share"] == 0
    # ... and the same model: the first losses agree (the weights dhp's ranks build), and each system learns
    first = [r["losses"][0] for r in (dhp, stock, kernels)]
    assert max(first) - min(first) <= 1e-5 * abs(first[0])
    for row in (dhp, stock, kernels):
        assert len(row["losses"]) == len(row["steps_s"]) == 1 + result["steps"]
        assert row["losses"][-1] < row["losses"][0] and row["step_s"] > 0
        assert row["vision_tokens_per_s"] == row["patches"] / row["step_s"]
        assert row["text_tokens_per_s"] == counts[0]["tokens"] / row["step_s"]
        assert row["model_tflops_per_s"] > 0 and 0 < row["mfu"] < 1
        assert all(b > 0 for b in row["peak_bytes"].values())
        assert set(row["peak_reserved_bytes"]) == set(row["peak_bytes"])  # None on a CPU: no caching allocator
        assert all(b is None for b in row["peak_reserved_bytes"].values())

    # the ratios: each row's tokens/s over the stock loop's; dhp's over the same-kernel loop's too
    assert dhp["over_stock"] == stock["step_s"] / dhp["step_s"]
    assert kernels["over_stock"] == stock["step_s"] / kernels["step_s"]
    assert dhp["over_same_kernels"] == kernels["step_s"] / dhp["step_s"]
    assert "over_stock" not in stock and "over_same_kernels" not in kernels
    assert set(dhp["peak_bytes"]) == {"vision", "text"}
    assert {"vision.forward", "vision.backward", "text.forward_backward"} <= set(dhp["calls_s"])
    assert 0 <= dhp["bubble"] <= 1
    moved = dhp["boundary_s_per_microbatch"]  # Ray's transfers of the shards and gradients are always timed
    assert moved["ray_s"] > 0 and moved["boundary_s"] == pytest.approx(moved["copy_s"] + moved["ray_s"])
    assert dhp["boundary_share"] == 2 * moved["boundary_s"] / dhp["step_s"] < 1

    # one more step (after the profiler's warm-up) of each system under torch.profiler, after the measured ones:
    # each loop's process and dhp's two actors each summarized where it ran
    assert set(stock["profile"]) == set(kernels["profile"]) == {"process"}
    assert set(dhp["profile"]) == {"vision", "text"}
    profiles = [stock["profile"]["process"], kernels["profile"]["process"], *dhp["profile"].values()]
    for prof in profiles:
        assert prof["wall_s"] > 0 and 0 < len(prof["top_host"]) <= 8 and prof["summary_s"] >= 0
        assert prof["device_busy_s"] == prof["device_busy_share"] == 0 and prof["top_device"] == []  # a CPU
        assert prof["device_gaps"] == {"count": 0, "total_s": 0, "longest_s": []}
        calls = [o["calls"] for o in prof["top_host"]]  # the host events called most often, with their host time
        assert calls == sorted(calls, reverse=True) and all(o["host_s"] >= 0 for o in prof["top_host"])
        assert any(o["op"].startswith("aten::") for o in prof["top_host"])

    out = (run_dir / "one_gpu.log").read_text()
    assert "| ÷ stock | ÷ same kernels |" in out
    for system in SYSTEMS:
        assert f"| photos | {dhp['patches']} | {system} |" in out
        assert f"profiled photos, {system}" in out
    assert "pipeline.boundary=cuda_ipc failed on photos: ConfigError" in out


def test_describe_lists_the_workload_without_training(tmp_path, capsys):
    """`--describe`: the photos' micro-batches as a run's JSON head lists them, here the quick ones: the first 4
    photos in packed micro-batches of at most 256 tokens, every sample in one of them."""
    assert main(_args(tmp_path / "unused.json", describe=True)) == 0
    (workload,) = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "unused.json").exists()
    microbatches = workload["microbatches"]
    assert workload["name"] == "photos" and workload["samples"] == workload["images"] == 4
    assert len(microbatches) == 2 and all(0 < m["tokens"] <= 256 for m in microbatches)
    for total in ("samples", "images", "patches", "tokens"):
        assert workload[total] == sum(m[total] for m in microbatches)
    assert workload["padded_tokens"] == workload["tokens"]  # packed: no padding
    assert "data.microbatch_tokens=256" in workload["settings"]


def test_fit_is_the_presets_precision_with_the_least_recomputation_the_plan_fits():
    """What a GPU run will train the 3B with, decided by the plan alone, so checked here without a GPU. On an 80 GB
    H100 its fp32 master states (60 GB) fit beside a 4 k-patch micro-batch only with both pools recomputing every
    block, and not at all beside one of the photos' packed micro-batches (about 22 k patches and 8 k tokens): bf16
    then. On a 141 GB H200 fp32 fits with less recomputation. Whatever is chosen, no other pair of checkpointing
    options that fits at that precision recomputes fewer forward FLOPs."""
    from dhp.dataflow.packing import MicroBatchMeta
    from dhp.models.planning.memory_plan import plan
    from dhp.scripts.bench.one_gpu import CHECKPOINTING, Fit, _settings, choose_fit, recomputed_flops
    from dhp.stages.config import load_config
    from dhp.stages.trainer import model_config_of

    settings = [*_settings("qwen2_5_vl_3b", cuda=True), "training.global_batch_size=32"]
    mc = model_config_of(load_config("qwen2_5_vl_7b", settings))
    small, photos = (MicroBatchMeta(4, t, t, t, 4, p) for p, t in ((4096, 1100), (24000, 8192)))
    fit = functools.partial(choose_fit, "qwen2_5_vl_7b", settings, mc)
    full = ("full", 1)

    def least(f: Fit, m: MicroBatchMeta, gib: float) -> bool:
        fitting = [
            other
            for other in (Fit(f.precision, {"vision": v, "text": t}) for v in CHECKPOINTING for t in CHECKPOINTING)
            if plan(load_config("qwen2_5_vl_7b", [*settings, *other.settings]), mc, gib, m.patches)["fits"]
        ]
        cost = functools.partial(recomputed_flops, mc, m)
        return f in fitting and all(cost(f.checkpointing) <= cost(o.checkpointing) for o in fitting)

    assert fit(small, 78.0) == Fit("fp32", {"vision": full, "text": full})
    on_h100 = fit(photos, 78.0)
    assert on_h100.precision == "bf16" and least(on_h100, photos, 78.0)
    on_h200 = fit(small, 139.0)
    assert on_h200.precision == "fp32" and on_h200.checkpointing != {"vision": full, "text": full}
    assert least(on_h200, small, 139.0)
    assert (
        "model.precision=bf16" in on_h100.settings
        and "text.activation_checkpointing_every=2" in Fit("bf16", {"vision": full, "text": ("every_n", 2)}).settings
    )
    assert fit(photos, None) == Fit("fp32", {"vision": full, "text": full})  # no device: the preset's
    with pytest.raises(ValueError, match="fits no precision on this 78 GiB device at 24000 patches"):
        fit(photos, 78.0, asked="fp32")
    with pytest.raises(ValueError, match="fits no precision on this 20 GiB device at 24000 patches"):
        fit(photos, 20.0)


def _ran(seconds: float, trained: dict, dhp: bool = False) -> dict:
    """A system's result as `measure` gets it, without running it."""
    out = {
        "step_s": seconds,
        "steps_s": [seconds, seconds],
        "losses": [12.0, 11.0],
        "trained": trained,
        "peak_bytes": {"process": 1},
        "peak_reserved_bytes": {"process": None},
    }
    if dhp:
        boundary = {"boundary_s": 0.01, "copy_s": 0.005, "ray_s": 0.005}
        out |= {"calls_s": {}, "peak_flops": 1e11, "bubble": 0.1, "boundary_s_per_microbatch": boundary}
    return out


def test_a_system_that_fails_is_recorded_and_what_ran_kept(tmp_path, monkeypatch, capsys):
    """An out-of-memory of one loop at an image size (what a GPU may answer at 16 k patches) is kept in the JSON
    beside the rows of the other systems at that size and of the sizes before it; the larger sizes are not run and
    the command exits 1. The systems are stand-ins (the schedule is the subject), the workloads real; with
    `--compile`, dhp and the same-kernel loop get it, and the stock loop runs transformers' modules as they are."""
    import torch

    from dhp.scripts.bench import one_gpu as bench_one_gpu
    from dhp.scripts.bench.one_process import trained

    def counted(w):
        return trained(w.metas)

    compiled = {}

    def ran(system, seconds, **kwargs):
        def run(cfg, mc, w, *args):
            compiled[system] = (cfg.vision.compile, cfg.text.compile)
            return _ran(seconds, counted(w), **kwargs)

        return run

    def stock(cfg, mc, w, steps, profile_steps):
        if w.side == 140:
            assert json.loads(path.read_text())["complete"] is False  # the first size, written before this one
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return _ran(2.0, counted(w))

    monkeypatch.setattr(bench_one_gpu, "run_dhp", ran("dhp", 1.0, dhp=True))
    monkeypatch.setattr(bench_one_gpu, "run_stock", stock)
    monkeypatch.setattr(bench_one_gpu, "run_same_kernels", ran("same kernels", 0.5))
    path = tmp_path / "one_gpu.json"
    assert main(_args(path, sides="168,140,112", profile=0, compile="aot_eager")) == 1
    result = json.loads(path.read_text())
    assert not result["complete"] and result["workload"] == "sides" and result["compile"] == "aot_eager"
    assert compiled == {"dhp": ("aot_eager", "aot_eager"), "same kernels": ("aot_eager", "aot_eager")}
    assert [(r["side"], r["system"]) for r in result["rows"]] == [
        (112, "dhp"),
        (112, "one process"),
        (112, "one process, dhp kernels"),
        (140, "dhp"),
        (140, "one process, dhp kernels"),
    ]  # smallest first; 168 never ran
    assert [w["side"] for w in result["workloads"]] == [112, 140]
    assert result["failed"] == [
        {
            "workload": "140 px",
            "side": 140,
            "system": "one process",
            "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB",
        }
    ]
    at_140 = {r["system"]: r for r in result["rows"] if r["side"] == 140}
    assert "over_stock" not in at_140["dhp"] and at_140["dhp"]["over_same_kernels"] == 0.5
    assert "one process failed on 140 px: OutOfMemoryError" in capsys.readouterr().out


def test_the_device_counts_as_released_with_this_process_cache_in_it():
    """The wait between systems (GPU only) decided on numbers: an H100 run's second image size, where
    this process's one-process loop kept 37.6 GiB cached on the 79.2 GiB device and the old check (free >= 90 %)
    waited out its limit; actors still holding memory keep it waiting."""
    from dhp.scripts.bench.one_gpu import device_released

    gib = 2**30
    total, cached = int(79.2 * gib), int(37.6 * gib)
    assert device_released(total - cached - gib, total, held_here=cached)  # only our own cache (+ contexts)
    assert not device_released(total - cached - 30 * gib, total, held_here=cached)  # an actor's 30 GiB left
    assert not device_released(int(0.5 * total), total, held_here=0)


def _event(name: str, device: bool, start_us: float, end_us: float, annotation: bool = False) -> SimpleNamespace:
    """What profile_summary reads of a `prof.events()` entry (torch's FunctionEvent)."""
    from torch.autograd import DeviceType

    return SimpleNamespace(
        name=name,
        device_type=DeviceType.CUDA if device else DeviceType.CPU,
        is_async=False,
        time_range=SimpleNamespace(start=start_us, end=end_us),
        is_user_annotation=annotation,
    )


def test_profile_summary_counts_the_chip_busy_once_and_skips_markers():
    """Two overlapping kernels on two streams count once; a CUPTI marker ("Command Buffer Full", 14 s of 3.5 on an
    H200 under key_averages), a stream sync, the step's range on the device and host ops are not
    device work; the device's idle gaps between its work are counted."""
    events = [
        _event("gemm", True, 0, 4),
        _event("attn", True, 2, 6),
        _event("gemm", True, 10, 12),
        _event("Memcpy HtoD (Pageable -> Device)", True, 12, 13),
        _event("Command Buffer Full", True, 0, 50),
        _event("Stream Sync", True, 6, 10),
        _event("ProfilerStep#3", True, 0, 20, annotation=True),
        _event("aten::mm", False, 0, 3),
        _event("aten::mm", False, 5, 6),
        _event("aten::add", False, 0, 9),
        _event("ProfilerStep#3", False, 0, 20),
    ]
    s = profile_summary(events, wall_s=20e-6)
    assert s["device_busy_s"] == pytest.approx(9e-6) and s["device_busy_share"] == pytest.approx(0.45)
    assert s["device_gaps"] == {"count": 1, "total_s": pytest.approx(4e-6), "longest_s": [pytest.approx(4e-6)]}
    assert s["top_device"][0] == {"op": "gemm", "calls": 2, "device_s": pytest.approx(6e-6)}
    assert [o["op"] for o in s["top_device"]] == ["gemm", "attn", "Memcpy HtoD (Pageable -> Device)"]
    assert s["top_host"] == [
        {"op": "aten::mm", "calls": 2, "host_s": pytest.approx(4e-6)},
        {"op": "aten::add", "calls": 1, "host_s": pytest.approx(9e-6)},
    ]
    assert list(s["skipped_device_s"]) == ["Command Buffer Full", "ProfilerStep#3", "Stream Sync"]


def test_profile_summary_reads_torch_profilers_public_events():
    """A real torch.profiler run on the CPU through `profiled` (one warm-up step, then the recorded ones): the
    summary reads only FunctionEvent's public fields, so it runs on whatever torch this is (the GPU machine's
    2.11 had no `_KinetoEvent.activity_type`, which the summary read before)."""
    import torch

    from dhp.scripts.bench.one_gpu import profiled

    x = torch.randn(16, 16, requires_grad=True)
    with profiled(2) as prof:
        for _ in range(3):
            (x @ x).sum().backward()
            prof.step()
    s = profile_summary(prof.events(), wall_s=1.0)
    assert s["device_busy_s"] == 0 and s["top_device"] == [] and s["skipped_device_s"] == {}
    mm = {o["op"]: o for o in s["top_host"]}["aten::mm"]  # forward 1 + backward 2, in each of the 2 recorded steps
    assert mm["calls"] == 6 and mm["host_s"] > 0


def test_boundaries_are_checked_when_parsed():
    from dhp.scripts.bench.one_gpu import _boundaries

    assert _boundaries("host,cuda_ipc") == ("host", "cuda_ipc")
    with pytest.raises(argparse.ArgumentTypeError, match="nccl: pipeline.boundary is one of host, cuda_ipc"):
        _boundaries("host,nccl")


def test_the_settings_choices_are_the_configs():
    """The bench lists `--compile` and `--precision` choices itself (building `dhp`'s parser must not import torch,
    which the config does); they must stay the config's own values."""
    import typing

    from dhp.scripts.bench.one_gpu import add_parser
    from dhp.stages.config import ModelConfig, StageConfig

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    actions = {a.dest: a for a in sub.choices["one-gpu"]._actions}
    assert tuple(actions["compile"].choices) == typing.get_args(typing.get_type_hints(StageConfig)["compile"])
    assert tuple(actions["precision"].choices) == typing.get_args(typing.get_type_hints(ModelConfig)["precision"])


def test_the_loop_of_dhps_kernels_reports_what_it_compiled(tmp_path, monkeypatch):
    """With `--compile`, the same-kernel loop's row says what its one process compiled, as dhp's rows say per pool:
    the real loop on the tiny model (`aot_eager`), dhp and the stock loop stand-ins (the dhp rows' own counts come from
    the stage actors, `test_three_systems_train_the_same_packed_photos`)."""
    from dhp.scripts.bench import one_gpu as bench_one_gpu
    from dhp.scripts.bench.one_process import trained

    monkeypatch.setattr(bench_one_gpu, "run_dhp", lambda cfg, mc, w, *a: _ran(1.0, trained(w.metas), dhp=True))
    monkeypatch.setattr(bench_one_gpu, "run_stock", lambda cfg, mc, w, *a: _ran(2.0, trained(w.metas)))
    path = tmp_path / "one_gpu.json"
    assert main(_args(path, sides="112", profile=0, compile="aot_eager")) == 0
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
    loop = rows["one process, dhp kernels"]["compiled"]["process"]
    assert loop["backend"] == "aot_eager" and loop["units"] > 0 and loop["graphs"] > 0, loop
    assert "compiled" not in rows["one process"]
