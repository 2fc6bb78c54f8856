"""Qwen3-VL in the plan's counts: FLOPs against torch's FlopCounterMode, kept activations against saved-tensor
hooks, parameters against a meta build, on the tiny Qwen3-VL's real modules (one process, quick).

What is held: full attention in every vision block (no windows), the learned position embedding, the merger and
the DeepStack mergers (their FLOPs, their saved tensors), LayerNorm and the plain MLP of its ViT, the decoder's
own head_dim and its q/k RMSNorms, and the wider boundary row the memory plan counts in both pools. Dropping any
of them from the formulas fails here. The same counts against the actors of a real layout:
tests/test_parity.py's Qwen3-VL cases marked `planned` (tests/test_plan_measured.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dhp.models.family import family_of_shape
from dhp.models.parallel.layout import Layout, VitShape
from dhp.models.planning.flops import merger_flops_per_patch, text_forward_flops, vision_forward_flops
from dhp.models.planning.memory_plan import boundary_row_bytes, meta_stage, text_activations
from dhp.models.planning.saved_tensors import SavedBytes
from dhp.stages.config import load_config

NAME = "qwen3_vl_tiny"
GRIDS = [(1, 12, 16), (1, 8, 8)]  # two images: attention stays within each


@pytest.fixture(scope="module")
def family():
    return family_of_shape(NAME)


def _pixels(vc, grids) -> torch.Tensor:
    torch.manual_seed(0)
    values = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    return torch.randn(sum(t * h * w for t, h, w in grids), values)


def test_vision_flops_count_full_attention_and_the_deepstack_mergers(family):
    config = family.shape_config(NAME, "eager")  # FlopCounterMode counts eager attention's matmuls, not CPU SDPA's
    vc = config.vision_config
    model = family.vision_model(config)
    with FlopCounterMode(display=False) as counter:
        model(_pixels(vc, GRIDS), torch.tensor(GRIDS))
    counts = counter.get_flop_counts()

    def of(pattern: str) -> int:
        return sum(sum(v.values()) for k, v in counts.items() if re.search(pattern + "$", k))

    patches = sum(t * h * w for t, h, w in GRIDS)
    k = len(family.deepstack_indexes(vc))
    assert k == 2
    assert of(r"visual\.merger") == pytest.approx(patches * merger_flops_per_patch(vc), rel=1e-9)
    assert of(r"visual\.deepstack_merger_list\.\d+") == pytest.approx(
        k * patches * merger_flops_per_patch(vc), rel=1e-9
    )
    # every block attends over its whole image: QK^T and AV, 4 x hidden per pair of patches
    attention = 4 * vc.hidden_size * sum(t * (h * w) ** 2 for t, h, w in GRIDS)
    qkv_proj = 2 * patches * 4 * vc.hidden_size**2
    for block in range(vc.depth):
        assert of(rf"visual\.blocks\.{block}\.attn") == attention + qkv_proj
    assert of(r"\.visual") == pytest.approx(vision_forward_flops(vc, GRIDS), rel=1e-6)


def test_text_flops_take_the_decoders_own_head_dim(family):
    config = family.shape_config(NAME, "eager")
    tc = config.text_config
    assert tc.head_dim * tc.num_attention_heads != tc.hidden_size  # the case Qwen2.5-VL's h / n would miss
    model = family.text_model(config)
    length = 40
    ids = torch.randint(100, 1000, (1, length))
    positions = torch.arange(length).view(1, 1, length).expand(3, 1, length)
    with FlopCounterMode(display=False) as counter:
        model.hidden_states(ids, torch.zeros(0, family.boundary_width(config)), positions, None)
    assert counter.get_total_flops() == pytest.approx(text_forward_flops(tc, [length], logit_tokens=0), rel=0.01)


@pytest.mark.parametrize("grids", [GRIDS, [(1, 32, 32)]], ids=["two-images", "one-1024"])
def test_vit_saved_bytes_are_the_plans(family, grids):
    """Exact for transformers' own modules: the position embedding's indices and weights, LayerNorm's mean and
    rstd, the plain MLP, every merger's norm and GELU, and no window index. dhp's grouped attention keeps no more:
    where its attention output is already the projection's input (one segment length) or its q/k/v are gathered
    copies (several), up to 2 D per patch and block less, plus the groups' int64 row indices (2 per patch)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention

    config = family.shape_config(NAME)
    vc = config.vision_config
    model = family.vision_model(config)
    pixels = _pixels(vc, grids)
    with SavedBytes(model) as grouped:
        model(pixels, torch.tensor(grids))
    for block in model.visual.blocks:
        block.attn.__class__ = Qwen3VLVisionAttention  # transformers' loop, one call per segment
    with SavedBytes(model) as saved:
        model(pixels, torch.tensor(grids))
    shape = VitShape.of(vc)
    assert (shape.full, shape.deepstack, shape.pos_embed, shape.gated, shape.layer_norm) == (4, 2, 64, False, True)
    planned = Layout("vision").vit_activation_bytes(shape, pixels.shape[0], 4)
    assert planned == saved.total
    patches = pixels.shape[0]
    assert planned - 2 * vc.hidden_size * vc.depth * patches * 4 <= grouped.total - 2 * patches * 8 <= planned
    without = shape._replace(deepstack=0)
    assert Layout("vision").vit_activation_bytes(without, pixels.shape[0], 4) < 0.95 * saved.total


