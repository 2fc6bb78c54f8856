"""Videos in the planner: `dhp plan --time --video`, attention per temporal patch as transformers' encoders cut it,
Qwen3-VL's timestamps in the text count as the tokenizer writes them, the length profile's frames, and each
family's own vision kernels. No wall-clock: every number is a prediction or a count of the real modules.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dhp.dataflow.length_profile import sizes_of
from dhp.dataflow.video_formats import SampledVideo
from dhp.models.architectures import architecture_config
from dhp.models.family import family_of_shape
from dhp.models.planning.hardware import datasheet
from dhp.models.planning.length_mix import check_samples, shape
from dhp.models.planning.time_model import MicroBatchShape, Workload, vision_calls
from dhp.scripts.plan_time import prepare
from dhp.stages.cli import main as cli_main
from dhp.stages.config import load_config

NAMES = ["tiny", "qwen3_vl_tiny"]


def _cfg(name: str, w: Workload):
    cfg = load_config("tiny", [f"model.name={name}", "training.global_batch_size=8"])
    return prepare(cfg, datasheet("h100-sxm"), 2, w), architecture_config(name, "sdpa")


@pytest.mark.parametrize("name", NAMES)
def test_plan_time_takes_a_video(name, tmp_path, capsys):
    """`--video 16x448x448`: 8 temporal patches of the frame's patches, merged by the family's unit; Qwen3-VL's
    sample carries its timestamps and per-temporal-patch start / end pairs among its text tokens."""
    family = family_of_shape(name)
    vc = family.shape_config(name).vision_config
    out = tmp_path / "plan.json"
    argv = ["plan", "--time", "--gpu", "h100-sxm", "--gpus", "2", "--video", "16x448x448", "--text-tokens", "100"]
    assert cli_main([*argv, "--json", str(out), f"model.name={name}"]) == 0
    row = json.loads(out.read_text())
    frame = (448 // vc.patch_size) ** 2  # 448 px is a whole number of units in both families (28, 32 px)
    assert row["visuals"] == [[8, frame]] and row["image_patches"] == 8 * frame
    markup = family.video_format.markup_tokens(16, 2.0, 2)
    assert row["text_tokens"] == 100 + markup
    assert markup == (0 if name == "tiny" else 8 * 6 + 2 * 7)  # 8 `<d.d seconds>` of 6 tokens, 7 more pairs
    tokens = 8 * frame // vc.spatial_merge_size**2 + 100 + markup  # a sample's sequence
    budget = max(load_config("tiny", [f"model.name={name}"]).data.microbatch_tokens, tokens)
    assert row["samples_per_microbatch"] == budget // tokens
    assert "a video: 8 temporal patches" in capsys.readouterr().out
    # a video beside an image, and the errors of one line
    assert cli_main([*argv, "--image-patches", "256", "--json", str(out), f"model.name={name}"]) == 0
    assert json.loads(out.read_text())["visuals"] == [[1, 256], [8, frame]]
    assert cli_main([*argv[:-4], "--video", "16x448"]) == 2
    assert "FRAMESxHEIGHTxWIDTH" in capsys.readouterr().err
    assert cli_main(["plan", "--video", "16x448x448"]) == 2  # the memory plan alone takes no sample


@pytest.mark.parametrize("name", NAMES)
def test_video_attention_is_per_temporal_patch(name):
    """The segments the time model attends over are transformers' `cu_seqlens` for the video's grid (h x w per
    temporal patch); full attention of 8 frame pairs costs 1/8 of one image of the same patches, window attention
    (Qwen2.5-VL, windows inside each frame pair) the same."""
    from transformers.vision_utils import get_vision_cu_seqlens

    family = family_of_shape(name)
    vc = family.shape_config(name).vision_config
    grid = torch.tensor([[8, 32, 32], [1, 16, 24]])
    cu = get_vision_cu_seqlens(grid)
    segments = [int(n) for n in cu[1:] - cu[:-1]]
    mb = MicroBatchShape((8 * 1024, 384), (2200,), (100,), frames=(8, 1))
    assert family.frame_attention
    assert [n for t, n in mb.attention_segments(family.frame_attention) for _ in range(t)] == segments
    video = Workload.of(vc, image_patches=[], videos=[(16, 32 * vc.patch_size, 32 * vc.patch_size)], text_tokens=0)
    image = Workload(video.image_patches, video.text_tokens)
    cfg, mc = _cfg(name, video)
    (fv, _), (fi, _) = (vision_calls(cfg, mc, datasheet("h100-sxm"), w) for w in (video, image))
    assert fv.parts["full_attention"] == pytest.approx(fi.parts["full_attention"] / 8)
    assert fv.parts["window_attention"] == pytest.approx(fi.parts["window_attention"])
    assert (fv.parts["window_attention"] > 0) == family.windowed(vc)
    assert fv.parts["linear"] == fi.parts["linear"]


@pytest.mark.parametrize("frames", [2, 7, 16, 40])
def test_video_markup_tokens_are_the_tokenizers(frames):
    """What each family's format writes around a video, tokenized by the real tokenizer, less its pad runs and the
    one start / end pair an image has: Qwen3-VL's timestamps (digits one token each, past 10 s two), none for
    Qwen2.5-VL."""
    from dhp.dataflow.tokenizer import load_tokenizer

    tok = load_tokenizer()
    video = SampledVideo([], list(range(frames)), frames, 2.0)
    for name in NAMES:
        fmt = family_of_shape(name).video_format
        t = -(-frames // 2)
        text, runs = fmt.text(video, [t, 4, 4], 4, 2)
        written = len(tok(text, add_special_tokens=False)["input_ids"])
        assert written - len(runs) - 2 == fmt.markup_tokens(frames, 2.0, 2), (name, text)


def test_a_profile_keeps_frames_and_an_old_one_still_loads():
    """`dhp data profile` writes each visual's temporal patches; a profile without them reads as one each; a
    micro-batch of a video sample attends per frame pair (less full attention than the same patches as one image)."""
    sample = {"image_grid_thw": torch.tensor([[8, 4, 4], [1, 8, 8]]), "input_ids": torch.zeros(200, dtype=torch.long)}
    sizes = sizes_of(sample, 4)
    assert sizes == {"patches": [128, 64], "frames": [8, 1], "text_tokens": 200 - 48, "tokens": 200}
    old = {k: v for k, v in sizes.items() if k != "frames"}
    assert check_samples([old])[0]["frames"] == [1, 1]
    with pytest.raises(ValueError, match="frames"):
        check_samples([{**sizes, "frames": [3, 1]}])
    video, flat = shape([sizes], packed=False), shape(check_samples([old]), packed=False)
    assert video.frames == (8, 1) and flat.frames == () and video.images == flat.images
    cfg, mc = _cfg("qwen3_vl_tiny", Workload(192, 152))
    (fv, _), (ff, _) = (vision_calls(cfg, mc, datasheet("h100-sxm"), mb) for mb in (video, flat))
    assert fv.parts["full_attention"] < ff.parts["full_attention"]


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched, views excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _ops_per_module(visual, modules, grid: torch.Tensor) -> dict:
    """Ops each of `modules` dispatches in one forward of transformers' vision model `visual` on `grid`."""
    counts, hooks = {}, []

    def before(module, args):
        module._ops = _Ops()
        module._ops.__enter__()

    def after(module, args, out):
        module._ops.__exit__(None, None, None)
        counts[module] = module._ops.count

    for m in modules:
        hooks += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    vc = visual.config
    pixels = torch.randn(int(grid.prod(-1).sum()), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2)
    with torch.no_grad():
        visual(pixels, grid_thw=grid)
    for h in hooks:
        h.remove()
    return counts


