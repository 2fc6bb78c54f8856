"""Model FLOPs of Qwen2.5-VL counted from its config, and the peak an actor can reach: dhp's one MFU definition
(docs/training.md#mfu), which every MFU figure dhp prints or writes computes with `mfu` over `model_flops`.

FLOPs are matmul FLOPs (2 per multiply-add), the convention of `torch.utils.flop_counter` and of MFU as
PaLM defines it; norms, activations and rotary embeddings are left out (a fraction of a percent).

Vision encoder, per patch token: patch embed (a Conv3d, one matmul per patch), per block qkv, proj and
the gated MLP, plus the attention term (QK^T and AV: 4 x len x hidden per token) whose length is the
window (window blocks) or the image frame (`fullatt_block_indexes`); the merger per merged token.
Text decoder, per token: q/k/v/o projections (k and v at the grouped-query width), the gated MLP, the
attention term over the whole sequence (the full L x L score matrix, as flop_counter and PaLM count
causal attention), and lm_head on the positions that get logits (dhp: labelled positions only).
Training = 3 x forward (backward is two matmuls per forward matmul). Work a step does on top is not model
work and is not counted: padding, and the forward activation checkpointing repeats in backward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

TRAIN_FACTOR = 3  # forward + backward (input and weight gradients)

# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s from NVIDIA's datasheets, by a substring of
# `torch.cuda.get_device_name()`; first match wins, so specific names come before general ones.
GPU_PEAK_TFLOPS: list[tuple[str, float]] = [
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
]


def _vision_dims(vc: Any) -> tuple[int, int, int, int]:
    return vc.hidden_size, vc.intermediate_size, vc.spatial_merge_size, vc.depth


def vision_linear_flops_per_patch(vc: Any) -> float:
    """Forward FLOPs per patch that do not depend on image size: patch embed, blocks' matmuls, mergers (the
    merger and any DeepStack mergers, all of one shape)."""
    from dhp.models.family import family_of

    family = family_of(vc)
    h, inter, m, depth = _vision_dims(vc)
    embed = 2 * vc.in_channels * vc.temporal_patch_size * vc.patch_size**2 * h
    block = 2 * (4 * h * h + family.vision_mlp_linears * h * inter)  # qkv (3h) + proj (h) + the MLP's Linears
    mergers = 1 + len(family.deepstack_indexes(vc))
    return embed + depth * block + mergers * merger_flops_per_patch(vc)


def _full_blocks(vc: Any) -> int:
    from dhp.models.family import family_of

    return len(family_of(vc).full_attention_blocks(vc))


def merger_flops_per_patch(vc: Any) -> float:
    """Forward FLOPs per patch of the patch merger's two Linears (one merged token per m^2 patches)."""
    h, _, m, _ = _vision_dims(vc)
    merged = h * m * m
    return 2 * (merged * merged + merged * vc.out_hidden_size) / (m * m)


def window_lengths(vc: Any, t: int, gh: int, gw: int) -> list[int]:
    """Patches per attention window of one image, as transformers' `get_vision_window_index` cuts it."""
    m = vc.spatial_merge_size
    ws = vc.window_size // m // vc.patch_size  # window side in merge units
    h, w = gh // m, gw // m
    rows = [min(ws, h - i) for i in range(0, h, ws)]
    cols = [min(ws, w - j) for j in range(0, w, ws)]
    return [r * c * m * m for _ in range(t) for r in rows for c in cols]


def vision_forward_flops(vc: Any, grids: Iterable[tuple[int, int, int]]) -> float:
    """Forward FLOPs of the vision encoder on images with these (t, h, w) patch grids."""
    h, _, _, depth = _vision_dims(vc)
    full = _full_blocks(vc)
    total = 0.0
    for t, gh, gw in grids:
        patches = t * gh * gw
        sq_full = t * (gh * gw) ** 2  # full-attention blocks attend within each frame
        sq_window = sum(n * n for n in window_lengths(vc, t, gh, gw)) if full < depth else 0
        total += patches * vision_linear_flops_per_patch(vc)
        total += 4 * h * (full * sq_full + (depth - full) * sq_window)
    return total


def vision_forward_flops_estimate(vc: Any, patches: int, images: int) -> float:
    """`vision_forward_flops` when only the totals are known: `images` square images of equal size.

    Exact for square images of equal size; for mixed sizes the attention term is a lower bound (the sum
    of squares of unequal lengths exceeds that of their mean).
    """
    if images <= 0 or patches <= 0:
        return 0.0
    h, _, m, depth = _vision_dims(vc)
    full = _full_blocks(vc)
    p = patches / images
    if full == depth:  # no window blocks
        return patches * vision_linear_flops_per_patch(vc) + 4 * h * images * depth * p * p
    side = math.sqrt(p) / m  # in merge units
    ws = vc.window_size // m // vc.patch_size
    n_whole = math.floor(side / ws)
    pieces_sq = n_whole * ws * ws + (side - n_whole * ws) ** 2  # sum of squared window sides along one axis
    sq_window = m**4 * pieces_sq**2
    attention = 4 * h * images * (full * p * p + (depth - full) * sq_window)
    return patches * vision_linear_flops_per_patch(vc) + attention


