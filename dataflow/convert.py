"""Dataset converters: COCO captions JSON and LAION-POP rows -> dhp's conversation-format JSONL.

    {"image": "<path relative to data.image_root>", "conversations": [
        {"from": "human", "value": "<image>\\nDescribe this image."}, {"from": "gpt", "value": CAPTION}]}

Both stream: the COCO JSON is decoded one `images` / `annotations` entry at a time (only the image id ->
file name map is held), LAION-POP parquet is read in column-pruned batches and JSONL line by line; records
are written as they are made. Inputs, the COCO image directory and the output may be local or `s3://`
(`dhp.dataflow.storage.filesystem`). The output is written to a temporary name beside it and moved into
place at the end, so a failed run never leaves a half-written file under the output name.

A row that cannot become a record is skipped and counted by reason. A caption holding `<image>` or a
`<|...|>` special token is skipped (`special_token_in_caption`), never rewritten: the tokenizer would turn
it into control tokens (a wrong image count, or a turn ending early), and silently editing captions
would hide how often it happens.
"""

from __future__ import annotations

import argparse
import io
import json
import posixpath
import re
import string
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pyarrow import fs as pafs

from dhp.dataflow.json_stream import JsonStream
from dhp.dataflow.storage import filesystem
from dhp.errors import ConfigError

PLACEHOLDER = "<image>"  # = preprocess.IMAGE_PLACEHOLDER; not imported from there because that pulls in torch
DEFAULT_PROMPT = PLACEHOLDER + "\nDescribe this image."
# Auto-detection order: path-like columns before a bare key, a URL last (it cannot be read as is).
IMAGE_FIELDS = ("image_path", "image", "file_name", "path", "key", "url")
CAPTION_FIELDS = ("caption", "llava_caption", "cogvlm_caption", "alt_txt", "text")
RESERVED = re.compile(r"<image>|<\|[^<>|\s]{1,64}\|>")
URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
EXAMPLES_PER_REASON = 3


