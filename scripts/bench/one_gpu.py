"""`dhp bench one-gpu`: dhp on one device against the loop a user would write instead.

    dhp bench one-gpu --json runs/bench/one_gpu.json [--quick] [--model qwen2_5_vl_3b] [--sides 448,896,1792]
                      [--steps 20] [--microbatches 2] [--precision fp32|bf16]

Systems, on the same device, one after the other in the same process tree:
  dhp           a vision actor and a text actor sharing the device (`pipeline.placement=shared`, half a GPU
                each), one precision for the whole run (`choose_precision`: the preset's fp32 master weights
                if `dhp plan` fits them on the device at the largest image, else pure bf16; the 3B's fp32
                states alone are 60 GB) and the preset's activation checkpointing, `Trainer.train_step` on
                pre-built global batches (the data pipeline is `dhp bench data`'s subject, not this one's).
  one process   transformers' `Qwen2_5_VLForConditionalGeneration`, the same precision (fp32 master weights under
                bf16 autocast, or pure bf16), `gradient_checkpointing_enable()` where dhp checkpoints, AdamW with
                dhp's hyper-parameters and clipping, the same micro-batches accumulated into one step.

Per image side (448, 896, 1792 px: 1 024, 4 096, 16 384 patches) and system: the median step after one warm-up
step, vision tokens/s (ViT patches), text tokens/s (decoder tokens, image placeholders included), model TFLOP/s and
MFU (`run_log.throughput`, dhp's own FLOP count and peak), dhp's bubble and the milliseconds per micro-batch its
pools spend moving embeddings and gradients across the boundary (`trace.boundary_seconds`), and peak memory: on a
GPU `torch.cuda.max_memory_allocated` of each process and its peak reserved by the caching allocator (what two
processes sharing a GPU each hold: neither can use the other's cache), next to `dhp plan`'s prediction per actor;
on a CPU the processes' peak RSS (mostly libraries: no prediction is compared). `ratio` is dhp's tokens/s over
the one-process loop's (the goal: >= 0.95). Weights are random (no released weights offline): speed does
not depend on their values. Without `--model` the tiny architecture runs, which is what CI checks on CPU; CPU
timings are labelled as such in the JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dhp.scripts.results import write_json

SIDES = (448, 896, 1792)  # px: 1 024, 4 096 and 16 384 patches of 14
QUICK_SIDES = (112,)  # 64 patches


def _settings(model: str | None, length: int, microbatches: int, cuda: bool) -> list[str]:
    # No loader runs (the batches are built here), so no preprocessing CPUs: the GPU preset's 2 x 8 would not fit.
    resources = [
        "vision.num_cpus_per_actor=0.5",
        "text.num_cpus_per_actor=0.5",
        "data.preprocess_workers=1",
        "data.preprocess_num_cpus=0.25",
    ]
    gpus = ["vision.num_gpus_per_actor=0.5", "text.num_gpus_per_actor=0.5"] if cuda else []
    # a released shape's weights drawn on the device, each actor its own part (speed does not depend on their
    # values): the exact replay of the 3B's random stream on the host takes a minute per actor build
    shape = [f"model.name={model}", "model.random_init=per_part"] if model else []
    return [
        *shape,
        *resources,
        *gpus,
        "vision.parallelism=none",
        "vision.num_actors=1",
        "vision.degree=1",
        "text.parallelism=none",
        "text.num_actors=1",
        "text.degree=1",
        "pipeline.placement=shared",
        f"data.microbatch_tokens={length}",
        f"data.max_seq_len={length}",
        f"training.global_batch_size={microbatches}",
        "training.warmup_steps=0",
        "pipeline.trace=true",
    ]


def _peak_bytes(_worker: Any = None) -> int:
    """This process's peak: device memory allocated by torch on a GPU since `_reset_peak`, else the resident set
    (which cannot be reset: on a CPU it includes the build)."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_reserved(_worker: Any = None) -> int | None:
    """On a GPU, the peak the caching allocator held (allocated + cached + fragmentation): beside the allocated
    peak it says how much of the device two processes' caches keep from each other. None on a CPU."""
    import torch

    return int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None


def _reset_peak(_worker: Any = None) -> None:
    """Forget the build's peak: what is compared is training's (as `dhp plan` predicts it)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def device_released(free: int, total: int, held_here: int) -> bool:
    """Whether the device is free but for what this process's caching allocator holds (the one-process loop's
    cache, which this process reuses: it keeps no other system from the memory). On an H100 the check
    without `held_here` waited out its limit at the second image size behind the loop's 37.6 GiB cache."""
    return free + held_here >= 0.9 * total


