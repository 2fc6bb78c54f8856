"""`dhp bench time-model`: the step-time model (`dhp plan --time`) against step times measured here.

    dhp bench time-model --json runs/bench/time_model.json [--profile PROFILE.json] [--quick]

On a tiny-but-deep Qwen2.5-VL (16 ViT blocks with full attention every 4th, 12 decoder layers, the tiny
widths, the real vocabulary) and one uniform sample repeated (one 896 x 448 image: 2 048 patches, 512 merged
tokens, and a short conversation), each configuration of `CONFIGS` trains a few global batches of `M`
one-sample micro-batches; the median step after a warm-up step is compared with the plan's prediction for the
same configuration and workload from a `dhp bench ops` profile of this machine (`--profile`; without it the
profile is measured first, `--quick` sizes). Rows: measured and predicted seconds, their ratio, the
predicted parts, each stage call's measured and predicted seconds, and the cores the rest of the machine used
while the steps ran (`others_cores`, scripts/bench/cpu_load.py: the plan gives each busy actor a core, and on
2 cores one other busy process slows a pool whose ranks wait for each other in collectives). `TOLERANCE` is
how close the plan comes on this project's 2-core machine (docs/time_model.md has the numbers);
tests/test_bench_time_model.py runs the bench tiny and holds every row within a factor of 2 only, since how
fast two busy ranks run on two cores differs between machines.

`MIXED` rows train a global batch of unequal samples instead (images of `MIX` pixels, one per micro-batch, each
with the same conversation) and are predicted by `time_model.step_time_of` from each micro-batch's own sizes, as
`dhp plan --time --data-profile` predicts a length mix: the check that a mix is costed as it runs.

The configurations keep at most as many actors busy at once as the machine has cores (two here): serial
orders run one pool at a time, and the pipelined ones have one actor per pool. With more busy actors than
cores, gloo collectives wait for descheduled peers, and the plan, which gives a CPU actor a core, says
nothing useful: `OVERSUBSCRIBED` is measured and reported beside them (`checked: false`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dhp.scripts.bench.cpu_load import CpuWindow, wait_quiet
from dhp.scripts.results import report

IMAGE = (896, 448)  # pixels: 64 x 32 patches of 14
BASE = [
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "text.parallelism=none",
    "text.num_actors=1",
    "text.degree=1",
    "vision.num_cpus_per_actor=0.5",
    "text.num_cpus_per_actor=0.5",
]
SERIAL, PIPELINED = ["pipeline.max_in_flight=1"], ["pipeline.max_in_flight=3"]
SP2 = ["vision.parallelism=sequence", "vision.num_actors=2", "vision.degree=2"]
VTP2 = ["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"]
TP2 = ["text.parallelism=tensor", "text.num_actors=2", "text.degree=2"]
ZERO3 = ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"]
CONFIGS: dict[str, list[str]] = {
    "none / none, serial": SERIAL,
    "none / none, pipelined": PIPELINED,
    "sequence 2 / none, serial": SP2 + SERIAL,
    "none / tensor 2, serial": TP2 + SERIAL,
    "tensor 2 / tensor 2, serial": VTP2 + TP2 + SERIAL,
    "zero3 2 / zero3 2, serial": ZERO3 + SERIAL,
}
OVERSUBSCRIBED: dict[str, list[str]] = {"sequence 2 / tensor 2, pipelined": SP2 + TP2 + PIPELINED}
MIX = ((448, 224), (1344, 448), (896, 448))  # pixels: 512, 3 072 and 2 048 patches, in micro-batch order
MIXED: dict[str, list[str]] = {
    "none / none, serial, mixed sizes": SERIAL,
    "sequence 2 / none, serial, mixed sizes": SP2 + SERIAL,
}
TOLERANCE = 0.20


def deep_sample(
    root: Path, image: tuple[int, int] = IMAGE, text_layers: int = 12, vision_depth: int = 16, save: bool = True
) -> tuple[Any, Path | None, dict]:
    """(model config, a seeded checkpoint of it (None unless `save`), one preprocessed one-image sample of
    `image` (width, height) pixels) under `root`."""
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.scripts.bench.checkpointing import deep_config

    config = deep_config(text_layers=text_layers, vision_depth=vision_depth)
    torch.manual_seed(0)
    ckpt = root / "ckpt" if save else None
    if ckpt is not None:
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(ckpt)
    rng = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (image[1], image[0], 3), generator=rng, dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(root / "a.png")
    record = {
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe it."},
            {"from": "gpt", "value": "Noise in many colours."},
        ],
    }
    settings = PreprocessSettings(str(root), min_pixels=56 * 56, max_pixels=image[0] * image[1], max_seq_len=4096)
    sample = decode_sample(Preprocessor(settings, config)({"source": "t", "record": json.dumps(record)})["sample"])
    return config, ckpt, sample


def global_batches(
    sample: dict | list[dict], cfg: Any, model_config: Any, per_replica: int, replicas: int
) -> list[Any]:
    """Each text replica's part of one global batch: `per_replica` one-sample micro-batches of `sample` (a list:
    one micro-batch per sample, in order, the same list for every replica), split for the vision pool's
    sequence-parallel ranks as the loader splits them."""
    import ray

    from dhp.dataflow.loader import GlobalBatch, MicroBatch, split_for_ranks
    from dhp.dataflow.packing import meta_of, text_inputs, vision_inputs
    from dhp.models.parallel.layouts import stage_layout

    sp = stage_layout(cfg, "vision", model_config).loader_shards  # what the trainer gives its loaders

    def microbatch(one: dict) -> Any:
        vision, text = vision_inputs([one]), text_inputs([one], pad_id=151643)
        parts = [ray.put(p) for p in split_for_ranks(vision, text, sp, model_config)]
        return MicroBatch(parts, ray.put(text), meta_of(vision, text))

    mbs = [microbatch(one) for one in sample] if isinstance(sample, list) else [microbatch(sample)] * per_replica
    return [GlobalBatch(mbs, epoch=0) for _ in range(replicas)]


def mixed_samples(root: Path, model_config: Any) -> list[dict]:
    """One preprocessed sample per image size of `MIX` (the deep model's, the same conversation)."""
    samples = []
    for k, image in enumerate(MIX):
        (root / f"mix{k}").mkdir(exist_ok=True)
        samples.append(deep_sample(root / f"mix{k}", image, save=False)[2])
    return samples


def measure_step(
    overrides: list[str],
    ckpt: Path,
    model_config: Any,
    sample: dict | list[dict],
    microbatches: int,
    steps: int,
    trainers: Any,
) -> dict[str, Any]:
    """Median seconds of `steps` optimizer steps after one warm-up, and the config they ran, on a trainer from
    `trainers` (`take` / `give_back`: stages/trainer.py `LastTrainer`, or a cache that keeps trainers longer),
    once the machine is quiet (`quiet_before`: how long that took, at most 30 s); `others_cores`: the cores the
    rest of the machine used meanwhile (processes other than the driver and the trainer's actors, and a
    hypervisor's steal; None where it cannot tell)."""
    from dhp.stages.config import load_config

    length = max(len(one["input_ids"]) for one in (sample if isinstance(sample, list) else [sample]))
    cfg = load_config(
        "tiny",
        BASE
        + overrides
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={length}",
            f"data.max_seq_len={length}",
            f"training.global_batch_size={microbatches}",
            "training.warmup_steps=0",
            "pipeline.trace=true",
        ],
    )
    trainer = trainers.take(cfg, model_config=model_config)
    pids = [os.getpid(), *(w["pid"] for ranks in trainer.where.values() for w in ranks)]
    # the processes of a trainer shut down for this one, or of the build, still exit and free memory for a while
    quiet = wait_quiet(max_s=30.0)
    try:
        with CpuWindow(pids) as cpu:
            times, calls = timed_steps(
                trainer, global_batches(sample, cfg, model_config, microbatches // trainer.dp, trainer.dp), steps
            )
    except BaseException:
        trainers.give_back(trainer, ok=False)
        raise
    trainers.give_back(trainer, ok=True)
    return {
        "cfg": cfg,
        "measured_s": statistics.median(times[1:]),
        "steps_s": times,
        "calls_s": calls,
        "others_cores": cpu.others_cores,
        "quiet_before": quiet,
    }


def timed_steps(
    trainer: Any, batches: list[Any], steps: int, metrics: list[dict] | None = None
) -> tuple[list[float], dict[str, float]]:
    """Seconds of 1 + `steps` training steps on `batches` (the first a warm-up), and the median seconds of each
    stage call (`stage.name`) over the measured ones: the model's per-call costs (`pipeline.trace=true`; else {}).
    `metrics`, if given, receives each step's `train_step` metrics."""
    times = []
    for _ in range(1 + steps):
        start = time.perf_counter()
        step_metrics = trainer.train_step(batches)
        times.append(time.perf_counter() - start)
        if metrics is not None:
            metrics.append(step_metrics)
    calls: dict[str, list[float]] = {}
    for e in trainer.events:
        if e["step"] > 1:
            calls.setdefault(f"{e['stage']}.{e['name']}", []).append(e["end"] - e["start"])
    return times, {k: statistics.median(v) for k, v in sorted(calls.items())}


def run(
    profile_path: str | None,
    quick: bool,
    steps: int | None = None,
    configs: dict[str, list[str]] | None = None,
    trainers: Any = None,
) -> dict[str, Any]:
    """Every configuration of `configs` (default: the bench's) measured and predicted. `trainers`: where each
    configuration's trainer comes from (default a `LastTrainer`, shut down at the end; a caller's own source keeps
    the last one)."""
    import ray

    from dhp.dataflow.length_profile import sizes_of
    from dhp.models.planning.hardware import profile as load_profile
    from dhp.models.planning.length_mix import longest, shape
    from dhp.models.planning.time_model import Workload, step_time_of
    from dhp.scripts.plan_time import predict, prepare
    from dhp.stages.trainer import LastTrainer

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if profile_path is None:
                from dhp.scripts.bench.ops import measure

                profile_path = str(Path(tmp) / "profile.json")
                Path(profile_path).write_text(json.dumps(measure(quick=True)))
            prof = load_profile(profile_path)
            model_config, ckpt, sample = deep_sample(Path(tmp))
            patches = int(sample["image_grid_thw"].prod())
            w = Workload(patches, len(sample["input_ids"]) - patches // 4)
            microbatches = 2 if quick else 4
            rows, source = [], trainers or LastTrainer()
            chosen = configs or {**CONFIGS, **({} if quick else OVERSUBSCRIBED), **MIXED}
            mix = mixed_samples(Path(tmp), model_config) if set(chosen) & set(MIXED) else []
            # each mixed sample as `dhp data profile` sizes it: its patches, text tokens and length
            sizes = [sizes_of(one, model_config.vision_config.spatial_merge_size**2) for one in mix]
            try:
                for name, overrides in chosen.items():
                    mixed = name in MIXED
                    m = measure_step(
                        overrides,
                        ckpt,
                        model_config,
                        mix if mixed else sample,
                        len(mix) if mixed else microbatches,
                        steps or (2 if quick else 3),
                        source,
                    )
                    if mixed:
                        cfg = prepare(m["cfg"], prof, None, w, longest(sizes))
                        p = step_time_of(cfg, model_config, prof, [[shape([one], False) for one in sizes]])
                    else:
                        p = predict(prepare(m["cfg"], prof, None, w), model_config, prof, w)
                    rows.append(
                        {
                            "config": name,
                            "overrides": overrides,
                            "checked": name not in OVERSUBSCRIBED,
                            "mixed_patches": [n for one in sizes for n in one["patches"]] if mixed else None,
                            "measured_s": m["measured_s"],
                            "steps_s": m["steps_s"],
                            "predicted_s": p["step_s"],
                            "ratio": p["step_s"] / m["measured_s"],
                            "per_call_s": p["per_call_s"],
                            "measured_calls_s": m["calls_s"],
                            "parts_s": p["parts_s"],
                            "bubble_s": p["bubble_s"],
                            "others_cores": m["others_cores"],
                            "quiet_before": m["quiet_before"],
                        }
                    )
                    others = "-" if m["others_cores"] is None else f"{m['others_cores']:.2f}"
                    waited = m["quiet_before"]["waited_s"]
                    print(
                        f"{name}: measured {m['measured_s']:.3f} s, predicted {p['step_s']:.3f} s (other processes: "
                        f"{others} cores, after {waited} s waiting for a quiet machine); calls measured "
                        f"{_ms(m['calls_s'])}, predicted {_ms(p['per_call_s'])}",
                        flush=True,
                    )
            finally:
                if trainers is None:
                    source.close()
            return {
                "profile": prof.to_dict(),
                "image_patches": patches,
                "text_tokens": w.text_tokens,
                "microbatches": microbatches,
                "tolerance": TOLERANCE,
                "rows": rows,
            }
    finally:
        if started:
            ray.shutdown()


def _ms(calls: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in calls.items())


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['microbatches']} micro-batches of one {result['image_patches']}-patch image + "
        f"{result['text_tokens']} text tokens; profile {result['profile']['name']}",
        "",
        "| configuration | measured s | predicted s | predicted / measured | busy actors <= cores | others, cores |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        others = r.get("others_cores")
        lines.append(
            f"| {r['config']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['ratio']:.2f} | "
            f"{'yes' if r['checked'] else 'no'} | {'-' if others is None else f'{others:.2f}'} |"
        )
    mixed = next((r["mixed_patches"] for r in result["rows"] if r.get("mixed_patches")), None)
    if mixed:
        lines += ["", f"mixed sizes: a global batch of {len(mixed)} one-image micro-batches of {mixed} patches"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.profile, args.quick)
    return report(args.json, result, table)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("time-model", help="the step-time model's prediction against measured step times here")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--profile", default=None, help="a `dhp bench ops` JSON (default: measure one, quick sizes)")
    p.add_argument("--quick", action="store_true", help="2 micro-batches, 2 steps, no oversubscribed row")
