"""One attention call per window length (models/window_attention.py) == transformers' call per window.

The reference is transformers' own ViT with its stock `Qwen2_5_VLVisionAttention`; the grouped copy holds the
same weights. Images with ragged edge windows, several images and video frames; sdpa and eager; output and
every gradient in fp32. The attention calls are counted through transformers' attention registry.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.modeling_utils import AttentionInterface
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from dhp.models.architectures import architecture_config
from dhp.models.qwen2_5_vl import VisionModel
from dhp.models.window_attention import (
    GroupedVisionAttention,
    group_segment_attention,
    group_segments,
    segment_attention,
    segment_groups,
)
from tests.conftest import rel_err

# [16, 20]: windows of 16 patches with ragged right-edge ones (20 % 8 != 0); [1, 8, 8]: one length only;
# [2, 8, 12]: two frames. Four windowed and full-attention lengths in all.
GRIDS = [[1, 16, 20], [1, 8, 8], [2, 8, 12], [1, 4, 6]]
TOL = 1e-5  # fp32; measured ~1e-7 here


def _run(visual, grid: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor):
    visual.zero_grad(set_to_none=True)
    out = visual(pixels, grid_thw=grid).pooler_output
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in visual.named_parameters()}


def _stock_and_grouped(vit_class, shape: str, implementation: str):
    """(vision config, transformers' ViT of `shape`, a copy with dhp's grouped attention), fp32, training."""
    config = copy.deepcopy(architecture_config(shape).vision_config)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    stock = vit_class._from_config(config, dtype=torch.float32).train()
    grouped = copy.deepcopy(stock)
    group_segment_attention(grouped)
    return config, stock, grouped


def _count_calls(implementation: str, monkeypatch) -> tuple[list[int], object]:
    """Count the calls of the attention function (eager has none in the registry): (each call's batch, the real
    function or None)."""
    calls = []
    real = AttentionInterface._global_mapping[implementation] if implementation != "eager" else None

    def counting(module, q, *args, **kwargs):
        calls.append(q.shape[0])  # batch: the segments this call stacks
        return real(module, q, *args, **kwargs)

    if real is not None:
        monkeypatch.setitem(AttentionInterface._global_mapping, implementation, counting)
    return calls, real


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_grouped_attention_matches_transformers(implementation, monkeypatch):
    config, stock, grouped = _stock_and_grouped(Qwen2_5_VisionTransformerPretrainedModel, "tiny", implementation)
    assert all(type(b.attn) is GroupedVisionAttention for b in grouped.blocks)
    assert all(type(b.attn) is not GroupedVisionAttention for b in stock.blocks)
    calls, real = _count_calls(implementation, monkeypatch)
    grid = torch.tensor(GRIDS)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g)
    weights = torch.randn(int(grid.prod(-1).sum()) // 4, config.out_hidden_size, generator=g)
    ref_out, ref_grads = _run(stock, grid, pixels, weights)
    stock_calls = len(calls)
    calls.clear()
    out, grads = _run(grouped, grid, pixels, weights)
    assert rel_err(out, ref_out) < TOL
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) < TOL, name
    if real is not None:
        # at most one call per distinct length in a block (4 windowed, 3 whole-image lengths here), where
        # transformers makes one per window/image; every segment attended exactly once
        assert len(calls) <= 2 * 4 + 2 * 3 < stock_calls
        windows, images = _segments(grouped, grid)
        assert sum(calls) == 2 * windows + 2 * images  # two windowed and two full-attention blocks


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_grouped_attention_matches_transformers_qwen3_vl(implementation, monkeypatch):
    """Qwen3-VL's encoder (full attention in every block, DeepStack mergers): dhp's grouped attention against
    transformers' stock per-segment loop on images of three sizes and a two-frame-pair video; the merged output,
    every DeepStack feature and every gradient, fp32; one call per distinct length in each block."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from dhp.models.window_attention import GroupedQwen3VisionAttention

    config, stock, grouped = _stock_and_grouped(Qwen3VLVisionModel, "qwen3_vl_tiny", implementation)
    assert all(type(b.attn) is GroupedQwen3VisionAttention for b in grouped.blocks)
    calls, real = _count_calls(implementation, monkeypatch)
    grid = torch.tensor([[1, 16, 20], [2, 8, 12], [1, 8, 8], [1, 4, 6]])
    g = torch.Generator().manual_seed(1)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, config.in_channels * config.temporal_patch_size * config.patch_size**2, generator=g)
    outs, grads = [], []
    for visual in (stock, grouped):
        calls.clear()
        visual.zero_grad(set_to_none=True)
        out = visual(pixels, grid_thw=grid)
        features = [out.pooler_output, *out.deepstack_features]
        torch.manual_seed(2)
        sum((f * torch.randn_like(f)).sum() for f in features).backward()
        outs.append([f.detach() for f in features])
        grads.append({n: p.grad.clone() for n, p in visual.named_parameters()})
    assert len(outs[1]) == 1 + len(config.deepstack_visual_indexes)
    for ours, theirs in zip(outs[1], outs[0]):
        assert rel_err(ours, theirs) < TOL
    for name, ref in grads[0].items():
        assert rel_err(grads[1][name], ref) < TOL, name
    if real is not None:  # four lengths: 320, 96 (the video's two frame pairs), 64, 24 patches
        assert len(calls) == 4 * len(grouped.blocks)