def _wait_for_free_device(timeout_s: float = 120.0) -> None:
    """After the actors are killed (`ray.kill` returns before their processes exit): until the device's memory is
    free again, so that the next system does not start beside the last one's tensors."""
    import torch

    deadline = time.monotonic() + timeout_s
    while True:
        (free, total), held = torch.cuda.mem_get_info(), torch.cuda.memory_reserved()
        if device_released(free, total, held):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the dhp actors' device memory was not released within {timeout_s:g} s: "
                f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
                f"{held / 2**30:.1f} GiB held by this process"
            )
        time.sleep(1.0)


# Events on the device's timeline that are not its work: CUPTI's markers (the launch queue full: 14 s of a 3.5 s
# step under key_averages on an H200), waits for a stream or event, and the profiler's own ranges
NOT_DEVICE_WORK = (
    "Command Buffer Full",
    "Buffer Flush",
    "Activity Buffer Request",
    "Driver Compiler",
    "Resource",
    "Instrumentation",
    "Runtime Triggered Module Loading",
    "Lazy Function Loading",
    "Event Sync",
    "Stream Wait Event",
    "Stream Sync",
    "Context Sync",
    "ProfilerStep",
)


def profile_summary(events: Any, wall_s: float, top: int = 8) -> dict[str, Any]:
    """What a torch.profiler run says about where a step's time goes, from `prof.events()` (torch's public
    `FunctionEvent`s: `name`, `device_type`, `time_range` in µs, `is_async`): the device's busy seconds (the union
    of its kernels and copies, so overlapping streams count once) against the wall (a share far below 1: the host,
    not the chip, sets the pace), its idle gaps, the kernels that take most device time, and the host events
    called most often with their inclusive host time. One pass over the events, none of the tree's recursive
    totals (`key_averages` had not finished after minutes at 16 k patches on an H200); the events' number is
    bounded by profiling few steps (`profiled`)."""
    from torch.autograd import DeviceType

    spans, device, host, skipped = [], {}, {}, {}
    for e in events:
        name, span = e.name, e.time_range
        us = span.end - span.start
        if e.device_type != DeviceType.CPU:
            if getattr(e, "is_user_annotation", False) or name.startswith(NOT_DEVICE_WORK):
                skipped[name] = skipped.get(name, 0.0) + us
                continue
            spans.append((span.start, span.end))
            calls, total = device.get(name, (0, 0.0))
            device[name] = (calls + 1, total + us)
        elif not e.is_async and not name.startswith("ProfilerStep"):
            calls, total = host.get(name, (0, 0.0))
            host[name] = (calls + 1, total + us)
    busy_us, reach, gaps = 0.0, None, []
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            gaps.append(start - reach)
        busy_us += max(0.0, end - max(start, reach if reach is not None else start))
        reach = end if reach is None else max(reach, end)
    device_s = busy_us / 1e6
    ranked = {
        "device": sorted(device.items(), key=lambda kv: kv[1][1], reverse=True)[:top],
        "host": sorted(host.items(), key=lambda kv: kv[1][0], reverse=True)[:top],
    }
    return {
        "wall_s": wall_s,
        "device_busy_s": device_s,
        "device_busy_share": device_s / wall_s if wall_s else 0.0,
        # the device idle between its first and last work: how often and how long it waits on the host
        "device_gaps": {
            "count": len(gaps),
            "total_s": sum(gaps) / 1e6,
            "longest_s": [g / 1e6 for g in sorted(gaps, reverse=True)[:3]],
        },
        "top_device": [{"op": k, "calls": c, "device_s": us / 1e6} for k, (c, us) in ranked["device"]],
        "top_host": [{"op": k, "calls": c, "host_s": us / 1e6} for k, (c, us) in ranked["host"]],
        "skipped_device_s": {k: us / 1e6 for k, us in sorted(skipped.items(), key=lambda kv: -kv[1])[:top]},
    }


