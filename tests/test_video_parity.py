"""A batch of a video sample (a video and an image in one conversation), a video given as frame files and a
text-only sample trains under vision SP2 / text TP2 exactly like the single-process transformers model given
pixel_values_videos, video_grid_thw and second_per_grid_ts (tests/test_parity.py's tolerances): padded (the videos
and the image in one micro-batch, the text-only sample in another) and packed (all three in one sequence, the
text-only sample between the videos). Qwen3-VL's video (a timestamp before each temporal patch, positions per temporal
patch) trains the same way against `Qwen3VLForConditionalGeneration` (padded)."""

from __future__ import annotations

import copy
import json

import pytest
import ray
import torch

from dhp.dataflow.loader import GlobalBatch
from dhp.dataflow.packing import text_inputs
from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
from dhp.dataflow.synth import write_mp4
from dhp.dataflow.video import VideoSettings
from dhp.models.architectures import architecture_config
from dhp.stages.config import load_config
from tests.conftest import rel_err, write_image
from tests.test_packing import _packed_microbatch
from tests.test_parity import BASE, RESOURCES, SP2, STEPS, TP2, _microbatch, collect, reference_trajectory
from tests.test_video import noise_frames

IMAGE_PAD, VIDEO_PAD = 151655, 151656
# 4 of 6 frames at 3 fps -> 2 temporal patches of 12 x 16 patches (168 x 224 px): windows of 8 x 8, the last
# row and column partial, in every temporal patch
VIDEO = VideoSettings(fps=2.0, min_frames=4, max_frames=8, min_pixels=56 * 56, max_pixels=168 * 224)


@pytest.fixture(scope="module")
def video_samples(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("video_parity")
    write_mp4(root / "clip.mp4", noise_frames(6, (224, 168), seed=3), fps=3)
    for k, frame in enumerate(noise_frames(4, (112, 84), seed=4)):
        frame.save(root / f"f{k}.png")
    write_image(root / "b.png", (60, 90), seed=2)
    records = [
        {
            "video": "clip.mp4",
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "<video>\nWhat changes? And in <image>?"},
                {"from": "gpt", "value": "Noise, frame after frame. Still noise."},
            ],
        },
        {
            "video": [f"f{k}.png" for k in range(4)],
            "conversations": [
                {"from": "human", "value": "Describe <video>"},
                {"from": "gpt", "value": "Four frames of noise."},
            ],
        },
        {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Teal."}]},
    ]
    settings = PreprocessSettings(str(root), 56 * 56, 224 * 224, 1024, video=VIDEO)
    pre = Preprocessor(settings, architecture_config("tiny"))
    rows = [pre({"source": "t", "record": json.dumps(r)}) for r in records]
    assert [r["error"] for r in rows] == ["", "", ""], rows
    return [decode_sample(r["sample"]) for r in rows]


def reference_inputs(samples: list[dict[str, torch.Tensor]], timestamps: bool = False) -> dict[str, torch.Tensor]:
    """The batch as transformers takes it: images and videos apart (each in sample order), positions its own;
    `timestamps`: Qwen3-VL's videos, each temporal patch a pad run behind its timestamp and no second_per_grid_ts
    (Qwen2.5-VL's: one run a video, its seconds per temporal patch)."""
    images, image_grids, videos, video_grids = [], [], [], []
    for s in samples:
        ids, offset = s["input_ids"], 0
        starts = torch.nonzero(torch.isin(ids, torch.tensor([IMAGE_PAD, VIDEO_PAD])), as_tuple=True)[0]
        firsts = [int(i) for i in starts if i == 0 or int(ids[i - 1]) not in (IMAGE_PAD, VIDEO_PAD)]
        runs = iter(firsts)
        for grid in s["image_grid_thw"]:  # the visuals are in the order of their pad runs
            first, n = next(runs), int(grid.prod())
            if timestamps and int(ids[first]) == VIDEO_PAD:
                for _ in range(int(grid[0]) - 1):  # the video's other temporal patches
                    next(runs)
            pixels, grids = (videos, video_grids) if int(ids[first]) == VIDEO_PAD else (images, image_grids)
            pixels.append(s["pixel_values"][offset : offset + n])
            grids.append(grid)
            offset += n
        assert offset == s["pixel_values"].shape[0]
    t = text_inputs(samples, pad_id=151643)
    inputs = dict(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        labels=t["labels"],
        pixel_values=torch.cat(images),
        image_grid_thw=torch.stack(image_grids),
        pixel_values_videos=torch.cat(videos),
        video_grid_thw=torch.stack(video_grids),
        second_per_grid_ts=torch.cat([s["second_per_grid_ts"] for s in samples]),
        mm_token_type_ids=(t["input_ids"] == IMAGE_PAD).int() + 2 * (t["input_ids"] == VIDEO_PAD).int(),
    )
    if timestamps:
        del inputs["second_per_grid_ts"]
    return inputs


