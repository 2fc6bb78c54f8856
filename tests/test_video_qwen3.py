"""Qwen3-VL videos (dataflow/video_formats.py) against transformers' `Qwen3VLVideoProcessor`, `Qwen3VLProcessor` and
`Qwen3VLModel.get_rope_index`: the sampled frames, the clip's size, the patches, the text with a timestamp before
each temporal patch, and the mRoPE positions of a sample that holds a video and an image.

transformers' video processors resize with torchvision, which this project does not install (docs/data.md#video).
The processor runs here with `do_resize=False` on the frames dhp resized (to the size its `smart_resize` gives,
compared with the processor's own patch count), normalised in the test with the processor's mean and std, so its
`patchify`, timestamps, text expansion and tokenizer are transformers' own. Building a `ProcessorMixin` checks its
parts' classes against the auto-class tables, whose video table is empty without torchvision: that one check is
switched off while the processor is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
from dhp.dataflow.synth import write_mp4
from dhp.dataflow.video import VideoSettings
from dhp.dataflow.video_formats import QWEN3_VIDEO_FORMAT
from dhp.models.architectures import architecture_config
from dhp.models.family import family_of
from tests.conftest import write_image
from tests.test_video import moving_frames

VIDEO_PAD, IMAGE_PAD = 151656, 151655
# the clip's bounds are frames x height x width (Qwen3VLVideoProcessor's `size`)
SETTINGS = VideoSettings(fps=2.0, min_frames=4, max_frames=8, min_pixels=64 * 64, max_pixels=4 * 96 * 128)


def video_processor(s: VideoSettings, **kwargs):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(
        fps=s.fps,
        min_frames=s.min_frames,
        max_frames=s.max_frames,
        size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
        cap_pixels_per_frame=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def config():
    return architecture_config("qwen3_vl_tiny")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_videos")
    write_mp4(root / "clip.mp4", moving_frames(9, (100, 70)), fps=4)  # 9 frames at 4 fps: 2.25 s
    write_mp4(root / "one.mp4", moving_frames(1, (100, 70)), fps=4)
    for k, frame in enumerate(moving_frames(5, (90, 60))):
        frame.save(root / f"f{k}.png")
    write_image(root / "b.png", (60, 90), seed=2)
    return root


def preprocessor(root: Path, config, s: VideoSettings) -> Preprocessor:
    settings = PreprocessSettings(str(root), min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=2048, video=s)
    return Preprocessor(settings, config)


def test_the_family_names_the_format(config):
    assert family_of(config).video_format is QWEN3_VIDEO_FORMAT


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "min_frames", "max_frames"),
    [(9, 4.0, 2.0, 4, 8), (300, 30.0, 2.0, 4, 16), (300, 30.0, 0.5, 4, 768), (7, 25.0, 2.0, 4, 768), (9, 4.0, 2, 5, 8)],
)
def test_sampling_matches_transformers(total, video_fps, fps, min_frames, max_frames):
    from transformers.video_utils import VideoMetadata

    s = VideoSettings(fps=fps, min_frames=min_frames, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
    theirs = video_processor(s).sample_frames(meta, fps=fps).tolist()
    assert QWEN3_VIDEO_FORMAT.sample(total, video_fps, s, 2) == theirs


def normalised(frame: Image.Image, vp) -> torch.Tensor:
    """A resized frame rescaled and normalised with the video processor's own factors -> [C, H, W] f32."""
    a = np.asarray(frame.convert("RGB"), np.float32) * np.float32(vp.rescale_factor)
    a = (a - np.asarray(vp.image_mean, np.float32)) / np.asarray(vp.image_std, np.float32)
    return torch.from_numpy(a.transpose(2, 0, 1).copy())


