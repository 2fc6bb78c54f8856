"""`dhp bench one-gpu`: dhp on one device against the loops a user would write instead.

    dhp bench one-gpu --json runs/bench/one_gpu.json [--quick] [--model qwen2_5_vl_3b] [--photos N] [--shard PATH]
                      [--sides 448,896,1792] [--steps N] [--microbatches 2] [--precision fp32|bf16]
                      [--profile STEPS] [--boundaries host,cuda_ipc] [--describe]

The workload, by default: real photos with their captions, packed. Each photo of an img2dataset WebDataset shard
(`--shard`, default the repository's tests/assets/cc12m-train-0000.tar: 32 CC12M photos) at its original size
(img2dataset's `original_width` x `original_height`: the shard stores them at 512 px), through dhp's preprocessor
with the preset's `data.min_pixels` / `data.max_pixels` (the image processor's smart resize) and chat template;
one global batch of all of them, packed by `data.microbatch_tokens` into micro-batches (`data.packing`), the same
every step. `--sides` trains square noise images of these sides instead, `--microbatches` one-image micro-batches
a step of each size (how the image size alone changes the picture).

Systems, on the same device, one after the other in the same process tree, on the same micro-batches:
  dhp                      a vision actor and a text actor sharing the device (`pipeline.placement=shared`,
                           half a GPU each), `data.packing=true`, `training.optimizer=fused`, one precision and
                           one activation checkpointing per pool for the whole run (`choose_fit`: the preset's
                           fp32 master weights if `dhp plan` fits them on the device at the largest micro-batch,
                           else pure bf16; the least recomputation that fits with it), `Trainer.train_step` on
                           pre-built global batches (the data pipeline is `dhp bench data`'s subject, not this
                           one's). Both loops train with the same precision and checkpointing.
  one process              transformers' stock `Qwen2_5_VLForConditionalGeneration`, each micro-batch padded
                           (scripts/bench/one_process.py `run_stock`).
  one process, dhp kernels dhp's own modules, optimizer and clipped step in one process: grouped window attention,
                           packed per-sample attention, fused AdamW (`run_same_kernels`).

`--compile inductor` compiles both pools' blocks in dhp and in the loop of dhp's kernels (`vision.compile`,
`text.compile`: models/compilation.py); the stock loop stays what transformers runs. The warm-up step then
includes the compilation; dhp's rows keep what each pool compiled (graphs and graph breaks), the same-kernel loop's
what its one process compiled.

Per workload and system: the median step after one warm-up step, each step's loss, what it trained (the same
counts for all three, padding aside), vision tokens/s (ViT patches), text tokens/s (decoder tokens, image
placeholders included, padding not), model TFLOP/s and MFU (`run_log.throughput`, dhp's own FLOP count and peak),
dhp's bubble and the milliseconds per micro-batch its pools spend moving embeddings and gradients across the
boundary (`trace.boundary_seconds`), and peak memory: on a GPU `torch.cuda.max_memory_allocated` of each process
and its peak reserved by the caching allocator (what two processes sharing a GPU each hold: neither can use the
other's cache), next to `dhp plan`'s prediction per actor; on a CPU the processes' peak RSS (mostly libraries: no
prediction is compared). `over_stock` is a row's tokens/s over the stock loop's; `over_same_kernels`, on dhp's
rows, dhp's tokens/s over the same-kernel loop's: the framework's cost (the goal: >= 0.95). Weights are random (no
released weights offline): speed does not depend on their values. Without `--model` the tiny architecture runs,
which is what CI checks on CPU; CPU timings are labelled as such in the JSON.
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import os
import platform
import resource
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dhp.scripts.bench.one_process import PAD_ID, STAGES, run_same_kernels, run_stock, trained
from dhp.scripts.results import write_json

SHARD = Path(__file__).resolve().parents[2] / "tests" / "assets" / "cc12m-train-0000.tar"  # tests/assets/README.md
QUICK_PHOTOS, QUICK_BUDGET = 4, 256  # the tiny shape's photos are ~100 tokens: 2 packed micro-batches of 2
SIDES = (448, 896, 1792)  # px: 1 024, 4 096 and 16 384 patches of 14
STEPS = {"photos": 8, "sides": 20}  # a step of the photos trains 32 photos, one of a side 2 images
STOCK, SAME_KERNELS = "one process", "one process, dhp kernels"


def _settings(model: str | None, cuda: bool) -> list[str]:
    """What every system of every workload runs with (a workload adds its data settings)."""
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
        "data.packing=true",
        "training.optimizer=fused",
        "training.warmup_steps=0",
        "pipeline.trace=true",
    ]


@dataclass
class Workload:
    """One global batch that every system trains at every step: `samples` (dhp's preprocessed form) and the
    micro-batches `groups` (indices into `samples`), with the data settings that describe it."""

    name: str  # "photos", or "448 px"
    samples: list[dict[str, Any]]
    groups: list[list[int]]
    settings: list[str]
    side: int | None = None  # a square image's side (`--sides`)

    def microbatches(self, packed: bool) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(vision inputs, text inputs) of each micro-batch: the text packed or padded (dataflow/packing.py)."""
        from dhp.dataflow.packing import microbatch_inputs

        return [microbatch_inputs([self.samples[i] for i in g], PAD_ID, packed) for g in self.groups]

    @functools.cached_property
    def metas(self) -> list[Any]:
        """Each packed micro-batch's `MicroBatchMeta`: what MFU counts for every system."""
        from dhp.dataflow.packing import meta_of

        return [meta_of(v, t) for v, t in self.microbatches(packed=True)]

    def largest(self) -> Any:
        """The `MicroBatchMeta` of the micro-batch with the most patches: what `dhp plan` is asked about."""
        return max(self.metas, key=lambda m: m.patches)

    def largest_patches(self) -> int:
        return self.largest().patches

    def as_batches(self) -> list[Any]:
        """The step as the `GlobalBatch` list `run_log.throughput` reads (metadata only)."""
        from dhp.dataflow.loader import GlobalBatch, MicroBatch

        return [GlobalBatch([MicroBatch([], None, m) for m in self.metas], epoch=0)]


def original_sizes(shard: Path) -> dict[str, tuple[int, int]]:
    """Each sample's (width, height) before img2dataset resized it, from its `.json` member."""
    sizes = {}
    with tarfile.open(shard) as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".json"):
                meta = json.loads(tar.extractfile(member).read())
                sizes[member.name.split(".", 1)[0]] = (meta["original_width"], meta["original_height"])
    return sizes


