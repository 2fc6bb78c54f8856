"""`dhp data profile`: a dataset's length mix, measured through the real preprocessing, as data for the planner.

The memory plan and the step-time model take one image size and one text length; real data is a long-tailed
mix. This reads up to `limit` records of `data.train` (JSONL or WebDataset shards, local or s3://; the synthetic
set when `data.train` is empty) in this process, each through the `Preprocessor` the Ray Data workers run (the
same smart_resize, tokenizer, chat template and skips), and keeps for each usable sample:

    patches      the vision patches of each image or video in it ([] for a text-only sample)
    frames       the temporal patches of each (1 an image, a video's frame pairs: its attention segments)
    text_tokens  its sequence length minus the merged vision tokens (patches / merge_size**2 each)
    tokens       its sequence length

Records are chosen evenly over the files' records in file order (every k-th, so that a sorted or grouped file is
still sampled across), from the first `4 * limit` records read. Skipped records are counted by reason, as a run
counts them. The output JSON holds the samples and a summary (min, quantiles, mean, max) of patches per image,
visuals per sample, text tokens and tokens per sample.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any

READ_FACTOR = 4  # records read per record kept, at most: the sample is spread over this many


def read_rows(cfg: Any, paths: list[str], want: int) -> list[dict[str, Any]]:
    """The first `want` record rows of `paths` in file order, as the loader's split makes them (text records, or
    a shard's members with their bytes)."""
    from dhp.dataflow.positions import Read
    from dhp.dataflow.sources import record_format
    from dhp.dataflow.storage import filesystem, resolve, scheme_of

    fmt, storage = record_format(cfg.data, paths), resolve(cfg.data.storage)
    rows: list[dict[str, Any]] = []
    for path in paths:
        fs, inner = filesystem(path, storage)
        prefix = f"{scheme_of(path)}://" if scheme_of(path) else ""
        rows += fmt.split(Read(part=0).item(inner), seed=None, prefix=prefix, **fmt.split_kwargs(fs))
        if len(rows) >= want:
            break
    return rows[:want]


def evenly(rows: list[Any], limit: int) -> list[Any]:
    """`limit` of `rows`, evenly spaced from the first (all of them when there are no more)."""
    if len(rows) <= limit:
        return rows
    return [rows[i * len(rows) // limit] for i in range(limit)]


def sizes_of(sample: dict[str, Any], merge_unit: int) -> dict[str, Any]:
    """A preprocessed sample -> its patches and temporal patches per visual, text tokens (a Qwen3-VL video's
    timestamps among them) and sequence length."""
    grid = sample["image_grid_thw"]
    patches = [int(n) for n in grid.prod(-1).tolist()]
    frames = [int(t) for t in grid[:, 0].tolist()]
    tokens = int(sample["input_ids"].shape[0])
    text = tokens - sum(p // merge_unit for p in patches)
    return {"patches": patches, "frames": frames, "text_tokens": text, "tokens": tokens}


def spread(values: list[float]) -> dict[str, float]:
    """min, p10, p50, p90, p99, max and mean of `values` (nearest-rank quantiles); zeros when there are none."""
    if not values:
        return dict.fromkeys(("min", "p10", "p50", "p90", "p99", "max", "mean"), 0)
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {
        "min": ordered[0],
        "p10": q(0.10),
        "p50": q(0.50),
        "p90": q(0.90),
        "p99": q(0.99),
        "max": ordered[-1],
        "mean": round(statistics.fmean(ordered), 2),
    }


def profile(cfg: Any, pre: Any, train: list[str], limit: int = 2000) -> dict[str, Any]:
    """The length mix of `train` (module docstring) from at most `limit` records, each through `pre` (the run's
    `Preprocessor`; stages/data_profile.py builds it from a config)."""
    from dhp.dataflow.preprocess import decode_sample

    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    rows = evenly(read_rows(cfg, train, READ_FACTOR * limit), limit)
    samples, skipped = [], Counter()
    for row in rows:
        out = pre(row)
        if out["error"]:
            skipped[out["error"]] += 1
        else:
            samples.append(sizes_of(decode_sample(out["sample"]), pre.merge_unit))
    patches = [p for s in samples for p in s["patches"]]
    return {
        "data": cfg.data.train or f"synthetic ({cfg.data.synthetic.dir})",
        "model": cfg.model.path or cfg.model.name,
        "records": len(rows),
        "samples": len(samples),
        "skipped": dict(sorted(skipped.items())),
        "summary": {
            "patches_per_visual": spread(patches),
            "visuals_per_sample": spread([len(s["patches"]) for s in samples]),
            "text_tokens_per_sample": spread([s["text_tokens"] for s in samples]),
            "tokens_per_sample": spread([s["tokens"] for s in samples]),
        },
        "per_sample": samples,
    }


def table(result: dict[str, Any]) -> str:
    """The summary as a short Markdown table."""
    keys = ("min", "p10", "p50", "p90", "p99", "max", "mean")
    lines = [
        f"{result['samples']} samples of {result['records']} records read from {result['data']} "
        f"(model {result['model']}); skipped: "
        + (", ".join(f"{k} {v}" for k, v in result["skipped"].items()) or "none"),
        "",
        "| per | " + " | ".join(keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for name, row in result["summary"].items():
        lines.append(f"| {name.replace('_', ' ')} | " + " | ".join(f"{row[k]:g}" for k in keys) + " |")
    return "\n".join(lines)


def write(result: dict[str, Any], out: str) -> None:
    from pathlib import Path

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