def test_decoder_saved_bytes_are_the_plans(family):
    """q and k RMSNorms per head and the query's own width; the DeepStack additions keep only an index."""
    config = family.shape_config(NAME)
    tc = config.text_config
    model = family.text_model(config)
    length, images = 256, 64
    ids = torch.randint(100, 1000, (1, length))
    ids[0, 8 : 8 + images] = config.image_token_id
    rows = torch.randn(images, family.boundary_width(config), requires_grad=True)
    positions = torch.arange(length).view(1, 1, length).expand(3, 1, length)
    with SavedBytes(model) as saved:
        model.hidden_states(ids, rows, positions, None)
    planned, _ = text_activations(tc, length, tp=1, b=4)
    assert abs(planned - saved.total) <= 0.001 * saved.total, (planned, saved.total)


@pytest.mark.parametrize("name", sorted(family_of_shape(NAME).shapes))
def test_vit_parameter_count_is_the_modules(name):
    family = family_of_shape(name)
    config = family.shape_config(name)
    module = meta_stage(config, "vision")
    assert VitShape.of(config.vision_config).params() == sum(p.numel() for p in module.parameters())


def test_the_boundary_row_carries_the_deepstack_features(family):
    cfg = load_config("tiny", [f"model.name={NAME}"])
    config = family.shape_config(NAME)
    width = config.text_config.hidden_size * (1 + len(config.vision_config.deepstack_visual_indexes))
    assert boundary_row_bytes(cfg, config, "vision") == boundary_row_bytes(cfg, config, "text") == 3 * 64 * 4
    assert family.boundary_width(config) == width


@pytest.mark.parametrize("name", ["tiny", NAME])
def test_workload_counts_video_frames_by_temporal_patch(name):
    """An image is one temporal patch; a video of F frames ceil(F / temporal_patch_size), each frame's sides
    rounded to patch x merge as the processor resizes them (Qwen2.5-VL: 28 px, Qwen3-VL: 32 px)."""
    from dhp.models.planning.time_model import Workload, visual_patches

    vc = family_of_shape(name).shape_config(name).vision_config
    unit = vc.patch_size * vc.spatial_merge_size
    assert vc.temporal_patch_size == 2
    frame = (8 * unit // vc.patch_size) * (4 * unit // vc.patch_size)  # an 8 x 4-unit frame's patches
    assert visual_patches(vc, 1, 8 * unit, 4 * unit) == frame
    assert visual_patches(vc, 8, 8 * unit, 4 * unit) == 4 * frame
    assert visual_patches(vc, 7, 8 * unit, 4 * unit) == 4 * frame  # the last frame repeated
    assert visual_patches(vc, 1, 8 * unit + 3, 4 * unit - 3) == frame  # rounded to the nearest unit
    w = Workload.of(vc, images=[(8 * unit, 4 * unit)], videos=[(16, 8 * unit, 4 * unit)], text_tokens=100)
    # the video's markup besides its pads, as its family writes it (Qwen3-VL: a timestamp per temporal patch)
    markup = family_of_shape(name).video_format.markup_tokens(16, 2.0, 2)
    assert w.image_patches == 9 * frame and w.sample_tokens == 9 * frame // 4 + 100 + markup
    assert w.visuals == ((1, frame), (8, frame))
    with pytest.raises(ValueError, match="at least one frame"):
        visual_patches(vc, 0, unit, unit)
