"""The FLOP count from the config against torch's FlopCounterMode on the real models' forward passes.

Eager attention: FlopCounterMode has no formula for the CPU SDPA kernel, but counts eager attention's
matmuls, so the attention terms are checked too. Each part is compared on its own (the tiny model's
lm_head is ~90 % of the total and would hide errors elsewhere).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from dhp.dataflow.packing import MicroBatchMeta, meta_of, text_inputs, vision_inputs
from dhp.labels import count_label_tokens
from dhp.models.architectures import architecture_config
from dhp.models.planning.flops import (
    TRAIN_FACTOR,
    datasheet_tflops,
    measure_matmul_tflops,
    mfu,
    model_flops,
    step_flops,
    text_forward_flops,
    vision_forward_flops,
    vision_forward_flops_estimate,
    window_lengths,
)
from dhp.models.qwen2_5_vl import IGNORE_INDEX, TextModel, VisionModel

IMAGE, START, END = 151655, 151652, 151653
# (1, 20, 28): 10 x 14 merge units -> 3 x 4 windows with partial ones at the edges; (1, 8, 8): smaller
# than one window.
GRIDS = [(1, 20, 28), (1, 8, 8)]


def _sample(grids, text: int = 30) -> torch.Tensor:
    ids = list(range(100, 100 + text))
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END] + list(range(300, 300 + text))
    return torch.tensor([ids])


def _by_module(counter: FlopCounterMode, suffix: str) -> int:
    counts = counter.get_flop_counts()
    (key,) = [k for k in counts if k.endswith(suffix)]
    return sum(counts[key].values())


def close(a: float, b: float, tol: float = 0.02) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.fixture(scope="module")
def config():
    return architecture_config("tiny", "eager")


def test_hf_forward_matches_the_count_part_by_part(config):
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    ids = _sample(GRIDS)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 1176)
    with FlopCounterMode(display=False) as forward:
        out = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            labels=ids,
            pixel_values=pixels,
            image_grid_thw=torch.tensor(GRIDS),
            mm_token_type_ids=(ids == IMAGE).int(),
        )
    vc, tc = config.vision_config, config.text_config
    vision = vision_forward_flops(vc, GRIDS)
    assert close(_by_module(forward, "model.visual"), vision)
    merged, width = sum(t * h * w for t, h, w in GRIDS) // 4, 4 * vc.hidden_size
    assert close(_by_module(forward, "model.visual.merger"), merged * 2 * width * (width + vc.out_hidden_size))
    decoder = text_forward_flops(tc, [ids.shape[1]], logit_tokens=0)
    assert close(_by_module(forward, "model.language_model"), decoder)
    assert close(_by_module(forward, "lm_head"), text_forward_flops(tc, [ids.shape[1]]) - decoder)
    # The attention terms on their own: a full-attention block and a window block of the vision encoder.
    full_block, window_block = (_by_module(forward, f"visual.blocks.{i}.attn") for i in (1, 0))
    sq_full = sum((h * w) ** 2 for _, h, w in GRIDS)
    sq_window = sum(n * n for g in GRIDS for n in window_lengths(vc, *g))
    assert full_block - window_block == 4 * vc.hidden_size * (sq_full - sq_window)
    assert forward.get_total_flops() == pytest.approx(vision + text_forward_flops(tc, [ids.shape[1]]), rel=0.02)

    with FlopCounterMode(display=False) as backward:
        out.loss.backward()
    ratio = (forward.get_total_flops() + backward.get_total_flops()) / forward.get_total_flops()
    assert abs(ratio - TRAIN_FACTOR) <= 0.05 * TRAIN_FACTOR, ratio


def test_dhp_stages_match_the_count_with_logits_on_labelled_positions_only(config):
    """dhp's text stage computes lm_head only where a label exists: the count follows it."""
    torch.manual_seed(0)
    vision, text = VisionModel(config).float(), TextModel(config).float()
    ids = _sample(GRIDS[:1], text=40)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, -25:] = ids[0, -25:]  # the answer: the last 25 tokens
    from dhp.models.qwen2_5_vl import rope_positions

    positions = rope_positions(ids[0], torch.tensor(GRIDS[:1]), config).unsqueeze(1)
    pixels = torch.randn(GRIDS[0][1] * GRIDS[0][2], 1176)
    with FlopCounterMode(display=False) as counter:
        embeds = vision(pixels, torch.tensor(GRIDS[:1]))
        text(ids, embeds, positions, torch.ones_like(ids), labels)
    expected = vision_forward_flops(config.vision_config, GRIDS[:1]) + text_forward_flops(
        config.text_config, [ids.shape[1]], logit_tokens=count_label_tokens(labels)
    )
    assert close(counter.get_total_flops(), expected, tol=0.01)


def test_the_estimate_from_totals_is_exact_for_equal_squares_and_low_for_mixed_sizes(config):
    vc = config.vision_config
    for side in (8, 16, 20, 36):  # within one window, whole windows, partial windows
        grids = [(1, side, side)] * 3
        exact = vision_forward_flops(vc, grids)
        assert vision_forward_flops_estimate(vc, 3 * side * side, 3) == pytest.approx(exact, rel=1e-9)
    mixed = [(1, 8, 8), (1, 36, 36)]
    estimate = vision_forward_flops_estimate(vc, 64 + 36 * 36, 2)
    assert estimate < vision_forward_flops(vc, mixed)
    assert vision_forward_flops_estimate(vc, 0, 0) == 0.0