def sp2_tp2_config(ckpt, samples: list[dict], packed: bool):
    """SP 2 vision / TP 2 text on the parity setup's checkpoint, a budget that takes every sample at once."""
    longest = max(s["input_ids"].shape[0] for s in samples)
    total = sum(s["input_ids"].shape[0] for s in samples)
    return load_config(
        "tiny",
        BASE
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={total}",
            f"data.packing={str(packed).lower()}",
            f"data.max_seq_len={longest}",
            f"training.steps={STEPS}",
            "training.warmup_steps=1",
            "training.lr=1e-3",
            "training.adam_eps=1e-6",  # test_parity.check_parity says why
            "training.weight_decay=0.1",
            "training.max_grad_norm=1.0",
        ]
        + RESOURCES
        + SP2
        + TP2,
    )


def trains_as_reference(trainers, cfg, ref, inputs: dict, batch: GlobalBatch) -> None:
    """`STEPS` steps of `batch` on a trainer of `cfg` against `ref` trained in one process on `inputs`: losses
    1e-6, every gradient 1e-5 relative, grad norms 1e-5, parameters 1e-5 absolute after the last step."""
    with trainers.use(cfg) as trainer:
        expected = reference_trajectory(copy.deepcopy(ref), inputs, cfg)
        for step in range(STEPS):
            loss = trainer.accumulate([batch])
            ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
            grads = collect(trainer, grads=True)
            ref_loss, ref_grads = expected.losses[step], expected.grads[step]
            assert abs(loss - ref_loss) / ref_loss <= 1e-6, (step, loss, ref_loss)
            errors = {n: rel_err(grads[n], g) for n, g in ref_grads.items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, f"step {step}: gradient of {worst} off by {errors[worst]:.2e}"
            grad_norm, _ = trainer.optimizer_step()
            assert abs(grad_norm - expected.norms[step]) / expected.norms[step] <= 1e-5
        params = collect(trainer)
        for name, p in expected.params.items():
            diff = (params[name] - p).abs().max().item()
            assert diff <= 1e-5, f"{name} differs by {diff:.2e} after {STEPS} steps"


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_video_batch_matches_transformers_sp2_tp2(parity_setup, video_samples, trainers, packed):
    ref, ckpt, _ = parity_setup
    samples = video_samples
    inputs = reference_inputs(samples)
    assert inputs["video_grid_thw"].tolist() == [[2, 12, 16], [2, 6, 8]]
    assert inputs["second_per_grid_ts"].tolist() == [1.0, 1.0]
    cfg = sp2_tp2_config(ckpt, samples, packed)
    if packed:  # one sequence: a video with an image, the text-only sample, the video of frame files
        batch = GlobalBatch([_packed_microbatch([samples[0], samples[2], samples[1]], cfg)], epoch=0)
    else:  # one micro-batch of both videos and the image, one text-only
        batch = GlobalBatch([_microbatch([samples[0], samples[1]], cfg), _microbatch([samples[2]], cfg)], epoch=0)
    trains_as_reference(trainers, cfg, ref, inputs, batch)


# Qwen3-VL: 4 frames of 96 x 64 px at 3 fps, the clip's bound exactly their pixels -> 2 temporal patches of 4 x 6
# patches of 16 px, each behind its timestamp; image b (6 x 4 patches) in the same conversation
QWEN3_VIDEO = VideoSettings(fps=3.0, min_frames=4, max_frames=4, min_pixels=32 * 32, max_pixels=4 * 64 * 96)


@pytest.fixture(scope="module")
def qwen3_video_samples(tmp_path_factory, small_qwen3_parity_setup) -> list[dict[str, torch.Tensor]]:
    ref, _, _ = small_qwen3_parity_setup
    root = tmp_path_factory.mktemp("qwen3_video_parity")
    write_mp4(root / "clip.mp4", noise_frames(4, (96, 64), seed=5), fps=3)
    write_image(root / "b.png", (60, 90), seed=2)
    records = [
        {
            "video": "clip.mp4",
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "<video>\nWhat changes? And in <image>?"},
                {"from": "gpt", "value": "Noise, frame after frame. Still noise."},
            ],
        },
        {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Teal."}]},
    ]
    settings = PreprocessSettings(str(root), 56 * 56, 224 * 224, 1024, video=QWEN3_VIDEO)
    pre = Preprocessor(settings, ref.config)
    rows = [pre({"source": "t", "record": json.dumps(r)}) for r in records]
    assert [r["error"] for r in rows] == ["", ""], rows
    return [decode_sample(r["sample"]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_qwen3_vl_video_batch_matches_transformers_sp2_tp2(
    small_qwen3_parity_setup, qwen3_video_samples, trainers, packed
):
    """Padded: the video and the image in one micro-batch, the text-only sample in another; packed: the text-only
    sample and the video sample in one sequence. 3 steps under SP2 / TP2."""
    ref, ckpt, _ = small_qwen3_parity_setup
    samples = qwen3_video_samples
    inputs = reference_inputs(samples, timestamps=True)
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert int((samples[0]["input_ids"] == 151652).sum()) == 3  # <|vision_start|>: two temporal patches, an image
    cfg = sp2_tp2_config(ckpt, samples, packed)
    if packed:  # one sequence: the text-only sample, then the video with the image
        batch = GlobalBatch([_packed_microbatch([samples[1], samples[0]], cfg, ref.config)], epoch=0)
    else:
        micro = [_microbatch([samples[0]], cfg, ref.config), _microbatch([samples[1]], cfg, ref.config)]
        batch = GlobalBatch(micro, epoch=0)
    trains_as_reference(trainers, cfg, ref, inputs, batch)
