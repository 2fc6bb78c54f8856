"""How a model family samples a video's frames, turns them into patches and writes the video into the text.

A family names its format (`ModelFamily.video_format`, models/family/); the preprocessor asks it and tests no name.

    Qwen2.5-VL  `VideoFormat`: transformers' `Qwen2VLVideoProcessor` (dataflow/video.py): frames sampled by its fps
                policy (a multiple of temporal_patch_size), each frame resized within data.video.min_pixels /
                max_pixels, the video one `<|vision_start|><|video_pad|>...<|vision_end|>` run; the time is in
                the positions (`second_per_grid_ts`).
    Qwen3-VL    `Qwen3VideoFormat`: transformers' `Qwen3VLVideoProcessor` and `Qwen3VLProcessor`: frames sampled
                by `sample_frames` (int(total / video_fps x fps), within [min_frames, max_frames] and the video's
                length, `linspace(0, total - 1)` rounded; an odd count repeats the last frame), one size for the
                whole clip from its `smart_resize` with data.video.min_pixels / max_pixels bounding frames x height
                x width (the processor's `size`), 32 px units (patch 16 x merge 2), normalised by its mean and std;
                every temporal patch is written `<t seconds><|vision_start|><|video_pad|>...<|vision_end|>`, t the
                mean time of its frames with one decimal (`_calculate_timestamps`); the positions treat each
                temporal patch as an image (`get_rope_index`), the time is only in the text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dhp.dataflow.video import BadVideo, VideoSettings, sample_indices, video_patches

if TYPE_CHECKING:
    from PIL import Image

VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"


@dataclass(frozen=True)
class SampledVideo:
    """A video's kept frames: `indices` of `total` frames at `fps` frames a second."""

    frames: list[Image.Image]
    indices: list[int]
    total: int
    fps: float

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of video (`VideoMetadata.sampled_fps`)."""
        return len(self.indices) / self.total * self.fps


class VideoFormat:
    """Qwen2.5-VL's videos (module docstring)."""

    def sample(self, total: int, video_fps: float, s: VideoSettings, temporal: int) -> list[int]:
        """The indices of the frames kept of `total` at `video_fps`."""
        return sample_indices(total, video_fps, s, temporal)

    def patcher(self, s: VideoSettings, vision_config: Any) -> Callable[[list[Image.Image]], tuple]:
        """frames -> (pixel_values [t * h * w, C * T * p * p] f32, grid_thw [1, 3] i64), sized within `s`'s bounds."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # Frames go through the same PIL image processor as images, within the video pixel bounds (per frame).
        processor = Qwen2VLImageProcessorPil(
            min_pixels=s.min_pixels,
            max_pixels=s.max_pixels,
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            merge_size=vision_config.spatial_merge_size,
        )
        return functools.partial(video_patches, frame_processor=processor, temporal=vision_config.temporal_patch_size)

    def text(self, video: SampledVideo, grid: np.ndarray, merge_unit: int, temporal: int) -> tuple[str, list[int]]:
        """What `<video>` becomes in the text (one `<|video_pad|>` per run) and the merged tokens of each run."""
        return VIDEO_TEXT, [int(np.prod(grid)) // merge_unit]

    def markup_tokens(self, frames: int, fps: float, temporal: int) -> int:
        """Text tokens `text` writes for a video of `frames` sampled frames at `fps` frames a second, besides its
        pad tokens and the one `<|vision_start|>` / `<|vision_end|>` pair an image has too (the planner's text
        count): none, the time is in the positions."""
        return 0


class Qwen3VideoFormat(VideoFormat):
    """Qwen3-VL's videos (module docstring)."""

    def sample(self, total: int, video_fps: float, s: VideoSettings, temporal: int) -> list[int]:
        # `Qwen3VLVideoProcessor.sample_frames(metadata, fps=s.fps)` with min_frames / max_frames from `s`
        num = int(total / video_fps * s.fps)
        num = min(max(num, s.min_frames), s.max_frames, total)
        return np.linspace(0, total - 1, num).round().astype(int).tolist()

    def patcher(self, s: VideoSettings, vision_config: Any) -> Callable[[list[Image.Image]], tuple]:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

        patch, merge = vision_config.patch_size, vision_config.spatial_merge_size
        temporal = vision_config.temporal_patch_size
        # Resized here to the clip's size; the PIL image processor then rescales, normalises with the video
        # processor's mean and std, and cuts each frame into patches (video_patches lays them out per temporal patch).
        processor = Qwen2VLImageProcessorPil(
            do_resize=False,
            patch_size=patch,
            temporal_patch_size=temporal,
            merge_size=merge,
            image_mean=Qwen3VLVideoProcessor.image_mean,
            image_std=Qwen3VLVideoProcessor.image_std,
        )

        def patches(frames: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
            width, height = frames[0].size
            if any(f.size != (width, height) for f in frames):
                raise BadVideo("corrupt_video", f"frames of different sizes {sorted({f.size for f in frames})}")
            # ValueError (fewer frames than a temporal patch, an aspect ratio beyond 200:1): bad_video_shape
            h, w = smart_resize(
                len(frames),
                height,
                width,
                temporal_factor=temporal,
                factor=patch * merge,
                min_pixels=s.min_pixels,
                max_pixels=s.max_pixels,
            )
            resized = [f.convert("RGB").resize((w, h), Image.Resampling.BICUBIC) for f in frames]
            return video_patches(resized, processor, temporal)

        return patches

    def text(self, video: SampledVideo, grid: np.ndarray, merge_unit: int, temporal: int) -> tuple[str, list[int]]:
        t, h, w = (int(x) for x in grid)
        stamps = timestamps(video.indices, video.fps, temporal)
        assert len(stamps) == t, (stamps, t)
        return "".join(f"<{s:.1f} seconds>{VIDEO_TEXT}" for s in stamps), [h * w // merge_unit] * t

    def markup_tokens(self, frames: int, fps: float, temporal: int) -> int:
        # each temporal patch's `<t seconds>` and its own start / end pair, the first pair an image's too; the
        # frames sampled evenly from 0 s at `fps`
        stamps = timestamps(list(range(frames)), fps, temporal)
        return sum(timestamp_tokens(s) for s in stamps) + 2 * (len(stamps) - 1)


def timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame, an odd count's last frame
    repeated (`Qwen3VLProcessor._calculate_timestamps`)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]


def timestamp_tokens(seconds: float) -> int:
    """Tokens of `<{seconds:.1f} seconds>` in the Qwen tokenizer: `<`, one per digit and the point (its
    pre-tokenizer splits every digit), ` seconds`, `>`."""
    return len(f"{seconds:.1f}") + 3


VIDEO_FORMAT = VideoFormat()
QWEN3_VIDEO_FORMAT = Qwen3VideoFormat()
