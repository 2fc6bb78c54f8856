"""`dhp bench peers`: dhp next to what users run instead, on the same model, data and per-rank memory cap.

    dhp bench peers --json runs/bench/peers.json [--quick] [--ranks N] [--cap-gib G]

Systems, each with N ranks (N = 4; `--quick`: 2):
  deepspeed zero3                    transformers' Qwen2_5_VLForConditionalGeneration under DeepSpeed's own ZeRO-3
                                     engine as qwen-vl-finetune runs it (scripts/peers/deepspeed_zero3.py): N
                                     processes, each a data-parallel replica holding both stages, micro-batch 1.
  dhp zero3 / zero3                  dhp's FSDP2 layout on both pools (N vision + N text actors).
  dhp tensor / tensor                uniform tensor parallelism, degree N on both pools: the uniform baseline.
  dhp sequence / tensor, serial      Ulysses SP N on the vision pool, TP N on the text pool: dhp's default layout,
  dhp sequence / tensor, pipelined   micro-batches in order, then with the vision forward of n+1 overlapping n.
"N ranks" is N processes per pool: dhp gives each module its own pool (its own GPUs on a cluster), so a dhp
rank holds one stage, a DeepSpeed rank both.

Model (`bench_config`): a ViT with the released block structure at a quarter of its width (16 blocks, full
attention in 7 and 15 = the released 1 in 8, 16 heads, D 256, I 684) before the tiny text stage (4 layers, the
real vocabulary); one seeded checkpoint every system loads. fp32, activation checkpointing on everywhere
(qwen-vl-finetune's `--gradient_checkpointing`; dhp's `activation_checkpointing=full`). One global batch = N
one-image samples of the same image.

Per system: the median step time at the fixed image (`--side` px) and its vision tokens/s (ViT patches per
second: N images a step), peak activation bytes (what autograd keeps for backward, `SavedBytes`) and peak RSS
per rank (of that system alone: the kernel's peak is reset when a system takes over the last one's actors), and the
largest image it trains under the per-rank cap. The cap is enforced by measurement: a rank's
bytes are its model state (parameters + gradients + Adam moments, as that rank holds them) plus the bytes its
autograd kept in that step (measured per rank with saved-tensor hooks); a probe whose worst rank exceeds the cap
does not fit. Process RSS is reported but not capped: on CPU it is mostly libraries (~0.9 GB a process), not
what a GPU would hold. The search climbs sides ~sqrt(2) apart and bisects the last gap twice
(scripts/peers/probe.py); the pipelined order is timed only (it keeps up to `pipeline.max_in_flight`
micro-batches' activations alive, which the serial search does not measure).

Timings here are CPU timings on a 2-core machine with 2N + 1 processes, labelled so in the JSON. Where GPUs are
visible, every system runs on them, one rank per GPU (`gpu_settings`: N may not exceed the GPUs; on one GPU,
`--ranks 1`), and the JSON says GPU timings.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dhp.scripts.results import write_json

N_RANKS = 4
BASE = [
    "vision.num_cpus_per_actor=0.25",
    "text.num_cpus_per_actor=0.25",
    "training.warmup_steps=0",
    "vision.activation_checkpointing=full",
    "text.activation_checkpointing=full",
]
SERIAL, PIPELINED = ["pipeline.max_in_flight=1"], ["pipeline.max_in_flight=3"]
GOAL_LONGER = 4.0  # dhp sequence / tensor trains images >= this many times longer than DeepSpeed ZeRO-3


def systems(n: int) -> dict[str, list[str] | None]:
    sp = ["vision.parallelism=sequence", f"vision.num_actors={n}", f"vision.degree={n}"]
    vtp = ["vision.parallelism=tensor", f"vision.num_actors={n}", f"vision.degree={n}"]
    tp = ["text.parallelism=tensor", f"text.num_actors={n}", f"text.degree={n}"]
    zero3 = [
        "vision.parallelism=zero3",
        f"vision.num_actors={n}",
        "vision.degree=1",
        "text.parallelism=zero3",
        f"text.num_actors={n}",
        "text.degree=1",
    ]
    return {
        "deepspeed zero3": None,
        "dhp zero3 / zero3": zero3 + SERIAL,
        "dhp tensor / tensor": vtp + tp + SERIAL,
        "dhp sequence / tensor, serial": sp + tp + SERIAL,
        "dhp sequence / tensor, pipelined": sp + tp + PIPELINED,
    }


def gpu_settings(n: int, gpus: int) -> list[str]:
    """On a GPU machine, each system's N ranks on N GPUs: DeepSpeed's rank r on GPU r, dhp's vision actor r and text
    actor r sharing GPU r (`pipeline.placement=shared`, half each). NCCL refuses two ranks of one communicator on
    one GPU ("Duplicate GPU detected"), so N may not exceed the GPUs; on one GPU that is `--ranks 1`, where every
    layout is one rank per pool and the comparison is of the systems' overheads and memory, not of parallelism."""
    if not gpus:
        return []
    if n > gpus:
        raise ValueError(
            f"--ranks {n} needs {n} GPUs (NCCL puts one rank of a group on each GPU) and this machine "
            f"has {gpus}: pass --ranks {gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) for the CPU run"
        )
    return ["vision.num_gpus_per_actor=0.5", "text.num_gpus_per_actor=0.5", "pipeline.placement=shared"]


