"""`dhp bench fine-tuning`: what each fine-tuning mode (models/fine_tuning.py) costs and saves per rank.

    dhp bench fine-tuning --json runs/bench/fine_tuning.json [--quick]

The shipped default layout (`tiny` preset: vision sequence-parallel 2, text tensor-parallel 2, pipelined) on
`dhp bench peers`' model shape (a ViT with the released block structure at a quarter of its width, the tiny
4-layer text stage with the real vocabulary) and one seeded side x side image per sample. For each mode:
the median step after a warm-up, and per rank the bytes of parameters, gradients (after the accumulation,
before the step frees them), AdamW states and the activations its training forward kept for backward
(saved-tensor hooks; text: embeddings, logits and loss included). Rows: `all` (full training), `vision.train
=none` (a frozen ViT), `vision.train=merger`, `text.train=none`, LoRA rank 16 on every decoder Linear, and a
frozen ViT with that LoRA. CPU timings, 4 actors on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from dhp.scripts.results import report

MODES = {
    "all": [],
    "frozen ViT": ["vision.train=none"],
    "merger only": ["vision.train=merger"],
    "frozen LLM": ["text.train=none"],
    "LoRA r16": ["text.train=lora", "text.lora.rank=16"],
    "frozen ViT + LoRA r16": ["vision.train=none", "text.train=lora", "text.lora.rank=16"],
}
FULL, QUICK = dict(side=448, steps=4, samples=4), dict(side=112, steps=2, samples=2)


def _rank_state(worker: Any) -> dict[str, Any]:
    """Runs inside a stage actor: its stage, rank and state bytes (params, grads present, optimizer)."""
    return {"stage": worker.stage, "rank": worker.rank, **worker.state_bytes()}


def measure(overrides: list[str], ckpt: Path, config: Any, sample: dict, size: dict, trainers: Any) -> dict[str, Any]:
    """The mode's row, on a trainer from `trainers` (stages/trainer.py `LastTrainer`: every mode has the same
    pools, so the last mode's trainer is rebuilt for this one and no process is started again)."""
    import ray

    from dhp.scripts.bench.time_model import global_batches, timed_steps
    from dhp.stages.config import load_config

    length = len(sample["input_ids"])
    cfg = load_config(
        "tiny",
        overrides
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={length}",
            f"data.max_seq_len={length}",
            f"training.global_batch_size={size['samples']}",
            "training.warmup_steps=0",
        ],
    )
    trainer = trainers.take(cfg, model_config=config)
    try:
        actors = [a for _, pool in trainer.pools() for a in pool.actors]
        batches = global_batches(sample, cfg, config, size["samples"] // trainer.dp, trainer.dp)
        times, _ = timed_steps(trainer, batches, size["steps"])
        ray.get([a.measure_activations.remote(True) for a in actors])
        trainer.accumulate(batches)
        ray.get([ref for _, pool in trainer.pools() if pool.trains for ref in pool.sync_grads()])
        ranks = ray.get([a.__ray_call__.remote(_rank_state) for a in actors])
        for rank, recs in zip(ranks, ray.get([a.measure_activations.remote(False) for a in actors])):
            rank["activations"] = max((r.get("step_bytes", r["bytes"]) for r in recs), default=0)
        trainer.optimizer_step()
    except BaseException:
        trainers.give_back(trainer, ok=False)
        raise
    trainers.give_back(trainer, ok=True)
    return {"step_s": statistics.median(times[1:]), "steps_s": times, "ranks": ranks}


def run(quick: bool) -> dict[str, Any]:
    import ray
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.scripts.bench.peers import bench_config
    from dhp.scripts.peers.probe import image_sample, patches
    from dhp.stages.trainer import LastTrainer

    size = QUICK if quick else FULL
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="dhp-bench-ft-") as tmp:
            config = bench_config()
            torch.manual_seed(0)
            Qwen2_5_VLForConditionalGeneration(config).save_pretrained(Path(tmp) / "ckpt")
            sample = image_sample(config, size["side"], Path(tmp) / "images")
            rows, trainers = [], LastTrainer()
            try:
                for mode, overrides in MODES.items():
                    m = measure(overrides, Path(tmp) / "ckpt", config, sample, size, trainers)
                    rows.append({"mode": mode, "overrides": overrides, **m})
                    print(f"{mode}: {m['step_s']:.3f} s", flush=True)
            finally:
                trainers.close()
    finally:
        if started:
            ray.shutdown()
    return {
        "device": "cpu",
        "layout": "tiny preset: vision sequence 2, text tensor 2, pipelined",
        "image_side": size["side"],
        "image_patches": patches(size["side"]),
        "samples_per_step": size["samples"],
        "rows": rows,
    }


def _worst(row: dict, stage: str, key: str) -> int:
    return max(r[key] for r in row["ranks"] if r["stage"] == stage)


def table(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"{result['samples_per_step']} samples of one {result['image_patches']}-patch image per step, "
        f"{result['layout']}; CPU timings; MiB on the worst rank of each pool",
        "",
        "| mode | step s | vision params / grads / AdamW / kept | text params / grads / AdamW / kept |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        cells = [
            " / ".join(f"{_worst(row, stage, k) / mib:.1f}" for k in ("params", "grads", "optimizer", "activations"))
            for stage in ("vision", "text")
        ]
        lines.append(f"| {row['mode']} | {row['step_s']:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.quick)
    return report(args.json, result, table)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fine-tuning", help="step time and per-rank bytes of each fine-tuning mode")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="a 112 px image, 2 samples, 2 steps (for the tests)")