class _Skip(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass
class Report:
    """What a conversion did: records written, skips by reason (with a few examples), extra notes."""

    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(detail)

    def summary(self, command: str, out: str) -> str:
        reasons = json.dumps(dict(sorted(self.skipped.items())))
        line = f"{command}: written {self.written} records to {out}; skipped {sum(self.skipped.values())} {reasons}"
        return "; ".join([line, *self.notes])


def _check_prompt(prompt: str | None) -> str:
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    if RESERVED.findall(prompt) != [PLACEHOLDER]:
        raise ConfigError(f"--prompt must hold {PLACEHOLDER!r} exactly once and no other special token, got {prompt!r}")
    return prompt


def _caption(value: Any) -> str:
    if value is None:
        raise _Skip("missing_caption", "no caption")
    if not isinstance(value, str):
        raise _Skip("wrong_field_type", f"caption is a {type(value).__name__}")
    text = value.strip()
    if not text:
        raise _Skip("empty_caption", "caption is empty")
    if RESERVED.search(text):
        raise _Skip("special_token_in_caption", f"{RESERVED.search(text).group()!r} in {text[:60]!r}")
    return text


def _record(image: str, prompt: str, caption: str) -> str:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": caption}]
    return json.dumps({"image": image, "conversations": turns}, ensure_ascii=False) + "\n"


def _open_input(uri: str, what: str) -> tuple[pafs.FileSystem, str]:
    fs, path = filesystem(uri)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{what} not found: {uri}")
    if kind != pafs.FileType.File:
        raise ConfigError(f"{what} is not a file: {uri}")
    return fs, path


class _AtomicOutput:
    """JSONL output written under a temporary name and moved over `uri` only when the block succeeds."""

    def __init__(self, uri: str, source: tuple[pafs.FileSystem, str]):
        self.uri = uri
        self.fs, self.path = filesystem(uri)
        if type(self.fs) is type(source[0]) and self.path == source[1]:
            raise ConfigError(f"--out {uri} is the input file")
        if self.fs.get_file_info(self.path).type == pafs.FileType.Directory:
            raise ConfigError(f"--out {uri} is a directory; give a file name")
        self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> _AtomicOutput:
        try:
            if isinstance(self.fs, pafs.LocalFileSystem):  # S3 has no directories to create
                self.fs.create_dir(posixpath.dirname(self.path), recursive=True)
            self.stream = self.fs.open_output_stream(self.tmp, buffer_size=1 << 20)
        except OSError as e:
            raise ConfigError(f"cannot write {self.uri}: {e}") from None
        return self

    def write(self, line: str) -> None:
        self.stream.write(line.encode("utf-8"))

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.stream.close()
        if exc_type is not None:
            try:
                self.fs.delete_file(self.tmp)
            except OSError:
                pass
            return
        self.fs.move(self.tmp, self.path)  # a rename locally; copy + delete on S3 (objects < 5 GB)


def _coco_entries(js: JsonStream) -> Iterator[tuple[str, Any]]:
    """("images", entry) / ("annotations", entry) in file order, and ("images_done", None) when the
    images list ends; other top-level keys (info, licenses) are decoded and dropped."""
    if js.peek() != "{":
        raise ConfigError(f"{js.name}: top level must be an object with 'images' and 'annotations' (COCO captions)")
    js.take("{")
    seen = set()
    if js.peek() == "}":
        js.take("}")
    else:
        while True:
            key = js.value()
            if not isinstance(key, str):
                raise js.error("object keys must be strings")
            js.take(":")
            if key in ("images", "annotations"):
                if js.peek() != "[":
                    raise ConfigError(f"{js.name}: '{key}' must be a list")
                seen.add(key)
                for entry in js.array():
                    yield key, entry
                if key == "images":
                    yield "images_done", None
            else:
                js.value()
            if js.take(",}") == "}":
                break
    if js.peek():
        raise js.error("text after the end of the document")
    for key in ("images", "annotations"):
        if key not in seen:
            raise ConfigError(f"{js.name}: no '{key}' list (is this a COCO captions file?)")


def existing_files(fs: pafs.FileSystem, root: str, names: Iterable[str], list_min: int = 64) -> set[str]:
    """The `names` (paths relative to `root`) that are files. A directory holding at least `list_min` of
    them is listed once (one request per 1000 keys on S3); the rest are looked up one by one."""
    by_dir: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_dir[posixpath.dirname(name.lstrip("/"))].append(name)
    root = root.rstrip("/")
    found = set()
    for folder, members in by_dir.items():
        if len(members) >= list_min:
            selector = pafs.FileSelector(f"{root}/{folder}" if folder else root, allow_not_found=True)
            files = {posixpath.basename(i.path) for i in fs.get_file_info(selector) if i.type == pafs.FileType.File}
            found.update(m for m in members if posixpath.basename(m) in files)
        else:
            infos = fs.get_file_info([f"{root}/{m.lstrip('/')}" for m in members])
            found.update(m for m, i in zip(members, infos) if i.type == pafs.FileType.File)
    return found


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def convert_coco(
    captions: str, images: str, out: str, prompt: str | None = None, all_captions: bool = False, list_min: int = 64
) -> Report:
    """COCO captions JSON -> JSONL; `image` is the entry's file_name (relative to `images`, which must hold it)."""
    prompt = _check_prompt(prompt)
    in_fs, in_path = _open_input(captions, "captions file")
    img_fs, img_root = filesystem(images)
    if img_fs.get_file_info(img_root).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"images directory not found: {images}")
    report, names, used = Report(), {}, set()
    present: set[str] | None = None
    pending: list[tuple[int, Any]] = []  # annotations met before the images list ended (not COCO's own order)
    unused = 0

    def annotation(i: int, ann: Any) -> None:
        nonlocal unused
        where = f"annotation {i}" + (f" (id {ann['id']})" if isinstance(ann, dict) and "id" in ann else "")
        try:
            if not isinstance(ann, dict):
                raise _Skip("wrong_field_type", f"entry is a {type(ann).__name__}")
            image_id = ann.get("image_id")
            if image_id is None:
                raise _Skip("missing_image_id", "no image_id")
            if not _is_int(image_id):
                raise _Skip("wrong_field_type", f"image_id is a {type(image_id).__name__}")
            caption = _caption(ann.get("caption"))
            if image_id not in names:
                raise _Skip("unknown_image_id", f"image_id {image_id} is not in 'images'")
            if names[image_id] not in present:
                raise _Skip("missing_image", f"{names[image_id]} not under {images}")
        except _Skip as e:
            return report.skip(e.reason, f"{where}: {e.detail}")
        if not all_captions and image_id in used:
            unused += 1
            return
        used.add(image_id)
        sink.write(_record(names[image_id], prompt, caption))
        report.written += 1

    with in_fs.open_input_stream(in_path) as raw, _AtomicOutput(out, (in_fs, in_path)) as sink:
        n_ann = 0
        for kind, entry in _coco_entries(JsonStream(io.TextIOWrapper(raw, encoding="utf-8"), captions)):
            if kind == "images":
                image_id, name = (entry.get("id"), entry.get("file_name")) if isinstance(entry, dict) else (None, None)
                if not _is_int(image_id) or not isinstance(name, str) or not name.strip():
                    report.skip("bad_image_entry", f"image {str(entry)[:80]}: needs an int 'id' and a 'file_name'")
                elif image_id in names:
                    report.skip("duplicate_image_id", f"image id {image_id} listed again ({name})")
                else:
                    names[image_id] = name.strip()
            elif kind == "images_done":
                present = existing_files(img_fs, img_root, set(names.values()), list_min)
                for i, ann in pending:
                    annotation(i, ann)
                pending.clear()
            else:
                if present is None:
                    pending.append((n_ann, entry))
                else:
                    annotation(n_ann, entry)
                n_ann += 1
    if unused:
        report.notes.append(f"{unused} further captions of written images not used (--all-captions keeps them)")
    return report