def bench_config():
    """The tiny text stage (4 layers, the real vocabulary) behind a ViT with the released block structure at a
    quarter of its width: 16 blocks, full attention in 7 and 15 (the released 1 in 8), 16 heads, D 256 and
    I 684 (the released I/D ratio), as `dhp bench layouts` measures it."""
    from dhp.scripts.bench.checkpointing import deep_config

    config = deep_config(text_layers=4, vision_depth=16)
    v = config.vision_config
    v.hidden_size, v.intermediate_size, v.num_heads, v.fullatt_block_indexes = 256, 684, 16, [7, 15]
    return config


def _rank_memory(worker: Any) -> dict[str, int]:
    """Runs inside a stage actor: its model state (parameters, gradients of the same size, Adam moments) and
    its process's peak RSS since `_reset_peak_rss` (the kernel's VmHWM)."""
    state = worker.state_bytes()
    status = Path("/proc/self/status").read_text()
    return {"state": 2 * state["params"] + state["optimizer"], "rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}


def _reset_peak_rss(worker: Any) -> None:
    """Runs inside a stage actor: the kernel's peak RSS (VmHWM) starts again from the current RSS, so that an
    actor that trained an earlier system (a reused trainer) reports the peak of this one only."""
    Path("/proc/self/clear_refs").write_text("5")


def run_dhp(
    overrides: list[str],
    n: int,
    ckpt: Path,
    config: Any,
    timing: dict,
    sides: list[int],
    cap: int,
    steps: int,
    work: Path,
    trainers: Any,
) -> dict[str, Any]:
    """One dhp system on a trainer from `trainers` (`take` / `give_back`: stages/trainer.py `LastTrainer`, or a
    cache that keeps trainers longer): the systems' pools have one shape, so each rebuilds the last one's actors."""
    import ray

    from dhp.scripts.bench.time_model import global_batches
    from dhp.scripts.peers.probe import image_sample, largest_fitting, patches
    from dhp.stages.config import load_config

    longest = patches(max(sides, default=0)) // 4 + 256 if sides else len(timing["input_ids"])
    cfg = load_config(
        "tiny",
        BASE
        + overrides
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={longest}",
            f"data.max_seq_len={longest}",
            f"training.global_batch_size={n}",
        ]
        + gpu_settings(n, _gpus()),
    )
    trainer = trainers.take(cfg, model_config=config)
    try:
        actors = [a for _, pool in trainer.pools() for a in pool.actors]
        ray.get([a.__ray_call__.remote(_reset_peak_rss) for a in actors])

        def measured_step(sample: dict) -> tuple[int, int]:
            """One step on `sample`: (worst rank's state + kept bytes, worst rank's kept bytes)."""
            ray.get([a.measure_activations.remote(True) for a in actors])
            trainer.train_step(global_batches(sample, cfg, config, n // trainer.dp, trainer.dp))
            kept = [
                max((r.get("step_bytes", r["bytes"]) for r in recs), default=0)  # text: logits and loss too
                for recs in ray.get([a.measure_activations.remote(False) for a in actors])
            ]
            state = [m["state"] for m in ray.get([a.__ray_call__.remote(_rank_memory) for a in actors])]
            return max(s + k for s, k in zip(state, kept)), max(kept)

        batches = global_batches(timing, cfg, config, n // trainer.dp, trainer.dp)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_step(batches)
            times.append(time.perf_counter() - start)
        _, kept = measured_step(timing)
        probes: list[dict[str, int]] = []

        def fits(side: int) -> bool:
            peak, _ = measured_step(image_sample(config, side, work / "images"))
            probes.append({"side": side, "patches": patches(side), "peak_bytes": peak})
            return peak <= cap

        # Only the serial order is searched: a pipelined one keeps up to max_in_flight graphs alive, which the
        # probe's single step does not measure.
        largest = largest_fitting(fits, sides) if sides and cfg.pipeline.max_in_flight == 1 else None
        memory = ray.get([a.__ray_call__.remote(_rank_memory) for a in actors])
    except BaseException:
        trainers.give_back(trainer, ok=False)
        raise
    trainers.give_back(trainer, ok=True)
    return {
        "step_s": statistics.median(times[1:] or times),
        "steps_s": times,
        "peak_activation_bytes": kept,
        "peak_rss_bytes": max(m["rss"] for m in memory),
        "state_bytes": max(m["state"] for m in memory),
        "probes": probes,
        "largest_side": largest,
    }


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_deepspeed(
    n: int, ckpt: Path, timing: dict, sides: list[int], cap: int, steps: int, work: Path
) -> dict[str, Any]:
    import torch

    from dhp.scripts.peers.deepspeed_zero3 import launch

    torch.save([timing], work / "timing.pt")
    out = launch(
        n,
        [
            "--model",
            str(ckpt),
            "--samples",
            str(work / "timing.pt"),
            "--out",
            str(work / "ds.json"),
            "--steps",
            str(steps + 1),
            "--activation-checkpointing",
            "--cap-bytes",
            str(cap),
            "--probe-sides",
            ",".join(map(str, sides)),
            "--work",
            str(work / "ds-images"),
        ],
    )
    times = [s["seconds"] for s in out["steps"] if not s["measured"]]
    return {
        "step_s": statistics.median(times[1:] or times),
        "steps_s": times,
        "peak_activation_bytes": max(r["peak_saved_bytes"] for r in out["ranks"]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in out["ranks"]),
        "state_bytes": out["state_bytes_per_rank"],
        "probes": out["probes"],
        "largest_side": out["largest_side"],
        "initialize_s": out["initialize_s"],
        "jit_built": out["jit_built"],
        "deepspeed": out["deepspeed"],
        "config": out["config"],
    }


def run(
    quick: bool,
    n: int | None = None,
    cap_gib: float | None = None,
    on_system: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every system in turn. `on_system` is handed the result so far after each (`complete` false until the
    last; goals only once their systems have run), so a run cut off by a time limit keeps what it measured.
    The dhp systems' pools have one shape: each system rebuilds the last one's actors (`LastTrainer`)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.scripts.peers.probe import image_sample, ladder, patches
    from dhp.stages.config import load_config
    from dhp.stages.driver import init_ray
    from dhp.stages.trainer import LastTrainer

    n = n or (2 if quick else N_RANKS)
    gpu_settings(n, _gpus())  # refused before anything starts
    side = 112 if quick else 224
    # Quick: the ladder's two lowest rungs (64 and 144 patches), a climb of 208 probe patches a system, not 948
    sides = ladder(112, 168 if quick else 1568)
    cap = int((cap_gib or (0.35 if quick else 0.2)) * 2**30)
    steps = 2 if quick else 3
    config = bench_config()
    results: dict[str, Any] = {}
    source = LastTrainer()
    with tempfile.TemporaryDirectory(prefix="dhp-peers-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(work / "ckpt")
        timing = image_sample(config, side, work / "images")
        init_ray(load_config("tiny", [f"ray.num_cpus={max(8, 2 * n + 2)}"]))
        try:
            for name, overrides in systems(n).items():
                start = time.perf_counter()
                row = (
                    run_deepspeed(n, work / "ckpt", timing, sides, cap, steps, work)
                    if overrides is None
                    else run_dhp(overrides, n, work / "ckpt", config, timing, sides, cap, steps, work, source)
                )
                row.update(
                    name=name,
                    wall_s=time.perf_counter() - start,
                    vision_tokens_per_s=n * patches(side) / row["step_s"],
                    largest_patches=patches(row["largest_side"]) if row["largest_side"] else None,
                )
                results[name] = row
                print(f"  {name}: {row['step_s']:.2f} s/step, largest {row['largest_patches']} patches", flush=True)
                if on_system:
                    done = len(results) == len(systems(n))
                    on_system(summary(results, n, quick, side, sides, cap, config, complete=done))
        finally:
            source.close()
    return summary(results, n, quick, side, sides, cap, config, complete=True)


def summary(
    results: dict[str, dict], n: int, quick: bool, side: int, sides: list[int], cap: int, config: Any, complete: bool
) -> dict[str, Any]:
    """The JSON of the systems in `results`; the goals are None until the systems they compare have run."""
    import torch

    from dhp.scripts.peers.probe import patches

    serial, pipelined = "dhp sequence / tensor, serial", "dhp sequence / tensor, pipelined"
    longer = longer_met = None
    if {"deepspeed zero3", serial} <= results.keys():
        ds, mine = results["deepspeed zero3"]["largest_patches"], results[serial]["largest_patches"]
        longer = mine / ds if ds and mine else None
        longer_met = (longer or 0) >= GOAL_LONGER
    not_slower = None
    if all(k in results for k in ("dhp tensor / tensor", serial, pipelined)):
        not_slower = all(
            results[k]["step_s"] <= results["dhp tensor / tensor"]["step_s"] * 1.05 for k in (serial, pipelined)
        )
    return {
        "complete": complete,
        "device": (
            f"{_gpus()} x {torch.cuda.get_device_name()} (GPU timings; one rank per GPU)"
            if _gpus()
            else f"cpu ({platform.machine()}, CPU timings)"
        ),
        "ranks": n,
        "quick": quick,
        "image_side_px": side,
        "image_patches": patches(side),
        "sides_searched": sides,
        "cap_bytes": cap,
        "cap_rule": "per rank: model state (params + grads + Adam moments as that rank holds them) + bytes its "
        "autograd kept in the step (saved-tensor hooks); a probe fits when its worst rank is within",
        "model": {
            "vision_depth": config.vision_config.depth,
            "fullatt": config.vision_config.fullatt_block_indexes,
            "text_layers": config.text_config.num_hidden_layers,
            "precision": "fp32",
            "activation_checkpointing": "full",
        },
        "systems": list(results.values()),
        "goals": {
            "longer_than_deepspeed": longer,
            "longer_goal": GOAL_LONGER,
            "longer_met": longer_met,
            "sp_tp_not_slower_than_uniform_tp": not_slower,
        },
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['ranks']} ranks, {result['image_patches']}-patch image, cap "
        f"{result['cap_bytes'] / 2**30:.2f} GiB per rank, {result['device']}",
        f"{'system':34} {'step s':>7} {'vis tok/s':>9} {'act MiB':>8} {'RSS MiB':>8} {'largest':>8}",
    ]
    for r in result["systems"]:
        largest = r["largest_patches"] if r["largest_patches"] else "-"
        lines.append(
            f"{r['name']:34} {r['step_s']:7.2f} {r['vision_tokens_per_s']:9.0f} "
            f"{r['peak_activation_bytes'] / 2**20:8.1f} {r['peak_rss_bytes'] / 2**20:8.0f} {largest:>8}"
        )
    g = result["goals"]
    lines.append(
        f"sequence/tensor trains {g['longer_than_deepspeed'] or 0:.1f}x longer images than DeepSpeed "
        f"ZeRO-3 (goal {g['longer_goal']:g}x); not slower than uniform TP: "
        f"{g['sp_tp_not_slower_than_uniform_tp']}"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["systems"]
    names = [r["name"].replace("dhp ", "").replace(", ", "\n") for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.barh(names, [r["largest_patches"] or 0 for r in rows])
    for i, r in enumerate(rows):  # at the search's ceiling the bar is a lower bound
        if r["largest_side"] == result["sides_searched"][-1]:
            a.text(r["largest_patches"], i, " >= (search ceiling)", va="center")
    a.set_xlabel(f"largest image under {result['cap_bytes'] / 2**30:.2f} GiB/rank (patches)")
    b.barh(names, [r["vision_tokens_per_s"] for r in rows])
    b.set_xlabel(f"vision tokens/s at {result['image_patches']} patches ({result['device']})")
    fig.suptitle(f"{result['ranks']} ranks per system")
    fig.tight_layout()
    fig.savefig(path)


def main(args: argparse.Namespace) -> int:
    import ray

    def finished_system(partial: dict[str, Any]) -> None:  # what a time-limited GPU run keeps if cut off
        if args.json:
            write_json(args.json, partial)

    try:
        result = run(args.quick, args.ranks, args.cap_gib, finished_system)
    finally:
        ray.shutdown()
    if args.json:
        write_json(args.json, result)
        plot(result, Path(args.json).with_suffix(".png"))
    print(table(result))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("peers", help="dhp next to DeepSpeed ZeRO-3 and uniform TP: speed, largest image per cap")
    p.add_argument("--json", default=None, help="write the results here (and a plot beside it, .png)")
    p.add_argument("--quick", action="store_true", help="2 ranks, images to 168 px: a check that it works")
    p.add_argument("--ranks", type=int, default=None, help=f"ranks per system (default {N_RANKS}; quick: 2)")
    p.add_argument("--cap-gib", type=float, default=None, help="per-rank cap (default 0.2; quick: 0.35)")