@pytest.mark.parametrize("name", NAMES)
def test_vision_kernels_are_the_familys_own_ops(name):
    """`vision_block_ops` / `vision_merger_ops` are what one block's and one merger's forward dispatch in the
    family's real modules (as dhp builds them) on one image; `vision_attention_ops` what a full-attention block
    adds over a video's temporal patches and images of three sizes (one attention call per distinct length,
    grouped, in both families). The time model's kernel part counts every block, every merger
    (Qwen3-VL: the three DeepStack mergers too) and the full blocks' extra calls."""
    from transformers.vision_utils import get_vision_cu_seqlens

    family = family_of_shape(name)
    config = family.shape_config(name)
    visual = family.vision_model(config).visual
    vc = config.vision_config
    mergers = [visual.merger, *family.deepstack_mergers(visual)]
    counts = _ops_per_module(visual, [*visual.blocks, *mergers], torch.tensor([[1, 16, 16]]))
    assert {counts[b] for b in visual.blocks} == {family.vision_block_ops}
    assert {counts[m] for m in mergers} == {family.vision_merger_ops}
    # the last full-attention block: Qwen2.5-VL's first one also builds the groups' indices, once per forward
    last_full = visual.blocks[family.full_attention_blocks(vc)[-1]]
    prof = datasheet("h100-sxm")
    for grid, frames in (([[4, 16, 16]], (4,)), ([[1, 16, 16], [1, 8, 8], [1, 32, 16]], (1, 1, 1))):
        grid = torch.tensor(grid)
        cu = get_vision_cu_seqlens(grid)
        extra = family.vision_attention_ops([int(n) for n in cu[1:] - cu[:-1]])
        assert _ops_per_module(visual, [last_full], grid)[last_full] == family.vision_block_ops + extra
        assert (extra > 0) == (frames != (4,))  # a video's frame pairs: one length, one call
        mb = MicroBatchShape(tuple(int(n) for n in grid.prod(-1)), (600,), (100,), frames=frames)
        cfg, mc = _cfg(name, Workload(mb.patches, 100))
        kernels = vision_calls(cfg, mc, prof, mb)[0].parts["kernels"]
        full = len(family.full_attention_blocks(vc))
        expected = family.vision_block_ops * vc.depth + family.vision_merger_ops * len(mergers) + full * extra
        assert kernels == pytest.approx(expected * prof.op_latency_s)
