"""`dhp bench checkpointing`: what activation checkpointing saves and what the recomputation costs.

    dhp bench checkpointing --json runs/bench/checkpointing.json [--quick]

On a tiny-but-deep shape (the tiny widths, the released depth structure: 16 ViT blocks with full attention
every 4th, 12 decoder layers) one forward + backward of the vision encoder at 4 k patches and of the language
model at 4 k tokens, with `activation_checkpointing` none / every_n (2) / full. Memory is torch's own
`MemTracker` (torch.distributed._tools), counting every live tensor that is not a parameter, buffer or
gradient: once when the forward ends (what is kept for the backward: the number checkpointing divides)
and at its peak over forward + backward (which also holds transients such as the embedding's gradient).
Time is the median of `--repeats` forward + backward passes (MemTracker off). One process, one rank: with
a sequence- or tensor-parallel layout each rank's activations shrink by the same factor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from dhp.scripts.results import report

MODES = ("none", "every_n", "full")
STATE = ("PARAM", "BUFFER", "GRAD")  # MemTracker's categories of model state; the rest is activations / temps


def deep_config(text_layers: int = 12, vision_depth: int = 16):
    from dhp.models.architectures import architecture_config

    config = architecture_config("tiny")
    config.text_config.num_hidden_layers = text_layers
    config.text_config.layer_types = ["full_attention"] * text_layers
    config.vision_config.depth = vision_depth
    config.vision_config.fullatt_block_indexes = list(range(3, vision_depth, 4))
    return config


def _workload(stage: str, config, seq: int):
    import torch

    from dhp.models.qwen2_5_vl import TextModel, VisionModel

    torch.manual_seed(0)
    if stage == "vision":
        model = VisionModel(config).train()
        side = int(seq**0.5)  # one square image of `seq` patches (an even side: 2 x 2 patches merge)
        grid = torch.tensor([[1, side, side]])
        pixels = torch.randn(side * side, 3 * 2 * 14 * 14)
        return model, lambda: model(pixels, grid).square().mean()
    model = TextModel(config).train()
    ids = torch.randint(0, 1000, (1, seq))
    return model, lambda: model.language_model(input_ids=ids, use_cache=False).last_hidden_state.square().mean()


def measure(stage: str, mode: str, seq: int, repeats: int, config) -> dict[str, Any]:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from dhp.models.activation_checkpointing import ActivationCheckpointing

    model, step = _workload(stage, config, seq)
    recomputed = ActivationCheckpointing(mode, 2).apply(model.blocks())
    tracker = MemTracker()
    tracker.track_external(model)
    cpu = torch.device("cpu")

    def not_state(snapshot: dict) -> int:
        return snapshot["Total"] - sum(v for k, v in snapshot.items() if str(k).split(".")[-1] in STATE)

    with tracker:
        loss = step()
        kept = not_state(tracker.get_tracker_snapshot()[cpu])  # what the forward left for the backward
        loss.backward()
        del loss
    peak = not_state(tracker.get_tracker_snapshot("peak")[cpu])
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - start)
    return dict(
        stage=stage,
        mode=mode,
        seq_len=seq,
        blocks=len(model.blocks()),
        recomputed_blocks=recomputed,
        kept_activation_bytes=kept,
        peak_activation_bytes=peak,
        step_s=round(statistics.median(times), 4),
    )


def run(quick: bool, repeats: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    seq = 576 if quick else 4096  # 24 x 24 / 64 x 64 patches
    config = deep_config(4, 8) if quick else deep_config()
    rows = [measure(stage, mode, seq, repeats, config) for stage in ("vision", "text") for mode in MODES]
    for r in rows:
        base = next(b for b in rows if b["stage"] == r["stage"] and not b["recomputed_blocks"])
        r["activation_reduction"] = round(base["kept_activation_bytes"] / r["kept_activation_bytes"], 2)
        r["peak_reduction"] = round(base["peak_activation_bytes"] / r["peak_activation_bytes"], 2)
        r["step_time_ratio"] = round(r["step_s"] / base["step_s"], 2)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| stage | tokens | checkpointing | blocks recomputed | kept after forward | fewer | peak (fwd+bwd) "
        "| step | cost |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['seq_len']} | {r['mode']} | {r['recomputed_blocks']} / {r['blocks']} | "
            f"{r['kept_activation_bytes'] / 2**20:.1f} MiB | {r['activation_reduction']:.2f}x | "
            f"{r['peak_activation_bytes'] / 2**20:.1f} MiB | "
            f"{r['step_s'] * 1e3:.0f} ms | {r['step_time_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    rows = run(args.quick, args.repeats or (1 if args.quick else 3))
    return report(args.json, rows, table)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("checkpointing", help="activation checkpointing: peak activation bytes and step-time cost")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="576 tokens, 4/8 blocks (seconds; for tests)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per row (default 3, quick 1)")
