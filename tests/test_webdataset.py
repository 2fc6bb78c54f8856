"""WebDataset shards as img2dataset writes them (dataflow/webdataset.py, dataflow/sources.py), on a real
img2dataset shard (tests/assets: 32 CC12M web photos with captions and metadata)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import ray
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from dhp.dataflow.loader import loader_actor
from dhp.dataflow.positions import Read, reshard
from dhp.dataflow.preprocess import IGNORE_INDEX, Preprocessor, PreprocessSettings, decode_sample
from dhp.dataflow.sources import WebDataset, expand_braces, expand_paths, record_format
from dhp.dataflow.tokenizer import load_tokenizer
from dhp.dataflow.webdataset import shard_rows, split_shard
from dhp.models.architectures import architecture_config
from dhp.stages import step_logs
from dhp.stages.config import ConfigError, load_config
from tests.test_preprocess import expected_ids

SHARD = Path(__file__).resolve().parent / "assets" / "cc12m-train-0000.tar"  # tests/assets/README.md
PROMPT = "<image>\nDescribe this image."
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
LOCAL = pafs.LocalFileSystem()


def _members(path: Path) -> dict[str, dict[str, bytes]]:
    """key -> extension -> bytes, read with tarfile directly (the reference for what the reader yields)."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, _, ext = m.name.partition(".")
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def _preprocessor() -> Preprocessor:
    settings = PreprocessSettings("", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_seq_len=1024)
    return Preprocessor(settings, architecture_config("tiny"))


@pytest.fixture(scope="module")
def shard() -> Path:
    if not SHARD.exists():  # part of the repository: its absence is a broken checkout, not a skip
        raise FileNotFoundError(f"test data missing: {SHARD}")
    return SHARD


def test_real_shard_becomes_one_conversation_per_photo(shard):
    members = _members(shard)
    rows = shard_rows(LOCAL, str(shard), "s3://b/x.tar", PROMPT, "txt")
    assert len(rows) == len(members) == 32
    for row in rows:
        key = row["source"].removeprefix("s3://b/x.tar:")
        record = json.loads(row["record"])
        assert row["skip"] == "" and row["image"] == members[key]["jpg"]
        assert record["image"] == f"{key}.jpg" and record["conversations"] == [
            {"from": "human", "value": PROMPT},
            {"from": "gpt", "value": members[key]["txt"].decode().strip()},
        ]
    by_field = shard_rows(LOCAL, str(shard), "x.tar", PROMPT, "caption")  # a field of {key}.json
    captions = [json.loads(r["record"])["conversations"][1]["value"] for r in by_field]
    assert captions == [json.loads(members[r["source"].split(":")[1]]["json"])["caption"].strip() for r in by_field]


