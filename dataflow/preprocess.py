"""One LLaVA-style record -> the tensors both stages need, or a named reason to skip it.

Runs inside Ray Data workers (never in the trainer actors). Every step uses transformers' own pieces:
`Qwen2VLImageProcessorPil` (smart_resize within min/max pixels, normalise, 14x14x2 patchify), the Qwen2.5
tokenizer and chat template, and `get_rope_index` for the 3-D mRoPE positions. A record's video (`"video"`, one
`<video>` in the text) is decoded by dataflow/video.py, then sampled, patchified and written into the text as the
model family's video format says (dataflow/video_formats.py: Qwen3-VL writes a timestamp before each temporal patch).

Output of `Preprocessor.__call__` (one Ray Data row):
    source  str    where the record came from ("file:line")
    error   str    "" for a usable sample, else a short reason ("missing_image", "too_long", ...)
    detail  str    human-readable detail of the error
    sample  bytes  safetensors blob (see `encode_sample`), empty on error
    tokens  int    sequence length L (0 on error)
Sample tensors: pixel_values f32 [P, 1176]; image_grid_thw i64 [n_visual, 3]; input_ids i64 [L];
labels i64 [L] (-100 except assistant replies); position_ids i64 [3, L]; second_per_grid_ts f32 [n_video].
The visuals -- images and videos alike, the vision encoder treats a video as an image of t > 1 temporal patches --
are in the order of their placeholders in the text: pixel_values and image_grid_thw hold them in that order, and
their merged tokens fill the sample's `<|image_pad|>` and `<|video_pad|>` tokens in that order.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from dhp.dataflow.storage import filesystem, is_uri, resolve, scheme_of
from dhp.dataflow.video import BadVideo, VideoSettings, decode_frames
from dhp.dataflow.video_formats import VIDEO_TEXT, SampledVideo
from dhp.errors import one_line
from dhp.labels import IGNORE_INDEX

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDERS = re.compile("<image>|<video>")
ROLES = {"human": "user", "gpt": "assistant"}
DEFAULT_SYSTEM = "You are a helpful assistant."


class SkipSample(Exception):
    """A record that cannot be trained on; `reason` is the counter it is recorded under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class PreprocessSettings:
    image_root: str  # local dir or URI that relative `image` paths are resolved against
    min_pixels: int
    max_pixels: int
    max_seq_len: int
    tokenizer_path: str | None = None
    storage: Any = None  # storage.Storage (resolved in the driver) or StorageConfig: how s3:// is reached
    records: Any = None  # the files' format (sources.record_format: Jsonl, WebDataset); None: JSONL
    video: VideoSettings = dataclasses.field(default_factory=VideoSettings)  # frame sampling and size of videos


def encode_sample(sample: dict[str, np.ndarray]) -> bytes:
    return st_save({k: np.ascontiguousarray(v) for k, v in sample.items()})


def decode_sample(blob: bytes) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in st_load(blob).items()}


def parse_record(text: str) -> tuple[list[str], list[tuple[str, str]], str | list[str] | None]:
    """JSON text -> (image paths, [(role, value)], video: a path, a list of frame paths or None), validated;
    raises SkipSample with the reason."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise SkipSample("malformed_json", str(e)) from None
    if not isinstance(record, dict):
        raise SkipSample("wrong_field_type", f"record is a {type(record).__name__}, not an object")
    images = record.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise SkipSample("wrong_field_type", "'image' must be a path or a list of paths")
    turns = record.get("conversations")
    if not turns:
        raise SkipSample("missing_conversations", "'conversations' is missing or empty")
    if not isinstance(turns, list):
        raise SkipSample("wrong_field_type", "'conversations' must be a list")
    parsed = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in ROLES or not isinstance(turn.get("value"), str):
            raise SkipSample("wrong_field_type", f"turn {i} needs 'from' in {list(ROLES)} and a string 'value'")
        parsed.append((ROLES[turn["from"]], turn["value"]))
    n_placeholders = sum(v.count(IMAGE_PLACEHOLDER) for _, v in parsed)
    if n_placeholders != len(images):
        raise SkipSample("image_count_mismatch", f"{n_placeholders} <image> for {len(images)} image(s)")
    video = record.get("video")
    frames_ok = isinstance(video, list) and video and all(isinstance(p, str) and p for p in video)
    if video is not None and not (isinstance(video, str) and video) and not frames_ok:
        raise SkipSample("wrong_field_type", "'video' must be a path or a list of frame paths")
    n_videos = sum(v.count(VIDEO_PLACEHOLDER) for _, v in parsed)
    if n_videos != (video is not None):
        raise SkipSample("video_count_mismatch", f"{n_videos} <video> for {int(video is not None)} video(s)")
    if not any(role == "assistant" for role, _ in parsed):
        raise SkipSample("no_assistant_turn", "nothing to learn: no 'gpt' turn")
    return images, parsed, video


_CACHED: dict[bytes, Preprocessor] = {}


def cached_preprocessor(settings: PreprocessSettings, model_config: Any) -> Preprocessor:
    """This process's `Preprocessor` for these settings, built on first use and kept."""
    key = pickle.dumps((dataclasses.replace(settings, records=None), model_config))  # the format is the reader's
    if key not in _CACHED:
        _CACHED[key] = Preprocessor(settings, model_config)
    return _CACHED[key]