def _image_template(spec: str) -> list[str]:
    """Column names a `--image-field` template like 'images/{key}.jpg' refers to ([] for a plain column)."""
    try:
        refs = [name for _, name, _, _ in string.Formatter().parse(spec) if name is not None]
    except ValueError as e:
        raise ConfigError(f"--image-field {spec!r}: bad template: {e}") from None
    if any(not r or not r.isidentifier() for r in refs):
        raise ConfigError(f"--image-field {spec!r}: template fields must be column names, e.g. 'images/{{key}}.jpg'")
    return refs


def _pick(columns: list[str], given: str | None, candidates: tuple[str, ...], flag: str, source: str) -> str:
    if given is not None:
        refs = _image_template(given) if flag == "--image-field" else []
        missing = [c for c in (refs or [given]) if c not in columns]
        if missing:
            raise ConfigError(f"{source}: no column {missing[0]!r} for {flag}; columns: {', '.join(columns)}")
        return given
    for name in candidates:
        if name in columns:
            return name
    raise ConfigError(
        f"{source}: no {flag[2:].replace('-', ' ')} column among {', '.join(candidates)}; "
        f"columns: {', '.join(columns) or '(none)'}; name one with {flag}"
    )


def _image_value(row: dict[str, Any], spec: str, refs: list[str]) -> str:
    if refs:
        values = {r: row.get(r) for r in refs}
        if any(v is None for v in values.values()):
            raise _Skip("missing_image_field", f"no value for {[r for r, v in values.items() if v is None]}")
        if any(not isinstance(v, (str, int)) or isinstance(v, bool) for v in values.values()):
            raise _Skip("wrong_field_type", f"template fields must be strings or integers: {values}")
        try:
            value = spec.format_map(values)
        except (ValueError, TypeError) as e:
            raise _Skip("wrong_field_type", f"{spec!r}: {e}") from None
    else:
        value = row.get(spec)
        if value is None:
            raise _Skip("missing_image_field", f"no {spec!r}")
        if not isinstance(value, str):
            raise _Skip("wrong_field_type", f"{spec!r} is a {type(value).__name__}")
    value = value.strip()
    if not value:
        raise _Skip("missing_image_field", f"{spec!r} is empty")
    scheme = URL_SCHEME.match(value)
    if scheme and scheme.group(1).lower() != "s3":
        raise _Skip("unsupported_url", f"{value[:80]}: dhp reads local paths and s3:// only; download first")
    return value


