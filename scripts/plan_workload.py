"""The one-size sample of `dhp plan --time` / `--search`, from its options.

    --image-patches P        one image of P patches per sample (default 1024 when no --video is given)
    --video FRAMESxHxW       a video of FRAMES sampled frames of H x W pixels per sample (repeatable)
    --text-tokens T          the sample's text besides its vision tokens (default 512)

A video is `time_model.visual_patches`' patches: ceil(FRAMES / temporal_patch_size) temporal patches of the
frame's patches (each side rounded to patch x merge pixels, no pixel bounds); its merged tokens are its patches
over the family's merge unit, and the family's video format adds the text it writes besides the pad tokens
(Qwen3-VL: a `<t seconds>` timestamp and a vision start / end pair per temporal patch, the frames taken at
`data.video.fps`). Its attention is per temporal patch (`ModelFamily.frame_attention`).
"""

from __future__ import annotations

import re
from typing import Any

from dhp.models.planning.time_model import Workload
from dhp.stages.config import ConfigError

DEFAULT_IMAGE_PATCHES = 1024
_VIDEO = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def parse_video(spec: str) -> tuple[int, int, int]:
    """`FRAMESxHEIGHTxWIDTH` -> (frames, height, width), each at least 1; else a ConfigError of one line."""
    m = _VIDEO.match(spec.strip().lower())
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ConfigError(f"--video {spec}: want FRAMESxHEIGHTxWIDTH in sampled frames and pixels, e.g. 16x448x448")
    frames, height, width = (int(g) for g in m.groups())
    return frames, height, width


def workload(args: Any, cfg: Any, mc: Any) -> Workload:
    """The sample `args` describe (module docstring) for the model config `mc`, videos taken at `cfg`'s
    `data.video.fps`."""
    videos = [parse_video(v) for v in getattr(args, "video", None) or ()]
    if videos and getattr(args, "data_profile", None):
        raise ConfigError("--video and --data-profile: the profile's samples hold their own videos; pass one")
    patches = args.image_patches
    if patches is None:
        patches = 0 if videos else DEFAULT_IMAGE_PATCHES
    if patches < 0 or (patches == 0 and not videos):
        raise ConfigError(f"--image-patches must be >= 1 (or 0 with a --video), got {patches}")
    if args.text_tokens < 0:
        raise ConfigError(f"--text-tokens must be >= 0, got {args.text_tokens}")
    return Workload.of(
        mc.vision_config,
        videos=videos,
        text_tokens=args.text_tokens,
        nodes=args.nodes,
        image_patches=[patches] if patches else [],
        fps=cfg.data.video.fps,
    )


def describe(visuals: list[list[int]]) -> str:
    """A sample's visuals ([temporal patches, patches of each] each) in words: `1024 patches` for one image,
    `2048 patches (a video: 8 temporal patches of 256)` where there is a video."""
    total = sum(t * n for t, n in visuals)
    videos = [f"a video: {t} temporal patches of {n}" for t, n in visuals if t > 1]
    images = sum(1 for t, _ in visuals if t == 1)
    if not videos and images <= 1:
        return f"{total} patches"
    parts = videos + ([f"{images} image{'s' * (images > 1)}"] if images else [])
    return f"{total} patches ({'; '.join(parts)})"
