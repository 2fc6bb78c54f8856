"""For `dhp bench ops`: the stages' own calls, timed on real transformers modules, against what the op rates say.

The op rates (matmul, attention, memory bandwidth, launches) predict a call from its FLOPs and bytes. A real
Qwen2.5-VL stage does more than its matmuls and attention: fp32 RMSNorms, rotary embeddings, the window
gathers and one SDPA call per window, SwiGLU, the embedding's dense gradient, allocations. So, as
layer-profiling planners do (Galvatron, Alpa: time the real layer, model the rest), this times the three
calls of a training step on a reference model, exactly as the stage workers run them (one torch thread,
fp32 on a CPU, `VisionModel` / `TextModel` from transformers' classes), and the AdamW step after real
backward passes:

    efficiency.vision_forward, .vision_backward, .text   the op model's compute for the call / its measured time
    optimizer_s_per_param                               median AdamW step of both stages / their parameters

The step-time model divides those calls' compute parts by the efficiencies (`CallCost.scale_compute`).

The reference model has the tiny architecture's widths (what `dhp bench time-model` trains) but is shallower
(`DEPTH` ViT blocks, `TEXT_LAYERS` decoder layers) and sees a smaller image (`IMAGE`: 1 024 patches, half of
the time-model bench's): the time-model check then tests how the model scales with depth and length, not a
copy of its own input. Measured on CPU profiles only: on a GPU the tiny widths are launch-bound and say
nothing about a real model (a GPU run records the note instead).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

IMAGE = (448, 448)  # pixels: 32 x 32 patches of 14 -> 1 024 patches, 16 windows of 8 x 8
DEPTH, TEXT_LAYERS = 8, 4  # full attention at blocks 3 and 7 (deep_config: every 4th)
MICROBATCHES = 2


def _prediction(model_config: Any, sample: dict, prof_raw: dict[str, Any]) -> dict[str, float]:
    """The op model's compute seconds of the three calls for this sample, before any efficiency."""
    from dhp.models.planning.hardware import from_measurement
    from dhp.models.planning.time_model import Workload, text_call, vision_calls
    from dhp.scripts.bench.time_model import BASE
    from dhp.stages.config import load_config

    prof = from_measurement({**prof_raw, "efficiency": {}}, "bench ops (in progress)")
    length = len(sample["input_ids"])
    patches = int(sample["image_grid_thw"].prod())
    w = Workload(patches, length - patches // 4)
    cfg = load_config("tiny", BASE + [f"data.microbatch_tokens={length}", f"data.max_seq_len={length}"])
    fwd, bwd = vision_calls(cfg, model_config, prof, w)
    return {
        "vision_forward": fwd.compute,
        "vision_backward": bwd.compute,
        "text": text_call(cfg, model_config, prof, w).compute,
    }


def _time_steps(model_config: Any, sample: dict, steps: int) -> tuple[dict[str, float], float, int]:
    """Median seconds of each call over `steps` training steps after a warm-up one, the median AdamW step of
    both stages, and their parameter count."""
    import torch

    from dhp.models.qwen2_5_vl import TextModel, VisionModel
    from dhp.stages.config import load_config
    from dhp.stages.stage_worker import build_optimizer, clipped_step

    torch.manual_seed(0)
    vision, text = VisionModel(model_config).train(), TextModel(model_config).train()
    cfg = load_config("tiny", [])
    optimizers = [build_optimizer(m, cfg)[0] for m in (vision, text)]
    params = sum(p.numel() for m in (vision, text) for p in m.parameters())
    pixels, grid = sample["pixel_values"], sample["image_grid_thw"].reshape(1, 3)
    ids, labels = sample["input_ids"][None], sample["labels"][None]
    positions, mask = sample["position_ids"].reshape(3, 1, -1), torch.ones_like(ids)
    calls: dict[str, list[float]] = {"vision_forward": [], "text": [], "vision_backward": []}
    opt: list[float] = []
    for step in range(1 + steps):
        for _ in range(MICROBATCHES):
            t0 = time.perf_counter()
            out = vision(pixels, grid)  # the stage keeps this graph until the gradient comes back
            t1 = time.perf_counter()
            embeds = out.detach().requires_grad_()
            text(ids, embeds, positions, mask, labels).backward()
            t2 = time.perf_counter()
            out.backward(embeds.grad)
            t3 = time.perf_counter()
            if step:
                for k, sec in zip(calls, (t1 - t0, t2 - t1, t3 - t2)):
                    calls[k].append(sec)
        t4 = time.perf_counter()
        for model, o in zip((vision, text), optimizers):  # as StageWorker.optimizer_step takes it
            clipped_step(o, model.parameters(), 0.5)
        if step:
            opt.append(time.perf_counter() - t4)
    return {k: statistics.median(v) for k, v in calls.items()}, statistics.median(opt), params


def measure_stages(prof_raw: dict[str, Any], quick: bool) -> dict[str, Any]:
    """{"efficiency": {vision_forward, vision_backward, text}, "optimizer_s_per_param", "notes"} for a CPU
    profile whose op rates are `prof_raw`; torch must already run one thread (as `measure` sets it)."""
    from dhp.scripts.bench.time_model import deep_sample

    with tempfile.TemporaryDirectory() as tmp:
        model_config, _, sample = deep_sample(
            Path(tmp), image=IMAGE, text_layers=TEXT_LAYERS, vision_depth=DEPTH, save=False
        )
    measured, optimizer, params = _time_steps(model_config, sample, 2 if quick else 4)
    predicted = _prediction(model_config, sample, prof_raw)
    patches = int(sample["image_grid_thw"].prod())
    note = (
        f"efficiency.vision_forward/vision_backward/text: the op model's compute / the measured call on a "
        f"reference stage (tiny widths, {DEPTH} ViT blocks, {TEXT_LAYERS} decoder layers, {patches} patches + "
        f"{len(sample['input_ids']) - patches // 4} text tokens); measured ms "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in measured.items())
        + f"; optimizer_s_per_param: the AdamW step after real backward passes ({params / 1e6:.1f} M params)"
    )
    return {
        "efficiency": {k: predicted[k] / measured[k] for k in measured},
        "optimizer_s_per_param": optimizer / params,
        "notes": [note],
    }
