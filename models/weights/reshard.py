"""Resharding: fill one rank's part of a tensor from the parts other ranks of another layout hold.

A layout's `slicer` gives the index of a rank's part of a full tensor (models/parallel/layout.py) in one of three
forms: None (the whole tensor), a tuple of slices (a rectangle; missing trailing dims and `slice(None)` mean
the whole dim), or a list of such tuples (row blocks concatenated along dim 0 in the local tensor, e.g. a
vision TP rank's q, k and v rows of the fused qkv). Every form is turned into *blocks*: a rectangle of the
full tensor plus the row where it starts in the local tensor. Resharding is then rectangle arithmetic: for
each block of the target part and each block of a source part, the intersection is read from the source
(only those rows and columns: `Part.read` takes a region of the source's *local* tensor, e.g. a
safetensors slice, so a rank never reads or gathers the full tensor) and written to its place in the
target. The same layout on both sides is an identity copy, exact.

Sources may overlap: replicated tensors (every holder has the whole), KV heads replicated over tensor-
parallel ranks. A source block identical to one already copied is skipped; the target must then be
covered exactly once, which is checked (a missing holder or a mis-shaped part is an error, not a silently
uninitialised slice).

`SavedRanks` applies this to a dhp checkpoint: the rank files one layout wrote for one stage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dhp.models.weights.hf_writer import DTYPE_OF

Index = tuple[slice, ...] | list[tuple[slice, ...]] | None
Region = tuple[slice, ...]
MOMENT_SEP = "::"  # moments file keys: f"{param name}::{optimizer state key}" (exp_avg, exp_avg_sq, step)


class Block(NamedTuple):
    """A rectangle of the full tensor ([start, stop) per dim) and its first row in the local tensor."""

    ranges: tuple[tuple[int, int], ...]
    row: int


class Part(NamedTuple):
    """What one holder has of a tensor: its index in the full tensor, its local shape, and a reader of a
    region of its local tensor."""

    index: Index
    shape: tuple[int, ...]
    read: Callable[[Region], torch.Tensor]


def blocks(shape: Sequence[int], index: Index) -> list[Block]:
    """The blocks of `index` into a tensor of full `shape`, in local row order."""
    if index is None:
        return [Block(tuple((0, n) for n in shape), 0)]
    out, row = [], 0
    for part in index if isinstance(index, list) else [index]:
        ranges = []
        for d, n in enumerate(shape):
            start, stop, step = (part[d] if d < len(part) else slice(None)).indices(n)
            if step != 1:
                raise ValueError(f"index {index}: only unit steps describe a part")
            ranges.append((start, max(start, stop)))
        out.append(Block(tuple(ranges), row))
        row += ranges[0][1] - ranges[0][0]
    return out


def local_shape(shape: Sequence[int], index: Index) -> tuple[int, ...]:
    """Shape of the local tensor `index` describes (`read_part` of a full tensor of `shape`)."""
    bs = blocks(shape, index)
    if not shape:
        return ()
    return (sum(b.ranges[0][1] - b.ranges[0][0] for b in bs), *(hi - lo for lo, hi in bs[0].ranges[1:]))


def _local_region(block: Block, inter: list[tuple[int, int]]) -> Region:
    """The region of the local tensor that holds `inter` (full-tensor coordinates inside `block`)."""
    offsets = [block.row - block.ranges[0][0], *(-lo for lo, _ in block.ranges[1:])]
    return tuple(slice(lo + o, hi + o) for (lo, hi), o in zip(inter, offsets))


def fill(target: torch.Tensor, shape: Sequence[int], index: Index, sources: Sequence[Part], name: str = "") -> None:
    """Write into `target` (the local tensor of `index` into a full tensor of `shape`) every element the
    `sources` hold of it, reading only the intersections. Raises unless each element is written once."""
    shape = tuple(shape)
    want = local_shape(shape, index)
    if tuple(target.shape) != want:
        raise ValueError(f"{name}: the target is {tuple(target.shape)}, its index gives {want}")
    seen: set[tuple[tuple[int, int], ...]] = set()
    written, own = 0, blocks(shape, index)
    for src in sources:
        if tuple(src.shape) != local_shape(shape, src.index):
            raise ValueError(
                f"{name}: a stored part is {tuple(src.shape)}, but its layout's index into the full "
                f"{shape} gives {local_shape(shape, src.index)}: another model shape?"
            )
        for a in blocks(shape, src.index):
            if a.ranges in seen:
                continue  # a replica of a block already copied (replicated tensor, replicated KV head)
            seen.add(a.ranges)
            for b in own:
                inter = [(max(b0, a0), min(b1, a1)) for (b0, b1), (a0, a1) in zip(b.ranges, a.ranges)]
                if any(lo >= hi for lo, hi in inter):
                    continue
                target[_local_region(b, inter)] = src.read(_local_region(a, inter))
                written += math.prod(hi - lo for lo, hi in inter)
    if written != target.numel():
        raise ValueError(
            f"{name}: the stored parts cover {written} of the {target.numel()} elements of this "
            f"rank's part (a rank file missing, or parts that overlap)"
        )


def index_of(slicer: Callable[[str], Index] | None, name: str) -> Index:
    """`slicer(name)`, where a layout's slicer None means every tensor whole."""
    return slicer(name) if slicer is not None else None


