"""Videos: decoding, the frame sampling policy, patches and mRoPE positions against transformers; video records from
JSONL (a file or a list of frame files) and WebDataset (a `.mp4` member); bad videos as counted skips.

transformers' `Qwen2VLVideoProcessor` module imports torchvision at its top, which this project does not install
(no CPU build pairs with the pinned torch here: docs/data.md#video). Its frame sampling (`sample_frames`) and its
patch layout (`patchify`) are plain torch: the module is imported with empty stand-ins for the torchvision modules
it names, and those two methods are compared with dhp's. The frames' resize is the PIL image processor's, which
dhp calls per frame; where torchvision imports, `test_pixels_match_the_video_processor` compares the whole
processor, resize included.
"""

from __future__ import annotations

import importlib
import io
import json
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings
from dhp.dataflow.synth import write_mp4, write_synthetic_dataset
from dhp.dataflow.video import VideoSettings, decode_video, sample_indices
from dhp.dataflow.webdataset import shard_rows
from dhp.models.architectures import architecture_config
from dhp.models.qwen2_5_vl import rope_positions

VIDEO_PAD, IMAGE_PAD = 151656, 151655
SETTINGS = VideoSettings(fps=2.0, min_frames=4, max_frames=8, min_pixels=56 * 56, max_pixels=112 * 112)


def video_processor_class():
    """transformers' `Qwen2VLVideoProcessor` class (module docstring: torchvision stand-ins while it imports)."""
    import transformers.video_processing_utils  # noqa: F401  (imported for real before the stand-ins go in)

    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    if name in sys.modules:
        return sys.modules[name].Qwen2VLVideoProcessor
    stand_ins = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    added = [n for n in stand_ins if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)
    try:
        return importlib.import_module(name).Qwen2VLVideoProcessor
    finally:
        for n in added:
            sys.modules.pop(n, None)
        if added:  # the module was built against the stand-ins: not left for others to import
            sys.modules.pop(name, None)


