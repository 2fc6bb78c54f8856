"""`dhp bench pipeline --mix long-tail`: the step against the balanced bound on a long-tailed image mix, with the
micro-batches grouped by tokens (`data.balance` off, `packing.pack`) and by predicted cost (on,
`balance.balance_groups`).

The global batch: the photos of the real img2dataset shard in tests/assets (32 CC12M photos, 417-840 px a side,
their own captions), each scaled by `--scale` in side length, and one in eight of them (seeded) enlarged a further
8-16x in area: the shard's size distribution plus a tail. Preprocessed for real (`Preprocessor`, `tiny`'s
tokenizer and patching), then grouped by `balance.micro_batches` -- the function the loader groups with -- under a
budget of 2 x the longest sample's tokens (so that a tail sample may share its micro-batch, padded); `--packed`:
the text packed (`data.packing`), where the grouping moves no padding.

Two vision replicas and one text replica, `disjoint`, one torch thread each, pipelined (`pipeline.max_in_flight`
default): with one vision replica the grouping could only move pipeline bubbles, with two it also sets how evenly
`routing.route` can deal the micro-batches' patches to them. The model: `pipeline.py`'s model widths at a fixed
vision depth and text layers (`mix_depth`, `mix_layers` of its presets: 8 and 1 make the pools' work about even per
rank on this mix). On 2 cores the three actors share the cores when all are busy, which every grouping pays alike.
One trainer runs the batch grouped off and grouped on in turn, step by step (off first), `--steps` measured steps
each after the preset's warm-up.
  step_s        median train_step time.
  work_s        per pool, the summed durations of its traced calls (forward, backward, forward_backward, grad
                norm, optimizer step) over all its ranks in a step, median over the measured steps.
  bound_s       the balanced bound: max over the pools of work_s / the pool's ranks (actors); no schedule of
                that work on those ranks finishes sooner.
  step_over_bound  step_s / bound_s (goal: <= 1.10).
  predicted     the grouping's micro-batches: count, and the costliest and mean micro-batch in `sample_cost` units.
"""

from __future__ import annotations

import io
import json
import random
import statistics
import tarfile
import time
from pathlib import Path
from typing import Any

GOAL = 1.10
SHARD = Path(__file__).resolve().parents[2] / "tests" / "assets" / "cc12m-train-0000.tar"
TAIL_EVERY = 8  # one in eight photos is enlarged
TAIL_AREA = (8.0, 16.0)  # ... by this much more area (uniform)
PROMPT = "<image>\nDescribe the photo."
VISION_RANKS = 2  # micro-batches are dealt to the vision replicas by patches (routing.route): the grouping matters


def shard_photos(shard: Path = SHARD) -> list[tuple[str, bytes, str]]:
    """(key, JPEG bytes, caption) of each photo of the shard, in key order."""
    if not shard.is_file():
        raise FileNotFoundError(f"{shard}: the mix is drawn from the repository's test shard; run from a checkout")
    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for m in tar.getmembers():
            key, _, ext = m.name.rpartition(".")
            if ext in ("jpg", "txt"):
                members.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return [(k, v["jpg"], v["txt"].decode().strip()) for k, v in sorted(members.items()) if {"jpg", "txt"} <= v.keys()]


