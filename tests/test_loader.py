"""The Ray Data path end to end: files -> preprocessing workers -> micro-batches in the object store."""

from __future__ import annotations

import json
import re

import pyarrow.fs as pafs
import pytest
import ray

from dhp.dataflow.loader import loader_actor
from dhp.dataflow.positions import Read
from dhp.dataflow.preprocess import PreprocessSettings
from dhp.dataflow.sources import split_records
from dhp.errors import DataError, one_line
from dhp.models.architectures import architecture_config
from tests.conftest import write_image

GOOD = 6


def _record(i: int, image: str | None = "images/{i}.png") -> dict:
    rec = {
        "id": f"r{i}",
        "conversations": [
            {"from": "human", "value": ("<image>\n" if image else "") + f"Sample {i}?"},
            {"from": "gpt", "value": f"Answer {i}."},
        ],
    }
    if image:
        rec["image"] = image.format(i=i)
    return rec


@pytest.fixture(scope="module")
def annotations(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    for i in range(GOOD):
        write_image(root / f"images/{i}.png", (56 + 14 * i, 84), seed=i)
    good = [_record(i) for i in range(GOOD - 1)] + [_record(GOOD - 1, image=None)]  # one text-only sample
    lines = [json.dumps(r) for r in good[:3]]
    lines += [
        "{not json",
        json.dumps(_record(99)),  # image file does not exist
        json.dumps({**_record(0), "image": ["images/0.png", "images/1.png"]}),  # 1 <image>, 2 images
        json.dumps({"id": "x", "conversations": []}),
        "",  # blank lines are not records
    ]
    lines += [json.dumps(r) for r in good[3:]]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "train.json").write_text(json.dumps(good))
    return root


def _drain(loader) -> list:
    batches = []
    while (batch := ray.get(loader.next_batch.remote())) is not None:
        batches.append(batch)
    return batches


def _loader(root, name: str, seed=None, budget: int = 400):
    settings = PreprocessSettings(str(root), min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=400)
    return loader_actor().remote(
        [str(root / name)],
        settings,
        architecture_config("tiny"),
        global_batch_size=4,
        microbatch_tokens=budget,
        seed=seed,
        repeat=False,
    )


def _sample_ids(batches) -> list[int]:
    """A fingerprint of every sample, in delivery order: the token after 'Answer' differs per record."""
    out = []
    for batch in batches:
        for mb in batch.microbatches:
            text = ray.get(mb.text)
            out += [int(row[row != 151643].sum()) for row in text["input_ids"]]
    return out


def test_bad_lines_are_counted_and_good_ones_batched(annotations, ray_session):
    loader = _loader(annotations, "train.jsonl", budget=250)
    batches = _drain(loader)
    assert [len(_sample_ids([b])) for b in batches] == [4, 2]
    report = ray.get(loader.skip_report.remote())
    assert report["good"] == GOOD
    assert report["counts"] == {
        "malformed_json": 1,
        "missing_image": 1,
        "image_count_mismatch": 1,
        "missing_conversations": 1,
    }
    sources = {e["error"]: e["source"] for e in report["examples"]}
    assert sources["malformed_json"].endswith("train.jsonl:4")
    assert sources["missing_conversations"].endswith("train.jsonl:7")
    assert sum(sum(b.skipped.values()) for b in batches) == 4
    for batch in batches:
        for mb in batch.microbatches:
            (vision,), text = ray.get(mb.vision), ray.get(mb.text)
            assert set(vision) == {"pixel_values", "image_grid_thw"}
            assert set(text) == {"input_ids", "labels", "attention_mask", "position_ids"}
            assert text["input_ids"].numel() <= 250 and mb.meta.padded_tokens == text["input_ids"].numel()
            assert mb.meta.images == vision["image_grid_thw"].shape[0]
            assert int((text["input_ids"] == 151655).sum()) == int(vision["image_grid_thw"].prod(-1).sum()) // 4


def test_json_array_and_jsonl_give_the_same_samples(annotations, ray_session):
    from_jsonl = sorted(_sample_ids(_drain(_loader(annotations, "train.jsonl"))))
    from_json = sorted(_sample_ids(_drain(_loader(annotations, "train.json"))))
    assert len(from_json) == GOOD and from_json == from_jsonl


def test_shuffle_is_seeded(annotations, ray_session):
    a = _sample_ids(_drain(_loader(annotations, "train.json", seed=3)))
    b = _sample_ids(_drain(_loader(annotations, "train.json", seed=3)))
    c = _sample_ids(_drain(_loader(annotations, "train.json", seed=4)))
    assert a == b and sorted(a) == sorted(c) and a != c


def test_a_resume_at_the_end_of_an_epoch_goes_on_into_the_next(annotations, ray_session):
    """The checkpoint's position is its epoch's last record: the resumed stream reads nothing more of that epoch,
    which is not an epoch without a usable sample; it continues with the next, as the uninterrupted stream does."""
    settings = PreprocessSettings(str(annotations), min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=400)

    def stream():
        return loader_actor().remote(
            [str(annotations / "train.json")],
            settings,
            architecture_config("tiny"),
            global_batch_size=GOOD // 2,
            microbatch_tokens=400,
            seed=0,
            repeat=True,
        )

    first = stream()
    end = [ray.get(first.next_batch.remote()) for _ in range(2)][-1]
    assert (end.state["epoch"], end.state["part"], end.state["taken"]) == (0, 0, GOOD)
    resumed = stream()
    ray.get(resumed.restore.remote(end.state))
    after, uninterrupted = ray.get([resumed.next_batch.remote(), first.next_batch.remote()])
    assert after.epoch == 1 and after.ids == uninterrupted.ids


