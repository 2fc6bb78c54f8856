"""`dhp data profile` (dataflow/length_profile.py, stages/data_profile.py): the length mix of real records through
the real preprocessing. The reference for the sizes does not use dhp's preprocessing: each photo of the real
img2dataset shard read with PIL and sized with transformers' `smart_resize`."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from dhp.dataflow.length_profile import evenly, spread
from dhp.stages.cli import main
from dhp.stages.config import load_config
from dhp.stages.data_profile import data_profile as profile

SHARD = Path(__file__).resolve().parent / "assets" / "cc12m-train-0000.tar"  # tests/assets/README.md
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224  # the tiny preset's


def _photo_patches() -> list[int]:
    """Patches of each photo of the shard, in member order: PIL's size through smart_resize (factor 28)."""
    out = []
    with tarfile.open(SHARD) as tar:
        for m in (m for m in tar.getmembers() if m.name.endswith(".jpg")):
            w, h = Image.open(io.BytesIO(tar.extractfile(m).read())).size
            rh, rw = smart_resize(h, w, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
            out.append(rh // 14 * (rw // 14))
    return out


def test_shard_profile_has_each_photos_patches_and_its_tokens():
    cfg = load_config("tiny", [f"data.train={SHARD}"])
    result = profile(cfg, limit=100)
    want = _photo_patches()
    assert result["records"] == result["samples"] == len(want) == 32 and result["skipped"] == {}
    assert [s["patches"] for s in result["per_sample"]] == [[p] for p in want]
    for s in result["per_sample"]:
        assert s["tokens"] == s["text_tokens"] + s["patches"][0] // 4 and s["text_tokens"] > 10
    summary = result["summary"]
    assert summary["patches_per_visual"] == spread(want) and summary["patches_per_visual"]["max"] <= 256
    assert summary["visuals_per_sample"]["min"] == summary["visuals_per_sample"]["max"] == 1


def test_a_limit_takes_records_evenly_over_the_files():
    assert evenly(list(range(32)), 8) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert evenly(list(range(5)), 8) == list(range(5))
    cfg = load_config("tiny", [f"data.train={SHARD}"])
    every = profile(cfg, limit=100)["per_sample"]
    assert profile(cfg, limit=8)["per_sample"] == every[::4]


def test_skips_are_counted_by_reason_and_text_only_samples_have_no_patches(tmp_path):
    with tarfile.open(SHARD) as tar:
        jpg = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
        (tmp_path / "a.jpg").write_bytes(tar.extractfile(jpg).read())
    turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A photo."}]
    records = [
        {"image": "a.jpg", "conversations": turns},
        {"image": "missing.jpg", "conversations": turns},
        {"conversations": [{"from": "human", "value": "Hello."}, {"from": "gpt", "value": "Hi there."}]},
        "not json",
    ]
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    result = profile(load_config("tiny", [f"data.train={tmp_path / 'train.jsonl'}"]), limit=10)
    assert result["records"] == 4 and result["samples"] == 2
    assert sum(result["skipped"].values()) == 2 and "missing_image" in result["skipped"], result["skipped"]
    (image, text_only) = result["per_sample"]
    assert len(image["patches"]) == 1 and text_only["patches"] == [] and text_only["tokens"] == text_only["text_tokens"]


def test_cli_writes_the_profile_and_refuses_a_bad_limit(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["data", "profile", str(SHARD), "--limit", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| patches per visual |" in printed and f"profile: {out}" in printed
    assert json.loads(out.read_text())["samples"] == 4
    assert main(["data", "profile", str(SHARD), "--limit", "0"]) == 2
    assert capsys.readouterr().err.strip() == "dhp: error: --limit must be >= 1 (got 0)"