def _segments(visual, grid) -> tuple[int, int]:
    """Non-empty windows (transformers' list also holds empty ones: a padded window row) and images/frames."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    _, cu_windows = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size, visual.patch_size)
    return int(((cu_windows[1:] - cu_windows[:-1]) > 0).sum()), get_vision_cu_seqlens(grid).shape[0] - 1


def test_vision_model_uses_grouped_attention():
    model = VisionModel(architecture_config("tiny"))
    assert all(type(b.attn) is GroupedVisionAttention for b in model.visual.blocks)


def test_group_segments_rows_and_order():
    one = group_segments(torch.tensor([0, 4, 8, 12]))
    assert one.inverse is None and one.groups == [(4, 3, slice(0, 12))]
    mixed = group_segments(torch.tensor([0, 4, 6, 6, 10, 12]))  # lengths 4, 2, 0 (dropped), 4, 2
    assert [(n, c) for n, c, _ in mixed.groups] == [(4, 2), (2, 2)]
    assert mixed.groups[0][2].tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert mixed.groups[1][2].tolist() == [4, 5, 10, 11]
    order = torch.cat([r for _, _, r in mixed.groups])
    assert torch.equal(order[mixed.inverse], torch.arange(12))
    assert (one.longest, mixed.longest) == (4, 4)
    assert group_segments(torch.tensor([0])).groups == [] and group_segments(torch.tensor([0])).longest == 0


def test_segment_groups_cached_per_tensor_until_changed():
    cu = torch.tensor([0, 4, 6])
    first = segment_groups(cu)
    assert segment_groups(cu) is first
    assert segment_groups(torch.tensor([0, 4, 6])) is not first  # another tensor: its own entry
    cu[1] = 3  # in place: the cached grouping no longer describes it
    assert [(n, c) for n, c, _ in segment_groups(cu).groups] == [(3, 2)]


def test_segment_attention_rejects_wrong_cover():
    model = VisionModel(architecture_config("tiny"))
    attn = model.visual.blocks[0].attn
    q = torch.zeros(5, 4, 16)
    with pytest.raises(ValueError, match="covers 4 rows but q has 5"):
        segment_attention(attn, q, q, q, torch.tensor([0, 4]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_grouped_attention_matches_transformers_on_cuda(dtype, tol):
    """The same on a GPU: fp32 through SDPA's kernels (the stacked windows as a batch), bf16 through torch's varlen
    flash attention (one call per block, models/torch_varlen.py)."""
    config = copy.deepcopy(architecture_config("tiny").vision_config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    stock = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype).cuda().train()
    grouped = copy.deepcopy(stock)
    group_segment_attention(grouped)
    grid = torch.tensor([[1, 32, 40], *GRIDS], device="cuda")
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g).to("cuda", dtype)
    weights = torch.randn(int(grid.prod(-1).sum()) // 4, config.out_hidden_size, generator=g).to("cuda", dtype)
    ref_out, ref_grads = _run(stock, grid, pixels, weights)
    out, grads = _run(grouped, grid, pixels, weights)
    assert rel_err(out.float(), ref_out.float()) < tol
    for name, ref in ref_grads.items():
        assert rel_err(grads[name].float(), ref.float()) < tol, name


def test_grouped_attention_runs_under_inference_mode():
    """Inference tensors keep no version counter: the grouping cache must not ask for one."""
    model = VisionModel(architecture_config("tiny")).eval()
    grid = torch.tensor([[1, 16, 20]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176)
    with torch.no_grad():
        want = model(pixels, grid)
    with torch.inference_mode():
        got = model(pixels, grid)
    assert torch.equal(got, want)
