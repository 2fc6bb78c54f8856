"""`dhp bench ops`: the rates of the operations a training step is made of, measured on this machine.

    dhp bench ops --json PATH [--quick]

Writes one *profile* (a JSON object) that a step-time model reads in place of datasheet figures. Compute
runs in one torch thread (stage actors run with torch_threads=1 by default) in the compute dtype: float32
on the CPU, bfloat16 on a GPU. Rates are the best of several short windows, not the mean: a peak is what
the device can do, and on a shared machine a window may lose its core to another process. Latencies are
medians. Operands are constants (no RNG): speed does not depend on the values. GB are 1e9 bytes.

Fields:
    name               "measured:<hostname>" (CPU) or "measured:<GPU name>"
    kind               "cpu" or "gpu"
    device             "cpu (1 thread)" or torch.cuda.get_device_name()
    threads            torch threads the compute was measured with (1)
    devices_per_node   CPU: os.cpu_count() (each core hosts one actor); GPU: torch.cuda.device_count()
    memory_gib         host RAM (CPU) or the GPU's memory, GiB
    matmul_tflops      TFLOP/s (2*m*n*k flops) of the largest square matmul in `matmul_by_size`
    matmul_by_size     [[n, TFLOP/s], ...] for square n x n @ n x n, ascending n (CPU 64..512, GPU 1024..8192);
                       a step-time model interpolates small matmuls from it
    attention_tflops   full (non-causal) SDPA forward, 4*L*L*head_dim*heads flops (CPU L=1024, 4 heads of 32,
                       fp32; GPU L=8192, 16 heads of 128, bf16)
    window_attention_tflops  the same L as L/64 windows of 64 tokens ([L/64, heads, 64, head_dim]),
                       4*64*64*head_dim*heads flops per window
    attention_head_dim the head_dim of the two rates above (CPU 32, GPU 128)
    attention_by_head_dim  [[head_dim, TFLOP/s], ...]: full attention at the same L and heads by head_dim (CPU
                       16..64, GPU 64, 128); a model scales attention rates by curve(its head_dim) / curve(the above)
    causal_attention_tflops  causal SDPA forward (is_causal) at the same shape, counting the half of the score
                       work a causal kernel needs (2*L*L*head_dim*heads): below attention_tflops where the kernel
                       does not skip the masked half
    attention_backward_ratio  time of SDPA's backward / its forward (full attention, same shape)
    optimizer_s_per_param  seconds per parameter of one torch.optim.AdamW step as the stage workers run it
                       (gradient scaled by the clip coefficient, step, grads set to None), fp32 states; CPU: the
                       median step of both reference stages after real backward passes (bench_ops_stages.py);
                       GPU: 16 tensors of 4 M parameters
    memory_passes      4, not measured: how a model counts elementwise work from this profile (write, read, and the
                       gradient's write and read of every activation kept for backward, at memory_gbps)
    op_latency_s       seconds per tiny op (`x.add_(1)` on 16 elements): the per-kernel dispatch/launch cost
    memory_gbps        `dst.copy_(src)` on a large tensor, counting read + write (2 x size) bytes per copy
    all_reduce_gbps    bus bandwidth per rank on 2 processes: bytes ONE rank sends / time; for S bytes on n ranks
                       all_reduce sends 2(n-1)/n*S, all_gather (output S) (n-1)/n*S, all_to_all (n-1)/n*S
    all_gather_gbps    (see all_reduce_gbps)
    all_to_all_gbps    (see all_reduce_gbps)
    collective_latency_s  an all_reduce of 4 elements (median)
    all_reduce_by_size, all_gather_by_size, all_to_all_by_size  [[tensor bytes, seconds], ...]: one collective
                       of that tensor (all_gather: the output) on 2 ranks, median, CPU 4 KiB..8 MiB, GPU 64 KiB..
                       128 MiB; a mid-size message costs more than latency + bytes / bandwidth (gloo: ~2 ms at
                       100 KiB), and a model reads its message sizes from these
    zero3_unit_s, zero3_s_per_byte, zero3_optimizer_s_per_tensor, zero1_step_s_per_tensor  what FSDP2 and
                       ZeRO-1 cost beyond their collectives' bytes, on 2 gloo ranks (scripts/bench/ops_sharded.py);
                       null on a GPU
    h2d_gbps           GPU: pinned host -> device copy of 256 MiB; CPU: memory_gbps / 2 (a host copy, per direction)
    object_store_gbps  bytes / (ray.put in the driver + ray.get in an actor, with its host copy) of a float32 tensor
                       as the boundary moves it (a `WireTensor`, stages/boundary.py)
    call_latency_s     round trip of `ray.get(actor.noop.remote())` (median)
    efficiency         {"matmul": 1.0, "attention": 1.0, "comm": 1.0}: a measured profile needs no fitted factor;
                       CPU: also vision_forward, vision_backward, text: the op model's compute for a reference
                       stage's call / the call measured on transformers' modules (scripts/bench/ops_stages.py)
    notes              what was not measured and why, and how a field was derived
    quick              whether --quick sizes were used
    torch              torch.__version__
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from dhp.scripts.results import report

MiB = 2**20
GB = 1e9
CPU_MATMUL_SIZES = (64, 128, 256, 512)
GPU_MATMUL_SIZES = (1024, 4096, 8192)
WINDOW = 64  # tokens per attention window (the vision encoder's window: 8 x 8 merged patches)
COMM_RANKS = 2
MEMORY_PASSES = 4  # elementwise traffic per kept activation byte: written, read, its gradient written and read
CPU_COLLECTIVE_SIZES = tuple(2**k for k in (12, 15, 17, 19, 21, 23))  # bytes of the tensor: 4 KiB .. 8 MiB
GPU_COLLECTIVE_SIZES = tuple(2**k for k in (16, 20, 24, 27))  # 64 KiB .. 128 MiB
SHARDED_FIELDS = ("zero3_unit_s", "zero3_s_per_byte", "zero3_optimizer_s_per_tensor", "zero1_step_s_per_tensor")

FIELDS = (  # (key, unit) in the order the table prints them
    ("name", ""),
    ("kind", ""),
    ("device", ""),
    ("threads", ""),
    ("devices_per_node", ""),
    ("memory_gib", "GiB"),
    ("matmul_tflops", "TFLOP/s"),
    ("matmul_by_size", "[n, TFLOP/s]"),
    ("attention_tflops", "TFLOP/s"),
    ("window_attention_tflops", "TFLOP/s"),
    ("attention_head_dim", ""),
    ("attention_by_head_dim", "[d, TFLOP/s]"),
    ("causal_attention_tflops", "TFLOP/s"),
    ("attention_backward_ratio", "x"),
    ("optimizer_s_per_param", "s"),
    ("memory_passes", ""),
    ("op_latency_s", "s"),
    ("memory_gbps", "GB/s"),
    ("all_reduce_gbps", "GB/s"),
    ("all_gather_gbps", "GB/s"),
    ("all_to_all_gbps", "GB/s"),
    ("collective_latency_s", "s"),
    ("all_reduce_by_size", "[B, s]"),
    ("all_gather_by_size", "[B, s]"),
    ("all_to_all_by_size", "[B, s]"),
    ("zero3_unit_s", "[fwd, bwd] s"),
    ("zero3_s_per_byte", "[fwd, bwd] s"),
    ("zero3_optimizer_s_per_tensor", "s"),
    ("zero1_step_s_per_tensor", "s"),
    ("h2d_gbps", "GB/s"),
    ("object_store_gbps", "GB/s"),
    ("call_latency_s", "s"),
    ("efficiency", ""),
    ("notes", ""),
    ("quick", ""),
    ("torch", ""),
)


# ---------------------------------------------------------------------------------------------- timing


def _sync_for(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _timed(op: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Seconds for `reps` back-to-back calls, synchronizing once at the end (as a training step does)."""
    start = time.perf_counter()
    for _ in range(reps):
        op()
    sync()
    return time.perf_counter() - start


