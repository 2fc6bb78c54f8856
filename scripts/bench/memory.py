"""`dhp bench memory`: what one rank holds at each released size, layout and precision, and what building it costs.

    dhp bench memory --json runs/bench/memory.json [--quick] [--no-measure] [--checkpoint-dir DIR]

Computed rows (every released shape x the presets' stage layouts x precision), on the meta device, nothing
allocated: a rank's parameter, gradient and AdamW bytes (the layout's `state_numel` and `optimizer_fraction`,
the precision's bytes per element), torch's foreach-AdamW temporary (one moment-sized buffer while it
steps), the largest full tensor (what a rank holds transiently while replaying the init or exporting), and
the bytes of a checkpoint (every rank's tensors and optimizer share).

Measured rows (peak_rss_bytes, build_s): one fresh process per row builds and loads one rank's shard from a
real-format checkpoint — safetensors in bf16 at the released shape with random values, written here first
(streamed, models/weights/hf_writer.py) — through the workers' own code (models/stage_build.py, with a fake process
group standing in for the other ranks), and reports its peak RSS. The goal:
peak_rss <= 1.25 x (held after setup + largest tensor) + 1.5 GiB, recorded per row as `goal_rss_bytes`.
`--quick` does the same on the tiny shapes of both families, Qwen2.5-VL's and Qwen3-VL's (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dhp.scripts.results import write_json

GIB = 2**30
SHAPES = (
    "qwen2_5_vl_3b",
    "qwen2_5_vl_7b",
    "qwen2_5_vl_32b",
    "qwen2_5_vl_72b",
    "qwen3_vl_2b",
    "qwen3_vl_8b",
    "qwen3_vl_32b",
)
# (stage, layout, degree, num_actors): the presets' layouts (tiny SP2/TP2, 7B SP4/TP4, 32B SP8/TP8), a TP 8 x
# DP 2 text pool (16 GPUs: ZeRO-1 halves its moments) and one unsharded rank of each stage for scale.
LAYOUTS = [
    ("vision", "none", 1, 1),
    ("vision", "sequence", 2, 2),
    ("vision", "sequence", 4, 4),
    ("vision", "sequence", 8, 8),
    ("text", "none", 1, 1),
    ("text", "tensor", 2, 2),
    ("text", "tensor", 4, 4),
    ("text", "tensor", 8, 8),
    ("text", "tensor", 8, 16),
]
MEASURED = [
    ("qwen2_5_vl_3b", "text", "tensor", 2),
    ("qwen2_5_vl_3b", "text", "tensor", 4),
    ("qwen2_5_vl_3b", "vision", "sequence", 4),
]
QUICK_LAYOUTS = [("vision", "sequence", 2, 2), ("text", "tensor", 2, 2), ("text", "none", 1, 2)]
QUICK_MEASURED = [
    ("tiny", "text", "tensor", 2),
    ("tiny", "vision", "sequence", 2),
    ("qwen3_vl_tiny", "vision", "sequence", 2),  # the learned position embedding and the DeepStack mergers
]
QUICK_SHAPES = ("tiny", "qwen3_vl_tiny")


def full_shapes(model: str, stage: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape, from a build on the meta device; tied tensors once."""
    from dhp.models.architectures import architecture_config
    from dhp.models.planning.memory_plan import full_shapes as shapes_of

    return shapes_of(architecture_config(model), stage)


def computed_row(
    model: str,
    stage: str,
    layout: str,
    degree: int,
    num_actors: int,
    precision: str,
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, Any]:
    from dhp.models.architectures import architecture_config
    from dhp.models.parallel.layouts import make_layout
    from dhp.models.planning.memory_plan import model_state_bytes
    from dhp.models.precision import precision_of

    lay = make_layout(stage, layout, degree, num_actors, architecture_config(model))
    states = [model_state_bytes(lay, precision_of(precision), shapes, r) for r in range(num_actors)]
    row = dict(
        model=model,
        stage=stage,
        layout=layout,
        degree=degree,
        num_actors=num_actors,
        precision=precision,
        **{f"{k}_bytes": v for k, v in states[0].items()},
        largest_tensor_bytes=max(math.prod(s) for s in shapes.values()) * 4,  # replayed / gathered in fp32
        checkpoint_bytes=sum(s["params"] + s["optimizer"] for s in states),  # every rank's tensors + its moments
    )
    row["held_bytes"] = row["params_bytes"]  # after setup: parameters (gradients and moments come with step 1)
    row["state_bytes"] = row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]
    row["peak_state_bytes"] = row["state_bytes"] + row["optimizer_step_temp_bytes"]
    row["goal_rss_bytes"] = round(1.25 * (row["held_bytes"] + row["largest_tensor_bytes"]) + 1.5 * GIB)
    row["peak_rss_bytes"] = row["build_s"] = None
    return row