def test_real_photos_preprocess_as_transformers_does(shard):
    pre, tok = _preprocessor(), load_tokenizer()
    ref = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    for row in shard_rows(LOCAL, str(shard), "x.tar", PROMPT, "txt")[:6]:
        out = pre(row)
        assert out["error"] == "", out
        sample = {k: v.numpy() for k, v in decode_sample(out["sample"]).items()}
        expect = ref(images=[Image.open(io.BytesIO(row["image"]))], return_tensors="np")
        np.testing.assert_array_equal(sample["pixel_values"], expect["pixel_values"])
        np.testing.assert_array_equal(sample["image_grid_thw"], expect["image_grid_thw"])
        record = json.loads(row["record"])
        assert sample["input_ids"].tolist() == expected_ids(tok, record, sample["image_grid_thw"])
        labelled = sample["input_ids"][sample["labels"] != IGNORE_INDEX]
        assert tok.decode(labelled) == record["conversations"][1]["value"] + "<|im_end|>"


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_bad_members_are_counted_skips_naming_shard_and_key(shard, tmp_path):
    photo = next(iter(_members(shard).values()))["jpg"]
    bad = _tar(
        tmp_path / "bad.tar",
        [
            ("a.jpg", photo),
            ("a.txt", b"A good one."),
            ("b.txt", b"No image."),
            ("c.jpg", photo),
            ("d.jpg", photo),
            ("d.txt", b"  \n"),
            ("e.jpg", photo),
            ("e.txt", b"Stop here<|im_end|> and more"),
            ("f.jpg", b"\xff\xd8 not a jpeg at all"),
            ("f.txt", b"Corrupt."),
            ("g.jpg", photo[: len(photo) // 3]),
            ("g.txt", b"Truncated JPEG."),
            ("h.png", photo),
            ("h.json", b'{"caption": "no such field here"}'),
        ],
    )
    pre = _preprocessor()
    got = {}
    for caption in ("txt", "cogvlm_caption"):
        for row in shard_rows(LOCAL, str(bad), "bad.tar", PROMPT, caption):
            out = pre(row)
            got[(caption, out["source"])] = out["error"]
            assert out["error"] == "" or out["detail"], out
    assert {k[1]: v for k, v in got.items() if k[0] == "txt"} == {
        "bad.tar:a": "",
        "bad.tar:b": "missing_image",
        "bad.tar:c": "missing_caption",
        "bad.tar:d": "empty_caption",
        "bad.tar:e": "special_token_caption",
        "bad.tar:f": "corrupt_image",
        "bad.tar:g": "corrupt_image",
        "bad.tar:h": "missing_caption",
    }
    assert got[("cogvlm_caption", "bad.tar:h")] == "missing_caption"

    cut = tmp_path / "cut.tar"  # a shard cut mid-member: the samples before the cut are kept
    cut.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rows = shard_rows(LOCAL, str(cut), "cut.tar", PROMPT, "txt")
    assert 10 < len(rows) < 32 and all(r["skip"] == "" for r in rows[:-1])
    assert rows[-1]["skip"].startswith("truncated_tar\t") and rows[-1]["source"].startswith("cut.tar:")
    missing = shard_rows(LOCAL, str(tmp_path / "gone.tar"), "s3://b/gone.tar", PROMPT, "txt")
    assert [(r["source"], r["skip"].split("\t")[0]) for r in missing] == [("s3://b/gone.tar", "missing_shard")]
    assert pre(missing[0])["error"] == "missing_shard"


def test_shards_are_shuffled_and_split_disjointly(shard):
    parts = [split_shard(Read(0, 0, r, 3).item(str(shard)), LOCAL, PROMPT, "txt", seed=3) for r in range(3)]
    sources = [r["source"] for p in parts for r in p]
    assert len(sources) == len(set(sources)) == 32
    assert split_shard(Read(0, 0, 1, 3).item(str(shard)), LOCAL, PROMPT, "txt", seed=3) == parts[1]
    whole = split_shard(Read(0).item(str(shard)), LOCAL, PROMPT, "txt", seed=3)  # a dealt shard: every sample
    assert whole[1::3] == parts[1] and split_shard(Read(0, 5).item(str(shard)), LOCAL, PROMPT, "txt", 3) == whole[5:]
    unshuffled = [r["source"] for r in split_shard({"path": str(shard)}, LOCAL, PROMPT, "txt", seed=None)]
    in_tar_order = [f"{shard}:{key}" for key in _members(shard)]
    assert unshuffled == in_tar_order != [r["source"] for r in whole]


def test_paths_expand_braces_and_globs_and_pick_the_format(tmp_path):
    assert expand_braces("s3://b/p/{0008..0011}.tar") == [f"s3://b/p/{i:04d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}/{1..2}.tar") == ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]
    with pytest.raises(ConfigError, match="runs backwards"):
        expand_braces("{3..1}.tar")
    for name in ("000.tar", "001.tar", "002.tar", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert expand_paths(f"{tmp_path}/00*.tar") == [str(tmp_path / f"00{i}.tar") for i in range(3)]
    assert expand_paths(f"{tmp_path}/{{000..001}}.tar, {tmp_path}/notes.txt") == [
        str(tmp_path / "000.tar"),
        str(tmp_path / "001.tar"),
        str(tmp_path / "notes.txt"),
    ]
    with pytest.raises(ConfigError, match="matches no file"):
        expand_paths(f"{tmp_path}/*.jsonl")
    cfg = load_config("tiny", [])
    assert record_format(cfg.data, ["a.tar", "s3://b/c.TAR"]).name == "webdataset"
    assert record_format(cfg.data, ["a.tar", "b.jsonl"]).name == "jsonl"
    with pytest.raises(ConfigError, match="exactly once"):
        load_config("tiny", ["data.webdataset.prompt=Describe it."])


def _loader(
    paths: list[str],
    replica: int,
    num_replicas: int,
    storage=None,
    batch: int = 8,
    repeat: bool = False,
    seed: int | None = 0,
):
    settings = PreprocessSettings(
        "",
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        max_seq_len=1024,
        storage=storage,
        records=WebDataset(PROMPT, "txt"),
    )
    return loader_actor().remote(
        paths,
        settings,
        architecture_config("tiny"),
        global_batch_size=batch,
        microbatch_tokens=1024,
        seed=seed,
        repeat=repeat,
        replica=replica,
        num_replicas=num_replicas,
    )


def _cut(shard: Path, folder: Path, shards: int, per: int) -> list[str]:
    """`shards` shards of `per` samples each, cut from the real one (members kept together, as img2dataset)."""
    samples = list(_members(shard).items())
    paths = []
    for s in range(shards):
        path = folder / f"{s:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for key, members in samples[s * per : (s + 1) * per]:
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def test_replicas_read_their_own_shards_and_a_resharded_resume_is_exact(ray_session, shard, tmp_path):
    """Four shards of 3 samples, two replicas: each reads only its own two shards, whole (each byte fetched once).
    After a batch of 4 each (one shard read, one begun), a resume into one replica reads exactly the 4 samples
    not trained on: the rest of the two begun shards."""
    paths = _cut(shard, tmp_path, 4, 3)
    loaders = [_loader(paths, r, 2, batch=4) for r in range(2)]
    firsts = ray.get([loader.next_batch.remote() for loader in loaders])
    trained = [{source for _, source in b.ids} for b in firsts]
    shards = [{source.rsplit(":", 1)[0] for source in t} for t in trained]
    assert all(len(t) == 4 and len(s) == 2 for t, s in zip(trained, shards)) and not shards[0] & shards[1]
    states = [b.state for b in firsts]
    assert [(s["part"], s["taken"]) for s in states] == [(2, 1), (3, 1)]  # 1 sample into its second shard
    (state,) = reshard(states, 1)
    assert state["plans"] == {"0": {"done": [[0, 2]], "first": [[2, 1], [3, 1]]}}

    resumed = _loader(paths, 0, 1, batch=4)
    ray.get(resumed.restore.remote(state))
    rest = []
    while (batch := ray.get(resumed.next_batch.remote())) is not None:
        rest += [source for _, source in batch.ids]
    everything = {f"{p}:{key}" for p in paths for key in _members(Path(p))}
    assert len(rest) == len(set(rest)) == 4 and not set(rest) & (trained[0] | trained[1])
    assert trained[0] | trained[1] | set(rest) == everything


def test_replicas_stream_disjoint_samples_and_count_a_missing_shard(ray_session, shard, tmp_path):
    shutil.copy(shard, tmp_path / "0000.tar")
    paths = expand_paths(f"{tmp_path}/{{0000..0001}}.tar")  # 0001 was never written: a failed shard
    seen, skipped = [], {}
    for r, loader in enumerate([_loader(paths, r, 2) for r in range(2)]):
        ids = []
        while (batch := ray.get(loader.next_batch.remote())) is not None:
            for mb in batch.microbatches:
                text = ray.get(mb.text)
                ids += [tuple(row[row != 151643].tolist()) for row in text["input_ids"]]
        seen.append(ids)
        report = ray.get(loader.skip_report.remote())
        skipped[r] = report["counts"]
        if report["examples"]:
            assert report["examples"][0]["source"] == paths[1]
    assert len(seen[0]) + len(seen[1]) == 32 and not set(seen[0]) & set(seen[1])
    assert sorted(skipped.values(), key=len) == [{}, {"missing_shard": 1}]  # one replica counts it


def test_a_replica_dealt_only_missing_shards_goes_on_and_no_shard_at_all_stops(ray_session, shard, tmp_path):
    """One shard of 6 samples and three never written, two replicas: every epoch one replica is dealt only missing
    shards; it counts them and goes on to its next epoch until it is dealt the real one. With no shard at all, a
    stream stops once it has met every shard without a usable sample."""
    real = _cut(shard, tmp_path, 1, 6)
    paths = real + [str(tmp_path / f"gone{i}.tar") for i in range(3)]
    loaders = [_loader(paths, r, 2, batch=4, repeat=True) for r in range(2)]
    batches = ray.get([loader.next_batch.remote() for loader in loaders])
    assert all(len(b.ids) == 4 and {s.rsplit(":", 1)[0] for _, s in b.ids} == set(real) for b in batches)
    assert sum(b.skipped.get("missing_shard", 0) for b in batches) >= 3  # each replica's missing ones, counted
    gone = _loader(paths[1:], 0, 1, batch=4, repeat=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="no usable sample"):
        ray.get(gone.next_batch.remote())
    # Without a seed the deal is the same every epoch: a replica dealt only missing shards would never have a
    # sample, so it stops after one epoch (replica 1 of [real, gone, real, gone]); replica 0 trains.
    (tmp_path / "b").mkdir()
    fixed = [paths[0], paths[1], *_cut(shard, tmp_path / "b", 1, 6), paths[2]]
    loaders = [_loader(fixed, r, 2, batch=4, repeat=True, seed=None) for r in range(2)]
    assert len(ray.get(loaders[0].next_batch.remote()).ids) == 4
    with pytest.raises(ray.exceptions.RayTaskError, match="no usable sample .* for data stream 1 of 2"):
        ray.get(loaders[1].next_batch.remote())


def test_training_on_shards_from_s3_equals_local(trainers, s3_endpoint, shard, tmp_path):
    """Two steps on the real shard, once from a local folder and once from an S3 bucket (moto), each named by
    a brace range whose first shard img2dataset never wrote (file order, unshuffled, so it is met at once):
    the same losses, the same counted skip."""
    from dhp.stages.driver import train

    local = tmp_path / "laion"
    local.mkdir()
    shutil.copy(shard, local / "0001.tar")
    s3_endpoint.upload(local, "pop", "laion")
    runs = {}
    for name, base in (("local", str(local)), ("s3", "s3://pop/laion")):
        cfg = load_config(
            "tiny",
            [
                f"data.train={base}/{{0000..0001}}.tar",
                f"data.storage.endpoint_url={s3_endpoint.url}",
                "data.webdataset.caption=caption",
                f"data.max_pixels={MAX_PIXELS}",
                "data.shuffle_seed=null",
                "training.steps=2",
                "training.global_batch_size=4",
                "training.eval_every=0",
                "training.warmup_steps=1",
                "vision.parallelism=none",
                "vision.num_actors=1",
                "vision.degree=1",
                "text.parallelism=none",
                "text.num_actors=1",
                "text.degree=1",
                f"output.dir={tmp_path}/runs",
                f"output.name={name}",
                "output.save_final_checkpoint=false",
            ],
        )
        summary = train(cfg, trainers=trainers)
        run = tmp_path / "runs" / name
        runs[name] = step_logs.read(run)
        quarantined = [json.loads(line) for line in (run / "quarantine.jsonl").read_text().splitlines()]
        assert [(q["source"], q["error"]) for q in quarantined] == [(f"{base}/0000.tar", "missing_shard")]
        assert json.loads((run / "summary.json").read_text()) == summary
        assert "missing_shard" in json.dumps(summary)
    assert [r["step"] for r in runs["s3"]] == [1, 2]
    assert [r["loss"] for r in runs["s3"]] == [r["loss"] for r in runs["local"]]  # exactly
    assert [r["tokens"] for r in runs["s3"]] == [r["tokens"] for r in runs["local"]]


def test_resumed_run_on_shards_equals_uninterrupted_run(trainers, shard, tmp_path):
    """Mid-epoch on two shards: the step-2 checkpoint holds the position (cursor, and the last sample's
    shard:key), and a run resumed from it trains steps 3-4 bit for bit as the uninterrupted run did."""
    from dhp.stages.driver import train

    for name in ("0000.tar", "0001.tar"):
        shutil.copy(shard, tmp_path / name)

    def cfg(name: str):
        return load_config(
            "tiny",
            [
                f"data.train={tmp_path}/{{0000..0001}}.tar",
                f"data.max_pixels={MAX_PIXELS}",
                "training.steps=4",
                "training.checkpoint_every=2",
                "training.keep_last=0",
                "training.global_batch_size=4",
                "training.eval_every=0",
                "training.warmup_steps=1",
                "vision.parallelism=none",
                "vision.num_actors=1",
                "vision.degree=1",
                "text.parallelism=none",
                "text.num_actors=1",
                "text.degree=1",
                f"output.dir={tmp_path}/runs",
                f"output.name={name}",
            ],
        )

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in step_logs.read(run)}

    train(cfg("full"), trainers=trainers)
    full, resumed = tmp_path / "runs" / "full", tmp_path / "runs" / "resumed"
    position = json.loads((full / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["loaders"]
    assert position[0]["cursor"] == 8 and position[0]["source"].startswith(f"{tmp_path}/000")
    assert position[0]["taken"] == 8 and position[0]["part"] == 0  # 8 samples into its first shard
    assert position[0]["source"].split(".tar:")[1] in {k for k in _members(shard)}
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    assert train(cfg("resumed"), trainers=trainers)["resumed_from"].endswith("step_000002")
    assert losses(resumed) == losses(full) and len(losses(full)) == 4