def at_size(image: bytes, size: tuple[int, int]) -> bytes:
    """An image file's bytes with its pixels resized to `size` (JPEG; the same bytes when already that size)."""
    from PIL import Image

    picture = Image.open(io.BytesIO(image))
    if picture.size == tuple(size):
        return image
    out = io.BytesIO()
    picture.convert("RGB").resize(size, Image.BICUBIC).save(out, format="JPEG", quality=95)
    return out.getvalue()


def photo_samples(cfg: Any, mc: Any, shard: Path, count: int | None) -> list[dict[str, Any]]:
    """The first `count` (None: all) photos of `shard` at their original sizes, preprocessed as dhp's loader
    does under `cfg` (its prompt, caption field, min/max pixels, tokenizer); a skipped record is an error."""
    import pyarrow.fs as pafs

    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.dataflow.webdataset import shard_rows

    d = cfg.data
    settings = PreprocessSettings("", d.min_pixels, d.max_pixels, d.max_seq_len, tokenizer_path=cfg.model.tokenizer_dir)
    preprocess, sizes = Preprocessor(settings, mc), original_sizes(shard)
    rows = shard_rows(pafs.LocalFileSystem(), str(shard), shard.name, d.webdataset.prompt, d.webdataset.caption)
    samples = []
    for row in rows[:count]:
        if not row["skip"]:
            row = {**row, "image": at_size(row["image"], sizes[row["source"].rsplit(":", 1)[1]])}
        out = preprocess(row)
        if out["error"]:
            raise ValueError(f"{out['source']}: {out['error']}: {out['detail']}")
        samples.append(decode_sample(out["sample"]))
    return samples