def test_replicas_get_disjoint_records_covering_the_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(_record(i)) + "\n" for i in range(11)))
    local = pafs.LocalFileSystem()

    def split(seed: int, r: int, first: int = 0) -> list[dict]:
        return split_records(Read(4, first, r, 3).item(str(path)), local, seed)

    parts = [split(5, r) for r in range(3)]
    sources = [[p["source"] for p in part] for part in parts]
    assert sorted(sum(sources, [])) == sorted(f"{path}:{i + 1}" for i in range(11))
    assert all(len(s) in (3, 4) for s in sources) and all(p["part"] == 4 for p in parts[0])
    assert split(5, 1) == parts[1] and split(6, 1) != parts[1]  # deterministic per epoch seed
    assert split(5, 1, first=3) == parts[1][1:]  # a resumed read: rows 3 + 1, 3 + 1 + 3, ...


def test_small_blocks_cuts_one_file_block_without_a_free_cpu(ray_session):
    """One file's records arrive as one block; `small_blocks` must cut it (order kept) so several preprocessing
    tasks share the file, and must do so while the stage actors hold every whole CPU (plain
    `Dataset.repartition` asks one CPU per task and would wait forever here)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from dhp.dataflow.loader import small_blocks

    held = placement_group([{"CPU": ray.available_resources()["CPU"] - 0.5}])
    ray.get(held.ready(), timeout=30)
    try:
        one_block = ray.data.from_items([{"i": i} for i in range(40)], override_num_blocks=1)
        cut = small_blocks(one_block, 16).materialize()
        assert cut.num_blocks() == 3
        assert [r["i"] for r in cut.iter_rows()] == list(range(40))
    finally:
        remove_placement_group(held)


def test_a_late_stream_that_only_skips_says_why_while_it_reads(annotations, tmp_path, ray_session, capsys):
    """Every record is longer than data.max_seq_len. The stream reads on: it stops with "no usable sample" only once
    it has read every file without one (at 100k shards, hours). Meanwhile the driver, waiting for its batch, says
    every data.timeout_s that it is late because it skips, with the reasons and the last skipped record."""
    from dhp.stages.watchdog import wait_for_data

    # Large photos, each decoded before its length is known: a stream of seconds, not a burst.
    write_image(tmp_path / "images/big.png", (1200, 900), seed=0)
    record = json.dumps(_record(0, image="images/big.png"))
    (tmp_path / "long.jsonl").write_text("".join(record + "\n" for _ in range(150)))
    settings = PreprocessSettings(str(tmp_path), min_pixels=56 * 56, max_pixels=1200 * 900, max_seq_len=8)
    loader = loader_actor().remote(
        [str(tmp_path / "long.jsonl")],
        settings,
        architecture_config("tiny"),
        global_batch_size=4,
        microbatch_tokens=400,
        seed=0,
        repeat=True,
    )
    try:
        ray.get(loader.start.remote())  # Ray Data's start-up is not what this test waits on
        # About 9 s of reading (60 ms a record here), asked every 4 s; a stall would be 8 s without a record.
        with pytest.raises(ray.exceptions.RayTaskError, match="no usable sample") as raised:
            wait_for_data([loader.next_batch.remote()], [loader], 4.0, "step 1")
        # what `dhp` prints as its one-line error (stages/cli.py): the loader's message, not Ray's traceback
        assert isinstance(raised.value, DataError) and isinstance(raised.value.cause, DataError)
        assert one_line(raised.value.cause) == (
            f"no usable sample in {[str(tmp_path / 'long.jsonl')]} for data stream 0 of 1; skipped: {{'too_long': 150}}"
        )
        out = capsys.readouterr().out
        assert re.search(r"warning: step 1: data stream 0 is late: (\d+) of the \1 records it read", out)
        assert "too_long: " in out and "long.jsonl:" in out and "data.max_seq_len=8" in out
    finally:
        ray.kill(loader)


def test_position_counts_the_batch_being_assembled(annotations):
    """What the probe thread answers while a batch is assembled (no actor: the loader object itself): the records
    taken for this batch, its skips by reason and the last one skipped; a new batch starts from nothing."""
    from dhp.dataflow.loader import BatchLoader

    settings = PreprocessSettings(str(annotations), min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=8)
    loader = BatchLoader(
        [str(annotations / "train.jsonl")],
        settings,
        architecture_config("tiny"),
        global_batch_size=4,
        microbatch_tokens=400,
        repeat=False,
    )
    rows = [
        {"source": f"train.jsonl:{i}", "part": 0, "error": error, "detail": f"d{i}", "sample": b""}
        for i, error in enumerate(["too_long", "missing_image", "too_long"])
    ]
    loader.rows = iter(rows)
    assert loader.position()["read"] == 0 and loader.position()["example"] is None
    assert loader.next_batch() is None  # the stream ends without a usable record
    where = loader.position()
    assert (where["read"], where["skipped"]) == (3, {"too_long": 2, "missing_image": 1})
    assert where["example"] == {"source": "train.jsonl:2", "error": "too_long", "detail": "d2"}
    assert where["where"].startswith("epoch 0, 0 records into it")  # the epoch ended: its cursor was reset