def test_step_flops_from_real_microbatch_metadata(config):
    """Two equal-length samples with equal square images: the metadata-only count is the exact one x 3."""
    grid = (1, 16, 16)
    samples = []
    for _ in range(2):
        ids = _sample([grid])[0]
        labels = ids.clone()
        labels[:10] = IGNORE_INDEX
        samples.append(
            {
                "input_ids": ids,
                "labels": labels,
                "position_ids": torch.zeros(3, len(ids), dtype=torch.long),
                "pixel_values": torch.zeros(256, 1176),
                "image_grid_thw": torch.tensor([grid]),
            }
        )
    meta = meta_of(vision_inputs(samples), text_inputs(samples, pad_id=0))
    vision, text = step_flops(config, [meta])
    length = len(samples[0]["input_ids"])
    assert vision == pytest.approx(TRAIN_FACTOR * vision_forward_flops(config.vision_config, [grid] * 2))
    assert text == pytest.approx(
        TRAIN_FACTOR * text_forward_flops(config.text_config, [length] * 2, logit_tokens=meta.label_tokens)
    )
    assert meta.label_tokens == 2 * (length - 10)


def test_real_shape_counts_are_in_the_published_range():
    """7B: ~2 x 7.6e9 FLOPs per text token with a short context (2 x parameters), and the ViT's ~0.67e9
    parameters give ~2 x 0.67e9 per patch plus attention."""
    config = architecture_config("qwen2_5_vl_7b")
    text = text_forward_flops(config.text_config, [1], logit_tokens=1)
    assert 2 * 7.0e9 < text < 2 * 7.7e9
    vision = vision_forward_flops(config.vision_config, [(1, 32, 32)]) / (32 * 32)
    assert 2 * 0.6e9 < vision < 2 * 0.75e9


def test_peaks():
    assert datasheet_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert datasheet_tflops("NVIDIA H100 PCIe") == 756.0
    assert datasheet_tflops("NVIDIA H200") == 989.0
    assert datasheet_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert datasheet_tflops("NVIDIA L40S") == 362.0 and datasheet_tflops("NVIDIA L4") == 121.0
    assert datasheet_tflops("NVIDIA GeForce GTX 1080") is None
    start = time.perf_counter()
    measured = measure_matmul_tflops("cpu", "float32", seconds=0.1)
    assert math.isfinite(measured) and 1e-4 < measured < 100
    assert time.perf_counter() - start < 2


def test_mfu_of_a_hand_counted_step():
    """dhp's MFU definition (docs/training.md#mfu) on shapes small enough to count by hand: a 2-block ViT, block 0
    windowed and block 1 full attention as in Qwen2.5-VL, its merger, and a 2-layer decoder with grouped-query
    attention, on one sample of 100 real tokens (padded to 128) holding one 16 x 16-patch image. Dropping any
    term, counting padding, or counting activation checkpointing's repeated forward changes the result."""
    config = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            fullatt_block_indexes=[1],
            window_size=112,  # 8 x 8 patches
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            out_hidden_size=48,
        ),
        text_config=dict(
            vocab_size=1000,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # head_dim 12: q 48 wide, k and v 24 each
            bos_token_id=0,
            eos_token_id=1,
        ),
    )
    meta = MicroBatchMeta(samples=1, tokens=100, padded_tokens=128, label_tokens=30, images=1, patches=256)

    # Vision, per patch: the patch embedding (3 x 2 x 14 x 14 = 1176 inputs -> 32) and, per block, qkv and proj
    # (4 x 32 x 32) and the gated MLP (3 x 32 x 64). The merger per merged token (256 / 4 = 64): 128 -> 128 -> 48.
    embed = 2 * 1176 * 32
    blocks = 2 * 2 * (4 * 32 * 32 + 3 * 32 * 64)
    merger = 64 * 2 * (128 * 128 + 128 * 48)
    # Attention, 4 x hidden x (sum of squared lengths): block 0 in four 64-patch windows, block 1 the whole image.
    window_attention = 4 * 32 * 4 * 64**2
    full_attention = 4 * 32 * 256**2
    vision = 256 * (embed + blocks) + merger + window_attention + full_attention

    # Text, per token and layer: q and o (48 x 48 each), k and v (48 x 24 each), the gated MLP (3 x 48 x 96);
    # attention 4 x 48 x 100^2 per layer over the real tokens only; lm_head on the 30 labelled positions.
    layers = 2 * 100 * 2 * (2 * 48 * 48 + 2 * 48 * 24 + 3 * 48 * 96)
    text_attention = 2 * 4 * 48 * 100**2
    lm_head = 2 * 48 * 1000 * 30
    text = layers + text_attention + lm_head

    assert (vision, text) == (43_122_688, 15_014_400)  # 29.8 M + 2.9 M + 2.1 M + 8.4 M; 8.3 M + 3.8 M + 2.9 M
    assert step_flops(config, [meta]) == pytest.approx((3 * vision, 3 * text), rel=1e-12)
    flops = model_flops(config, [meta])
    assert flops == pytest.approx(3 * (vision + text), rel=1e-12)
    assert mfu(flops, 2.0, 1e9) == pytest.approx(3 * (vision + text) / 2e9, rel=1e-12)

    from types import SimpleNamespace

    from dhp.stages.run_log import throughput

    batches = [SimpleNamespace(microbatches=[SimpleNamespace(meta=meta)])]
    assert throughput(batches, config, 2.0, 1e9)["mfu"] == pytest.approx(3 * (vision + text) / 2e9, rel=1e-3)