def photos_workload(cfg: Any, mc: Any, shard: Path, count: int | None, budget: int | None = None) -> Workload:
    """The photos as one global batch packed into micro-batches of at most `budget` tokens (default the
    preset's `data.microbatch_tokens`)."""
    from dhp.dataflow.packing import pack

    samples = photo_samples(cfg, mc, shard, count)
    budget = budget or cfg.data.microbatch_tokens
    groups = pack([s["input_ids"].shape[0] for s in samples], budget, packed=True)
    settings = [
        f"data.microbatch_tokens={budget}",
        f"data.max_seq_len={min(cfg.data.max_seq_len, budget)}",  # a sample longer than a micro-batch: refused
        f"training.global_batch_size={len(samples)}",
    ]
    return Workload("photos", samples, groups, settings)


def side_workload(mc: Any, side: int, microbatches: int, root: Path) -> Workload:
    """`microbatches` one-image micro-batches of one seeded noise image, `side` px square."""
    from dhp.scripts.peers.probe import image_sample

    sample = image_sample(mc, side, root)
    length = len(sample["input_ids"])
    settings = [
        f"data.microbatch_tokens={length}",
        f"data.max_seq_len={length}",
        f"training.global_batch_size={microbatches}",
    ]
    return Workload(f"{side} px", [sample], [[0]] * microbatches, settings, side)


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


def ensure_ray() -> None:
    """Ray for dhp's actors, on the first dhp run: the one RAY_ADDRESS names (scripts/gpu_session.sh starts one for
    its steps), else a local one of this process's own (`run` shuts it down)."""
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        local = {"address": "local", "num_cpus": 4, "include_dashboard": False}
        ray.init(**({"address": address} if address else local), log_to_driver=False)


@contextmanager
def new_trainer(cfg: Any, mc: Any) -> Iterator[Any]:
    """A `Trainer` of `cfg` for one system's run, shut down after it (and on a GPU, until its actors' memory is
    back: the next system needs the device)."""
    from dhp.stages.trainer import Trainer

    trainer = Trainer(cfg, model_config=mc)
    try:
        yield trainer
    finally:
        trainer.shutdown()
        if cfg.vision.num_gpus_per_actor:  # also after a failed run
            _wait_for_free_device()


def dhp_batches(workload: Workload, cfg: Any, mc: Any) -> list[Any]:
    """The workload as the one replica's `GlobalBatch`, its micro-batches in Ray's object store and split for
    the vision ranks as dhp's loader splits them (`dataflow/loader.py`)."""
    import ray

    from dhp.dataflow.loader import GlobalBatch, MicroBatch, split_for_ranks
    from dhp.dataflow.packing import meta_of
    from dhp.models.parallel.layouts import stage_layout

    sp = stage_layout(cfg, "vision", mc).loader_shards
    microbatches = []
    for vision, text in workload.microbatches(packed=cfg.data.packing):
        meta = meta_of(vision, text)
        parts = split_for_ranks(vision, text, sp, mc)
        microbatches.append(MicroBatch([ray.put(p) for p in parts], ray.put(text), meta))
    return [GlobalBatch(microbatches, epoch=0)]


