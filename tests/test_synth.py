"""Tests for the synthetic captioning set in dhp.dataflow.synth."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dhp.dataflow.synth import PALETTE, POSITIONS, SHAPES, SIZES, write_synthetic_dataset

CAPTION_RE = re.compile(r"A (small|large) (\w+) (\w+) in the ([a-z ]+)\.")
ATTRIBUTE_WORDS = {w for phrase in (*PALETTE, *SHAPES, *SIZES, *POSITIONS) for w in phrase.split()}


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _images(rec: dict) -> list[str]:
    return rec["image"] if isinstance(rec["image"], list) else [rec["image"]]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "ds"
    summary = write_synthetic_dataset(
        out, num=30, seed=3, eval_num=12, multi_image_fraction=0.2, multi_turn_fraction=0.3
    )
    return summary, _load(summary.train_path), _load(summary.val_path)


def test_counts_and_meta(ds):
    summary, train, val = ds
    assert (summary.num_train, summary.num_val) == (30, 12)
    assert (len(train), len(val)) == (30, 12)
    meta = json.loads(summary.meta_path.read_text())
    assert (meta["num"], meta["eval_num"], meta["seed"], meta["version"]) == (30, 12, 3, 1)
    assert summary.num_images == sum(len(_images(r)) for r in train + val)
    assert len(list((summary.out_dir / "images").iterdir())) == summary.num_images
    assert not summary.reused


def test_default_eval_num(tmp_path):
    s = write_synthetic_dataset(tmp_path / "d", num=20, seed=0)
    assert s.num_val == 16 and len(_load(s.val_path)) == 16


def test_schema_images_and_placeholders(ds):
    summary, train, val = ds
    sizes = set()
    kinds = {"multi_image": 0, "multi_turn": 0}
    for split, recs in (("train", train), ("val", val)):
        for i, rec in enumerate(recs):
            assert rec["id"] == f"{split}_{i:05d}"
            convs = rec["conversations"]
            assert [c["from"] for c in convs] == ["human", "gpt"] * (len(convs) // 2) and len(convs) in (2, 4)
            paths = _images(rec)
            n_placeholders = sum(c["value"].count("<image>") for c in convs if c["from"] == "human")
            assert n_placeholders == len(paths)
            assert "<image>" not in "".join(c["value"] for c in convs if c["from"] == "gpt")
            for p in paths:
                assert p.startswith(f"images/{rec['id']}") and p.endswith(".png")
                with Image.open(summary.out_dir / p) as im:
                    assert im.format == "PNG" and im.mode == "RGB"
                    assert 84 <= im.width <= 224 and 84 <= im.height <= 224
                    sizes.add(im.size)
            kinds["multi_image"] += len(paths) == 2
            kinds["multi_turn"] += len(convs) == 4
            if len(paths) == 2:
                assert re.fullmatch(rf"First: {CAPTION_RE.pattern} Second: {CAPTION_RE.pattern}", convs[1]["value"])
            else:
                assert CAPTION_RE.fullmatch(convs[1]["value"])
    assert kinds["multi_image"] > 0 and kinds["multi_turn"] > 0
    assert len(sizes) > 10 and any(w != h for w, h in sizes)


def test_prompts_carry_no_attribute_words(ds):
    _, train, val = ds
    for rec in train + val:
        for c in rec["conversations"]:
            if c["from"] == "human":
                words = set(re.findall(r"[a-z]+", c["value"].lower()))
                assert not words & ATTRIBUTE_WORDS, c["value"]


def test_caption_vocabulary_covers_attributes(ds):
    _, train, val = ds
    found = [CAPTION_RE.findall(r["conversations"][1]["value"]) for r in train + val]
    attrs = [a for group in found for a in group]
    assert {a[0] for a in attrs} == set(SIZES)
    assert len({a[1] for a in attrs}) >= 4 and {a[1] for a in attrs} <= set(PALETTE)
    assert len({a[2] for a in attrs}) >= 3 and {a[2] for a in attrs} <= set(SHAPES)
    assert len({a[3] for a in attrs}) >= 5 and {a[3] for a in attrs} <= set(POSITIONS)


def test_second_round_answers_match_caption(ds):
    _, train, val = ds
    checked = 0
    for rec in train + val:
        convs = rec["conversations"]
        if len(convs) != 4:
            continue
        size, colour, shape, pos = CAPTION_RE.fullmatch(convs[1]["value"]).groups()
        assert convs[3]["value"] in {
            colour.capitalize() + ".",
            f"In the {pos}.",
            f"A {shape}.",
            size.capitalize() + ".",
        }
        checked += 1
    assert checked > 0


def test_val_is_held_out(ds):
    _, train, val = ds
    assert not {r["id"] for r in train} & {r["id"] for r in val}
    assert not {p for r in train for p in _images(r)} & {p for r in val for p in _images(r)}
    # Different RNG streams: the val captions are not simply the first train captions.
    val_caps = [r["conversations"][1]["value"] for r in val]
    assert val_caps != [r["conversations"][1]["value"] for r in train[: len(val)]]


def test_pixels_match_caption(ds):
    summary, train, _ = ds
    checked = 0
    for rec in train:
        if isinstance(rec["image"], list):
            continue
        size, colour, _, pos = CAPTION_RE.fullmatch(rec["conversations"][1]["value"]).groups()
        px = np.asarray(Image.open(summary.out_dir / rec["image"]).convert("RGB")).astype(int)
        h, w, _ = px.shape
        # Shapes never touch the corners (they stay inside one grid cell), so a corner is background.
        mask = np.any(px != px[0, 0], axis=-1)
        close = np.abs(px - np.array(PALETTE[colour])).sum(-1) < 30
        assert close.sum() >= 0.8 * mask.sum() > 0
        ys, xs = np.nonzero(mask)
        # Size is relative to the short side: small spans < 0.2 of it, large more.
        extent = max(xs.max() - xs.min(), ys.max() - ys.min()) + 1
        assert (extent < 0.2 * min(w, h)) == (size == "small")
        row, col = divmod(POSITIONS.index(pos), 3)
        assert col * w / 3 <= xs.mean() < (col + 1) * w / 3
        assert row * h / 3 <= ys.mean() < (row + 1) * h / 3
        checked += 1
    assert checked >= 20


def _snapshot(out: Path) -> dict[str, bytes]:
    snap = {p.name: p.read_bytes() for p in out.glob("*.jsonl")}
    for p in sorted((out / "images").iterdir()):
        snap[p.name] = np.asarray(Image.open(p)).tobytes()
    return snap


def test_deterministic(tmp_path):
    a = write_synthetic_dataset(tmp_path / "a", num=10, seed=7, eval_num=4)
    b = write_synthetic_dataset(tmp_path / "b", num=10, seed=7, eval_num=4)
    c = write_synthetic_dataset(tmp_path / "c", num=10, seed=8, eval_num=4)
    assert _snapshot(a.out_dir) == _snapshot(b.out_dir)
    assert a.train_path.read_bytes() != c.train_path.read_bytes()


def test_idempotent_and_rewrites_on_change(tmp_path):
    out = tmp_path / "ds"
    first = write_synthetic_dataset(out, num=8, seed=1, eval_num=2)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    second = write_synthetic_dataset(out, num=8, seed=1, eval_num=2)
    assert second.reused and not first.reused
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes
    third = write_synthetic_dataset(out, num=8, seed=2, eval_num=2)
    assert not third.reused
    assert json.loads((out / "meta.json").read_text())["seed"] == 2
    assert first.train_path.read_bytes() != b""
    # No temp or old copies are left beside the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_incomplete_dir_is_not_reused(tmp_path):
    out = tmp_path / "ds"
    write_synthetic_dataset(out, num=4, seed=0, eval_num=2)
    (out / "val.jsonl").unlink()  # simulate a damaged set
    s = write_synthetic_dataset(out, num=4, seed=0, eval_num=2)
    assert not s.reused and len(_load(s.val_path)) == 2


def test_refuses_to_replace_foreign_dir(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_synthetic_dataset(out, num=4, seed=0)
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_crash_midway_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    calls = {"n": 0}
    real_save = Image.Image.save

    def flaky_save(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("disk full")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_dataset(out, num=10, seed=0, eval_num=2)
    assert list(tmp_path.iterdir()) == []  # neither out_dir nor a stray temp dir
    monkeypatch.undo()
    s = write_synthetic_dataset(out, num=10, seed=0, eval_num=2)
    assert not s.reused and len(_load(s.train_path)) == 10


@pytest.mark.parametrize("eval_num", [0, 4])
def test_a_run_evaluates_only_with_held_out_records(tmp_path, eval_num):
    """`dhp train`'s data for the synthetic set: `data.synthetic.eval_num=0` gives it no held-out split (an empty
    one would report a loss of nothing), any other number one file of that many records."""
    from dhp.stages.config import load_config
    from dhp.stages.driver import resolve_data

    cfg = load_config(
        "tiny", [f"data.synthetic.dir={tmp_path}", "data.synthetic.num=8", f"data.synthetic.eval_num={eval_num}"]
    )
    train, evals, _ = resolve_data(cfg)
    assert len(train) == 1 and len(evals) == (1 if eval_num else 0)
    assert [len(Path(p).read_text().splitlines()) for p in evals] == ([eval_num] if eval_num else [])
