"""What `data.train` / `data.eval` name, and how Ray Data turns each file into records: the one place that
knows the data formats (a new format is a class here). Light on imports (no torch, no transformers): the
read tasks that run the splits import this module, and Ray Data's start-up waits for them.

`expand_paths`: a comma-separated list whose items may hold brace ranges (`{00000..01023}`, zero-padded as
written), brace alternatives (`{a,b}`) and globs (`*`, `?`, `[...]`, matched against the listing of the
local folder or the s3:// prefix). `record_format`: the format object the loaders ask:

    name          "jsonl" | "webdataset"
    missing_ok    a listed file that does not exist is a counted skip (a failed shard) rather than a stop
    deals         the files may be dealt out whole between data-parallel streams (`positions.reads`)
    order(n, seed)  the epoch's reading order of the n files (indices; WebDataset: permuted with the seed)
    split, split_kwargs(fs)  the map from one `positions.Read` of a file to its records (shuffled, the read's rows)
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from dhp.dataflow.positions import own_rows
from dhp.dataflow.storage import filesystem, is_uri
from dhp.dataflow.webdataset import split_shard
from dhp.errors import ConfigError

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")
GLOB_CHARS = "*?["


def expand_braces(item: str) -> list[str]:
    """'s3://b/{000..002}.tar' -> ['s3://b/000.tar', 's3://b/001.tar', 's3://b/002.tar']; '{a,b}' -> both."""
    m = _BRACE.search(item)
    if not m:
        return [item]
    body, head, tail = m.group(1), item[: m.start()], item[m.end() :]
    r = _RANGE.match(body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        if hi < lo:
            raise ConfigError(f"data paths: brace range {{{body}}} in {item!r} runs backwards")
        width = len(r.group(1)) if r.group(1).startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(lo, hi + 1)]
    elif "," in body:
        choices = body.split(",")
    else:
        raise ConfigError(f"data paths: {{{body}}} in {item!r} is neither a range {{A..B}} nor alternatives {{a,b}}")
    return [p for c in choices for p in expand_braces(head + c + tail)]


def _glob(item: str, storage: Any) -> list[str]:
    """The files matching a glob, sorted, as URIs like `item` (local: absolute paths)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(item, storage)
    first = min(path.index(c) for c in GLOB_CHARS if c in path)
    base = path[:first].rpartition("/")[0] or "/"
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except OSError as e:
        raise ConfigError(f"data paths: cannot list {base} for {item!r}: {str(e).splitlines()[0]}") from None
    found = sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path))
    if not found:
        raise ConfigError(f"data paths: {item!r} matches no file")
    prefix = item.split("://", 1)[0] + "://" if is_uri(item) else ""
    return [prefix + p for p in found]


def expand_paths(spec: str, storage: Any = None) -> list[str]:
    """`data.train` / `data.eval` -> the files, in the order written (globs sorted)."""
    out = []
    for item in _split_top(spec):
        for path in expand_braces(item):
            path = path if is_uri(path) else os.path.abspath(path)
            out += _glob(path, storage) if any(c in path for c in GLOB_CHARS) else [path]
    return out


def _split_top(spec: str) -> list[str]:
    """Split on the commas outside braces ('{a,b}.tar,c.tar' -> ['{a,b}.tar', 'c.tar'])."""
    items, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [s.strip() for s in [*items, cur] if s.strip()]


def split_records(row: dict[str, Any], fs: Any, seed: int | None, prefix: str = "") -> list[dict]:
    """One annotation file (JSONL or a JSON array), a `positions.Read` row -> its records, one row each, JSON as text.

    Records stay text until the preprocessor parses them, so one bad line is one counted skip rather than a
    failed read. With a seed, the file's records are permuted (per-epoch shuffle); then the read keeps its rows
    (data-parallel stream r of N: every N-th from r, disjoint streams). `prefix` ("s3://") turns the filesystem's
    path back into the URI the user wrote, for `source`.
    """
    with fs.open_input_stream(row["path"]) as f:
        text = f.read().decode("utf-8", errors="replace")
    path = prefix + row["path"]
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
            rows = [{"source": f"{path}[{i}]", "record": json.dumps(r)} for i, r in enumerate(items)]
        except json.JSONDecodeError as e:  # the whole array is unreadable: one skip naming the file
            rows = [{"source": path, "record": f"<unparseable JSON array: {e}>"}]
    else:
        lines = text.splitlines()
        rows = [{"source": f"{path}:{i + 1}", "record": line} for i, line in enumerate(lines) if line.strip()]
    return own_rows(rows, row, seed)


def split_batch(batch: dict[str, Any], split: Any, **kwargs: Any) -> dict[str, list]:
    """A format's `split` as a Ray Data `map_batches` function: the file rows of `batch` (columns) -> all their
    record rows (columns). map_batches rather than flat_map because only a MapBatches fuses with the streaming
    repartition after it (loader.build_dataset): fused, the cutting into small blocks runs in these tasks, with
    their small CPU request, instead of as tasks of its own that ask a whole CPU a busy trainer does not have."""
    n = len(next(iter(batch.values()))) if batch else 0
    rows = [r for i in range(n) for r in split({k: v[i] for k, v in batch.items()}, **kwargs)]
    if not rows:
        return {"source": [], "record": []}
    return {k: [r[k] for r in rows] for k in rows[0]}


@dataclass(frozen=True)
class Jsonl:
    """LLaVA-style annotation files (JSON array or JSONL), images as files beside them or URIs. Every stream reads
    every file, each its stride of the records: a file is one unit of the shuffle, and few files is the usual."""

    name = "jsonl"
    missing_ok = False
    deals = False

    def order(self, n: int, seed: int | None) -> list[int]:
        return list(range(n))

    split = staticmethod(split_records)

    def split_kwargs(self, fs: Any) -> dict[str, Any]:
        return {"fs": fs}


@dataclass(frozen=True)
class WebDataset:
    """img2dataset / webdataset tar shards (dataflow/webdataset.py), dealt out whole between the data-parallel
    streams when there are enough; a shard opens inside the split, so a missing one is a counted skip there."""

    prompt: str
    caption: str
    name = "webdataset"
    missing_ok = True
    deals = True

    def order(self, n: int, seed: int | None) -> list[int]:
        """The epoch's shard order: the n shards permuted with its seed (file order without one)."""
        order = list(range(n))
        if seed is not None:
            random.Random(seed).shuffle(order)
        return order

    split = staticmethod(split_shard)

    def split_kwargs(self, fs: Any) -> dict[str, Any]:
        return {"fs": fs, "prompt": self.prompt, "caption": self.caption}


def record_format(data: Any, paths: list[str]) -> Jsonl | WebDataset:
    """The format of `paths` under `data` (a DataConfig): `data.format`, or for auto, webdataset when every
    path ends in .tar."""
    name = data.format
    if name == "auto":
        name = "webdataset" if paths and all(p.lower().endswith(".tar") for p in paths) else "jsonl"
    if name == "webdataset":
        return WebDataset(data.webdataset.prompt, data.webdataset.caption)
    return Jsonl()