def write_mix(root: Path, n: int, scale: float, seed: int = 0) -> tuple[Path, list[dict[str, Any]]]:
    """`n` records (the shard's photos in turn) as JSONL under `root`; returns the file and each record's sizes."""
    from PIL import Image

    rng = random.Random(seed)
    photos = shard_photos()
    tail = set(rng.sample(range(n), max(1, n // TAIL_EVERY)))
    lines, sizes = [], []
    for i in range(n):
        key, jpg, caption = photos[i % len(photos)]
        image = Image.open(io.BytesIO(jpg)).convert("RGB")
        grow = rng.uniform(*TAIL_AREA) if i in tail else 1.0
        side = scale * grow**0.5
        size = (max(28, round(image.width * side)), max(28, round(image.height * side)))
        (root / "images").mkdir(parents=True, exist_ok=True)
        image.resize(size).save(root / "images" / f"{i}.png")
        turns = [{"from": "human", "value": PROMPT}, {"from": "gpt", "value": caption}]
        lines.append(json.dumps({"id": f"{key}-{i}", "image": f"images/{i}.png", "conversations": turns}))
        sizes.append({"photo": key, "size": size, "area_x": round(grow, 2), "tail": i in tail})
    path = root / "mix.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, sizes


def preprocess(path: Path, max_pixels: int) -> list[dict]:
    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.models.architectures import architecture_config

    settings = PreprocessSettings(str(path.parent), 28 * 28, max_pixels, 1 << 16)
    pre = Preprocessor(settings, architecture_config("tiny"))
    rows = [pre({"source": f"mix:{i}", "record": line}) for i, line in enumerate(path.read_text().splitlines())]
    bad = [r for r in rows if r["error"]]
    if bad:
        raise ValueError(f"{len(bad)} of the mix's records were skipped: {bad[0]['error']} {bad[0]['detail']}")
    return [decode_sample(r["sample"]) for r in rows]


def global_batch(samples: list[dict], budget: int, balanced: bool, packed: bool = False):
    """One GlobalBatch of `samples`, grouped as the loader groups them (`balance.micro_batches`), the text padded
    or `packed`."""
    import ray

    from dhp.dataflow.balance import micro_batches, sample_cost
    from dhp.dataflow.loader import GlobalBatch, MicroBatch
    from dhp.dataflow.packing import meta_of, microbatch_inputs
    from dhp.scripts.bench.pipeline import PAD_ID

    lengths = [s["input_ids"].shape[0] for s in samples]
    patches = [s["pixel_values"].shape[0] for s in samples]
    groups = micro_batches(lengths, patches, budget, packed, balanced)
    mbs = []
    for g in groups:
        vision, text = microbatch_inputs([samples[i] for i in g], PAD_ID, packed)
        mbs.append(MicroBatch([ray.put(vision)], ray.put(text), meta_of(vision, text)))
    costs = [sum(sample_cost(lengths[i], patches[i]) for i in g) for g in groups]
    predicted = {"microbatches": len(groups), "max_cost": max(costs), "mean_cost": statistics.mean(costs)}
    return GlobalBatch(mbs, epoch=0), predicted


def pool_work(events: list[dict], stage: str, rank: int | None = None) -> float:
    """Summed durations of `stage`'s traced calls (of one `rank`, or of all)."""
    return sum(e["end"] - e["start"] for e in events if e["stage"] == stage and rank in (None, e["rank"]))


def step_row(trainer, batch) -> dict[str, float]:
    """One train_step of `batch`: its time, each pool's summed call durations (pipeline.trace on), its loss."""
    trainer.events = []
    metrics = trainer.train_step([batch])
    events = trainer.events
    return {
        "step_s": metrics["step_time_s"],
        "vision_work_s": pool_work(events, "vision"),
        "text_work_s": pool_work(events, "text"),
        "loss": metrics["loss"],
    }


def measure(trainer, batches: dict[bool, Any], warmup: int, steps: int) -> dict[bool, dict[str, float]]:
    """Per grouping (balance off, on), the medians of `steps` steps after `warmup`, the two interleaved step by
    step (off first: today's figure before the new one), so that a machine whose load drifts weighs on both alike."""
    rows: dict[bool, list[dict[str, float]]] = {b: [] for b in batches}
    for i in range(warmup + steps):
        for balanced, batch in batches.items():
            trainer.cfg.data.balance = balanced  # read at every accumulate (balance_text's costs)
            row = step_row(trainer, batch)
            if i >= warmup:
                rows[balanced].append(row)
    return {b: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for b, rs in rows.items()}


def run(preset: dict, steps: int, scale: float, packed: bool = False, seed: int = 0) -> list[dict[str, Any]]:
    """The rows (balance off, then on) of one long-tailed global batch; Ray must be running."""
    import tempfile

    from dhp.scripts.bench import pipeline as bench
    from dhp.stages.config import load_config
    from dhp.stages.trainer import trainer_for

    with tempfile.TemporaryDirectory() as tmp:
        path, sizes = write_mix(Path(tmp), preset["mix_samples"], scale, seed)
        samples = preprocess(path, max_pixels=1 << 22)
    lengths = [s["input_ids"].shape[0] for s in samples]
    budget = 2 * max(lengths)
    depth, layers = preset["mix_depth"], preset["mix_layers"]
    ranks = {"vision": VISION_RANKS, "text": 1}
    pools = [
        f"{stage}.{kv}"
        for stage, n in ranks.items()
        for kv in ("parallelism=none", f"num_actors={n}", "degree=1", f"num_cpus_per_actor={1 / n:g}")
    ]
    cfg = load_config(
        "tiny",
        [
            *pools,
            "vision.torch_threads=1",
            "text.torch_threads=1",
            "pipeline.placement=disjoint",
            "pipeline.trace=true",
            f"training.global_batch_size={len(samples)}",
            "training.steps=100000",
            "training.warmup_steps=0",
            "training.lr=1e-6",
            f"data.microbatch_tokens={budget}",
            f"data.max_seq_len={budget}",
            f"data.packing={str(packed).lower()}",
        ],
    )
    trainer = trainer_for(cfg, bench.model_config(preset, depth, layers))
    try:
        grouped = {b: global_batch(samples, budget, b, packed) for b in (False, True)}
        start = time.perf_counter()
        measured = measure(trainer, {b: batch for b, (batch, _) in grouped.items()}, preset["warmup"], steps)
        wall = time.perf_counter() - start
    finally:
        trainer.shutdown()
    rows = []
    for balanced, m in measured.items():
        work = {"vision": m["vision_work_s"], "text": m["text_work_s"]}
        bound = max(work[s] / ranks[s] for s in work)
        rows.append(
            {
                "scenario": "long_tail",
                "balance": balanced,
                "packing": packed,
                "samples": len(samples),
                "tail_samples": sum(s["tail"] for s in sizes),
                "patches": sum(s["pixel_values"].shape[0] for s in samples),
                "tokens": sum(lengths),
                "microbatch_tokens": budget,
                "vision_depth": depth,
                "text_layers": layers,
                "vision_ranks": ranks["vision"],
                "text_ranks": ranks["text"],
                "steps": steps,
                "step_s": round(m["step_s"], 4),
                "vision_work_s": round(work["vision"], 4),
                "text_work_s": round(work["text"], 4),
                "bound_s": round(bound, 4),
                "step_over_bound": round(m["step_s"] / bound, 4),
                "loss": m["loss"],
                "predicted": {k: round(v, 1) if isinstance(v, float) else v for k, v in grouped[balanced][1].items()},
                "measured_for_s": round(wall, 1),  # both groupings, warm-up included
                "goal": m["step_s"] / bound <= GOAL,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'balance':8}{'mbs':>5}{'max/mean':>9}{'vision_s':>9}{'text_s':>8}{'bound':>8}{'step':>8}"
    head += f"{'step/bound':>11}"
    lines = [head]
    for r in rows:
        p = r["predicted"]
        lines.append(
            f"{'on' if r['balance'] else 'off':8}{p['microbatches']:5d}{p['max_cost'] / p['mean_cost']:9.2f}"
            f"{r['vision_work_s']:9.3f}{r['text_work_s']:8.3f}{r['bound_s']:8.3f}{r['step_s']:8.3f}"
            f"{r['step_over_bound']:11.3f}"
        )
    return "\n".join(lines)