def preprocess_row(row: dict[str, Any], settings: PreprocessSettings, model_config: Any) -> dict[str, Any]:
    """The `Dataset.map` function: `Preprocessor(settings, model_config)(row)`, with the preprocessor built once
    per worker process and kept for every later task and epoch of the same settings.

    Why a task-based map with a process cache rather than an actor pool of Preprocessors: Ray Data builds a new
    actor pool for every dataset it executes (each epoch, each resume, each eval pass), and an actor's
    construction is a process start plus ~4 s of imports and tokenizer loading on 2 cores (measured). Ray
    reuses its worker processes across tasks, so only the first task in a process pays that (and the trainer
    starts the streams while the stage pools build, `BatchLoader.start`).
    """
    return cached_preprocessor(settings, model_config)(row)


class Preprocessor:
    """One record -> one Ray Data row: holds the tokenizer, image processor and model config."""

    def __init__(self, settings: PreprocessSettings, model_config: Any):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from dhp.dataflow.tokenizer import load_backend
        from dhp.models.family import family_of

        self.settings = settings
        self.config = model_config
        vc = model_config.vision_config
        family = family_of(model_config)
        self.image_processor = Qwen2VLImageProcessorPil(
            min_pixels=settings.min_pixels,
            max_pixels=settings.max_pixels,
            patch_size=vc.patch_size,
            temporal_patch_size=vc.temporal_patch_size,
            merge_size=vc.spatial_merge_size,
            image_mean=list(family.image_mean),  # the family's normalisation (models/family/base.py)
            image_std=list(family.image_std),
        )
        self.tokenizer = load_backend(settings.tokenizer_path)  # tokenizers' object: what transformers' wraps
        self.rope_positions = family.rope_positions  # the model family's mRoPE positions
        # how the family samples, sizes and writes a video (dataflow/video_formats.py)
        self.video_format = family.video_format
        self.merge_unit = vc.spatial_merge_size**2
        self.pad_id = self.tokenizer.token_to_id("<|image_pad|>")
        self.video_pad_id = self.tokenizer.token_to_id("<|video_pad|>")
        self.video_patches = self.video_format.patcher(settings.video, vc)
        self.temporal = vc.temporal_patch_size
        self.im_end_id = self.tokenizer.token_to_id("<|im_end|>")
        # The same filesystem code as the annotation reads; one per URI scheme, made once per worker.
        self.storage = resolve(settings.storage)
        self.fs, self.root = filesystem(settings.image_root, self.storage)
        self.root_scheme = scheme_of(settings.image_root)
        self.filesystems: dict[str, Any] = {self.root_scheme: self.fs}

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            if row.get("skip"):  # the reader knew already (a shard's missing member: dataflow/webdataset.py)
                raise SkipSample(*row["skip"].split("\t", 1))
            sample = self.process(row["record"], row.get("image") or None, row.get("video") or None)
        except SkipSample as e:
            return {
                "source": row["source"],
                "part": row.get("part", 0),
                "error": e.reason,
                "detail": e.detail,
                "sample": b"",
                "tokens": 0,
            }
        return {
            "source": row["source"],
            "part": row.get("part", 0),  # where the stream stands (dataflow/positions.py)
            "error": "",
            "detail": "",
            "sample": encode_sample(sample),
            "tokens": int(sample["input_ids"].shape[0]),
        }

    def process(self, text: str, image: bytes | None = None, video: bytes | None = None) -> dict[str, np.ndarray]:
        """One record -> the sample's tensors; `image` / `video`: the record's one image's or video's bytes when
        the reader holds them (a WebDataset member) rather than a path to read."""
        image_paths, turns, video_ref = parse_record(text)
        if image is not None:
            images = [self.decode_image(image, image_paths[0])]
        else:
            images = [self.load_image(p) for p in image_paths]
        image_pixels: list[np.ndarray] = []
        image_grids: list[np.ndarray] = []
        if images:
            try:
                out = self.image_processor(images=images, return_tensors="np")
            except ValueError as e:  # smart_resize refuses aspect ratios beyond 200:1
                raise SkipSample("bad_image_shape", str(e)) from None
            grids = out["image_grid_thw"].astype(np.int64)
            image_pixels = np.split(out["pixel_values"].astype(np.float32), grids.prod(-1).cumsum()[:-1])
            image_grids = list(grids)
        videos, seconds, video_texts = [], [], []
        if video_ref is not None:
            pixels, grid, sampled = self.load_video(video_ref, video)
            videos.append((pixels, grid))
            seconds.append(self.temporal / sampled.sampled_fps)
            video_texts.append(self.video_format.text(sampled, grid, self.merge_unit, self.temporal))
        # The visuals in the order of their placeholders (module docstring).
        kinds = [m.group() for _, v in turns for m in PLACEHOLDERS.finditer(v)]
        own_images, own_videos = iter(zip(image_pixels, image_grids)), iter(videos)
        visuals = [next(own_videos) if k == VIDEO_PLACEHOLDER else next(own_images) for k in kinds]
        if visuals:
            pixel_values = np.concatenate([p for p, _ in visuals])
            grid = np.stack([g for _, g in visuals]).astype(np.int64)
        else:
            pixel_values = np.zeros((0, 3 * self.temporal * self.config.vision_config.patch_size**2), np.float32)
            grid = np.zeros((0, 3), np.int64)
        is_video = np.array([k == VIDEO_PLACEHOLDER for k in kinds], bool)
        # the pad runs in text order: an image's one, a video's as its format writes it
        own_texts, runs, run_is_video = iter(video_texts), [], []
        for g, v in zip(grid, is_video):
            counts = next(own_texts)[1] if v else [int(g.prod()) // self.merge_unit]
            runs += counts
            run_is_video += [bool(v)] * len(counts)
        input_ids, labels = self.tokenize(turns, runs, run_is_video, [text for text, _ in video_texts])
        if len(input_ids) > self.settings.max_seq_len:
            raise SkipSample("too_long", f"{len(input_ids)} tokens > data.max_seq_len={self.settings.max_seq_len}")
        ids, image_grid = torch.from_numpy(input_ids), torch.from_numpy(grid[~is_video])
        if videos:
            video_grid, second_per_grid = torch.from_numpy(grid[is_video]), torch.tensor(seconds, dtype=torch.float64)
            positions = self.rope_positions(ids, image_grid, self.config, video_grid, second_per_grid)
        else:
            positions = self.rope_positions(ids, image_grid, self.config)
        return {
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": positions.numpy().astype(np.int64),
            "second_per_grid_ts": np.asarray(seconds, np.float64),
        }

    def load_video(self, ref: str | list[str], data: bytes | None) -> tuple[np.ndarray, np.ndarray, SampledVideo]:
        """A record's video (a file, its bytes `data`, or a list of frame files) -> (pixel_values, grid [3], its
        sampled frames), or the skip that names where it came from (dataflow/video.py)."""
        s = self.settings.video

        def sample(total: int, fps: float) -> list[int]:
            return self.video_format.sample(total, fps, s, self.temporal)

        where = ref if isinstance(ref, str) else f"{ref[0]} and {len(ref) - 1} more frames"
        try:
            if isinstance(ref, list):
                images = [self.load_image(p, "frame") for p in ref]
                keep = sample(len(images), s.frames_fps)
                video = SampledVideo([images[i] for i in keep], keep, len(images), s.frames_fps)
            else:
                if data is None:
                    where, data = self.read(ref, "video")
                video = SampledVideo(*decode_frames(data, sample))
            pixels, grid = self.video_patches(video.frames)
        except BadVideo as e:
            raise SkipSample(e.reason, f"{where}: {e}") from None
        except ValueError as e:  # smart_resize refuses aspect ratios beyond 200:1 (Qwen3-VL: and a single frame)
            raise SkipSample("bad_video_shape", f"{where}: {e}") from None
        return pixels, grid[0], video

    def read(self, rel_path: str, kind: str = "image") -> tuple[str, bytes]:
        """(where, bytes) of a path relative to `image_root`, or of an absolute URI, through the pyarrow
        filesystem; `kind` names the skip ("missing_image", "unreadable_video", ...).

        Skip details name the full location (s3://bucket/key or the local path), which is what a person
        needs to find the object; transient S3 errors were already retried by the filesystem.
        """
        if is_uri(rel_path):
            scheme = scheme_of(rel_path)
            if scheme not in self.filesystems:
                self.filesystems[scheme] = filesystem(rel_path, self.storage)[0]
            fs, path, where = self.filesystems[scheme], rel_path.split("://", 1)[1], rel_path
        else:
            fs, path = self.fs, f"{self.root.rstrip('/')}/{rel_path.lstrip('/')}"
            where = f"{self.root_scheme}://{path}" if self.root_scheme else path
        try:
            with fs.open_input_stream(path) as f:
                return where, f.read()
        except FileNotFoundError:
            raise SkipSample(f"missing_{kind}", f"{where}: not found") from None
        except OSError as e:  # a folder, no permission, or a storage error that outlived the retries
            raise SkipSample(f"unreadable_{kind}", f"{where}: {one_line(e)}") from None

    def load_image(self, rel_path: str, kind: str = "image") -> Image.Image:
        """A decoded image from a path relative to `image_root` or an absolute URI (`read`); `kind` "frame": a
        video's frame file, whose skips count as the video's (missing_video, corrupt_video, ...)."""
        _, data = self.read(rel_path, "video" if kind == "frame" else kind)
        try:
            return self.decode_image(data, rel_path)
        except SkipSample as e:
            if kind == "frame":
                raise SkipSample("corrupt_video", f"frame {e.detail}") from None
            raise

    @staticmethod
    def decode_image(data: bytes, name: str) -> Image.Image:
        """An image file's bytes -> a loaded PIL image, or the skip that names `name`."""
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise SkipSample("corrupt_image", f"{name}: {e}") from None
        if min(image.size) < 2:
            raise SkipSample("degenerate_image", f"{name}: size {image.size}")
        return image  # the image processor's convert_to_rgb blends transparency onto white, as upstream

    def tokenize(
        self,
        turns: list[tuple[str, str]],
        visual_tokens: list[int],
        is_video: list[bool] | None = None,
        video_texts: list[str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Chat template -> ids with each <image> / <video> expanded to its <|image_pad|> / <|video_pad|> runs;
        labels on replies. `visual_tokens`: the merged tokens of each pad run in text order, `is_video` which of
        them are video runs (None: all images), `video_texts` what each <video> becomes, one `<|video_pad|>` a run
        (None: `<|vision_start|><|video_pad|><|vision_end|>`).

        Each visual is rendered as a single pad token (the chat template's form) and expanded after
        tokenisation: cheaper than tokenising thousands of pad tokens, and pad tokens never merge.
        """
        is_video = is_video or [False] * len(visual_tokens)
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        videos = iter(video_texts or [VIDEO_TEXT] * sum(is_video))
        pieces: list[tuple[str, bool]] = [(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n", False)]
        for role, value in turns:
            if role == "assistant":
                pieces += [("<|im_start|>assistant\n", False), (value + "<|im_end|>", True), ("\n", False)]
            else:
                value = PLACEHOLDERS.sub(lambda m: image if m.group() == IMAGE_PLACEHOLDER else next(videos), value)
                pieces.append((f"<|im_start|>{role}\n{value}<|im_end|>\n", False))
        text = "".join(p for p, _ in pieces)
        spans, pos = [], 0
        for piece, labelled in pieces:
            if labelled:
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
        pad_ids = (self.pad_id, self.video_pad_id)
        pads = [t for t in ids if t in pad_ids]
        if pads != [self.video_pad_id if v else self.pad_id for v in is_video]:  # e.g. a literal <|image_pad|>
            raise SkipSample(
                "image_count_mismatch",
                f"{pads.count(self.pad_id)} image and {pads.count(self.video_pad_id)} video pads for "
                f"{len(is_video) - sum(is_video)} image(s) and {sum(is_video)} video(s)",
            )
        # A token is a label when it lies inside a reply span (the reply's text and its <|im_end|>).
        labelled = [any(s <= a and b <= e for s, e in spans) for a, b in offsets]
        out_ids: list[int] = []
        out_labels: list[int] = []
        runs = iter(visual_tokens)
        for tok, is_label in zip(ids, labelled):
            count = next(runs) if tok in pad_ids else 1
            out_ids += [tok] * count
            out_labels += [tok if is_label else IGNORE_INDEX] * count
        return np.asarray(out_ids, np.int64), np.asarray(out_labels, np.int64)
