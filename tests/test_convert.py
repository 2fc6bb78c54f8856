"""`dhp data convert-coco` / `convert-laion-pop` on small files written here, run through the real CLI.

Exact output records and skip counts; every record passes `parse_record`, and the COCO output goes
through the real `Preprocessor` (tiny model). S3 runs against moto's S3 HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dhp.dataflow import convert
from dhp.dataflow.json_stream import JsonStream
from dhp.dataflow.preprocess import IGNORE_INDEX, IMAGE_PLACEHOLDER, Preprocessor, PreprocessSettings, parse_record
from dhp.dataflow.storage import filesystem
from dhp.models.architectures import architecture_config
from dhp.stages.cli import main as cli
from tests.conftest import write_image

PROMPT = "<image>\nDescribe this image."
SUMMARY = re.compile(r"written (\d+) records to (\S+); skipped (\d+) (\{.*?\})")

COCO = {
    "info": {"description": "test", "nested": [1, 2.5e3, {"x": None}]},
    "licenses": [{"id": 1, "name": "CC"}],
    "images": [
        {"id": 1, "file_name": "a.png", "height": 40, "width": 60},
        {"id": 2, "file_name": "b.png"},
        {"id": 3, "file_name": "sub/c.png"},
        {"id": 4, "file_name": "gone.png"},  # no such file
        {"id": "5", "file_name": "x.png"},  # bad_image_entry
        {"id": 1, "file_name": "dup.png"},  # duplicate_image_id
    ],
    "annotations": [
        {"id": 10, "image_id": 1, "caption": "A red square. "},
        {"id": 11, "image_id": 1, "caption": "Second caption of a."},
        {"id": 12, "image_id": 2, "caption": 'Blue noise, café "quoted".'},
        {"id": 13, "image_id": 3, "caption": "In a subfolder.\n"},
        {"id": 14, "image_id": 4, "caption": "Missing file."},  # missing_image
        {"id": 15, "image_id": 99, "caption": "Nobody."},  # unknown_image_id
        {"id": 16, "image_id": 2},  # missing_caption
        {"id": 17, "image_id": 2, "caption": "   "},  # empty_caption
        {"id": 18, "image_id": 2, "caption": 42},  # wrong_field_type
        {"id": 19, "image_id": "2", "caption": "string id"},  # wrong_field_type
        "not an object",  # wrong_field_type
        {"id": 20, "image_id": 2, "caption": "Look at <image> here."},  # special_token_in_caption
        {"id": 21, "image_id": 3, "caption": "Ends <|im_end|> early."},  # special_token_in_caption
        {"id": 22, "caption": "No image id."},  # missing_image_id
    ],
}
COCO_SKIPS = {
    "bad_image_entry": 1,
    "duplicate_image_id": 1,
    "empty_caption": 1,
    "missing_caption": 1,
    "missing_image": 1,
    "missing_image_id": 1,
    "special_token_in_caption": 2,
    "unknown_image_id": 1,
    "wrong_field_type": 3,
}


def rec(image: str, caption: str, prompt: str = PROMPT) -> dict:
    return {"image": image, "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": caption}]}


COCO_FIRST = [
    rec("a.png", "A red square."),
    rec("b.png", 'Blue noise, café "quoted".'),
    rec("sub/c.png", "In a subfolder."),
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli(["data", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def summary(stdout: str) -> tuple[int, dict[str, int]]:
    m = SUMMARY.search(stdout)
    assert m, stdout
    skipped = json.loads(m.group(4))
    assert int(m.group(3)) == sum(skipped.values())
    return int(m.group(1)), skipped


def read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        parse_record(line)  # raises SkipSample on any record dhp could not train on
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    write_image(root / "images/a.png", (60, 40), seed=1)
    write_image(root / "images/b.png", (50, 70), seed=2)
    write_image(root / "images/sub/c.png", (64, 64), seed=3)
    (root / "captions.json").write_text(json.dumps(COCO, ensure_ascii=False), encoding="utf-8")
    return root


def test_coco_records_and_counts(coco, tmp_path, capsys):
    out = tmp_path / "deep/out.jsonl"
    rc, stdout, stderr = run(
        capsys,
        "convert-coco",
        "--captions",
        str(coco / "captions.json"),
        "--images",
        str(coco / "images"),
        "--out",
        str(out),
    )
    assert rc == 0, stderr
    assert read_jsonl(out) == COCO_FIRST
    assert summary(stdout) == (3, COCO_SKIPS)
    assert "1 further captions of written images not used" in stdout
    assert f"skipped (missing_image) annotation 4 (id 14): gone.png not under {coco / 'images'}" in stderr
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # the temporary file was moved, not left


def test_coco_all_captions_prompt_and_order(coco, tmp_path, capsys):
    """--all-captions, a custom prompt, and annotations listed before images (held until the images end)."""
    reordered = {"annotations": COCO["annotations"], "images": COCO["images"]}
    (tmp_path / "rev.json").write_text(json.dumps(reordered, indent=2), encoding="utf-8")
    out = tmp_path / "all.jsonl"
    rc, stdout, _ = run(
        capsys,
        "convert-coco",
        "--captions",
        str(tmp_path / "rev.json"),
        "--images",
        str(coco / "images"),
        "--out",
        str(out),
        "--all-captions",
        "--prompt",
        "What is this? <image>",
    )
    assert rc == 0
    p = "What is this? <image>"
    assert read_jsonl(out) == [
        rec("a.png", "A red square.", p),
        rec("a.png", "Second caption of a.", p),
        *[rec(r["image"], r["conversations"][1]["value"], p) for r in COCO_FIRST[1:]],
    ]
    assert summary(stdout) == (4, COCO_SKIPS)


def test_coco_output_preprocesses(coco, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert (
        run(
            capsys,
            "convert-coco",
            "--captions",
            str(coco / "captions.json"),
            "--images",
            str(coco / "images"),
            "--out",
            str(out),
        )[0]
        == 0
    )
    settings = PreprocessSettings(image_root=str(coco / "images"), min_pixels=3136, max_pixels=50176, max_seq_len=1024)
    pre = Preprocessor(settings, architecture_config("tiny"))
    for line, expected in zip(out.read_text(encoding="utf-8").splitlines(), COCO_FIRST, strict=True):
        sample = pre.process(line)
        assert sample["image_grid_thw"].shape == (1, 3)
        assert (sample["input_ids"] == pre.pad_id).sum() == sample["image_grid_thw"].prod() // 4
        labelled = sample["input_ids"][sample["labels"] != IGNORE_INDEX]
        reply = pre.tokenizer.decode(labelled.tolist(), skip_special_tokens=False)
        assert reply == expected["conversations"][1]["value"] + "<|im_end|>"


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_captions", "captions file not found"),
        ("missing_images", "images directory not found"),
        ("not_coco", "top level must be an object with 'images' and 'annotations'"),
        ("no_annotations", "no 'annotations' list"),
        ("images_not_list", "'images' must be a list"),
        ("truncated", "not valid JSON near character"),
        ("bad_prompt", "--prompt must hold '<image>' exactly once"),
    ],
)
def test_coco_errors(coco, tmp_path, capsys, case, message):
    captions, images, extra = tmp_path / "c.json", str(coco / "images"), []
    text = json.dumps(COCO)
    captions.write_text(
        {
            "not_coco": "[1, 2]",
            "no_annotations": '{"images": []}',
            "images_not_list": '{"images": {}}',
            "truncated": text[: len(text) // 2],
        }.get(case, text)
    )
    if case == "missing_captions":
        captions = tmp_path / "nope.json"
    if case == "missing_images":
        images = str(tmp_path / "no_images")
    if case == "bad_prompt":
        extra = ["--prompt", "<image> and <image>"]
    rc, stdout, stderr = run(
        capsys,
        "convert-coco",
        "--captions",
        str(captions),
        "--images",
        images,
        "--out",
        str(tmp_path / "out/o.jsonl"),
        *extra,
    )
    assert rc == 2 and stderr.startswith("dhp: error:") and message in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, 64])
def test_json_stream_matches_json_loads_at_any_chunk_size(chunk):
    doc = {
        "images": [{"id": 123456789, "f": -1.25e-7}, 0, 98765, 'é\\"x', [], {}, True, None],
        "annotations": [{"image_id": 1000000000001, "caption": "a\nb"}, 12, 3.5e-12],
        "z": 3.0,
        "w": -7,
    }
    js = JsonStream(io.StringIO(json.dumps(doc)), "doc", chunk_chars=chunk)
    got = {"images": [], "annotations": []}
    for kind, entry in convert._coco_entries(js):
        if kind != "images_done":
            got[kind].append(entry)
    assert got == {"images": doc["images"], "annotations": doc["annotations"]}


@pytest.mark.parametrize("list_min", [1, 1000])  # one listing per folder / one lookup per file
def test_existing_files_listing_and_lookup_agree(coco, list_min):
    fs, root = filesystem(str(coco / "images"))
    names = ["a.png", "b.png", "sub/c.png", "gone.png", "sub/gone.png", "nofolder/x.png", "sub"]
    assert convert.existing_files(fs, root, names, list_min) == {"a.png", "b.png", "sub/c.png"}


LAION_ROWS = [
    {
        "key": "000000001",
        "url": "https://example.com/1.jpg",
        "llava_caption": "A cat on a mat.",
        "cogvlm_caption": "Cat.",
        "alt_txt": "cat",
        "similarity": 0.3,
    },
    {
        "key": "000000002",
        "url": "s3://bucket/2.jpg",
        "llava_caption": "A dog.",
        "cogvlm_caption": "Dog.",
        "alt_txt": "dog",
        "similarity": 0.4,
    },
    {
        "key": None,
        "url": "https://example.com/3.jpg",
        "llava_caption": "No key.",
        "cogvlm_caption": "No key.",
        "alt_txt": "",
        "similarity": 0.1,
    },
    {
        "key": "000000004",
        "url": None,
        "llava_caption": None,
        "cogvlm_caption": "Only cogvlm.",
        "alt_txt": None,
        "similarity": 0.2,
    },
    {
        "key": "000000005",
        "url": "",
        "llava_caption": "  ",
        "cogvlm_caption": "<image> twice",
        "alt_txt": "x",
        "similarity": 0.5,
    },
    {
        "key": "000000006",
        "url": "images/6.jpg",
        "llava_caption": "Six <|vision_start|>.",
        "cogvlm_caption": "Six.",
        "alt_txt": "six",
        "similarity": 0.6,
    },
]


@pytest.fixture(scope="module")
def laion(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("laion")
    pq.write_table(pa.Table.from_pylist(LAION_ROWS), root / "pop.parquet", row_group_size=2)
    return root


@pytest.mark.parametrize(
    "flags, records, skips",
    [
        (
            [],
            [rec("000000001", "A cat on a mat."), rec("000000002", "A dog.")],  # auto: key + llava_caption
            {"missing_image_field": 1, "missing_caption": 1, "empty_caption": 1, "special_token_in_caption": 1},
        ),
        (
            ["--image-field", "images/{key}.jpg", "--caption-field", "cogvlm_caption"],
            [
                rec("images/000000001.jpg", "Cat."),
                rec("images/000000002.jpg", "Dog."),
                rec("images/000000004.jpg", "Only cogvlm."),
                rec("images/000000006.jpg", "Six."),
            ],
            {"missing_image_field": 1, "special_token_in_caption": 1},
        ),
        (
            ["--image-field", "url", "--caption-field", "alt_txt", "--prompt", "<image> Caption:"],
            [rec("s3://bucket/2.jpg", "dog", "<image> Caption:"), rec("images/6.jpg", "six", "<image> Caption:")],
            {"unsupported_url": 2, "missing_image_field": 2},
        ),
    ],
)
def test_laion_parquet(laion, tmp_path, capsys, flags, records, skips):
    out = tmp_path / "pop.jsonl"
    rc, stdout, stderr = run(capsys, "convert-laion-pop", "--in", str(laion / "pop.parquet"), "--out", str(out), *flags)
    assert rc == 0, stderr
    assert read_jsonl(out) == records
    assert summary(stdout) == (len(records), skips)


def test_laion_jsonl_and_json_array(tmp_path, capsys):
    lines = [
        json.dumps({"img": "p/1.jpg", "txt": "One.", "extra": [1]}),
        "{not json",
        "",
        json.dumps(["a", "list"]),
        json.dumps({"img": "p/2.jpg", "txt": 7}),
        json.dumps({"img": 3, "txt": "Three."}),
        json.dumps({"txt": "No image."}),
        json.dumps({"img": "p/5.jpg", "txt": "Five, ünïcode."}),
    ]
    (tmp_path / "rows.jsonl").write_bytes("\n".join(lines).encode("utf-8") + b"\n\xff\xfe not UTF-8\n")
    expected = [rec("p/1.jpg", "One."), rec("p/5.jpg", "Five, ünïcode.")]
    flags = ["--image-field", "img", "--caption-field", "txt"]
    rc, stdout, stderr = run(
        capsys, "convert-laion-pop", "--in", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "a.jsonl"), *flags
    )
    assert rc == 0, stderr
    assert read_jsonl(tmp_path / "a.jsonl") == expected
    assert summary(stdout) == (2, {"malformed_json": 2, "wrong_field_type": 3, "missing_image_field": 1})
    assert "skipped (malformed_json) line 2:" in stderr

    good = [json.loads(x) for x in lines if x.startswith('{"img"')]
    (tmp_path / "rows.json").write_text(json.dumps(good, ensure_ascii=False), encoding="utf-8")
    rc, stdout, _ = run(
        capsys, "convert-laion-pop", "--in", str(tmp_path / "rows.json"), "--out", str(tmp_path / "b.jsonl"), *flags
    )
    assert rc == 0 and read_jsonl(tmp_path / "b.jsonl") == expected
    assert summary(stdout) == (2, {"wrong_field_type": 2})


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_laion_auto_detection_error_lists_columns(tmp_path, capsys, fmt):
    rows = [{"img": "1.jpg", "txt": "One."}]
    src = tmp_path / f"rows.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), src)
    else:
        src.write_text(json.dumps(rows[0]) + "\n")
    rc, _, stderr = run(capsys, "convert-laion-pop", "--in", str(src), "--out", str(tmp_path / "o.jsonl"))
    assert rc == 2
    assert "no image field column among image_path, image, file_name, path, key, url; columns: img, txt" in stderr
    rc, _, stderr = run(
        capsys,
        "convert-laion-pop",
        "--in",
        str(src),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--image-field",
        "img",
        "--caption-field",
        "caption_typo",
    )
    assert rc == 2 and "no column 'caption_typo' for --caption-field; columns: img, txt" in stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_coco_and_laion_on_s3(coco, laion, tmp_path, capsys, monkeypatch, s3_endpoint):
    """Same records from s3:// inputs, image directory and outputs as from local files."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)  # the converters read the endpoint from the environment
    s3 = s3_endpoint.client()
    s3_endpoint.upload(coco, "data", "coco")
    s3.upload_file(str(laion / "pop.parquet"), "data", "laion/pop.parquet")

    rc, stdout, stderr = run(
        capsys,
        "convert-coco",
        "--captions",
        "s3://data/coco/captions.json",
        "--images",
        "s3://data/coco/images",
        "--out",
        "s3://data/out/coco.jsonl",
    )
    assert rc == 0, stderr
    assert summary(stdout) == (3, COCO_SKIPS)
    rc, stdout, stderr = run(
        capsys, "convert-laion-pop", "--in", "s3://data/laion/pop.parquet", "--out", "s3://data/out/pop.jsonl"
    )
    assert rc == 0 and summary(stdout)[0] == 2, stderr
    body = {k: s3.get_object(Bucket="data", Key=f"out/{k}.jsonl")["Body"].read().decode() for k in ("coco", "pop")}
    assert [json.loads(x) for x in body["coco"].splitlines()] == COCO_FIRST
    assert [json.loads(x) for x in body["pop"].splitlines()] == [
        rec("000000001", "A cat on a mat."),
        rec("000000002", "A dog."),
    ]
    # pyarrow keeps an "out/" directory marker after deleting the temporary object; no temporary left
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="data", Prefix="out/")["Contents"])
    assert [k for k in keys if not k.endswith("/")] == ["out/coco.jsonl", "out/pop.jsonl"]

    rc, _, stderr = run(
        capsys,
        "convert-coco",
        "--captions",
        "s3://data/coco/captions.json",
        "--images",
        "s3://data/coco/nothing",
        "--out",
        "s3://data/out/x.jsonl",
    )
    assert rc == 2 and "images directory not found: s3://data/coco/nothing" in stderr


def test_placeholder_matches_preprocess():
    assert convert.PLACEHOLDER == IMAGE_PLACEHOLDER
