"""Synthetic image-captioning data in LLaVA conversation format.

The set exists so a training run can be checked end to end without downloading anything: a tiny
vision-language model trained on it should show its caption loss fall, and that fall is only possible
if image features actually reach the language model. To make that true:

* every image holds ONE shape with four independent attributes (size, colour, shape, 3x3 position),
  drawn uniformly, so a caption cannot be guessed from priors beyond chance;
* human prompts come from a fixed set of phrasings that never mention an attribute, so the text side
  carries no information about the answer;
* captions are a fixed template of the attributes, so the loss floor is near zero once the pixels are
  read, and a text-only model is stuck at the entropy of the attributes.

Images vary in width and height independently (not square), and some records have two images or two
rounds, so the dynamic-resolution, multi-image and multi-turn code paths are exercised too. The val
split comes from its own RNG stream, so it is held out, not a copy of train.

A `video_fraction` of the records are short videos instead (`videos/`): one shape moving from one cell of the
3x3 grid to another over `VIDEO_FRAMES` frames at `VIDEO_FPS` frames a second, captioned with both cells, so the
caption needs the first and the last frames. Half of them are MPEG-4 files (written with PyAV), half lists of
PNG frame files (`"video": [...]`), the two forms a record's video takes (dataflow/video.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

FORMAT_VERSION = 1
VIDEO_FRAMES = 8  # frames of a synthetic video
VIDEO_FPS = 4  # its frame rate: 2 s long
FORMAT_NAME = "dhp-synth"

# Saturated colours far from each other and from the light backgrounds (all channels >= 215).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = ("small", "large")
# Row-major over the 3x3 grid, so index // 3 is the row and index % 3 the column.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
# Half-extent of the shape as a fraction of min(w, h); large stays under 1/6 so it fits in one cell.
_SIZE_FRAC = {"small": (0.065, 0.085), "large": (0.13, 0.15)}

PROMPTS = (
    "Describe the image.",
    "What is in this picture?",
    "Write a short caption for this image.",
    "Describe what you see.",
)
MULTI_PROMPTS = ("Describe both images.", "Write a caption for each of the two images.")
VIDEO_PROMPTS = ("Describe the video.", "What happens in this clip?")
# (question, attribute) pairs for the second round; questions name no attribute value.
QUESTIONS = (
    ("What colour is the shape?", "colour"),
    ("Where is it?", "position"),
    ("What shape is it?", "shape"),
    ("How big is the shape?", "size"),
)

_PROGRESS_MIN = 300


@dataclass(frozen=True)
class SynthSummary:
    out_dir: Path
    train_path: Path
    val_path: Path
    meta_path: Path
    num_train: int
    num_val: int
    num_images: int  # image files across both splits (multi-image records have two)
    num_videos: int  # video records across both splits (an MPEG-4 file or a list of frame files each)
    seed: int
    reused: bool  # True when an identical complete dataset was already in place


def caption(attrs: dict[str, str]) -> str:
    return f"A {attrs['size']} {attrs['colour']} {attrs['shape']} in the {attrs['position']}."


def answer(attrs: dict[str, str], attribute: str) -> str:
    if attribute == "colour":
        return attrs["colour"].capitalize() + "."
    if attribute == "position":
        return f"In the {attrs['position']}."
    if attribute == "shape":
        return f"A {attrs['shape']}."
    return attrs["size"].capitalize() + "."


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _draw_image(rng: np.random.Generator, min_size: int, max_size: int) -> tuple[Image.Image, dict[str, str]]:
    w, h = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    attrs = {
        "size": _pick(rng, SIZES),
        "colour": _pick(rng, list(PALETTE)),
        "shape": _pick(rng, SHAPES),
        "position": _pick(rng, POSITIONS),
    }
    # Half white, half a random light tint, so background colour is a nuisance variable to ignore.
    bg = (255, 255, 255) if rng.random() < 0.5 else tuple(int(v) for v in rng.integers(215, 256, size=3))
    lo, hi = _SIZE_FRAC[attrs["size"]]
    r = float(rng.uniform(lo, hi)) * min(w, h)
    row, col = divmod(POSITIONS.index(attrs["position"]), 3)
    # Jitter within the cell but keep the whole shape inside it, so the position label is unambiguous.
    centre = []
    for idx, extent in ((col, w), (row, h)):
        c0, c1 = idx * extent / 3 + r + 1, (idx + 1) * extent / 3 - r - 1
        centre.append(float(rng.uniform(c0, c1)) if c1 > c0 else (idx + 0.5) * extent / 3)
    cx, cy = centre
    img = Image.new("RGB", (w, h), bg)
    _draw_shape(ImageDraw.Draw(img), attrs["shape"], cx, cy, r, PALETTE[attrs["colour"]])
    return img, attrs


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = 0.85 * r
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    else:
        n, inner = (3, None) if shape == "triangle" else (5, 0.45 * r)
        pts = []
        for k in range(n):
            a = -np.pi / 2 + 2 * np.pi * k / n
            pts.append((cx + r * np.cos(a), cy + r * np.sin(a)))
            if inner is not None:
                b = a + np.pi / n
                pts.append((cx + inner * np.cos(b), cy + inner * np.sin(b)))
        draw.polygon([(float(x), float(y)) for x, y in pts], fill=fill)


def video_caption(attrs: dict[str, str], end: str) -> str:
    return f"A {attrs['size']} {attrs['colour']} {attrs['shape']} moves from the {attrs['position']} to the {end}."


def _draw_video(rng: np.random.Generator, min_size: int, max_size: int) -> tuple[list[Image.Image], str]:
    """VIDEO_FRAMES frames of one shape moving in a straight line from its cell's centre to another cell's, and
    the caption. Even sides: the MPEG-4 encoder's 4:2:0 chroma needs them."""
    w, h = (int(v) // 2 * 2 for v in rng.integers(min_size, max_size + 1, size=2))
    attrs = {
        "size": _pick(rng, SIZES),
        "colour": _pick(rng, list(PALETTE)),
        "shape": _pick(rng, SHAPES),
        "position": _pick(rng, POSITIONS),
    }
    end = _pick(rng, [p for p in POSITIONS if p != attrs["position"]])
    bg = (255, 255, 255)
    r = float(np.mean(_SIZE_FRAC[attrs["size"]])) * min(w, h)
    (r0, c0), (r1, c1) = divmod(POSITIONS.index(attrs["position"]), 3), divmod(POSITIONS.index(end), 3)
    frames = []
    for k in range(VIDEO_FRAMES):
        a = k / (VIDEO_FRAMES - 1)
        cx = ((1 - a) * (c0 + 0.5) + a * (c1 + 0.5)) * w / 3
        cy = ((1 - a) * (r0 + 0.5) + a * (r1 + 0.5)) * h / 3
        img = Image.new("RGB", (w, h), bg)
        _draw_shape(ImageDraw.Draw(img), attrs["shape"], cx, cy, r, PALETTE[attrs["colour"]])
        frames.append(img)
    return frames, video_caption(attrs, end)


def write_mp4(path: Path, frames: list[Image.Image], fps: int = VIDEO_FPS) -> None:
    """`frames` as an MPEG-4 Part 2 video (FFmpeg's own encoder, in every PyAV wheel), one thread: the same bytes
    on every machine."""
    import av

    with av.open(str(path), mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 4_000_000
        stream.codec_context.thread_count = 1
        for img in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(img)))
        out.mux(stream.encode(None))