def profiled(steps: int) -> Any:
    """A torch.profiler for one warm-up step (the profiler's own start, not kept) and then `steps` recorded ones:
    call its `step()` after each of the 1 + `steps`; `profile_summary(prof.events(), ...)` after the last."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    return profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1))


def _profile_start(worker: Any, steps: int) -> None:
    """In a dhp actor (`__ray_call__`): start a `profiled` run that the next 1 + `steps` train steps go through."""
    worker._bench_profiler = profiled(steps)
    worker._bench_profiler.start()


def _profile_step(worker: Any) -> None:
    worker._bench_profiler.step()


def _profile_stop(worker: Any, wall_s: float) -> dict[str, Any]:
    """In a dhp actor: stop its profiler and hand back the small summary (not the events)."""
    prof = worker._bench_profiler
    del worker._bench_profiler
    prof.stop()
    began = time.perf_counter()
    summary = profile_summary(prof.events(), wall_s)
    return {**summary, "summary_s": time.perf_counter() - began}


def profile_dhp(trainer: Any, batches: list[Any], steps: int) -> dict[str, dict[str, Any]]:
    """`steps` more train steps (after a warm-up one) with torch.profiler in each pool's rank 0: a summary per
    pool, each against the wall of the driver's steps."""
    import ray

    actors = {stage: pool.actors[0] for stage, pool in trainer.pools()}
    ray.get([a.__ray_call__.remote(_profile_start, steps) for a in actors.values()])
    wall = 0.0
    for i in range(1 + steps):
        start = time.perf_counter()
        trainer.train_step(batches)
        if i:  # the warm-up step is not recorded
            wall += time.perf_counter() - start
        ray.get([a.__ray_call__.remote(_profile_step) for a in actors.values()])
    return dict(zip(actors, ray.get([a.__ray_call__.remote(_profile_stop, wall) for a in actors.values()])))