def _text_dims(tc: Any) -> tuple[int, int, int, int, int]:
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return (
        tc.hidden_size,
        tc.intermediate_size,
        tc.num_attention_heads * head_dim,
        tc.num_key_value_heads * head_dim,
        tc.num_hidden_layers,
    )


def text_linear_flops_per_token(tc: Any) -> float:
    """Forward FLOPs per decoder token that do not depend on sequence length (lm_head not included)."""
    h, inter, q, kv, layers = _text_dims(tc)
    return layers * 2 * (h * q + 2 * h * kv + q * h + 3 * h * inter)


def lm_head_flops_per_token(tc: Any) -> float:
    return 2 * tc.hidden_size * tc.vocab_size


def text_forward_flops(tc: Any, lengths: Iterable[int], logit_tokens: int | None = None) -> float:
    """Forward FLOPs of the decoder on sequences of these lengths; lm_head on `logit_tokens` positions
    (None: every position, as `Qwen2_5_VLForConditionalGeneration` computes it)."""
    lengths = list(lengths)
    _, _, q, _, layers = _text_dims(tc)
    tokens = sum(lengths)
    logit_tokens = tokens if logit_tokens is None else logit_tokens
    attention = 4 * q * layers * sum(n * n for n in lengths)
    return tokens * text_linear_flops_per_token(tc) + attention + logit_tokens * lm_head_flops_per_token(tc)


def step_flops(model_config: Any, metas: Iterable[Any]) -> tuple[float, float]:
    """(vision, text) training FLOPs of micro-batches known only by their `MicroBatchMeta` totals.

    Each micro-batch's images are taken as equal squares and its samples as equal lengths (it is packed
    from samples of similar length); padding is not counted: it is not useful work.
    """
    vision = text = 0.0
    vc, tc = model_config.vision_config, model_config.text_config
    for meta in metas:
        vision += vision_forward_flops_estimate(vc, meta.patches, meta.images)
        mean = meta.tokens / max(1, meta.samples)
        text += text_forward_flops(tc, [mean] * meta.samples, logit_tokens=meta.label_tokens)
    return TRAIN_FACTOR * vision, TRAIN_FACTOR * text


def model_flops(model_config: Any, metas: Iterable[Any]) -> float:
    """Model FLOPs of one training step over these micro-batches: the numerator of MFU (`step_flops`, both
    stages together)."""
    return sum(step_flops(model_config, metas))


def mfu(flops: float, step_time_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: `flops` (`model_flops`) done in `step_time_s` against `peak_flops`, the FLOP/s
    of every stage actor together (stages/run_log.py `peak_of`: `actor_peak` per actor)."""
    return flops / (step_time_s * peak_flops)


def datasheet_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known GPU, or None."""
    name = device_name.upper()
    return next((tflops for key, tflops in GPU_PEAK_TFLOPS if key in name), None)


def measure_matmul_tflops(device: str = "cpu", dtype: str = "float32", seconds: float = 0.25) -> float:
    """Best TFLOP/s of a square matmul on `device` with the current thread setting, over about `seconds`.

    The best of several short windows, not the mean: a peak is what the device can do, and on a shared
    machine a window may lose its core to another process.
    """
    import torch

    n = 512 if device == "cpu" else 8192
    dt = getattr(torch, dtype)
    # Constant operands, not torch.randn: this runs inside stage actors, whose RNG state a checkpoint
    # restores (and an exact resume replays); the matmul's speed does not depend on the values.
    a, b = torch.full((n, n), 0.5, device=device, dtype=dt), torch.full((n, n), 0.25, device=device, dtype=dt)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b  # warm-up: first-call allocation and kernel selection
    sync()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        runs, start = 0, time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds / 8:
            a @ b
            runs += 1
            sync()
        best = max(best, 2 * n**3 * runs / (time.perf_counter() - start) / 1e12)
    return best


def actor_peak(worker: Any, dtype: str = "float32") -> dict[str, Any]:
    """Peak TFLOP/s of the device a stage actor computes on (run on the actor through `__ray_call__`).

    A known GPU: its datasheet figure; an unknown GPU: a bf16 matmul measured on it; the CPU: a matmul in
    the run's compute `dtype`, measured here in the actor's own thread setting.
    """
    import torch

    device = str(getattr(worker, "device", "cpu"))
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        known = datasheet_tflops(name)
        if known is not None:
            return {"device": name, "gpu": True, "tflops": known, "source": "datasheet, bf16 dense"}
        tflops = measure_matmul_tflops(device, "bfloat16")
        return {"device": name, "gpu": True, "tflops": tflops, "source": "measured bf16 matmul"}
    threads = torch.get_num_threads()
    return {
        "device": f"cpu ({threads} thread{'s' * (threads > 1)})",
        "gpu": False,
        "tflops": measure_matmul_tflops("cpu", dtype),
        "source": f"measured {dtype} matmul",
    }