def _make_video_record(rng: np.random.Generator, rid: str, min_size: int, max_size: int) -> tuple[dict, list]:
    frames, text = _draw_video(rng, min_size, max_size)
    prompt = _pick(rng, VIDEO_PROMPTS)
    human = f"<video>\n{prompt}" if rng.random() < 0.5 else f"{prompt}\n<video>"
    convs = [{"from": "human", "value": human}, {"from": "gpt", "value": text}]
    if rng.random() < 0.5:
        path = f"videos/{rid}.mp4"
        return {"id": rid, "video": path, "conversations": convs}, [(path, frames)]
    paths = [f"videos/{rid}_{k}.png" for k in range(len(frames))]
    return {"id": rid, "video": paths, "conversations": convs}, list(zip(paths, frames))


def _make_record(
    rng: np.random.Generator,
    rid: str,
    multi_image_p: float,
    multi_turn_p: float,
    min_size: int,
    max_size: int,
    video_p: float = 0.0,
) -> tuple[dict, list[tuple[str, Image.Image | list[Image.Image]]]]:
    # The video coin only when videos are asked for: a set without videos is the one earlier versions wrote.
    if video_p > 0 and rng.random() < video_p:
        return _make_video_record(rng, rid, min_size, max_size)
    # Draw both coins every time so one fraction's value never shifts the other's stream.
    multi_image = rng.random() < multi_image_p
    multi_turn = rng.random() < multi_turn_p
    if multi_image:
        (img_a, at_a), (img_b, at_b) = (_draw_image(rng, min_size, max_size) for _ in range(2))
        images = [(f"images/{rid}_a.png", img_a), (f"images/{rid}_b.png", img_b)]
        text = _pick(rng, MULTI_PROMPTS)
        human = f"<image>\n<image>\n{text}" if rng.random() < 0.5 else f"{text}\n<image>\n<image>"
        convs = [
            {"from": "human", "value": human},
            {"from": "gpt", "value": f"First: {caption(at_a)} Second: {caption(at_b)}"},
        ]
        # A follow-up question about "the shape" would be ambiguous with two images.
        return {"id": rid, "image": [p for p, _ in images], "conversations": convs}, images
    img, attrs = _draw_image(rng, min_size, max_size)
    text = _pick(rng, PROMPTS)
    human = f"<image>\n{text}" if rng.random() < 0.5 else f"{text}\n<image>"
    convs = [{"from": "human", "value": human}, {"from": "gpt", "value": caption(attrs)}]
    if multi_turn:
        question, attribute = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        convs += [{"from": "human", "value": question}, {"from": "gpt", "value": answer(attrs, attribute)}]
    path = f"images/{rid}.png"
    return {"id": rid, "image": path, "conversations": convs}, [(path, img)]