def run_dhp(cfg: Any, mc: Any, sample: dict, microbatches: int, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """dhp's steps on pre-built batches: median step, per-call medians, each actor's peak, the MFU peak, the
    median bubble and the boundary's seconds per micro-batch over the measured steps; with `profile_steps`, that
    many more steps under torch.profiler in each pool (`profile_dhp`)."""
    import ray

    from dhp.scripts.bench.time_model import global_batches, timed_steps
    from dhp.stages.run_log import peak_of
    from dhp.stages.trace import boundary_seconds
    from dhp.stages.trainer import Trainer

    trainer = Trainer(cfg, model_config=mc)
    metrics: list[dict] = []
    try:
        batches = global_batches(sample, cfg, mc, microbatches, 1)
        ray.get([pool.actors[0].__ray_call__.remote(_reset_peak) for _, pool in trainer.pools()])
        times, calls = timed_steps(trainer, batches, steps, metrics)
        peaks, reserved = (
            {stage: ray.get(pool.actors[0].__ray_call__.remote(f)) for stage, pool in trainer.pools()}
            for f in (_peak_bytes, _peak_reserved)
        )
        peak = peak_of(cfg, trainer)
        boundary = boundary_seconds(e for e in trainer.traced_events() if e["step"] > 1)  # the warm-up is step 1
        # after the measured steps, so the profiler's overhead is in none of them
        profiles = profile_dhp(trainer, batches, profile_steps) if profile_steps else None
    finally:
        trainer.shutdown()
        if cfg.vision.num_gpus_per_actor:  # also after a failed run: the next system needs the device back
            _wait_for_free_device()
    return {
        "step_s": statistics.median(times[1:]),
        "steps_s": times,
        "peak_bytes": peaks,
        "peak_reserved_bytes": reserved,
        "calls_s": calls,
        "peak_flops": peak.flops,
        "bubble": statistics.median(m["bubble"] for m in metrics[1:]),
        "boundary_s_per_microbatch": boundary,
        "batches": batches,
        **({"profile": profiles} if profiles else {}),
    }


def _boundaries(text: str) -> tuple[str, ...]:
    """`--boundaries host,cuda_ipc` -> the names, each a `pipeline.boundary` (a typo is an argument error)."""
    from dhp.stages.boundary import TRANSPORTS

    names = tuple(text.split(","))
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: pipeline.boundary is one of {', '.join(TRANSPORTS)}")
    return names


def _system(boundary: str) -> str:
    """A dhp row's name: plain "dhp" through Ray's object store (the name earlier JSON files use)."""
    from dhp.stages.boundary import transport_of

    return f"dhp {boundary}" if transport_of(boundary).direct else "dhp"


def run_one_process(
    cfg: Any, mc: Any, sample: dict, microbatches: int, steps: int, profile_steps: int = 0
) -> dict[str, Any]:
    """The same steps as one transformers model in this process: median step and the process's peak; with
    `profile_steps`, that many more steps under torch.profiler (`profiled`, `profile_summary`)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.models.activation_checkpointing import ActivationCheckpointing
    from dhp.models.precision import precision_of
    from dhp.scripts.peers.deepspeed_zero3 import hf_batch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    precision, t = precision_of(cfg.model.precision), cfg.training
    torch.manual_seed(0)
    with device:  # initialized where it trains: a released shape's random init on the host takes minutes
        model = Qwen2_5_VLForConditionalGeneration._from_config(  # a copy: _from_config sets its dtype
            copy.deepcopy(mc), attn_implementation=cfg.model.attn_implementation, dtype=precision.param_dtype
        ).train()
    if all(ActivationCheckpointing.of(getattr(cfg, stage)).recomputes for stage in ("vision", "text")):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay
    )
    batch = {k: v.to(device) for k, v in hf_batch(sample, precision.param_dtype).items()}  # as the DeepSpeed peer's
    autocast = precision.autocast(device, precision.compute_dtype(cfg.model.dtype))
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(model: Any, optimizer: Any, batch: dict) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(microbatches):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            del loss  # its graph's leaves are the parameters: a live loss keeps the model after `del model`
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times = [step(model, optimizer, batch) for _ in range(1 + steps)]
    peak, reserved = _peak_bytes(), _peak_reserved()
    summary = None
    if profile_steps:  # after the measured steps, so the profiler's overhead is in none of them
        with profiled(profile_steps) as prof:
            wall = 0.0
            for i in range(1 + profile_steps):  # the first is the profiler's warm-up, not recorded
                seconds = step(model, optimizer, batch)
                wall += seconds if i else 0.0
                prof.step()
        began = time.perf_counter()
        summary = profile_summary(prof.events(), wall)
        summary = {"process": {**summary, "summary_s": time.perf_counter() - began}}
    del model, optimizer, batch
    gc.collect()  # before the cache is emptied: what a reference cycle still holds is not free to give back
    if cuda:
        torch.cuda.empty_cache()
    return {
        "step_s": statistics.median(times[1:]),
        "steps_s": times,
        "peak_bytes": {"process": peak},
        "peak_reserved_bytes": {"process": reserved},
        **({"profile": summary} if summary else {}),
    }


def choose_precision(
    base: str, settings: list[str], mc: Any, patches: int, device_gib: float | None, asked: str | None = None
) -> str:
    """`asked`, else the preset's precision if `dhp plan` fits it on `device_gib` at `patches` (the largest image
    of the run), else pure bf16: fp32 master weights take 16 bytes a parameter, 60 GB for the 3B's 3.75 B, too
    much beside 16 k-patch activations on an 80 GB GPU. Raises when not even bf16 fits (a bench that would run
    out of memory on the device after spending its time). No device (CPU): the preset's."""
    from dhp.models.planning.memory_plan import GIB, plan
    from dhp.stages.config import load_config

    if asked or device_gib is None:
        return asked or load_config(base, settings).model.precision
    tried = []
    for name in dict.fromkeys([load_config(base, settings).model.precision, "bf16"]):
        cfg = load_config(base, [*settings, f"model.precision={name}"])
        result = plan(cfg, mc, device_gib, vision_patches=patches)
        if result["fits"]:
            return name
        tried.append(f"{name}: {result['per_device'] / GIB:.1f} GiB")
    raise ValueError(
        f"the plan fits no precision on this {device_gib:.0f} GiB device at {patches} patches "
        f"({'; '.join(tried)}): ask for smaller --sides"
    )