@pytest.mark.parametrize(
    ("video", "s", "frames"),
    [
        ("clip.mp4", SETTINGS, 4),  # 4 of 9 frames at 4 fps: 2 temporal patches
        ("clip.mp4", VideoSettings(**{**SETTINGS.__dict__, "min_frames": 5}), 5),  # odd: the last frame repeats
        ([f"f{k}.png" for k in range(5)], SETTINGS, 5),  # frame files at data.video.frames_fps: all 5
    ],
    ids=["mp4", "mp4-odd", "frame-files"],
)
def test_sample_matches_the_qwen3_vl_processor(root, config, monkeypatch, video, s, frames):
    """A conversation with a video and an image: ids, video pixels and grid equal `Qwen3VLProcessor`'s on the same
    frames, positions equal `Qwen3VLModel.get_rope_index` given the processor's token types."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_utils import VideoMetadata

    from dhp.dataflow.tokenizer import load_tokenizer

    pre = preprocessor(root, config, s)
    record = {
        "video": video,
        "image": "b.png",
        "conversations": [
            {"from": "human", "value": "<video>\nWhat moves? And in <image>?"},
            {"from": "gpt", "value": "A red bar. Nothing."},
        ],
    }
    row = pre({"source": "t", "record": json.dumps(record)})
    assert row["error"] == "", row
    sample = decode_sample(row["sample"])

    # the same sampled frames as dhp reads them, resized to the clip's size (torchvision's resize is not here)
    _, grid, sampled = pre.load_video(video, None)
    vp = video_processor(
        s, do_sample_frames=False, do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False
    )
    total, fps = sampled.total, sampled.fps
    assert sampled.indices == vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
    assert len(sampled.indices) == frames
    w, h = sampled.frames[0].size
    # the clip's size: the processor's own patch count for these frames (its smart_resize, its bounds)
    assert vp.get_num_of_video_patches(frames, h, w) == int(np.prod(grid))
    resized = [f.resize((int(grid[2]) * 16, int(grid[1]) * 16), Image.Resampling.BICUBIC) for f in sampled.frames]

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    processor = Qwen3VLProcessor(image_processor=pre.image_processor, tokenizer=load_tokenizer(), video_processor=vp)
    text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|video_pad|>\nWhat moves? And in <|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n"
        "<|im_start|>assistant\nA red bar. Nothing.<|im_end|>\n"
    )
    out = processor(
        text=[text],
        images=[Image.open(root / "b.png")],
        videos=[torch.stack([normalised(f, vp) for f in resized])],
        video_metadata=[VideoMetadata(total_num_frames=total, fps=fps, frames_indices=sampled.indices)],
        return_tensors="pt",
    )
    ids = out["input_ids"][0]
    assert sample["input_ids"].tolist() == ids.tolist()
    t = (frames + 1) // 2
    decoded = processor.tokenizer.decode(ids)
    assert decoded.count(" seconds><|vision_start|><|video_pad|>") == t
    # the visuals in placeholder order: the video's patches first, then the image's
    video_rows = int(out["video_grid_thw"][0].prod())
    assert sample["image_grid_thw"].tolist() == [out["video_grid_thw"][0].tolist(), out["image_grid_thw"][0].tolist()]
    torch.testing.assert_close(sample["pixel_values"][:video_rows], out["pixel_values_videos"], rtol=0, atol=1e-6)
    assert torch.equal(sample["pixel_values"][video_rows:], out["pixel_values"].float())

    model = Qwen3VLModel(config)
    positions, _ = model.get_rope_index(
        out["input_ids"],
        mm_token_type_ids=out["mm_token_type_ids"],
        image_grid_thw=out["image_grid_thw"],
        video_grid_thw=out["video_grid_thw"].clone(),
    )
    assert torch.equal(sample["position_ids"], positions[:, 0])


def test_timestamps_in_the_text(root, config):
    """9 frames at 4 fps, 4 kept (0, 3, 5, 8): temporal patches at 0.375 s and 1.625 s, written with one decimal."""
    from dhp.dataflow.tokenizer import load_backend

    pre = preprocessor(root, config, SETTINGS)
    record = {
        "video": "clip.mp4",
        "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "A bar."}],
    }
    sample = decode_sample(pre({"source": "t", "record": json.dumps(record)})["sample"])
    text = load_backend(None).decode(sample["input_ids"].tolist(), skip_special_tokens=False)
    assert "<0.4 seconds><|vision_start|><|video_pad|>" in text and "<1.6 seconds><|vision_start|><|video_pad|>" in text


def test_a_one_frame_video_is_a_counted_skip(root, config):
    """Qwen3-VL's smart_resize refuses fewer frames than a temporal patch: the skip names the video."""
    pre = preprocessor(root, config, SETTINGS)
    record = {
        "video": "one.mp4",
        "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}],
    }
    row = pre({"source": "t", "record": json.dumps(record)})
    assert row["error"] == "bad_video_shape" and "one.mp4" in row["detail"], row


def test_synthetic_videos(tmp_path, config):
    """The synthetic set's videos (MPEG-4 files at 4 fps and frame lists) preprocess for Qwen3-VL with the default
    `data.video` settings, each temporal patch behind its timestamp."""
    from dhp.dataflow.synth import write_synthetic_dataset

    s = write_synthetic_dataset(tmp_path / "v", 12, seed=0, eval_num=0, video_fraction=0.5)
    videos = [r for r in map(json.loads, s.train_path.read_text().splitlines()) if "video" in r]
    assert {isinstance(r["video"], str) for r in videos} == {True, False}
    pre = Preprocessor(PreprocessSettings(str(s.out_dir), 56 * 56, 224 * 224, 2048), config)
    for r in videos:
        out = pre.process(json.dumps(r))
        t = int(out["image_grid_thw"][0, 0])
        assert out["image_grid_thw"].shape == (1, 3) and t >= 2
        assert int((out["input_ids"] == 151652).sum()) == t  # a <|vision_start|> per temporal patch
