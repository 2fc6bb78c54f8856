"""For `dhp bench ops`: what sharding costs beyond its collectives' bytes, measured on 2 ranks.

Run inside `bench_ops`'s collective processes (the process group is up). A collective's curve says what one
all-gather of a tensor costs; FSDP2 (`zero3`) does more per unit: it copies the shards into a flat buffer,
all-gathers, copies out, frees, and in the backward all-gathers again and reduce-scatters, each a separate
small call on gloo, and allocates the unsharded parameters afresh each time. Its optimizer steps DTensors,
whose dispatch costs per tensor. ZeRO-1 (`ZeroRedundancyOptimizer`, the vision pool's optimizer under
`sequence`) broadcasts every stepped parameter from its owner. So this times them as dhp runs them
(`apply_zero3`, `build_optimizer`) on the reference stages of `bench_ops_stages` (real transformers modules):

    zero3_unit_s        [forward, backward] seconds per FSDP2 unit per call, beyond the call's compute
    zero3_s_per_byte    [forward, backward] seconds per byte of the stage's (unsharded) parameters
    zero3_optimizer_s_per_tensor  AdamW on DTensor parameters, seconds per parameter tensor beyond plain AdamW
    zero1_step_s_per_tensor       ZeroRedundancyOptimizer's step, seconds per parameter tensor beyond plain AdamW

The per-unit figure compares the vision encoder sharded as dhp shards it (blocks, merger, root) with the same
encoder sharded as one unit: the same bytes move, only the number of units differs. The per-byte figure is
then what remains of the language model's overhead (few units, a large root: embedding, lm_head), its
sharded call's time minus the same call unsharded, beyond its units. (Solving one equation per stage for both
unknowns instead put the per-unit cost at zero whenever the two overheads' noise tipped the solution
negative.) Medians over repetitions every rank runs in the same number (a collective needs every rank).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _calls(stage: str, model: Any, inputs: dict, reps: int) -> tuple[float, float]:
    """Median seconds of the stage's forward and of its backward (each repetition: barrier, forward, backward)."""
    import torch
    import torch.distributed as dist

    fwd, bwd = [], []
    for rep in range(1 + reps):  # the first allocates: a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        out = model(*inputs[stage])
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        if rep:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def _step_s(model: Any, reps: int, zero1: bool = False) -> float:
    """Median seconds of the stage workers' AdamW step (ZeroRedundancyOptimizer over the group if `zero1`), as
    `StageWorker.optimizer_step` runs it: gradients scaled by a clip coefficient, step, zero."""
    import torch

    from dhp.stages.config import load_config
    from dhp.stages.stage_worker import NOT_SHARDED, build_optimizer, clipped_step

    opt, _ = build_optimizer(model, load_config("tiny", []), zero_group=None if zero1 else NOT_SHARDED)
    samples = []
    for rep in range(1 + reps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        torch.distributed.barrier()
        start = time.perf_counter()
        clipped_step(opt, model.parameters(), 0.5)
        if rep:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_sharded(ranks: int, quick: bool) -> dict[str, Any]:
    """The module docstring's fields, measured on the default process group (CPU / gloo)."""
    import torch

    from dhp.models.parallel.zero3 import apply_zero3
    from dhp.models.qwen2_5_vl import TextModel, VisionModel
    from dhp.scripts.bench.ops_stages import DEPTH, IMAGE, TEXT_LAYERS
    from dhp.scripts.bench.time_model import deep_sample

    reps = 5 if quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        config, _, sample = deep_sample(Path(tmp), image=IMAGE, text_layers=TEXT_LAYERS, vision_depth=DEPTH, save=False)
    ids = sample["input_ids"][None]
    merged = int(sample["image_grid_thw"].prod()) // 4
    inputs = {
        "vision": (sample["pixel_values"], sample["image_grid_thw"].reshape(1, 3)),
        "text": (
            ids,
            torch.zeros(merged, config.text_config.hidden_size, requires_grad=True),
            sample["position_ids"].reshape(3, 1, -1),
            torch.ones_like(ids),
            sample["labels"][None],
        ),
    }
    overhead, units, nbytes, sharded = {}, {}, {}, {}
    for stage, cls in (("vision", VisionModel), ("text", TextModel)):
        torch.manual_seed(0)
        model = cls(config).train()
        plain = _calls(stage, model, inputs, reps)
        if stage == "vision":  # steps are short: more repetitions
            plain_step, zero1_step = _step_s(model, 3 * reps), _step_s(model, 3 * reps, zero1=True)
            tensors = len(list(model.parameters()))
        shard_units = model.shard_units()
        units[stage] = len(shard_units) + 1  # and the root
        nbytes[stage] = sum(p.numel() * p.element_size() for p in model.parameters())
        apply_zero3(model, shard_units, ranks, torch.device("cpu"))
        sharded[stage] = _calls(stage, model, inputs, reps)
        overhead[stage] = [max(0.0, z - p) for z, p in zip(sharded[stage], plain)]
        if stage == "vision":
            dtensor_step = _step_s(model, 3 * reps)
            torch.manual_seed(0)
            whole = cls(config).train()
            apply_zero3(whole, [], ranks, torch.device("cpu"))  # the same bytes in one unit: the root
            one_unit = _calls(stage, whole, inputs, reps)
    (u_v, u_t), (b_v, b_t) = (units["vision"], units["text"]), (nbytes["vision"], nbytes["text"])
    # forward, backward: overhead = units * a + bytes * b; a from the vision encoder's two unit counts
    per_unit = [max(0.0, (many - one) / (u_v - 1)) for many, one in zip(sharded["vision"], one_unit)]
    per_byte = [max(0.0, (o_t - u_t * a) / b_t) for o_t, a in zip(overhead["text"], per_unit)]
    return {
        "zero3_unit_s": per_unit,
        "zero3_s_per_byte": per_byte,
        "zero3_optimizer_s_per_tensor": max(0.0, dtensor_step - plain_step) / tensors,
        "zero1_step_s_per_tensor": max(0.0, zero1_step - plain_step) / tensors,
        "notes": [
            f"zero3/zero1: FSDP2 (apply_zero3) and ZeroRedundancyOptimizer on {ranks} ranks on the reference "
            f"stages (vision {u_v} units, {b_v / 1e6:.1f} MB; text {u_t} units, {b_t / 1e6:.1f} MB): sharded "
            "minus unsharded medians, ms [fwd, bwd] vision "
            + "/".join(f"{x * 1e3:.0f}" for x in overhead["vision"])
            + ", text "
            + "/".join(f"{x * 1e3:.0f}" for x in overhead["text"])
        ],
    }