def best_rate(op: Callable[[], Any], work: float, seconds: float, sync: Callable[[], None] = lambda: None) -> float:
    """Best `work` per second of `op` over windows of about seconds/8, for about `seconds` in all."""
    window = seconds / 8
    op()  # warm-up: first-call allocation, page faults, kernel selection
    sync()
    reps, took = 1, _timed(op, 1, sync)
    # Grow the batch until it fills a window, so the one sync and the timer are a small share of it.
    while took < window and reps < 1 << 20:
        reps *= 2
        took = _timed(op, reps, sync)
    best, end = work * reps / took, time.perf_counter() + seconds
    while time.perf_counter() < end:
        best = max(best, work * reps / _timed(op, reps, sync))
    return best


def median_latency(op: Callable[[], Any], reps: int, batches: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median over `batches` of (time of `reps` calls, one sync) / reps: the cost of one call in a stream."""
    op()
    sync()
    return statistics.median(_timed(op, reps, sync) / reps for _ in range(batches))


# --------------------------------------------------------------------------------------------- compute


def matmul_by_size(device: str, dtype: Any, sizes: tuple[int, ...], seconds: float) -> list[list[float]]:
    import torch

    rows = []
    for n in sizes:
        a = torch.full((n, n), 0.5, device=device, dtype=dtype)
        b = torch.full((n, n), 0.25, device=device, dtype=dtype)
        rows.append([n, best_rate(lambda a=a, b=b: a @ b, 2 * n**3 / 1e12, seconds, _sync_for(device))])
    return rows


def _qkv(device: str, dtype: Any, shape: tuple[int, ...], grad: bool = False) -> tuple[Any, Any, Any]:
    import torch

    # Not a constant: a constant query gives every key the same score, which no real attention sees.
    # A fixed arithmetic pattern keeps the run free of RNG state.
    q = (torch.arange(math.prod(shape), device=device, dtype=torch.float32) % 7 / 7).reshape(shape).to(dtype)
    k, v = q.flip(-1).contiguous(), q.flip(-2).contiguous()
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def attention_tflops(
    device: str,
    dtype: Any,
    length: int,
    heads: int,
    head_dim: int,
    seconds: float,
    window: int | None = None,
    causal: bool = False,
) -> float:
    """SDPA forward TFLOP/s over `length` tokens: one full sequence, or length/window windows as a batch;
    `causal` counts half the score work (what a causal kernel needs)."""
    import torch.nn.functional as F

    span = window or length
    shape = (length // span, heads, span, head_dim)
    q, k, v = _qkv(device, dtype, shape)
    flops = shape[0] * 4 * span * span * head_dim * heads / (2 if causal else 1)
    return best_rate(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flops / 1e12, seconds, _sync_for(device)
    )


def attention_backward_ratio(device: str, dtype: Any, length: int, heads: int, head_dim: int, seconds: float) -> float:
    """(forward + backward) / forward - 1 of full SDPA: the backward's cost in forwards."""
    import torch.nn.functional as F

    q, k, v = _qkv(device, dtype, (1, heads, length, head_dim), grad=True)
    sync = _sync_for(device)
    forward = best_rate(lambda: F.scaled_dot_product_attention(q, k, v).detach(), 1.0, seconds, sync)
    both = best_rate(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(), 1.0, seconds, sync)
    return forward / both - 1


def optimizer_s_per_param(device: str, seconds: float) -> float:
    """One AdamW step as `StageWorker.optimizer_step` runs it (scale by the clip coefficient, step, zero), per
    parameter; gradients re-attached each time (set_to_none frees them)."""
    import torch

    # Tensors larger than a CPU's caches, as a model's largest (the embedding) are: AdamW's passes then
    # stream from memory each time, as they do in training.
    numel, count = (4 * MiB, 16) if device.startswith("cuda") else (8 * MiB, 2)
    params = [torch.full((numel,), 0.5, device=device, requires_grad=True) for _ in range(count)]
    grads = [torch.full_like(p, 1e-3) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
            g.mul_(1.0 - 1e-7)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return 1 / best_rate(step, count * numel, seconds, _sync_for(device))


def op_latency_s(device: str, quick: bool) -> float:
    import torch

    x = torch.zeros(16, device=device)
    return median_latency(lambda: x.add_(1), reps=200, batches=20 if quick else 100, sync=_sync_for(device))


def copy_gbps(device: str, nbytes: int, seconds: float) -> float:
    import torch

    src = torch.full((nbytes // 4,), 1.0, device=device)
    dst = torch.empty_like(src)
    return best_rate(lambda: dst.copy_(src), 2 * nbytes / GB, seconds, _sync_for(device))


def h2d_gbps(nbytes: int, seconds: float) -> float:
    import torch

    src = torch.full((nbytes // 4,), 1.0).pin_memory()
    dst = torch.empty(nbytes // 4, device="cuda")
    return best_rate(lambda: dst.copy_(src, non_blocking=True), nbytes / GB, seconds, torch.cuda.synchronize)


# ---------------------------------------------------------------------------------------------- comm


def sent_bytes(collective: str, nbytes: int, ranks: int) -> float:
    """Bytes one rank sends in `collective` of an `nbytes` tensor (all_gather: the output) on `ranks` ranks."""
    share = (ranks - 1) / ranks * nbytes
    return 2 * share if collective == "all_reduce" else share


def _pairwise_all_to_all(out: Any, inp: Any, rank: int, ranks: int) -> None:
    """all_to_all as n-1 pairwise isend/irecv: what a Ulysses exchange does on a backend without one."""
    import torch.distributed as dist

    outs, ins = out.chunk(ranks), inp.chunk(ranks)
    outs[rank].copy_(ins[rank])
    works = [
        w for peer in range(ranks) if peer != rank for w in (dist.isend(ins[peer], peer), dist.irecv(outs[peer], peer))
    ]
    for w in works:
        w.wait()


def _window_rate(op: Callable[[], Any], work: float, reps: int, windows: int, sync: Callable[[], None]) -> float:
    """Best work/s over `windows` windows of `reps` collectives. Every rank runs the same counts (a time-based
    window would give the ranks different counts and hang); the barrier starts the ranks together."""
    import torch.distributed as dist

    op()
    sync()
    best = 0.0
    for _ in range(windows):
        dist.barrier()
        best = max(best, work * reps / _timed(op, reps, sync))
    return best


def _collectives(rank: int, ranks: int, device: str, nbytes: int, quick: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sync = _sync_for(device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    x, out = torch.full((numel,), 1.0, device=device, dtype=dtype), torch.empty(numel, device=device, dtype=dtype)
    part = x[: numel // ranks]
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reps, windows = (5, 4) if quick else (4, 8)
    notes = []
    try:
        dist.all_to_all_single(out, x)
        all_to_all = partial(dist.all_to_all_single, out, x)
        notes.append("all_to_all: all_to_all_single (native on this backend)")
    except (RuntimeError, NotImplementedError) as e:
        notes.append(
            f"all_to_all_single is not implemented on this backend ({str(e)[:80]}); "
            "measured as n-1 pairwise isend/irecv"
        )
        all_to_all = partial(_pairwise_all_to_all, out, x, rank, ranks)
    result = {
        "all_reduce_gbps": _window_rate(
            lambda: dist.all_reduce(x), sent_bytes("all_reduce", nbytes, ranks) / GB, reps, windows, sync
        ),
        "all_gather_gbps": _window_rate(
            lambda: gather(out[: len(part) * ranks], part),
            sent_bytes("all_gather", nbytes, ranks) / GB,
            reps,
            windows,
            sync,
        ),
        "all_to_all_gbps": _window_rate(all_to_all, sent_bytes("all_to_all", nbytes, ranks) / GB, reps, windows, sync),
    }
    tiny = torch.zeros(4, device=device)
    samples = []
    for _ in range(50 if quick else 200):
        start = time.perf_counter()
        dist.all_reduce(tiny)
        sync()
        samples.append(time.perf_counter() - start)
    result["collective_latency_s"] = statistics.median(samples)
    sizes = GPU_COLLECTIVE_SIZES if device.startswith("cuda") else CPU_COLLECTIVE_SIZES
    ops = {
        "all_reduce": lambda t, o: dist.all_reduce(t),
        "all_to_all": lambda t, o: dist.all_to_all_single(o, t),
        "all_gather": lambda t, o: gather(o, t[: t.numel() // ranks]),
    }
    for kind, op in ops.items():  # the time of one collective by tensor size: small messages pay more than latency
        curve = []
        for size in sizes:
            t = x[: size // x.element_size()]
            o = out[: t.numel()]
            curve.append(
                [size, median_latency(lambda t=t, o=o, op=op: op(t, o), reps=5 if quick else 10, batches=7, sync=sync)]
            )
        result[f"{kind}_by_size"] = curve
    result["notes"] = notes
    return result


def _collective_worker(rank: int, ranks: int, port: int, backend: str, nbytes: int, quick: bool, out: str) -> None:
    """One spawned rank; rank 0 writes the result (spawn returns nothing)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks, timeout=timedelta(seconds=120)
    )
    try:
        result = _collectives(rank, ranks, device, nbytes, quick)
        if backend == "gloo":  # GPU: NCCL's FSDP2 overlaps its prefetch; the datasheet model stands there
            from dhp.scripts.bench.ops_sharded import measure_sharded

            sharded = measure_sharded(ranks, quick)
            result["notes"] += sharded.pop("notes")
            result.update(sharded)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_collectives(gpu: bool, quick: bool) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from dhp.scripts.local_head import free_ports

    if gpu and torch.cuda.device_count() < COMM_RANKS:
        return {"notes": [f"collectives not measured: {torch.cuda.device_count()} GPU(s), NCCL needs {COMM_RANKS}"]}
    # GPU: NCCL reaches its bus bandwidth only on large messages
    nbytes = ((64 if quick else 256) if gpu else (1 if quick else 16)) * MiB
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        mp.start_processes(
            _collective_worker,
            nprocs=COMM_RANKS,
            start_method="spawn",
            args=(COMM_RANKS, free_ports(1)[0], "nccl" if gpu else "gloo", nbytes, quick, str(out)),
        )
        result = json.loads(out.read_text())
    result["notes"].insert(
        0,
        f"collectives: {COMM_RANKS} processes, {'nccl' if gpu else 'gloo'}, "
        f"{nbytes // MiB} MiB messages, 1 torch thread each",
    )
    return result


# -------------------------------------------------------------------------------------------------- ray


class _Probe:
    def noop(self) -> None:
        return None

    def get(self, refs: list) -> float:
        """Seconds to fetch the object behind refs[0] (in a list so Ray hands over the ref, not the value)."""
        import ray

        from dhp.stages.boundary import from_wire

        start = time.perf_counter()
        from_wire(ray.get(refs[0]))  # as a stage receives a shard: the read, then its own copy on the host
        return time.perf_counter() - start


def _ray_rates(ray: Any, nbytes: int, quick: bool) -> dict[str, Any]:
    import torch

    from dhp.stages.boundary import to_wire

    probe = ray.remote(num_cpus=0.25)(_Probe).remote()
    try:
        ray.get(probe.noop.remote())  # the actor's process start is no part of a call's latency
        calls = []
        for _ in range(20 if quick else 100):
            start = time.perf_counter()
            ray.get(probe.noop.remote())
            calls.append(time.perf_counter() - start)
        tensor, best = torch.full((nbytes // 4,), 1.0), 0.0
        # The first fetch imports torch in the actor (seconds), so it is a warm-up, not a sample.
        for rep in range(1 + (3 if quick else 6)):
            start = time.perf_counter()
            ref = ray.put(to_wire(tensor))  # as a stage sends a shard (stages/boundary.py)
            put = time.perf_counter() - start
            rate = nbytes / (put + ray.get(probe.get.remote([ref]))) / GB
            best = max(best, rate) if rep else 0.0
            del ref  # free the store between repetitions
        return {"object_store_gbps": best, "call_latency_s": statistics.median(calls)}
    finally:
        ray.kill(probe)


def measure_ray(quick: bool) -> dict[str, Any]:
    try:
        import ray
    except ImportError:
        return {"notes": ["object_store_gbps, call_latency_s not measured: Ray is not importable here"]}
    nbytes = (8 if quick else 64) * MiB
    # A test session's Ray is reused and left running; one started here is ours to stop.
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = _ray_rates(ray, nbytes, quick)
    finally:
        if started:
            ray.shutdown()
    # Ray pickles (copies) a torch tensor unless this is set; the loader's micro-batches are torch tensors.
    zero_copy = os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "").lower() in ("true", "1")
    result["notes"] = [
        f"object store: ray.put in the driver + ray.get in an actor of a {nbytes // MiB} MiB "
        f"float32 torch tensor ({'zero-copy' if zero_copy else 'pickled: not zero-copy'})"
    ]
    return result


# -------------------------------------------------------------------------------------------- profile


def meminfo_bytes(field: str) -> int | None:
    """/proc/meminfo's `field` (e.g. "MemTotal", "MemAvailable") in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_gib(gpu: bool) -> float:
    if gpu:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**30
    total = meminfo_bytes("MemTotal")
    if total is not None:
        return total / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def measure(quick: bool) -> dict[str, Any]:
    import torch

    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    seconds = 0.1 if quick else 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stage actors' default; restored so a caller's (a test's) setting survives
    try:
        by_size = matmul_by_size(device, dtype, GPU_MATMUL_SIZES if gpu else CPU_MATMUL_SIZES, seconds)
        length, heads, head_dim = (8192, 16, 128) if gpu else (1024, 4, 32)
        attention = attention_tflops(device, dtype, length, heads, head_dim, seconds)
        window = attention_tflops(device, dtype, length, heads, head_dim, seconds, window=WINDOW)
        by_head_dim = [
            [d, attention_tflops(device, dtype, length, heads, d, seconds)]
            for d in ((64, 128) if gpu else (16, 32, 64))
        ]
        causal = attention_tflops(device, dtype, length, heads, head_dim, seconds, causal=True)
        backward = attention_backward_ratio(device, dtype, length, heads, head_dim, seconds)
        optimizer = optimizer_s_per_param(device, seconds)
        latency = op_latency_s(device, quick)
        copy_bytes = (256 if quick else 1024) * MiB if gpu else (32 if quick else 256) * MiB
        memory = copy_gbps(device, copy_bytes, seconds)
        h2d = h2d_gbps(256 * MiB, seconds) if gpu else memory / 2
    finally:
        torch.set_num_threads(threads)
    notes = [
        f"compute: 1 torch thread, {str(dtype).removeprefix('torch.')}; rates are the best of short windows",
        f"memory_gbps: a {copy_bytes // MiB} MiB copy, read + write bytes",
    ]
    if not gpu:
        notes.append(
            "h2d_gbps: no device; memory_gbps / 2, the cost per direction of a host copy between processes' buffers"
        )
    comm, store = measure_collectives(gpu, quick), measure_ray(quick)
    profile = {
        "name": f"measured:{torch.cuda.get_device_name() if gpu else socket.gethostname()}",
        "kind": "gpu" if gpu else "cpu",
        "device": torch.cuda.get_device_name() if gpu else "cpu (1 thread)",
        "threads": 1,
        "devices_per_node": torch.cuda.device_count() if gpu else os.cpu_count(),
        "memory_gib": round(memory_gib(gpu), 2),
        "matmul_tflops": by_size[-1][1],
        "matmul_by_size": by_size,
        "attention_tflops": attention,
        "window_attention_tflops": window,
        "attention_head_dim": head_dim,
        "attention_by_head_dim": by_head_dim,
        "causal_attention_tflops": causal,
        "attention_backward_ratio": backward,
        "optimizer_s_per_param": optimizer,
        "memory_passes": MEMORY_PASSES,
        "op_latency_s": latency,
        "memory_gbps": memory,
        "h2d_gbps": h2d,
        "efficiency": {"matmul": 1.0, "attention": 1.0, "comm": 1.0},
        "notes": notes + comm.pop("notes") + store.pop("notes"),
        "quick": quick,
        "torch": torch.__version__,
    }
    for key in (
        "all_reduce_gbps",
        "all_gather_gbps",
        "all_to_all_gbps",
        "collective_latency_s",
        "all_reduce_by_size",
        "all_gather_by_size",
        "all_to_all_by_size",
        *SHARDED_FIELDS,
    ):
        profile[key] = comm.get(key)
    for key in ("object_store_gbps", "call_latency_s"):
        profile[key] = store.get(key)
    if gpu:
        profile["notes"].append(
            "efficiency.vision_forward/vision_backward/text: not measured on a GPU (the "
            "reference stage's tiny widths are launch-bound there)"
        )
    else:
        from dhp.scripts.bench.ops_stages import measure_stages

        torch.set_num_threads(1)
        try:
            stages = measure_stages(profile, quick)
        finally:
            torch.set_num_threads(threads)
        profile["efficiency"].update(stages["efficiency"])
        profile["optimizer_s_per_param"] = stages["optimizer_s_per_param"]
        profile["notes"] += stages["notes"]
    return {key: profile[key] for key, _ in FIELDS}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return ", ".join(f"{n}: {r:.4g}" for n, r in value)
    if isinstance(value, list):
        return "; ".join(_fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def table(profile: dict[str, Any]) -> str:
    lines = ["| field | value | unit |", "|---|---|---|"]
    lines += [f"| {key} | {_fmt(profile[key])} | {unit} |" for key, unit in FIELDS if key != "notes"]
    return "\n".join(lines + [f"note: {n}" for n in profile["notes"]])


def _check_target(path: Path) -> None:
    """Fail before minutes of measuring, not after, when the profile cannot be written at `path`."""
    if path.is_dir():
        raise FileExistsError(f"--json {path}: is a directory; give a file path")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise FileExistsError(f"--json {path}: {parent} is a file, not a directory")


def main(args: argparse.Namespace) -> int:
    target = Path(args.json) if args.json else None
    if target is not None:
        _check_target(target)
    profile = measure(args.quick)
    return report(target, profile, table)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ops", help="measure op rates (matmul, attention, memory, collectives, Ray) as a profile")
    p.add_argument("--json", default=None, help="write the profile here")
    p.add_argument("--quick", action="store_true", help="smaller messages, shorter windows (seconds; for tests)")
