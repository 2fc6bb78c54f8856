"""A video -> its sampled frames -> Qwen2.5-VL's video patches: for videos what preprocess.py does for images.

A record's video is a file (`"video": "clip.mp4"`, or an s3:// URI, or a WebDataset shard's `.mp4` member) or a
list of frame files (`"video": ["f0.jpg", "f1.jpg", ...]`, in time order). Every step follows transformers'
`Qwen2VLVideoProcessor` and `Qwen2_5_VLProcessor`:

    decode       PyAV (`av`, FFmpeg's libraries; its wheels bundle FFmpeg): the file's first video stream, its
                 frame count and average frame rate from the container. Why PyAV: it decodes from bytes in memory
                 (an object read from S3, a tar member) with no system FFmpeg and no torch version coupling
                 (torchcodec needs a system FFmpeg and a build matching torch; decord's last release is of 2021).
                 A list of frame files is decoded as images, at `data.video.frames_fps` frames a second.
    sample       `sample_indices`: `Qwen2VLVideoProcessor.sample_frames` with `fps`: total / video_fps x fps frames,
                 within [min_frames, max_frames] and the video's length, floored to a multiple of temporal_patch_size
                 (2), taken evenly; a video shorter than that keeps all its frames
    resize       one size for every frame: smart_resize of the first frame's size within the video pixel bounds
                 (per frame), then transformers' PIL image processor per frame (bicubic resize, rescale, normalise)
    patchify     frames 2t and 2t + 1 are temporal patch t (an odd count repeats the last frame, as transformers
                 does): patches [t * h * w, 3 * 2 * 14 * 14] in the image processor's order within each t,
                 grid [t, h, w]
    time         second_per_grid_ts = temporal_patch_size / sampled fps, where sampled fps = frames kept / total
                 frames x video fps (`VideoMetadata.sampled_fps`): what the mRoPE time positions scale by
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

# Light imports at the top: dataflow/webdataset.py's read tasks import this module (VIDEO_EXTENSIONS).
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "avi", "mov")


@dataclass(frozen=True)
class VideoSettings:
    """How videos are sampled and sized (`data.video`; docs/data.md#video)."""

    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4  # at least this many frames (when the video has them)
    max_frames: int = 16  # at most this many frames
    min_pixels: int = 56 * 56  # smart_resize bounds of one frame
    max_pixels: int = 112 * 112
    frames_fps: float = 2.0  # the rate a list of frame files stands for


class BadVideo(Exception):
    """A video that cannot be decoded: `reason` is the skip counter, the message its detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def sample_indices(total: int, video_fps: float, s: VideoSettings, temporal: int = 2) -> list[int]:
    """The frames kept of `total` at `video_fps`: `Qwen2VLVideoProcessor.sample_frames(fps=s.fps)`'s indices."""
    max_frames = math.floor(min(s.max_frames, total) / temporal) * temporal
    num = total / video_fps * s.fps
    num = min(max(num, s.min_frames), max_frames, total)
    num = math.floor(num / temporal) * temporal
    if num <= 0:  # fewer frames than one temporal patch: all of them (the last one repeats)
        return list(range(total))
    # torch's float arange, as transformers samples (numpy's float64 steps could round an index differently);
    # imported here because dataflow/webdataset.py's read tasks import this module and must start light
    import torch

    return torch.arange(0, total, total / num).int().tolist()


def decode_video(data: bytes, s: VideoSettings, temporal: int = 2) -> tuple[list[Image.Image], float]:
    """A video file's bytes -> (its sampled frames as RGB images, sampled fps); `BadVideo` if it does not decode."""
    frames, keep, total, rate = decode_frames(data, lambda total, rate: sample_indices(total, rate, s, temporal))
    return frames, len(keep) / total * rate


def decode_frames(
    data: bytes, sample: Callable[[int, float], list[int]]
) -> tuple[list[Image.Image], list[int], int, float]:
    """A video file's bytes -> (the frames `sample(total, fps)` keeps, their indices, total frames, fps);
    `BadVideo` if it does not decode."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise BadVideo("corrupt_video", "no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate or rate <= 0:
                raise BadVideo("corrupt_video", "no frame rate")
            total = stream.frames
            if total <= 0:  # the container does not say: count by decoding
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total <= 0:
                raise BadVideo("corrupt_video", "no frames")
            keep = sample(total, float(rate))
            wanted, frames = set(keep), {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames[i] = frame.to_image()
                if i >= keep[-1]:
                    break
    except BadVideo:
        raise
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise BadVideo("corrupt_video", str(e) or repr(e)) from None
    if len(frames) != len(wanted):
        # the container promised more frames than it holds (a truncated file)
        raise BadVideo("corrupt_video", f"{len(frames)} of {len(wanted)} sampled frames decode")
    return [frames[i] for i in keep], keep, total, float(rate)


def frame_list(images: list[Image.Image], s: VideoSettings, temporal: int = 2) -> tuple[list[Image.Image], float]:
    """A video given as frame files (in time order, at `s.frames_fps`) -> (sampled frames, sampled fps)."""
    keep = sample_indices(len(images), s.frames_fps, s, temporal)
    return [images[i] for i in keep], len(keep) / len(images) * s.frames_fps


def video_patches(frames: list[Image.Image], frame_processor: Any, temporal: int) -> tuple[np.ndarray, np.ndarray]:
    """Sampled frames -> (pixel_values [t * h * w, C * temporal * p * p] f32, grid_thw [1, 3] i64).

    `frame_processor` is transformers' `Qwen2VLImageProcessorPil` with the video pixel bounds: it resizes,
    normalises and patchifies each frame as a still image (the frame repeated in each temporal slot); slot 0 of
    frame 2t + k becomes slot k of temporal patch t, the layout of `Qwen2VLVideoProcessor.patchify`.
    """
    size = frames[0].size
    if any(f.size != size for f in frames):
        raise BadVideo("corrupt_video", f"frames of different sizes {sorted({f.size for f in frames})}")
    out = frame_processor(images=frames, return_tensors="np")
    n = len(frames)
    grid = out["image_grid_thw"][0]
    hw = int(grid[1] * grid[2])
    per_frame = out["pixel_values"].reshape(n, hw, 3, temporal, -1)[:, :, :, 0]  # [n, hw, C, p*p]
    if pad := -n % temporal:
        per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
    t = per_frame.shape[0] // temporal
    patches = per_frame.reshape(t, temporal, hw, 3, -1).transpose(0, 2, 3, 1, 4)  # [t, hw, C, T, p*p]
    pixel_values = np.ascontiguousarray(patches.reshape(t * hw, -1), dtype=np.float32)
    return pixel_values, np.array([[t, int(grid[1]), int(grid[2])]], np.int64)