def run(
    quick: bool,
    model: str | None = None,
    sides: list[int] | None = None,
    steps: int | None = None,
    microbatches: int = 2,
    precision: str | None = None,
    on_side: Callable[[dict[str, Any]], None] | None = None,
    profile_steps: int = 0,
    boundaries: tuple[str, ...] = ("host",),
) -> dict[str, Any]:
    """Both systems at each side, smallest first; dhp once per `pipeline.boundary` in `boundaries` (a row
    each: "dhp" for host, "dhp cuda_ipc", ...). `on_side` is handed the result so far after each side
    (`complete` false until the last), so a run cut off by a time limit keeps the sides it finished."""
    import ray
    import torch

    from dhp.models.planning.memory_plan import plan
    from dhp.scripts.peers.probe import image_sample, patches
    from dhp.stages.config import load_config
    from dhp.stages.run_log import throughput
    from dhp.stages.trainer import model_config_of

    cuda = torch.cuda.is_available()
    sides = sorted(sides or (QUICK_SIDES if quick else SIDES))
    steps = steps or (2 if quick else 20)
    base = "qwen2_5_vl_7b" if model else "tiny"  # a GPU preset's precision and checkpointing
    mc = model_config_of(load_config(base, [f"model.name={model}"] if model else []))
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    head = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "timings": "GPU" if cuda else "CPU timings (not GPU figures)",
        "torch": torch.__version__,
        "model": model or "tiny",
        "precision": precision,
        "device_gib": device_gib,
        "microbatches": microbatches,
        "steps": steps,
    }
    started = not ray.is_initialized()
    if started:  # a running Ray where RAY_ADDRESS names one (scripts/gpu_session.sh starts one for its steps)
        address = os.environ.get("RAY_ADDRESS")
        local = {"address": "local", "num_cpus": 4, "include_dashboard": False}
        ray.init(**({"address": address} if address else local), log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            samples = {side: image_sample(mc, side, Path(tmp)) for side in sides}
            settings = {side: _settings(model, len(samples[side]["input_ids"]), microbatches, cuda) for side in sides}
            largest = max(sides)
            precision = choose_precision(base, settings[largest], mc, patches(largest), device_gib, precision)
            head["precision"] = precision
            print(f"precision: {precision}", flush=True)
            for side in sides:
                sample, length = samples[side], len(samples[side]["input_ids"])
                cfg = load_config(base, [*settings[side], f"model.precision={precision}"])
                planned = {s: p.total for s, p in plan(cfg, mc, vision_patches=patches(side))["ranks"].items()}
                try:
                    dhps = {}
                    for boundary in boundaries:
                        try:
                            dhps[boundary] = run_dhp(
                                load_config(
                                    base,
                                    [*settings[side], f"model.precision={precision}", f"pipeline.boundary={boundary}"],
                                ),
                                mc,
                                sample,
                                microbatches,
                                steps,
                                profile_steps if not dhps else 0,
                            )  # the first boundary's row is profiled
                        except Exception as e:  # a later transport (alpha in Ray) failing keeps the others' rows
                            if not dhps:  # the first boundary is the side's baseline: without it, no dhp row
                                raise
                            error = f"{type(e).__name__}: {e}"[:2000]
                            head.setdefault("failed_boundaries", []).append(
                                {"boundary": boundary, "side": side, "patches": patches(side), "error": error}
                            )
                            print(f"side {side}, pipeline.boundary={boundary}: {error}", flush=True)
                    alone = run_one_process(cfg, mc, sample, microbatches, steps, profile_steps)
                except Exception as e:  # an OOM at the largest image is a finding: keep it and the sides before
                    error = f"{type(e).__name__}: {e}"[:2000]
                    head["failed"] = {"side": side, "patches": patches(side), "error": error}
                    print(f"side {side}: {error}", flush=True)
                    break
                batches = [r.pop("batches") for r in dhps.values()][0]  # the same batches for each
                systems = [(_system(b), r) for b, r in dhps.items()]
                for system, r in [*systems, ("one process", alone)]:
                    rows.append(
                        {
                            "side": side,
                            "patches": patches(side),
                            "sample_tokens": length,
                            "system": system,
                            "step_s": r["step_s"],
                            "steps_s": r["steps_s"],
                            "peak_bytes": r["peak_bytes"],
                            "peak_reserved_bytes": r["peak_reserved_bytes"],
                            "calls_s": r.get("calls_s", {}),
                            **{k: r[k] for k in ("bubble", "boundary_s_per_microbatch", "profile") if k in r},
                            "planned_bytes": planned if cuda and r is not alone else {},
                            "vision_tokens_per_s": microbatches * patches(side) / r["step_s"],
                            "text_tokens_per_s": microbatches * length / r["step_s"],
                            **throughput(batches, mc, r["step_s"], systems[0][1]["peak_flops"]),
                        }
                    )
                for row, (_, r) in zip(rows[-1 - len(systems) : -1], systems):
                    row["ratio"] = alone["step_s"] / r["step_s"]  # dhp's tokens/s over the loop's
                    # of dhp's step: both pools' rank 0 moving embeddings and gradients (they may overlap other work)
                    row["boundary_share"] = microbatches * r["boundary_s_per_microbatch"]["boundary_s"] / r["step_s"]
                if on_side:
                    on_side({**head, "complete": side == sides[-1], "rows": rows})
    finally:
        if started:
            ray.shutdown()
    return {**head, "complete": "failed" not in head, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} on {result['device']} ({result['timings']}), {result['precision']}, "
        f"{result['microbatches']} micro-batches a step, median of {result['steps']} steps",
        "",
        "| patches | system | step s | vision tok/s | text tok/s | TFLOP/s | MFU | peak GiB[/reserved] (planned) "
        "| bubble | boundary ms/mb (share) | dhp / loop |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in result["rows"]:
        reserved = r.get("peak_reserved_bytes", {})
        peak = ", ".join(
            f"{k} {v / 2**30:.2f}"
            + (f"/{reserved[k] / 2**30:.2f}" if reserved.get(k) else "")
            + (f" ({r['planned_bytes'][k] / 2**30:.2f})" if k in r["planned_bytes"] else "")
            for k, v in r["peak_bytes"].items()
        )
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        bubble = f"{r['bubble']:.3f}" if "bubble" in r else ""
        boundary = (
            f"{r['boundary_s_per_microbatch']['boundary_s'] * 1e3:.1f} ({r['boundary_share']:.1%})"
            if "boundary_share" in r
            else ""
        )
        lines.append(
            f"| {r['patches']} | {r['system']} | {r['step_s']:.3f} | {r['vision_tokens_per_s']:.0f} | "
            f"{r['text_tokens_per_s']:.0f} | {r['model_tflops_per_s']:.3g} | {r['mfu']:.3g} | {peak} | "
            f"{bubble} | {boundary} | {ratio} |"
        )
    for r in result["rows"]:
        for process, prof in r.get("profile", {}).items():
            top = ", ".join(f"{o['op'][:60]} {o['device_s'] * 1e3:.0f} ms" for o in prof["top_device"][:3])
            who = r["system"] if process == "process" else f"{r['system']} {process}"
            lines.append(
                f"\nprofiled {r['patches']} patches, {who}: device busy "
                f"{prof['device_busy_share']:.0%} of {prof['wall_s']:.2f} s "
                f"({prof['device_gaps']['count']} gaps, {prof['device_gaps']['total_s'] * 1e3:.0f} ms); "
                f"most device time: {top or 'none (no device)'}"
            )
    for f in result.get("failed_boundaries", []):
        lines.append(f"\npipeline.boundary={f['boundary']} failed at {f['patches']} patches: {f['error'][:300]}")
    if "failed" in result:
        lines.append(f"\nfailed at {result['failed']['patches']} patches: {result['failed']['error'][:300]}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    sides = [int(s) for s in args.sides.split(",")] if args.sides else None

    def finished_side(partial: dict[str, Any]) -> None:  # what a time-limited GPU run keeps if cut off
        if args.json:
            write_json(args.json, partial)
        print(table(partial), flush=True)

    result = run(
        args.quick,
        args.model,
        sides,
        args.steps,
        args.microbatches,
        args.precision,
        finished_side,
        args.profile,
        args.boundaries,
    )
    if args.json:
        write_json(args.json, result)
    if not result["complete"]:
        print(table(result))
    return 0 if result["complete"] else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "one-gpu",
        help="dhp (vision + text actor sharing one device) vs a one-process transformers "
        "loop: tokens/s, MFU, peak memory",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write the rows here (after each image size, so a cut-off run keeps the sizes it finished)",
    )
    p.add_argument("--quick", action="store_true", help="one 64-patch image, 2 steps (what CI runs)")
    p.add_argument("--model", default=None, help="a released shape, e.g. qwen2_5_vl_3b (default: tiny)")
    p.add_argument("--sides", default=None, help="image sides in px, comma-separated (default 448,896,1792)")
    p.add_argument("--steps", type=int, default=None, help="measured steps after one warm-up (default 20)")
    p.add_argument("--microbatches", type=int, default=2, help="one-image micro-batches per step (default 2)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the measured steps, run this many more (after one warm-up) of the one-process loop "
        "and of dhp (its first boundary) under torch.profiler, in dhp's vision and text actors "
        "each, and keep the device's busy share and the top operators in the JSON (default 0: none)",
    )
    p.add_argument(
        "--boundaries",
        default=("host",),
        type=_boundaries,
        help="pipeline.boundary values to run dhp with, comma-separated, one row each (default host; "
        "host,cuda_ipc on a GPU compares Ray's object store with CUDA IPC)",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16"],
        help="model.precision for both systems (default: the preset's if `dhp plan` fits it on the "
        "device at the largest side, else bf16)",
    )
