"""Preprocessing of one LLaVA record, checked against transformers' own functions, not dhp's code paths.

Pixels and grids come from `Qwen2VLImageProcessorPil` / `smart_resize`, token ids from the tokenizer's chat
template, mRoPE positions from `get_rope_index` of a real `Qwen2_5_VLModel`. Collation, packing, the skip
reasons and the safetensors round trip are checked on the same samples. CPU only, no Ray.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from dhp.dataflow.packing import meta_of, pack, text_inputs, vision_inputs
from dhp.dataflow.preprocess import (
    IGNORE_INDEX,
    Preprocessor,
    PreprocessSettings,
    SkipSample,
    decode_sample,
    encode_sample,
)
from dhp.dataflow.tokenizer import load_tokenizer
from dhp.labels import count_label_tokens
from dhp.models.architectures import architecture_config
from tests.conftest import write_image

MIN_PIXELS, MAX_PIXELS, MAX_SEQ_LEN = 56 * 56, 224 * 224, 2048
IMAGE_PAD, VISION_START, VISION_END, IM_END, ENDOFTEXT = 151655, 151652, 151653, 151645, 151643
PATCH_DIM = 3 * 2 * 14 * 14

# name -> (width, height); every one of these is a valid image of a different size / aspect ratio.
IMAGES = {
    "a.png": (150, 100),  # landscape, rounds to 112 x 140
    "b.png": (60, 90),  # small portrait
    "tall.png": (40, 300),  # 1:7.5
    "big.png": (600, 400),  # 240000 px > MAX_PIXELS: resized down
    "tiny.png": (20, 30),  # 600 px < MIN_PIXELS: resized up
}


def conv(*pairs: str) -> list[dict[str, str]]:
    """conv(human, gpt, human, gpt, ...) -> LLaVA conversations."""
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": v} for i, v in enumerate(pairs)]


RECORDS = {
    "single": {"image": "b.png", "conversations": conv("<image>\nDescribe the image.", "Random colours.")},
    "two": {
        "image": ["a.png", "tall.png"],
        "conversations": conv(
            "<image>\nWhat is in the first picture?",
            "Noise, mostly.",
            "And here? <image> Anything else?",
            "Smaller noise.\nStill noise.",
        ),
    },
    "adjacent": {"image": ["big.png", "tiny.png"], "conversations": conv("<image><image>Compare them.", "Same.")},
    "big": {"image": ["big.png"], "conversations": conv("Look: <image>", "A large image.")},
    "text": {"conversations": conv("Hello there, how are you?", "Fine, thanks!\nAnd you?", "Good.", "Great.")},
}


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preprocess_images")
    for seed, (name, size) in enumerate(IMAGES.items()):
        write_image(root / name, size, seed=seed)
    write_image(root / "dot.png", (1, 1), seed=7)
    write_image(root / "line.png", (1, 50), seed=8)
    write_image(root / "extreme.png", (2, 500), seed=9)  # aspect ratio 250 > smart_resize's limit of 200
    (root / "notimage.png").write_bytes(b"this is not an image at all\n" * 10)
    full = (root / "a.png").read_bytes()
    (root / "truncated.png").write_bytes(full[: len(full) // 2])
    g = np.random.default_rng(0)
    rgba = g.integers(0, 256, (70, 90, 4), dtype=np.uint8)  # H x W x RGBA, alpha varies per pixel
    Image.fromarray(rgba, "RGBA").save(root / "rgba.png")
    return root


@pytest.fixture(scope="module")
def config():
    return architecture_config("tiny")


def make_preprocessor(root: Path, config, max_seq_len: int = MAX_SEQ_LEN) -> Preprocessor:
    settings = PreprocessSettings(
        image_root=str(root), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_seq_len=max_seq_len
    )
    return Preprocessor(settings, config)


@pytest.fixture(scope="module")
def pre(image_root, config) -> Preprocessor:
    return make_preprocessor(image_root, config)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def ref_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def hf_model(config) -> Qwen2_5_VLModel:
    torch.manual_seed(0)
    return Qwen2_5_VLModel(config).eval()


@pytest.fixture(scope="module")
def samples(pre) -> dict[str, dict[str, np.ndarray]]:
    return {name: pre.process(json.dumps(rec)) for name, rec in RECORDS.items()}


def image_paths(record: dict) -> list[str]:
    images = record.get("image", [])
    return [images] if isinstance(images, str) else list(images)


def expected_ids(tok, record: dict, grids: np.ndarray) -> list[int]:
    """Ids from the tokenizer's own chat template, each <|image_pad|> expanded to grid.prod() // 4."""
    messages = []
    for turn in record["conversations"]:
        if turn["from"] == "human":
            content = []
            for i, part in enumerate(turn["value"].split("<image>")):
                if i:
                    content.append({"type": "image"})
                if part:
                    content.append({"type": "text", "text": part})
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "assistant", "content": turn["value"]})
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    runs = iter(int(n) for n in np.prod(grids, axis=-1) // 4)
    out: list[int] = []
    for t in ids:
        out += [t] * (next(runs) if t == IMAGE_PAD else 1)
    assert next(runs, None) is None, "more images than <|image_pad|> in the template"
    return out


def runs_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of True."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def row_for(record: dict | str, source: str = "data/train.jsonl:7") -> dict:
    return {"source": source, "record": record if isinstance(record, str) else json.dumps(record)}


# 1. Pixels ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "two", "adjacent", "big"])
def test_pixels_and_grid_match_transformers(name, samples, image_root, ref_processor):
    sample = samples[name]
    paths = image_paths(RECORDS[name])
    images = [Image.open(image_root / p) for p in paths]
    ref = ref_processor(images=images, return_tensors="np")
    assert sample["pixel_values"].dtype == np.float32 and sample["image_grid_thw"].dtype == np.int64
    assert sample["image_grid_thw"].shape == (len(paths), 3)
    np.testing.assert_array_equal(sample["image_grid_thw"], ref["image_grid_thw"])
    assert sample["pixel_values"].shape == ref["pixel_values"].shape
    assert sample["pixel_values"].shape[1] == PATCH_DIM
    np.testing.assert_array_equal(sample["pixel_values"], ref["pixel_values"])
    # Patches are laid out image after image: each image alone gives its own slice.
    offset = 0
    for image, grid in zip(images, sample["image_grid_thw"]):
        alone = ref_processor(images=[image], return_tensors="np")["pixel_values"]
        n = int(np.prod(grid))
        np.testing.assert_array_equal(sample["pixel_values"][offset : offset + n], alone)
        offset += n
    assert offset == sample["pixel_values"].shape[0]
    # Grids follow smart_resize within [min_pixels, max_pixels].
    for path, grid in zip(paths, sample["image_grid_thw"].tolist()):
        width, height = IMAGES[path]
        rh, rw = smart_resize(height, width, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        assert grid == [1, rh // 14, rw // 14]
        assert MIN_PIXELS <= rh * rw <= MAX_PIXELS


def test_large_image_is_resized_down_and_small_up(samples):
    big = samples["big"]["image_grid_thw"][0]
    assert IMAGES["big.png"][0] * IMAGES["big.png"][1] > MAX_PIXELS
    assert big.tolist() == [1, 12, 18]  # 168 x 252 = 42336 px <= 224 * 224
    tiny = samples["adjacent"]["image_grid_thw"][1]
    assert tiny.tolist() == [1, 6, 4]  # 84 x 56 = 4704 px >= 56 * 56


def test_rgba_pixels_match_transformers(pre, image_root, ref_processor):
    record = {"image": "rgba.png", "conversations": conv("<image>What?", "Noise.")}
    sample = pre.process(json.dumps(record))
    ref = ref_processor(images=[Image.open(image_root / "rgba.png")], return_tensors="np")
    np.testing.assert_array_equal(sample["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(sample["pixel_values"], ref["pixel_values"])


@pytest.mark.parametrize("name", ["tiny", "qwen3_vl_tiny"])
def test_each_family_normalises_as_its_checkpoints(name, image_root):
    """Qwen2.5-VL's images are normalised with OpenAI CLIP's mean and std, Qwen3-VL's with 0.5 per channel (its
    released checkpoints' preprocessor config; transformers' Qwen3-VL video processor defaults to the same): the
    pixels are transformers' image processor's with that normalisation and the family's patch size."""
    config = architecture_config(name)
    vc = config.vision_config
    mean, std = {"tiny": (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD), "qwen3_vl_tiny": ([0.5] * 3, [0.5] * 3)}[name]
    sample = make_preprocessor(image_root, config).process(
        json.dumps({"image": "a.png", "conversations": conv("<image>What?", "Noise.")})
    )
    ref = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size,
        image_mean=list(mean),
        image_std=list(std),
    )(images=[Image.open(image_root / "a.png")], return_tensors="np")
    np.testing.assert_array_equal(sample["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(sample["pixel_values"], ref["pixel_values"])


# 2. Token ids -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECORDS))
def test_input_ids_match_chat_template(name, samples, tok):
    sample = samples[name]
    grids = sample["image_grid_thw"]
    ids = sample["input_ids"]
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.tolist() == expected_ids(tok, RECORDS[name], grids)
    assert int((ids == IMAGE_PAD).sum()) == int((grids.prod(-1) // 4).sum())
    pad_runs = runs_of(ids == IMAGE_PAD)
    assert [e - s for s, e in pad_runs] == (grids.prod(-1) // 4).tolist()
    for s, e in pad_runs:
        assert ids[s - 1] == VISION_START and ids[e] == VISION_END
    assert int((ids == VISION_START).sum()) == int((ids == VISION_END).sum()) == len(grids)


# 3. Labels ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECORDS))
def test_labels_cover_exactly_the_replies(name, samples, tok):
    ids, labels = samples[name]["input_ids"], samples[name]["labels"]
    assert labels.dtype == np.int64 and labels.shape == ids.shape
    labelled = labels != IGNORE_INDEX
    np.testing.assert_array_equal(labels[labelled], ids[labelled])
    replies = [t["value"] for t in RECORDS[name]["conversations"] if t["from"] == "gpt"]
    runs = runs_of(labelled)
    assert len(runs) == len(replies)
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for (s, e), reply in zip(runs, replies):
        assert tok.decode(ids[s:e].tolist()) == reply + "<|im_end|>"
        assert ids[s - len(header) : s].tolist() == header
        assert ids[e - 1] == IM_END
        assert e == len(ids) or tok.decode([int(ids[e])]) == "\n"
    assert not labelled[0]
    assert count_label_tokens(torch.from_numpy(labels)) == int((labels[1:] != IGNORE_INDEX).sum())
    assert count_label_tokens(torch.from_numpy(labels)) == int(labelled.sum())


def test_multi_turn_reply_with_newline_is_one_run(samples, tok):
    ids, labels = samples["two"]["input_ids"], samples["two"]["labels"]
    runs = runs_of(labels != IGNORE_INDEX)
    assert len(runs) == 2
    s, e = runs[1]
    assert tok.decode(ids[s:e].tolist()) == "Smaller noise.\nStill noise.<|im_end|>"
    assert IMAGE_PAD not in labels.tolist()


def test_count_label_tokens_batched():
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, 9, -100]])
    assert count_label_tokens(labels) == 3  # the first column never carries loss after the shift


# 4. Positions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "two", "adjacent", "text"])
def test_positions_match_get_rope_index(name, samples, hf_model):
    sample = samples[name]
    ids = torch.from_numpy(sample["input_ids"])
    grid = torch.from_numpy(sample["image_grid_thw"])
    with torch.no_grad():
        ref, _ = hf_model.get_rope_index(
            ids[None],
            mm_token_type_ids=(ids == IMAGE_PAD).int()[None],
            image_grid_thw=grid if grid.numel() else None,
        )
    positions = sample["position_ids"]
    assert positions.dtype == np.int64 and positions.shape == (3, ids.shape[0])
    np.testing.assert_array_equal(positions, ref[:, 0].numpy())
    if name == "text":
        np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(ids.shape[0]), (3, ids.shape[0])))
    else:  # vision tokens spread in h/w, so the last position is below L - 1
        assert positions.max() < ids.shape[0] - 1


# 5. Collation and packing -------------------------------------------------------------------------------


def decoded(samples, names) -> list[dict[str, torch.Tensor]]:
    return [decode_sample(encode_sample(samples[n])) for n in names]


NAMES = ["two", "text", "single", "adjacent"]


def test_text_inputs_pad_right(samples):
    chosen = decoded(samples, NAMES)
    out = text_inputs(chosen, pad_id=ENDOFTEXT)
    lengths = [s["input_ids"].shape[0] for s in chosen]
    length = max(lengths)
    assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (len(chosen), length)
    assert out["position_ids"].shape == (3, len(chosen), length)
    for b, (s, n) in enumerate(zip(chosen, lengths)):
        assert torch.equal(out["input_ids"][b, :n], s["input_ids"])
        assert torch.equal(out["labels"][b, :n], s["labels"])
        assert torch.equal(out["position_ids"][:, b, :n], s["position_ids"])
        assert out["attention_mask"][b, :n].eq(1).all()
        assert out["input_ids"][b, n:].eq(ENDOFTEXT).all()
        assert out["labels"][b, n:].eq(IGNORE_INDEX).all()
        assert out["attention_mask"][b, n:].eq(0).all()
    assert min(lengths) < length  # some padding was exercised


def test_vision_inputs_concatenate_in_order(samples):
    chosen = decoded(samples, NAMES)
    out = vision_inputs(chosen)
    assert out["image_grid_thw"].dtype == torch.long
    expected_grid = np.concatenate([samples[n]["image_grid_thw"] for n in NAMES])
    expected_pixels = np.concatenate([samples[n]["pixel_values"] for n in NAMES])
    np.testing.assert_array_equal(out["image_grid_thw"].numpy(), expected_grid)
    np.testing.assert_array_equal(out["pixel_values"].numpy(), expected_pixels)
    assert out["pixel_values"].shape[0] == int(out["image_grid_thw"].prod(-1).sum())


def test_meta_of_counts(samples):
    chosen = decoded(samples, NAMES)
    vision, text = vision_inputs(chosen), text_inputs(chosen, pad_id=ENDOFTEXT)
    meta = meta_of(vision, text)
    lengths = [s["input_ids"].shape[0] for s in chosen]
    assert meta.samples == len(NAMES)
    assert meta.tokens == sum(lengths)
    assert meta.padded_tokens == len(NAMES) * max(lengths)
    assert meta.label_tokens == sum(int((samples[n]["labels"][1:] != IGNORE_INDEX).sum()) for n in NAMES)
    assert meta.images == sum(len(samples[n]["image_grid_thw"]) for n in NAMES) == 5
    assert meta.patches == sum(samples[n]["pixel_values"].shape[0] for n in NAMES)


@pytest.mark.parametrize("seed", range(5))
def test_pack_respects_budget_and_covers_all(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.choice([300, 512, 1000, 4096])
    groups = pack(lengths, budget)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    for g in groups:
        assert g and len(g) * max(lengths[i] for i in g) <= budget


def test_pack_examples_and_errors():
    assert pack([], 10) == []
    assert pack([4, 4, 4, 4], 16) == [[0, 1, 2, 3]]
    assert pack([5, 3, 3, 2], 6) == [[0], [1, 2], [3]]
    assert pack([10], 10) == [[0]]
    with pytest.raises(ValueError):
        pack([3, 11, 2], 10)


# 6. Skipped records -------------------------------------------------------------------------------------

GOOD_TURNS = conv("<image>Hi", "Hello")

BAD_RECORDS = {
    "malformed_json": ('{"image": "b.png", "conversations": [', "malformed_json"),
    "list_record": (json.dumps([{"conversations": GOOD_TURNS}]), "wrong_field_type"),
    "image_not_path": ({"image": 5, "conversations": GOOD_TURNS}, "wrong_field_type"),
    "no_conversations": ({"image": "b.png"}, "missing_conversations"),
    "empty_conversations": ({"image": "b.png", "conversations": []}, "missing_conversations"),
    "robot_turn": (
        {"image": "b.png", "conversations": [{"from": "robot", "value": "<image>Hi"}, {"from": "gpt", "value": "x"}]},
        "wrong_field_type",
    ),
    "value_not_string": (
        {"image": "b.png", "conversations": [{"from": "human", "value": ["<image>"]}, {"from": "gpt", "value": "x"}]},
        "wrong_field_type",
    ),
    "too_many_placeholders": (
        {"image": "b.png", "conversations": conv("<image><image>Hi", "x")},
        "image_count_mismatch",
    ),
    "no_placeholder": ({"image": ["b.png"], "conversations": conv("Hi", "x")}, "image_count_mismatch"),
    "placeholder_without_image": ({"conversations": conv("<image>Hi", "x")}, "image_count_mismatch"),
    "literal_image_pad": ({"conversations": conv("Hi", "x <|image_pad|>")}, "image_count_mismatch"),
    "no_gpt_turn": (
        {"image": "b.png", "conversations": [{"from": "human", "value": "<image>Hi"}]},
        "no_assistant_turn",
    ),
    "missing_file": ({"image": "nope/missing.png", "conversations": GOOD_TURNS}, "missing_image"),
    "not_an_image": ({"image": "notimage.png", "conversations": GOOD_TURNS}, "corrupt_image"),
    "truncated_png": ({"image": "truncated.png", "conversations": GOOD_TURNS}, "corrupt_image"),
    "one_pixel": ({"image": "dot.png", "conversations": GOOD_TURNS}, "degenerate_image"),
    "one_pixel_wide": (
        {"image": ["b.png", "line.png"], "conversations": conv("<image><image>Hi", "x")},
        "degenerate_image",
    ),
    "too_long": ({"conversations": conv("word " * 3000, "x")}, "too_long"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_records_are_skipped_with_reason(case, pre):
    record, reason = BAD_RECORDS[case]
    text = record if isinstance(record, str) else json.dumps(record)
    with pytest.raises(SkipSample) as info:
        pre.process(text)
    assert info.value.reason == reason
    row = pre(row_for(text, source=f"bad.jsonl:{case}"))
    assert row["error"] == reason
    assert row["detail"]
    assert row["sample"] == b""
    assert row["tokens"] == 0
    assert row["source"] == f"bad.jsonl:{case}"


def test_extreme_aspect_ratio_is_skipped_not_raised(pre):
    row = pre(row_for({"image": "extreme.png", "conversations": GOOD_TURNS}))
    assert row["error"] != "" and row["sample"] == b"" and row["tokens"] == 0


def test_good_rows_and_text_only_record_not_skipped(pre, samples):
    for name, record in RECORDS.items():
        row = pre(row_for(record, source=f"good.jsonl:{name}"))
        assert row["error"] == "" and row["detail"] == "" and row["source"] == f"good.jsonl:{name}"
        assert row["tokens"] == samples[name]["input_ids"].shape[0] > 0
        blob = decode_sample(row["sample"])
        for key, value in samples[name].items():
            np.testing.assert_array_equal(blob[key].numpy(), value)
    text = samples["text"]
    assert text["pixel_values"].shape == (0, PATCH_DIM) and text["pixel_values"].dtype == np.float32
    assert text["image_grid_thw"].shape == (0, 3) and text["image_grid_thw"].dtype == np.int64


def test_max_seq_len_boundary(image_root, config, samples):
    length = samples["two"]["input_ids"].shape[0]
    record = json.dumps(RECORDS["two"])
    assert make_preprocessor(image_root, config, max_seq_len=length).process(record)["input_ids"].shape[0] == length
    with pytest.raises(SkipSample) as info:
        make_preprocessor(image_root, config, max_seq_len=length - 1).process(record)
    assert info.value.reason == "too_long"


# 7. Serialisation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["two", "text"])
def test_encode_decode_round_trip(name, samples):
    sample = samples[name]
    out = decode_sample(encode_sample(sample))
    assert (
        set(out)
        == set(sample)
        == {"pixel_values", "image_grid_thw", "input_ids", "labels", "position_ids", "second_per_grid_ts"}
    )
    for key, value in sample.items():
        assert isinstance(out[key], torch.Tensor)
        assert out[key].dtype == torch.from_numpy(value).dtype
        assert tuple(out[key].shape) == value.shape
        assert torch.equal(out[key], torch.from_numpy(value))
    # Non-contiguous input (a transposed view) round-trips to the same values.
    view = {"x": np.arange(12, dtype=np.int64).reshape(3, 4).T}
    np.testing.assert_array_equal(decode_sample(encode_sample(view))["x"].numpy(), view["x"])
