"""Hugging Face safetensors shards written one tensor at a time, and rank files read without a memory map.

`safetensors.save_file` takes a dict of every tensor of the file, so a 5 GB shard means 5 GB in memory (and
today's one-file-per-stage export meant the whole stage: ~64 GB for the 32B text stage). The format is
simple enough to stream: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes in that order. With every tensor's name, shape and dtype known up
front (from the rank files' headers, or the meta model), the shards and their headers are planned first
(`plan_shards`: in order, a new file when the next tensor would pass `max_shard_size`, a larger tensor alone
in its own, as transformers' `save_pretrained` does), and then each tensor is produced, written and dropped
(`write_shards`): a process never holds more than the tensor being written (plus what produces it).

Reading (`SafetensorsReader`) is by hand for the same reason in reverse: `safe_open` memory-maps the file,
so every page a process has read stays in its resident set until the file is closed, and assembling one
tensor from its parts would count the parts and the whole. Plain `readinto` puts a part's bytes where they
go: straight into the output tensor when that part is a contiguous block of it, a few rows at a time
through a small buffer when it is strided (a block of columns).

Files are named `model-00001-of-0000N.safetensors` with `model.safetensors.index.json` (`total_size`: the
bytes of all tensors), the layout `from_pretrained` loads.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dhp.models.weights.hf_checkpoint import INDEX_FILE
from dhp.models.weights.shard_size import parse_size

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default
CHUNK_BYTES = 16 * 2**20  # reading a strided part: rows at a time through a buffer this large
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_OF = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: its checkpoint name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most `max_shard_size` bytes of tensor data."""
    shards: list[list[Entry]] = []
    size = 0
    for e in entries:
        if not shards or (size + e.nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _header(entries: list[Entry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        end = offset + e.nbytes
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment


class SafetensorsReader:
    """One safetensors file: its header parsed once, each tensor read on request with plain file reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115  (closed in close())
        (n,) = struct.unpack("<Q", self._file.read(8))
        header = json.loads(self._file.read(n))
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries = {name: Entry(name, tuple(h["shape"]), DTYPE_OF[h["dtype"]]) for name, h in header.items()}
        self._offsets = {name: h["data_offsets"][0] for name, h in header.items()}

    def keys(self) -> list[str]:
        return list(self.entries)

    def read_into(self, name: str, target: torch.Tensor, row: int = 0) -> None:
        """Fill `target` with the stored tensor's rows `row : row + len(target)` (all of a 0-dim tensor).
        A contiguous target is read into directly; a strided one (a block of columns of a larger tensor)
        through a buffer of at most `CHUNK_BYTES`, so reading never holds a second copy of a part."""
        e = self.entries[name]
        rows = target.shape[0] if target.ndim else 1
        row_bytes = math.prod(e.shape[1:]) * e.dtype.itemsize  # a 0-dim tensor: one row of one element
        if target.dtype != e.dtype or tuple(target.shape[1:]) != e.shape[1:] or row + rows > (e.shape or (1,))[0]:
            raise ValueError(
                f"{self.path}: {name} is {e.shape} {e.dtype}; asked rows {row}:{row + rows} as "
                f"{tuple(target.shape)} {target.dtype}"
            )
        if not target.is_contiguous():
            step = max(1, CHUNK_BYTES // row_bytes)
            for start in range(0, rows, step):
                chunk = target[start : start + step]
                buffer = torch.empty(chunk.shape, dtype=chunk.dtype)
                self.read_into(name, buffer, row + start)
                chunk.copy_(buffer)
            return
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
        self._file.seek(self._base + self._offsets[name] + row * row_bytes)
        done = 0
        while done < len(view):
            got = self._file.readinto(view[done:])
            if not got:
                raise ValueError(f"{self.path}: truncated inside {name}")
            done += got

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(name, out)
        return out

    def close(self) -> None:
        self._file.close()


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_shards(
    out_dir: str | Path, entries: list[Entry], produce: Callable[[Entry], torch.Tensor], max_shard_size: int | str
) -> dict[str, str]:
    """Write `entries` as HF shards plus the index, calling `produce(entry)` for one tensor at a time (it must
    return exactly that shape and dtype); returns the weight_map. A stale shard or index is replaced."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(entries, parse_size(max_shard_size))
    names = {shard_name(i, len(shards)) for i in range(len(shards))}
    for stale in out.glob("model*.safetensors"):  # an earlier export's files would shadow or confuse the index
        if stale.name not in names:
            stale.unlink()
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        header = _header(shard)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for e in shard:
                t = produce(e)
                if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                    raise ValueError(f"{e.name}: produced {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
                del t
                weight_map[e.name] = name
    (out / INDEX_FILE).write_text(
        json.dumps(
            {
                "metadata": {"total_size": sum(e.nbytes for e in entries)},
                "weight_map": dict(sorted(weight_map.items())),
            },
            indent=1,
        )
    )
    return weight_map