def noise_frames(n: int, size: tuple[int, int], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def moving_frames(n: int, size: tuple[int, int]) -> list[Image.Image]:
    """Frames that differ from each other and survive MPEG-4 (a bar sweeping across a gradient)."""
    w, h = size
    grad = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    out = []
    for k in range(n):
        a = grad.copy()
        a[:, (k * w) // n : (k * w) // n + max(2, w // n)] = (255, 0, 0)
        out.append(Image.fromarray(a.astype(np.uint8)))
    return out


@pytest.fixture(scope="module")
def config():
    return architecture_config("tiny")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    write_mp4(root / "clip.mp4", moving_frames(9, (100, 70)), fps=4)  # 9 frames at 4 fps: 2.25 s
    for k, frame in enumerate(moving_frames(5, (90, 60))):
        frame.save(root / f"f{k}.png")
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(root / "still.png")
    (root / "not_a_video.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    data = (root / "clip.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (root / "f_bad.png").write_bytes(b"not a png")
    return root


@pytest.fixture(scope="module")
def pre(root, config) -> Preprocessor:
    settings = PreprocessSettings(str(root), min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=1024, video=SETTINGS)
    return Preprocessor(settings, config)


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "min_frames", "max_frames"),
    [
        (9, 4.0, 2.0, 4, 8),
        (300, 30.0, 2.0, 4, 16),
        (300, 30.0, 0.5, 4, 768),
        (7, 25.0, 2.0, 4, 768),
        (50, 10.0, 1, 2, 4),
    ],
)
def test_sampling_matches_transformers(total, video_fps, fps, min_frames, max_frames):
    from transformers.video_utils import VideoMetadata

    processor = video_processor_class()(fps=fps, min_frames=min_frames, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
    theirs = processor.sample_frames(meta, fps=fps).tolist()
    s = VideoSettings(fps=fps, min_frames=min_frames, max_frames=max_frames)
    assert sample_indices(total, video_fps, s) == theirs
    assert len(theirs) % 2 == 0


def test_decoding_matches_transformers_pyav_reader(root):
    """The same frames (bytes in memory vs transformers' reader on the file) and the same sampled fps."""
    from transformers.video_utils import load_video

    processor = video_processor_class()(fps=SETTINGS.fps, min_frames=SETTINGS.min_frames, max_frames=8)
    frames, fps = decode_video((root / "clip.mp4").read_bytes(), SETTINGS)
    video, meta = load_video(
        str(root / "clip.mp4"),
        backend="pyav",
        sample_indices_fn=lambda metadata, **kw: processor.sample_frames(metadata),
    )
    assert len(frames) == len(video) == 4
    for ours, theirs in zip(frames, video):
        assert np.array_equal(np.asarray(ours), theirs)
    assert fps == pytest.approx(meta.sampled_fps) and fps == pytest.approx(4 / 9 * 4)


@pytest.mark.parametrize("n", [4, 5])
def test_patches_match_transformers_layout(pre, n):
    """Frames resized and normalised by transformers' PIL image processor, patchified by the video processor's
    `patchify` (an odd count: its last frame repeated) == dhp's `video_patches`, bit for bit."""
    frames = noise_frames(n, (100, 70))
    pixels, grid = pre.video_patches(frames)
    p = pre.video_patches.keywords["frame_processor"]
    from transformers.image_utils import SizeDict

    size = SizeDict(shortest_edge=p.size["shortest_edge"], longest_edge=p.size["longest_edge"])
    prepared = []
    for f in frames:
        chw = np.asarray(f).transpose(2, 0, 1)
        resized = p.resize(chw, size=size, resample=p.resample, factor=28)
        prepared.append(p.normalize(p.rescale(resized, p.rescale_factor), p.image_mean, p.image_std))
    videos = torch.from_numpy(np.stack(prepared))[None]
    theirs, t, h, w = video_processor_class().patchify(None, videos, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid.tolist() == [[t, h, w]] == [[(n + 1) // 2, 4, 8]]  # 70 x 100 px -> 56 x 112
    assert np.array_equal(pixels, theirs[0].numpy())


def test_pixels_match_the_video_processor(root, pre):
    """The whole of transformers' video processor (torchvision's resize) on the same frames, where torchvision
    imports: the same grid, pixels within the two resizes' rounding (PIL's and torchvision's bicubic on uint8)."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a torchvision built for another torch raises RuntimeError)
        pytest.skip(f"torchvision does not import here: {str(e).splitlines()[0] if str(e) else e!r}")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    frames, _ = decode_video((root / "clip.mp4").read_bytes(), SETTINGS)
    pixels, grid = pre.video_patches(frames)
    processor = Qwen2VLVideoProcessor(min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
    out = processor(videos=[np.stack([np.asarray(f) for f in frames])], do_sample_frames=False, return_tensors="pt")
    assert out["video_grid_thw"].tolist() == grid.tolist()
    # one uint8 level after rescale and normalise is 1 / 255 / std <= 0.0153
    assert np.abs(out["pixel_values_videos"].numpy() - pixels).max() <= 2 * 0.0153


def test_positions_of_a_video_follow_its_seconds(config):
    """Text, a video of t=3 temporal patches (h=4, w=6 patches) at 1.5 s per patch, text, an image: the video's time
    positions step by tokens_per_second x 1.5, its rows and columns are the image's rule, text resumes after the
    largest."""
    video, image = torch.tensor([[3, 4, 6]]), torch.tensor([[1, 2, 2]])
    ids = torch.tensor([1, 2] + [VIDEO_PAD] * 18 + [3] + [IMAGE_PAD] + [4, 5])
    pos = rope_positions(ids, image, config, video_grid_thw=video, second_per_grid_ts=torch.tensor([1.5]))
    step = config.vision_config.tokens_per_second * 1.5
    t, h, w = torch.meshgrid(torch.arange(3), torch.arange(2), torch.arange(3), indexing="ij")
    expected_video = torch.stack([(t * step).long() + 2, h + 2, w + 2]).reshape(3, -1)
    assert torch.equal(pos[:, :2], torch.tensor([[0, 1]] * 3))
    assert torch.equal(pos[:, 2:20], expected_video)
    nxt = 2 + 3  # text after a visual continues at start + max(h, w) merged
    assert torch.equal(pos[:, 20], torch.tensor([nxt] * 3))
    assert torch.equal(pos[:, 21], torch.tensor([nxt + 1] * 3))  # the 1 x 1 merged image
    assert torch.equal(pos[:, 22:], torch.tensor([[nxt + 2, nxt + 3]] * 3))
    assert step != 1  # time positions unlike an image's rows
    slower = rope_positions(ids, image, config, video_grid_thw=video, second_per_grid_ts=torch.tensor([3.0]))
    assert slower[0, 2:20].max() == 2 + 2 * 2 * config.vision_config.tokens_per_second * 3.0 // 2


def conv(human: str, reply: str = "A red bar moves right.") -> list[dict]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]


def test_video_records_in_placeholder_order(pre, root):
    """A file, a list of frame files, and a video before an image: pixel rows and grids follow the placeholders,
    every visual's pads are the right kind, second_per_grid_ts is temporal_patch_size / sampled fps."""
    clip = pre.process(json.dumps({"video": "clip.mp4", "conversations": conv("<video>\nWhat happens?")}))
    assert clip["image_grid_thw"].tolist() == [[2, 4, 8]]  # 4 of 9 frames, 70 x 100 px -> 56 x 112
    assert clip["second_per_grid_ts"].tolist() == pytest.approx([2 / (4 / 9 * 4)])
    assert (clip["input_ids"] == VIDEO_PAD).sum() == 16 and (clip["input_ids"] == IMAGE_PAD).sum() == 0
    assert (clip["labels"] != -100).sum() > 0

    frames = [f"f{k}.png" for k in range(5)]
    listed = pre.process(json.dumps({"video": frames, "conversations": conv("<video> Describe.")}))
    assert listed["image_grid_thw"].tolist() == [[2, 4, 6]]  # 5 frames at 2 fps -> 4 kept (even); 60 x 90 -> 56 x 84
    assert listed["second_per_grid_ts"].tolist() == pytest.approx([2 / (4 / 5 * SETTINGS.frames_fps)])

    both = pre.process(
        json.dumps({"image": "still.png", "video": "clip.mp4", "conversations": conv("<video> then <image>: same?")})
    )
    grid = both["image_grid_thw"].tolist()
    assert grid == [[2, 4, 8], [1, 4, 6]]  # the video first, as in the text (the still: 40 x 60 -> 56 x 84)
    assert np.array_equal(both["pixel_values"][:64], clip["pixel_values"])
    pads = both["input_ids"][np.isin(both["input_ids"], [VIDEO_PAD, IMAGE_PAD])]
    assert pads.tolist() == [VIDEO_PAD] * 16 + [IMAGE_PAD] * 6


@pytest.mark.parametrize(
    ("record", "reason", "where"),
    [
        ({"video": "gone.mp4", "conversations": conv("<video>")}, "missing_video", "gone.mp4"),
        ({"video": "not_a_video.mp4", "conversations": conv("<video>")}, "corrupt_video", "not_a_video.mp4"),
        ({"video": "truncated.mp4", "conversations": conv("<video>")}, "corrupt_video", "truncated.mp4"),
        ({"video": ["f0.png", "f_gone.png"], "conversations": conv("<video>")}, "missing_video", "f_gone.png"),
        ({"video": ["f0.png", "f_bad.png"], "conversations": conv("<video>")}, "corrupt_video", "f_bad.png"),
        ({"video": 3, "conversations": conv("<video>")}, "wrong_field_type", "'video'"),
        ({"video": [], "conversations": conv("<video>")}, "wrong_field_type", "'video'"),
        ({"video": "clip.mp4", "conversations": conv("no placeholder")}, "video_count_mismatch", "0 <video>"),
        ({"conversations": conv("<video> alone")}, "video_count_mismatch", "1 <video>"),
        ({"video": "clip.mp4", "conversations": conv("<video>", "x <|video_pad|>")}, "image_count_mismatch", "video"),
    ],
)
def test_bad_videos_are_counted_skips(pre, root, record, reason, where):
    row = pre({"source": "train.jsonl:7", "record": json.dumps(record)})
    assert (row["error"], row["source"], row["sample"]) == (reason, "train.jsonl:7", b"")
    assert where in row["detail"]


def test_a_video_longer_than_max_seq_len_is_skipped(root, config):
    settings = PreprocessSettings(str(root), 56 * 56, 112 * 112, max_seq_len=30, video=SETTINGS)
    row = Preprocessor(settings, config)(
        {"source": "s", "record": json.dumps({"video": "clip.mp4", "conversations": conv("<video>")})}
    )
    assert row["error"] == "too_long"


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_webdataset_video_members(root, pre, tmp_path):
    """A shard's `.mp4` member becomes a video sample (<video> in the prompt's <image> place); a broken one is a
    counted skip naming shard:key."""
    import pyarrow.fs as pafs

    clip = (root / "clip.mp4").read_bytes()
    shard = tmp_path / "000.tar"
    shard.write_bytes(
        tar_bytes({"a.mp4": clip, "a.txt": b"A red bar moves right.", "b.mp4": b"garbage", "b.txt": b"Nothing."})
    )
    rows = shard_rows(pafs.LocalFileSystem(), str(shard), "000.tar", "<image>\nDescribe this.", "txt")
    assert [json.loads(r["record"]).get("video") for r in rows] == ["a.mp4", "b.mp4"]
    good, bad = (pre(r) for r in rows)
    assert good["error"] == "" and bad["error"] == "corrupt_video" and bad["source"] == "000.tar:b"
    expected = pre.process(json.dumps({"video": "clip.mp4", "conversations": conv("<video>\nDescribe this.")}))
    from dhp.dataflow.preprocess import decode_sample

    sample = decode_sample(good["sample"])
    assert torch.equal(sample["pixel_values"], torch.from_numpy(expected["pixel_values"]))
    assert torch.equal(sample["position_ids"], torch.from_numpy(expected["position_ids"]))


def test_synthetic_videos(tmp_path, config):
    """The synthetic set's videos (MPEG-4 files and frame lists) preprocess, and a set without videos is the one
    earlier versions wrote (no video coin drawn)."""
    s = write_synthetic_dataset(tmp_path / "v", 12, seed=0, eval_num=0, video_fraction=0.5)
    records = [json.loads(line) for line in s.train_path.read_text().splitlines()]
    videos = [r for r in records if "video" in r]
    assert {isinstance(r["video"], str) for r in videos} == {True, False}
    assert json.loads(s.meta_path.read_text())["num_videos"] == len(videos)
    settings = PreprocessSettings(str(s.out_dir), 56 * 56, 224 * 224, 2048)
    pre = Preprocessor(settings, config)
    for r in videos:
        out = pre.process(json.dumps(r))
        assert out["image_grid_thw"].shape == (1, 3) and out["image_grid_thw"][0, 0] >= 2
    plain = write_synthetic_dataset(tmp_path / "p", 12, seed=0, eval_num=0)
    again = write_synthetic_dataset(tmp_path / "q", 12, seed=0, eval_num=0, video_fraction=0.0)
    assert plain.train_path.read_text() == again.train_path.read_text()
    assert not any("video" in json.loads(x) for x in plain.train_path.read_text().splitlines())


def test_videos_from_s3_equal_local(s3_endpoint, root, pre, config):
    """A video file and a list of frame files as s3:// URIs preprocess to the local samples; a missing object is a
    counted skip naming its URI."""
    from dhp.stages.config import StorageConfig

    s3_endpoint.upload(root, "videos", "v")
    storage = StorageConfig(endpoint_url=s3_endpoint.url, region="us-east-1")
    settings = PreprocessSettings("s3://videos/v", 56 * 56, 112 * 112, 1024, storage=storage, video=SETTINGS)
    remote = Preprocessor(settings, config)
    frames = [f"f{k}.png" for k in range(5)]
    for video in ("clip.mp4", "s3://videos/v/clip.mp4", frames, [f"s3://videos/v/{f}" for f in frames]):
        local_video = video.rsplit("/", 1)[-1] if isinstance(video, str) else frames
        record = {"video": video, "conversations": conv("<video>\nWhat happens?")}
        ours = remote.process(json.dumps(record))
        local = pre.process(json.dumps({**record, "video": local_video}))
        assert all(np.array_equal(ours[k], local[k]) for k in local), video
    row = remote({"source": "s", "record": json.dumps({"video": "gone.mp4", "conversations": conv("<video>")})})
    assert (row["error"], row["detail"]) == ("missing_video", "s3://videos/v/gone.mp4: not found")