class SavedRanks:
    """The rank files a layout wrote for one stage (`{stage}-rank{r:05d}.safetensors` with the local tensors,
    `...-moments.safetensors` with the AdamW state by parameter name). Files are opened as safetensors
    (headers parsed; data read only for the regions asked for) and closed by `close` / `with`."""

    def __init__(self, ckpt: Path, stage: str, layout: Any, full_shapes: dict[str, torch.Size]):
        self.ckpt, self.stage, self.full_shapes = Path(ckpt), stage, full_shapes
        self.slicers = {r: layout.slicer(r, full_shapes) for r in range(layout.num_actors)}
        self.weight_ranks = layout.state_ranks(0)  # one copy of the model is enough for the weights
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self.moment_holders: dict[str, list[int]] = {}  # "name::key" -> ranks whose moments file holds it
        self._keys: dict[str, set[str]] = {}  # name -> its saved optimizer state keys
        for r in range(layout.num_actors):  # ZeRO-1 decides who holds which moments: ask the headers
            for key in self._open(self.file(r, "-moments")).keys():
                self.moment_holders.setdefault(key, []).append(r)
                name, _, state_key = key.rpartition(MOMENT_SEP)
                self._keys.setdefault(name, set()).add(state_key)

    def file(self, rank: int, suffix: str = "") -> Path:
        return self.ckpt / f"{self.stage}-rank{rank:05d}{suffix}.safetensors"

    def _open(self, path: Path) -> Any:
        if str(path) not in self._files:
            from safetensors import safe_open

            if not path.is_file():
                raise FileNotFoundError(f"{self.ckpt}: missing rank file {path.name}")
            self._files[str(path)] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._files[str(path)]

    def _part(self, rank: int, suffix: str, key: str, name: str) -> Part:
        """Rank `rank`'s stored `key`, laid out like parameter / tensor `name` by the saved layout."""
        stored = self._open(self.file(rank, suffix)).get_slice(key)
        return Part(index_of(self.slicers[rank], name), tuple(stored.get_shape()), lambda region: stored[region])

    def fill_weight(self, target: torch.Tensor, name: str, index: Index) -> None:
        """This rank's part (`index`) of tensor `name`, from the saved layout's weight files."""
        parts = [self._part(r, "", name, name) for r in self.weight_ranks]
        fill(target, self.full_shapes[name], index, parts, name)

    def moment_keys(self, name: str) -> list[str]:
        """The optimizer state keys saved for parameter `name` (none: it had no state yet)."""
        return sorted(self._keys.get(name, ()))

    def read_moment(self, name: str, key: str, index: Index) -> torch.Tensor:
        """This rank's part (`index`) of optimizer state `key` of parameter `name`: laid out like the
        parameter, or a 0-dim value (AdamW's `step`) taken whole from its first holder."""
        full_key = name + MOMENT_SEP + key
        ranks = self.moment_holders[full_key]
        first = self._open(self.file(ranks[0], "-moments")).get_slice(full_key)
        if not first.get_shape():  # a scalar per parameter: the same on every holder
            return first[()].clone()
        shape = self.full_shapes[name]
        out = torch.empty(local_shape(shape, index), dtype=DTYPE_OF[first.get_dtype()])
        fill(out, shape, index, [self._part(r, "-moments", full_key, name) for r in ranks], full_key)
        return out

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SavedRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