def _is_parquet(fs: pafs.FileSystem, path: str) -> bool:
    with fs.open_input_stream(path) as f:
        return f.read(4) == b"PAR1"


def _parquet_rows(pfile: Any, columns: list[str]) -> Iterator[tuple[str, Any]]:
    n = 0
    for batch in pfile.iter_batches(batch_size=4096, columns=columns):
        for row in batch.to_pylist():
            yield f"row {n}", row
            n += 1


def _json_rows(fs: pafs.FileSystem, path: str, source: str) -> Iterator[tuple[str, Any]]:
    """(where, row) from JSONL (a bad line becomes a _Skip row) or from a JSON array of rows."""
    with fs.open_input_stream(path) as raw:
        reader = io.BufferedReader(raw, buffer_size=1 << 20)
        if reader.peek(64).lstrip()[:1] == b"[":
            js = JsonStream(io.TextIOWrapper(reader, encoding="utf-8"), source)
            for n, row in enumerate(js.array()):
                yield f"element {n}", row
            if js.peek():
                raise js.error("text after the end of the array")
            return
        for n, line in enumerate(reader, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield f"line {n}", _Skip("malformed_json", str(e))


def convert_laion_pop(
    src: str, out: str, image_field: str | None = None, caption_field: str | None = None, prompt: str | None = None
) -> Report:
    """LAION-POP rows (parquet, JSONL or a JSON array) -> JSONL. Fields are auto-detected from the parquet
    schema or the first JSON object unless named; `image_field` may be a template such as '{key}.jpg'."""
    prompt = _check_prompt(prompt)
    fs, path = _open_input(src, "input file")
    report = Report()
    spec = refs = caption_col = None
    if _is_parquet(fs, path):  # fields from the schema; only their columns are read
        import pyarrow.parquet as pq

        pfile = pq.ParquetFile(fs.open_input_file(path))
        columns = pfile.schema_arrow.names
        spec = _pick(columns, image_field, IMAGE_FIELDS, "--image-field", src)
        caption_col = _pick(columns, caption_field, CAPTION_FIELDS, "--caption-field", src)
        refs = _image_template(spec)
        rows = _parquet_rows(pfile, sorted({*(refs or [spec]), caption_col}))
    else:
        rows = _json_rows(fs, path, src)
    with _AtomicOutput(out, (fs, path)) as sink:
        for where, row in rows:
            try:
                if isinstance(row, _Skip):
                    raise row
                if not isinstance(row, dict):
                    raise _Skip("wrong_field_type", f"row is a {type(row).__name__}, not an object")
                if spec is None:  # JSON: fields from the first object row
                    keys = list(row)
                    spec = _pick(keys, image_field, IMAGE_FIELDS, "--image-field", f"{src} (first row)")
                    caption_col = _pick(keys, caption_field, CAPTION_FIELDS, "--caption-field", f"{src} (first row)")
                    refs = _image_template(spec)
                image = _image_value(row, spec, refs)
                caption = _caption(row.get(caption_col))
            except _Skip as e:
                report.skip(e.reason, f"{where}: {e.detail}")
                continue
            sink.write(_record(image, prompt, caption))
            report.written += 1
    if spec is not None:
        report.notes.insert(0, f"image from {spec!r}, caption from {caption_col!r}")
    return report


def main(args: argparse.Namespace) -> int:
    """`dhp data convert-coco` / `dhp data convert-laion-pop`: skip examples on stderr, one summary line."""
    if args.data_command == "convert-coco":
        report = convert_coco(args.captions, args.images, args.out, args.prompt, args.all_captions)
    else:
        report = convert_laion_pop(args.src, args.out, args.image_field, args.caption_field, args.prompt)
    for reason, examples in sorted(report.examples.items()):
        for example in examples:
            print(f"skipped ({reason}) {example}", file=sys.stderr)
    print(report.summary(args.data_command, args.out))
    return 0
