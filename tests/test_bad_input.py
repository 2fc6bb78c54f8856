"""20 % bad records of every kind: the run trains on exactly the good ones, counts and quarantines the rest.

A real `dhp train` (in-process, shared Ray) over one epoch of a hand-made set: 48 good records (three of
them text-only, one with an image far beyond `max_pixels`, which is resized, not skipped) and 12 bad ones,
each a different way a real dataset goes wrong. Two steps of 24: the bad records all come first, so the first
step's batch holds every skip, and an epoch that ran short would show in the second step's epoch.
"""

from __future__ import annotations

import json

from PIL import Image

from dhp.stages import step_logs
from dhp.stages.config import load_config
from dhp.stages.driver import train
from tests.conftest import write_image

BATCH = 24  # GOOD // BATCH steps
GOOD, BAD_EXPECTED = (
    48,
    {
        "missing_image": 1,
        "corrupt_image": 3,
        "degenerate_image": 1,
        "malformed_json": 1,
        "missing_conversations": 2,
        "image_count_mismatch": 2,
        "wrong_field_type": 1,
        "too_long": 1,
    },
)


def _conv(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _write_set(root) -> list[str]:
    """The bad records first (file order: the one epoch reads all of them), then the good ones."""
    good = []
    for i in range(GOOD - 4):
        write_image(root / f"img/{i}.png", (56 + 8 * (i % 5), 56), seed=i)
        good.append(json.dumps({"id": i, "image": f"img/{i}.png", "conversations": _conv("<image>\nWhat?", f"A{i}.")}))
    for i in range(3):  # text-only: trained, not skipped
        good.append(json.dumps({"id": f"t{i}", "conversations": _conv("Say hi.", f"Hi {i}.")}))
    write_image(root / "img/huge.png", (1600, 1200), seed=99)  # beyond max_pixels: resized
    good.append(json.dumps({"id": "huge", "image": "img/huge.png", "conversations": _conv("<image>\nSize?", "Big.")}))

    (root / "img/garbage.png").write_bytes(b"this is not an image at all")
    png = (root / "img/0.png").read_bytes()
    (root / "img/truncated.png").write_bytes(png[: len(png) // 3])
    (root / "img/empty.png").write_bytes(b"")
    Image.new("RGB", (1, 1)).save(root / "img/one.png")
    bad = [
        {"id": "b1", "image": "img/does_not_exist.png", "conversations": _conv("<image>\nQ", "A")},
        {"id": "b2", "image": "img/garbage.png", "conversations": _conv("<image>\nQ", "A")},
        {"id": "b3", "image": "img/truncated.png", "conversations": _conv("<image>\nQ", "A")},
        {"id": "b4", "image": "img/empty.png", "conversations": _conv("<image>\nQ", "A")},
        {"id": "b5", "image": "img/one.png", "conversations": _conv("<image>\nQ", "A")},
        {"id": "b6", "image": "img/1.png", "conversations": _conv("<image><image>\nQ", "A")},
        None,  # a malformed JSON line
        {"id": "b8", "image": "img/1.png"},
        {"id": "b9", "image": "img/1.png", "conversations": []},
        {"id": "b10", "image": ["img/1.png", "img/2.png"], "conversations": _conv("<image>\nQ", "A")},
        {"id": "b11", "image": "img/1.png", "conversations": "not a list"},
        {"id": "b12", "conversations": _conv("word " * 3000, "A")},
    ]
    lines = ['{"id": "b7", "conversations": [' if r is None else json.dumps(r) for r in bad] + good
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return lines


def test_bad_records_are_skipped_counted_and_quarantined(trainers, tmp_path):
    lines = _write_set(tmp_path / "data")
    cfg = load_config(
        "tiny",
        [
            f"data.train={tmp_path}/data/train.jsonl",
            "data.max_seq_len=1024",
            f"training.global_batch_size={BATCH}",
            f"training.steps={GOOD // BATCH}",
            "training.eval_every=0",
            "data.shuffle_seed=null",
            f"output.dir={tmp_path}/runs",
            "output.name=bad",
            "output.save_final_checkpoint=false",
        ],
    )
    summary = train(cfg, trainers=trainers)
    run = tmp_path / "runs" / "bad"

    records = step_logs.read(run)
    assert all(r["epoch"] == 0 for r in records)  # one epoch exactly: every good record once, nothing else
    assert sum(r["samples"] for r in records) == summary["skipped"]["good"] == GOOD
    counts = summary["skipped"]["counts"]
    assert counts == BAD_EXPECTED, counts
    assert sum(sum(r["skipped"].values()) for r in records) == len(lines) - GOOD

    quarantine = [json.loads(line) for line in (run / "quarantine.jsonl").read_text().splitlines()]
    assert len(quarantine) == len(lines) - GOOD
    sources = {q["source"].rsplit(":", 1)[1] for q in quarantine}  # file:line, 1-based
    assert sources == {str(i + 1) for i in range(len(lines) - GOOD)}
    assert all(q["error"] in BAD_EXPECTED and q["detail"] for q in quarantine)