def _read_meta(out_dir: Path) -> dict | None:
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT_NAME else None


def _summary(out_dir: Path, meta: dict, reused: bool) -> SynthSummary:
    return SynthSummary(
        out_dir=out_dir,
        train_path=out_dir / "train.jsonl",
        val_path=out_dir / "val.jsonl",
        meta_path=out_dir / "meta.json",
        num_train=meta["num"],
        num_val=meta["eval_num"],
        num_images=meta["num_images"],
        num_videos=meta.get("num_videos", 0),
        seed=meta["seed"],
        reused=reused,
    )


def _is_complete(out_dir: Path, params: dict) -> dict | None:
    meta = _read_meta(out_dir)
    if meta is None or any(meta.get(k) != v for k, v in params.items()):
        return None
    if not ((out_dir / "train.jsonl").is_file() and (out_dir / "val.jsonl").is_file()):
        return None
    return meta


def write_synthetic_dataset(
    out_dir: str | Path,
    num: int,
    seed: int = 0,
    eval_num: int | None = None,
    min_size: int = 84,
    max_size: int = 224,
    multi_image_fraction: float = 0.1,
    multi_turn_fraction: float = 0.2,
    video_fraction: float = 0.0,
) -> SynthSummary:
    """Write ``num`` train and ``eval_num`` val records (plus images and meta.json) into ``out_dir``.

    Returns at once if ``out_dir`` already holds a complete set made with the same parameters.
    """
    if num < 0 or (eval_num is not None and eval_num < 0):
        raise ValueError("num and eval_num must be >= 0")
    if not 16 <= min_size <= max_size:
        raise ValueError(f"need 16 <= min_size <= max_size, got {min_size}, {max_size}")
    out_dir = Path(out_dir)
    eval_num = max(16, num // 10) if eval_num is None else eval_num
    params = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num": num,
        "eval_num": eval_num,
        "seed": seed,
        "min_size": min_size,
        "max_size": max_size,
        "multi_image_fraction": multi_image_fraction,
        "multi_turn_fraction": multi_turn_fraction,
    }
    if video_fraction > 0:  # absent otherwise: sets written without videos stay complete
        params["video_fraction"] = video_fraction
    meta = _is_complete(out_dir, params)
    if meta is not None:
        return _summary(out_dir, meta, reused=True)
    # Never delete a directory this module did not make: only an empty one or an older synthetic set.
    if out_dir.exists() and any(out_dir.iterdir()) and _read_meta(out_dir) is None:
        raise FileExistsError(f"{out_dir} exists and is not a synthetic dataset; refusing to replace it")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "images").mkdir()
        (tmp / "videos").mkdir()
        # Spawned children of one SeedSequence are independent streams, so val is held out from train.
        train_ss, val_ss = np.random.SeedSequence(seed).spawn(2)
        bar = tqdm(
            total=num + eval_num,
            desc="synthetic data",
            unit="rec",
            disable=num + eval_num <= _PROGRESS_MIN or not sys.stderr.isatty(),
        )
        num_images = num_videos = 0
        for split, count, ss in (("train", num, train_ss), ("val", eval_num, val_ss)):
            rng = np.random.default_rng(ss)
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
                for i in range(count):
                    rec, files = _make_record(
                        rng,
                        f"{split}_{i:05d}",
                        multi_image_fraction,
                        multi_turn_fraction,
                        min_size,
                        max_size,
                        video_fraction,
                    )
                    for rel, img in files:
                        if isinstance(img, list):
                            write_mp4(tmp / rel, img)
                        else:
                            img.save(tmp / rel, format="PNG")
                    num_images += len(files) if "image" in rec else 0
                    num_videos += "video" in rec
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    bar.update(1)
        bar.close()
        meta = {**params, "num_images": num_images, "num_videos": num_videos}
        # meta.json last: its presence is what marks the set complete.
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if _is_complete(out_dir, params) is not None:  # a concurrent writer finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return _summary(out_dir, meta, reused=True)
        old = None
        if out_dir.exists():
            # os.replace cannot overwrite a non-empty directory, so move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "d")
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _summary(out_dir, meta, reused=False)