def run_dhp(
    cfg: Any,
    mc: Any,
    workload: Workload,
    steps: int,
    profile_steps: int = 0,
    trainers: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """dhp's steps on the workload: median step, each step's loss, what it trained, per-call medians, each actor's
    peak, the MFU peak, the median bubble and the boundary's seconds per micro-batch over the measured steps; with
    `profile_steps`, that many more steps under torch.profiler in each pool (`profile_dhp`). `trainers(cfg)`: a
    context manager giving the trainer (default `new_trainer`; the tests' keeps it for the next)."""
    import ray

    from dhp.scripts.bench.time_model import timed_steps
    from dhp.stages.run_log import peak_of
    from dhp.stages.trace import boundary_seconds

    ensure_ray()
    metrics: list[dict] = []
    with (trainers or (lambda c: new_trainer(c, mc)))(cfg) as trainer:
        batches = dhp_batches(workload, cfg, mc)
        ray.get([pool.actors[0].__ray_call__.remote(_reset_peak) for _, pool in trainer.pools()])
        times, calls = timed_steps(trainer, batches, steps, metrics)
        peaks, reserved = (
            {stage: ray.get(pool.actors[0].__ray_call__.remote(f)) for stage, pool in trainer.pools()}
            for f in (_peak_bytes, _peak_reserved)
        )
        peak = peak_of(cfg, trainer)
        compiled = {stage: ray.get(pool.actors[0].compiled.remote()) for stage, pool in trainer.pools()}
        boundary = boundary_seconds(e for e in trainer.traced_events() if e["step"] > 1)  # the warm-up is step 1
        # after the measured steps, so the profiler's overhead is in none of them
        profiles = profile_dhp(trainer, batches, profile_steps) if profile_steps else None
    metas = [mb.meta for b in batches for mb in b.microbatches]
    first = metrics[0]  # the trainer's own counts, and the micro-batches' for what it does not count
    counted = {**trained(metas), **{k: first[k] for k in ("samples", "tokens", "label_tokens", "microbatches")}}
    return {
        "step_s": statistics.median(times[1:]),
        "steps_s": times,
        "losses": [m["loss"] for m in metrics],
        "trained": counted,
        "peak_bytes": peaks,
        "peak_reserved_bytes": reserved,
        "calls_s": calls,
        "peak_flops": peak.flops,
        "bubble": statistics.median(m["bubble"] for m in metrics[1:]),
        "boundary_s_per_microbatch": boundary,
        "compiled": compiled,
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


# each pool's activation checkpointing, from the least recomputation to the most: (mode, every)
CHECKPOINTING = (("none", 1), ("every_n", 4), ("every_n", 2), ("full", 1))


@dataclass(frozen=True)
class Fit:
    """What a run trains with so that it fits the device: a precision and each pool's activation checkpointing."""

    precision: str
    checkpointing: dict[str, tuple[str, int]]  # pool -> (activation_checkpointing, activation_checkpointing_every)

    @property
    def settings(self) -> list[str]:
        out = [f"model.precision={self.precision}"]
        for stage, (mode, every) in self.checkpointing.items():
            out.append(f"{stage}.activation_checkpointing={mode}")
            out.append(f"{stage}.activation_checkpointing_every={every}")
        return out

    def describe(self) -> str:
        pools = ", ".join(f"{s} {m}" + (f" {e}" if m == "every_n" else "") for s, (m, e) in self.checkpointing.items())
        return f"{self.precision}, checkpointing {pools}"


def _checkpointing(stage: Any) -> tuple[str, int]:
    """A pool's config as one of `CHECKPOINTING`'s options (`every` only means something to every_n)."""
    mode = stage.activation_checkpointing
    return mode, stage.activation_checkpointing_every if mode == "every_n" else 1


def recomputed_flops(mc: Any, largest: Any, checkpointing: dict[str, tuple[str, int]]) -> float:
    """Forward FLOPs of the micro-batch `largest` (a `MicroBatchMeta`) that each pool's checkpointing (pool ->
    (mode, every)) recomputes: its blocks' share of the pool's linear FLOPs (`models/planning/flops.py`)."""
    from dhp.models.activation_checkpointing import ActivationCheckpointing
    from dhp.models.planning.flops import text_linear_flops_per_token, vision_linear_flops_per_patch

    forward = {
        "vision": vision_linear_flops_per_patch(mc.vision_config) * largest.patches,
        "text": text_linear_flops_per_token(mc.text_config) * largest.padded_tokens,
    }
    layers = {"vision": mc.vision_config.depth, "text": mc.text_config.num_hidden_layers}
    return sum(
        forward[stage] * len(ActivationCheckpointing(*option).chosen(layers[stage])) / layers[stage]
        for stage, option in checkpointing.items()
    )


def choose_fit(
    base: str, settings: list[str], mc: Any, largest: Any, device_gib: float | None, asked: str | None = None
) -> Fit:
    """The precision and checkpointing a run takes on a `device_gib` device, its largest micro-batch `largest` (a
    `MicroBatchMeta`), decided by `dhp plan` alone. The precision: `asked`, else the preset's (fp32 master weights:
    16 bytes a parameter, 60 GB for the 3B's 3.75 B) where any checkpointing fits it, else pure bf16. The
    checkpointing: of the pairs (vision, text) from `CHECKPOINTING` that fit, the one recomputing the fewest
    forward FLOPs of that micro-batch (`models/planning/flops.py`'s per-patch and per-token counts), so the device
    spends its time on the step, not on recomputation. Raises when nothing fits (a bench that would run out of
    memory after spending its time). No device (CPU): the preset's precision and checkpointing."""
    from dhp.models.planning.memory_plan import GIB, plan
    from dhp.stages.config import load_config

    preset = load_config(base, settings)
    if device_gib is None:
        pools = {s: _checkpointing(getattr(preset, s)) for s in STAGES}
        return Fit(asked or preset.model.precision, pools)
    pairs = sorted(
        (dict(zip(STAGES, pair)) for pair in itertools.product(CHECKPOINTING, repeat=len(STAGES))),
        key=lambda checkpointing: recomputed_flops(mc, largest, checkpointing),
    )
    tried = []
    for precision in [asked] if asked else dict.fromkeys([preset.model.precision, "bf16"]):
        for checkpointing in pairs:
            fit = Fit(precision, checkpointing)
            result = plan(load_config(base, [*settings, *fit.settings]), mc, device_gib, vision_patches=largest.patches)
            if result["fits"]:
                return fit
        tried.append(f"{precision}: {result['per_device'] / GIB:.1f} GiB with full checkpointing")
    raise ValueError(
        f"the plan fits no precision on this {device_gib:.0f} GiB device at {largest.patches} patches "
        f"({'; '.join(tried)}): ask for smaller --sides or fewer --photos"
    )


def workloads(
    quick: bool,
    preset: Any,
    mc: Any,
    sides: list[int] | None,
    microbatches: int,
    photos: int | None,
    shard: Path | None,
    root: Path,
) -> list[Workload]:
    """The square images of `sides` (smallest first), else the photos (`--quick`: a few, in small micro-batches)."""
    if sides:
        return [side_workload(mc, side, microbatches, root) for side in sorted(sides)]
    count = photos or (QUICK_PHOTOS if quick else None)
    return [photos_workload(preset, mc, shard or SHARD, count, QUICK_BUDGET if quick else None)]


def measure(
    w: Workload,
    base: str,
    settings: list[str],
    mc: Any,
    steps: int,
    profile_steps: int,
    boundaries: tuple[str, ...],
    trainers: Callable[[Any], Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every system on `w`: (system -> its result, the dhp boundaries that failed, the systems that failed). dhp
    once per `pipeline.boundary`: the first one's failure raises (without it the workload has no dhp row), a later
    one's is kept apart (a transport in alpha in Ray); then the loops, a failure of one (an out-of-memory is a
    finding) recorded and the others' results kept. The first boundary's dhp run and each loop are profiled."""
    from dhp.stages.config import load_config

    results, failed_boundaries, failed = {}, [], []
    for boundary in boundaries:
        try:
            cfg = load_config(base, [*settings, f"pipeline.boundary={boundary}"])
            profile = profile_steps if not results else 0
            results[_system(boundary)] = run_dhp(cfg, mc, w, steps, profile, trainers)
        except Exception as e:
            if not results:
                raise
            failed_boundaries.append({**failure(w, _system(boundary), e), "boundary": boundary})
    cfg = load_config(base, settings)
    for system, loop in ((STOCK, run_stock), (SAME_KERNELS, run_same_kernels)):
        try:
            results[system] = loop(cfg, mc, w, steps, profile_steps)
        except Exception as e:
            failed.append(failure(w, system, e))
    return results, failed_boundaries, failed


def failure(w: Workload, system: str, e: BaseException) -> dict[str, Any]:
    """What the JSON keeps of a system's exception on `w` (printed too, as it happens)."""
    error = f"{type(e).__name__}: {e}"[:2000]
    print(f"{w.name}, {system}: {error}", flush=True)
    return {"workload": w.name, "side": w.side, "system": system, "error": error}


def rows_of(w: Workload, results: dict[str, dict[str, Any]], mc: Any, planned: dict[str, int]) -> list[dict]:
    """One row per system that ran, with the throughput ratios between them."""
    from dhp.stages.run_log import throughput

    peak_flops = next(iter(results.values()))["peak_flops"]  # dhp's: the device's (the first result is dhp's)
    rows = []
    for system, r in results.items():
        counted = r["trained"]
        rates = throughput(w.as_batches(), mc, r["step_s"], peak_flops)
        rows.append(
            {
                "workload": w.name,
                "side": w.side,
                "patches": rates["vision_tokens"],  # a step's
                "system": system,
                "step_s": r["step_s"],
                "steps_s": r["steps_s"],
                "losses": r["losses"],
                "trained": counted,
                "peak_bytes": r["peak_bytes"],
                "peak_reserved_bytes": r["peak_reserved_bytes"],
                "calls_s": r.get("calls_s", {}),
                **{k: r[k] for k in ("bubble", "boundary_s_per_microbatch", "compiled", "profile") if k in r},
                "planned_bytes": planned if system.startswith("dhp") else {},
                "vision_tokens_per_s": rates["vision_tokens"] / r["step_s"],
                "text_tokens_per_s": rates["text_tokens"] / r["step_s"],
                **rates,
                # of the decoder token slots this system computed (the stock loop pads each micro-batch)
                "padding_share": 1 - counted["tokens"] / counted["padded_tokens"],
            }
        )
    for row in rows:
        r = results[row["system"]]
        if row["system"] != STOCK and STOCK in results:
            row["over_stock"] = results[STOCK]["step_s"] / r["step_s"]  # its tokens/s over the stock loop's
        if row["system"].startswith("dhp") and SAME_KERNELS in results:  # dhp over itself without the framework
            row["over_same_kernels"] = results[SAME_KERNELS]["step_s"] / r["step_s"]
        if "boundary_s_per_microbatch" in r:  # of dhp's step: both pools' rank 0 moving embeddings and gradients
            moved = r["boundary_s_per_microbatch"]["boundary_s"]
            row["boundary_share"] = r["trained"]["microbatches"] * moved / r["step_s"]
    return rows


def run(
    quick: bool,
    model: str | None = None,
    sides: list[int] | None = None,
    steps: int | None = None,
    microbatches: int = 2,
    precision: str | None = None,
    on_workload: Callable[[dict[str, Any]], None] | None = None,
    profile_steps: int = 0,
    boundaries: tuple[str, ...] = ("host",),
    photos: int | None = None,
    shard: Path | None = None,
    trainers: Callable[[Any], Any] | None = None,
    compile_backend: str = "none",
) -> dict[str, Any]:
    """Every system on each workload (the photos; or each side, smallest first); dhp once per `pipeline.boundary`
    in `boundaries` (a row each: "dhp" for host, "dhp cuda_ipc", ...). `on_workload` is handed the result so far
    after each workload (`complete` false until the last), so a run cut off by a time limit keeps the workloads it
    finished; a workload where a system failed is the last one run."""
    import ray
    import torch

    from dhp.models.packed_attention import varlen_kernel
    from dhp.models.planning.memory_plan import plan
    from dhp.stages.config import load_config

    cuda = torch.cuda.is_available()
    steps = steps or (2 if quick else STEPS["sides" if sides else "photos"])
    base, common, preset, mc = _preset(model, cuda)
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    head = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "timings": "GPU" if cuda else "CPU timings (not GPU figures)",
        "torch": torch.__version__,
        # the packed decoder's attention (models/packed_attention.py), as this process's actors choose it too
        "text_attention": varlen_kernel().name,
        "model": model or "tiny",
        "precision": precision,
        "device_gib": device_gib,
        "workload": "sides" if sides else "photos",
        "steps": steps,
        "compile": compile_backend,  # dhp's and the same-kernel loop's blocks (models/compilation.py)
    }
    compile_settings = [f"{stage}.compile={compile_backend}" for stage in STAGES]
    had_ray, rows, failed = ray.is_initialized(), [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            todo = workloads(quick, preset, mc, sides, microbatches, photos, shard, Path(tmp))
            largest = max(todo, key=Workload.largest_patches)
            fit = choose_fit(base, [*common, *largest.settings], mc, largest.largest(), device_gib, precision)
            head["precision"] = fit.precision
            head["activation_checkpointing"] = {s: list(c) for s, c in fit.checkpointing.items()}
            print(f"fit: {fit.describe()}", flush=True)
            for w in todo:
                settings = [*common, *w.settings, *fit.settings, *compile_settings]
                head.setdefault("workloads", []).append(_described(w))
                ranks = plan(load_config(base, settings), mc, vision_patches=w.largest_patches())["ranks"]
                planned = {s: p.total for s, p in ranks.items()} if cuda else {}
                try:
                    results, boundaries_failed, failures = measure(
                        w, base, settings, mc, steps, profile_steps, boundaries, trainers
                    )
                except Exception as e:  # an OOM at the largest image is a finding: keep it and the workloads before
                    results, boundaries_failed, failures = {}, [], [failure(w, _system(boundaries[0]), e)]
                rows += rows_of(w, results, mc, planned) if results else []
                failed += failures
                if boundaries_failed:
                    head.setdefault("failed_boundaries", []).extend(boundaries_failed)
                if on_workload:
                    done = not failed and w is todo[-1]
                    on_workload({**head, "complete": done, "rows": rows, **({"failed": failed} if failed else {})})
                if failed:
                    break
    finally:
        if not had_ray and ray.is_initialized():  # the one `ensure_ray` started
            ray.shutdown()
    return {**head, "complete": not failed, "rows": rows, **({"failed": failed} if failed else {})}


def _preset(model: str | None, cuda: bool) -> tuple[str, list[str], Any, Any]:
    """(preset, the bench's settings, the config they make, its model config): a released shape runs under the GPU
    preset (its precision, checkpointing, pixels and packing budget), the tiny one under its own."""
    from dhp.stages.config import load_config
    from dhp.stages.trainer import model_config_of

    base = "qwen2_5_vl_7b" if model else "tiny"
    common = _settings(model, cuda)
    preset = load_config(base, common)
    return base, common, preset, model_config_of(preset)


def describe(
    quick: bool,
    model: str | None = None,
    sides: list[int] | None = None,
    microbatches: int = 2,
    photos: int | None = None,
    shard: Path | None = None,
) -> list[dict[str, Any]]:
    """The workloads `run` would train with these arguments (as its JSON's head lists them), built without
    training anything: on any machine, for any shape."""
    _, _, preset, mc = _preset(model, cuda=False)
    with tempfile.TemporaryDirectory() as tmp:
        return [_described(w) for w in workloads(quick, preset, mc, sides, microbatches, photos, shard, Path(tmp))]


def _described(w: Workload) -> dict[str, Any]:
    """A workload's shape in the JSON's head: its samples, micro-batches, and each micro-batch's sizes."""
    metas = w.metas
    return {
        "name": w.name,
        "side": w.side,
        **{k: v for k, v in trained(metas).items() if k != "microbatches"},  # a step's totals
        "microbatches": [
            {"samples": m.samples, "images": m.images, "patches": m.patches, "tokens": m.tokens} for m in metas
        ],
        "settings": w.settings,
    }


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f}" if key in row else ""


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} on {result['device']} ({result['timings']}), {result['precision']}, "
        f"packed text attention {result.get('text_attention', '?')}, blocks compiled: {result.get('compile', 'none')}, "
        f"median of {result['steps']} steps",
        "",
        "| workload | patches | system | step s | vision tok/s | text tok/s | TFLOP/s | MFU | padding "
        "| peak GiB[/reserved] (planned) | bubble | boundary ms/mb (share) | ÷ stock | ÷ same kernels |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        reserved = r.get("peak_reserved_bytes", {})
        peak = ", ".join(
            f"{k} {v / 2**30:.2f}"
            + (f"/{reserved[k] / 2**30:.2f}" if reserved.get(k) else "")
            + (f" ({r['planned_bytes'][k] / 2**30:.2f})" if k in r["planned_bytes"] else "")
            for k, v in r["peak_bytes"].items()
        )
        bubble = f"{r['bubble']:.3f}" if "bubble" in r else ""
        boundary = (
            f"{r['boundary_s_per_microbatch']['boundary_s'] * 1e3:.1f} ({r['boundary_share']:.1%})"
            if "boundary_share" in r
            else ""
        )
        lines.append(
            f"| {r['workload']} | {r['patches']} | {r['system']} | {r['step_s']:.3f} | "
            f"{r['vision_tokens_per_s']:.0f} | {r['text_tokens_per_s']:.0f} | {r['model_tflops_per_s']:.3g} | "
            f"{r['mfu']:.3g} | {r['padding_share']:.1%} | {peak} | {bubble} | {boundary} | "
            f"{_ratio(r, 'over_stock')} | {_ratio(r, 'over_same_kernels')} |"
        )
    for r in result["rows"]:
        for process, prof in r.get("profile", {}).items():
            top = ", ".join(f"{o['op'][:60]} {o['device_s'] * 1e3:.0f} ms" for o in prof["top_device"][:3])
            who = r["system"] if process == "process" else f"{r['system']} {process}"
            lines.append(
                f"\nprofiled {r['workload']}, {who}: device busy "
                f"{prof['device_busy_share']:.0%} of {prof['wall_s']:.2f} s "
                f"({prof['device_gaps']['count']} gaps, {prof['device_gaps']['total_s'] * 1e3:.0f} ms); "
                f"most device time: {top or 'none (no device)'}"
            )
    for r in result["rows"]:
        if result.get("compile", "none") != "none" and "compiled" in r:
            done = ", ".join(
                f"{stage} {c.get('graphs', '?')} graphs, {c.get('graph_breaks', '?')} breaks"
                for stage, c in r["compiled"].items()
            )
            lines.append(f"\ncompiled in {r['workload']}, {r['system']}: {done}")
    for f in result.get("failed_boundaries", []):
        lines.append(f"\npipeline.boundary={f['boundary']} failed on {f['workload']}: {f['error'][:300]}")
    for f in result.get("failed", []):
        lines.append(f"\n{f['system']} failed on {f['workload']}: {f['error'][:300]}")
    return "\n".join(lines)


def main(args: argparse.Namespace, trainers: Callable[[Any], Any] | None = None) -> int:
    """`trainers`: how dhp gets its trainer (`run_dhp`; the tests keep theirs between tests)."""
    sides = [int(s) for s in args.sides.split(",")] if args.sides else None
    shard = Path(args.shard) if args.shard else None
    if args.describe:
        print(json.dumps(describe(args.quick, args.model, sides, args.microbatches, args.photos, shard), indent=1))
        return 0

    def finished_workload(partial: dict[str, Any]) -> None:  # what a time-limited GPU run keeps if cut off
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
        finished_workload,
        args.profile,
        args.boundaries,
        args.photos,
        shard,
        trainers,
        args.compile,
    )
    if args.json:
        write_json(args.json, result)
    if not result["complete"]:
        print(table(result))
    return 0 if result["complete"] else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "one-gpu",
        help="dhp (vision + text actor sharing one device) vs a one-process transformers loop and a one-process "
        "loop of dhp's kernels, on real photos packed: tokens/s, MFU, peak memory",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write the rows here (after each workload, so a cut-off run keeps the workloads it finished)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_PHOTOS} photos in micro-batches of {QUICK_BUDGET} tokens, 2 steps (what CI runs)",
    )
    p.add_argument("--model", default=None, help="a released shape, e.g. qwen2_5_vl_3b (default: tiny)")
    p.add_argument("--shard", default=None, help="the photos' WebDataset shard (default tests/assets' 32 photos)")
    p.add_argument("--photos", type=int, default=None, help="train the first N photos of the shard (default all)")
    p.add_argument(
        "--sides",
        default=None,
        help="instead of the photos, square noise images of these sides in px, comma-separated (e.g. "
        f"{','.join(map(str, SIDES))}), --microbatches of them a step",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"measured steps after one warm-up (default {STEPS['photos']} for the photos, {STEPS['sides']} a side)",
    )
    p.add_argument("--microbatches", type=int, default=2, help="with --sides: one-image micro-batches a step")
    p.add_argument(
        "--describe",
        action="store_true",
        help="print the workloads (samples, micro-batches, patches, tokens) as JSON and exit without training",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the measured steps, run this many more (after one warm-up) of each one-process loop "
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
        "--compile",
        default="none",
        choices=["none", "inductor", "aot_eager"],
        help="vision.compile and text.compile for dhp and the loop of dhp's kernels (default none)",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16"],
        help="model.precision for every system (default: the preset's if `dhp plan` fits it on the "
        "device at the largest micro-batch, else bf16)",
    )