def write_checkpoint(model: str, out: Path) -> None:
    """A real-format checkpoint of the released shape: both stages, bf16, random values, streamed to disk."""
    import torch

    from dhp.models.architectures import architecture_config
    from dhp.models.family import family_of
    from dhp.models.weights.hf_writer import Entry, write_shards

    config = architecture_config(model)
    entries = []
    for stage in ("vision", "text"):
        cls = family_of(config).stage_module_class(stage)
        for name, shape in full_shapes(model, stage).items():
            hf = cls.hf_name(name)
            if not (config.tie_word_embeddings and hf == "lm_head.weight"):
                entries.append(Entry(hf, shape, torch.bfloat16))
    write_shards(out, entries, lambda e: torch.randn(e.shape).mul_(0.02).to(torch.bfloat16), "5GB")
    config.save_pretrained(out)


def measured(model: str, stage: str, layout: str, degree: int, ckpt: Path) -> dict[str, Any]:
    """measure_build in a fresh process (peak RSS only grows), loading from `ckpt`."""
    cmd = [
        sys.executable,
        "-m",
        "dhp.scripts.measure_build",
        "--model",
        model,
        "--stage",
        stage,
        "--layout",
        layout,
        "--degree",
        str(degree),
        "--path",
        str(ckpt),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool, measure: bool, checkpoint_dir: str | None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from dhp.models.architectures import architecture_config
    from dhp.models.parallel.layouts import make_layout

    shapes_of = QUICK_SHAPES if quick else SHAPES
    layouts = QUICK_LAYOUTS if quick else LAYOUTS
    rows = []
    for model in tqdm(shapes_of, desc="meta builds", disable=quick):
        shapes = {stage: full_shapes(model, stage) for stage in ("vision", "text")}
        for stage, layout, degree, num_actors in layouts:
            try:
                make_layout(stage, layout, degree, num_actors, architecture_config(model)).check_shape(
                    architecture_config(model)
                )
            except ValueError:
                continue  # e.g. TP 8 of the 7B's 28 heads: not a layout this shape can have
            for precision in ("fp32", "bf16"):
                rows.append(computed_row(model, stage, layout, degree, num_actors, precision, shapes[stage]))
    if not measure:
        return rows
    todo = QUICK_MEASURED if quick else MEASURED
    for model in sorted({m for m, *_ in todo}):
        tmp = Path(checkpoint_dir) if checkpoint_dir else Path(tempfile.mkdtemp(prefix="dhp-bench-memory-"))
        try:
            if not (tmp / "config.json").is_file():
                print(f"writing a random {model} checkpoint (bf16) to {tmp} ...", file=sys.stderr)
                write_checkpoint(model, tmp)
            for m, stage, layout, degree in tqdm([t for t in todo if t[0] == model], desc="measured builds"):
                got = measured(m, stage, layout, degree, tmp)
                row = next(
                    r
                    for r in rows
                    if (r["model"], r["stage"], r["layout"], r["degree"], r["num_actors"], r["precision"])
                    == (m, stage, layout, degree, degree, "fp32")
                )
                if got["held_bytes"] != row["held_bytes"]:
                    raise AssertionError(
                        f"{m} {stage} {layout} {degree}: built {got['held_bytes']} bytes, "
                        f"the plan says {row['held_bytes']}"
                    )
                row["peak_rss_bytes"], row["build_s"] = got["peak_rss_bytes"], got["build_s"]
        finally:
            if not checkpoint_dir:
                shutil.rmtree(tmp, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | stage | layout | actors | precision | params | grads | AdamW | state | +step temp "
        "| checkpoint | peak RSS (goal) | build |"
    )
    lines = [head, "|" + "---|" * 4 + "---|" + "---:|" * 8]
    for r in rows:
        rss = (
            ""
            if r["peak_rss_bytes"] is None
            else (f"{r['peak_rss_bytes'] / GIB:.2f} ({r['goal_rss_bytes'] / GIB:.2f})")
        )
        build = "" if r["build_s"] is None else f"{r['build_s']:.0f} s"
        lines.append(
            f"| {r['model']} | {r['stage']} | {r['layout']} {r['degree']} | {r['num_actors']} | {r['precision']} | "
            + " | ".join(
                f"{r[k] / GIB:.2f}"
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_bytes",
                    "state_bytes",
                    "optimizer_step_temp_bytes",
                    "checkpoint_bytes",
                )
            )
            + f" | {rss} | {build} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    rows = run(args.quick, not args.no_measure, args.checkpoint_dir)
    out = write_json(args.json, rows)
    print(table(rows))
    print(f"\n{len(rows)} rows (GiB per rank; checkpoint: the whole pool) -> {out}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("memory", help="bytes a rank holds per shape / layout / precision; measured build RSS")
    p.add_argument("--json", required=True, help="where the rows go")
    p.add_argument("--quick", action="store_true", help="the tiny shapes only (seconds)")
    p.add_argument("--no-measure", action="store_true", help="computed rows only (no checkpoint, no builds)")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="reuse/keep the random checkpoint here (default: a temporary dir, removed)",
    )
