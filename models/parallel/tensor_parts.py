"""Parts of a tensor, as every sharded layout indexes them: read one, write one back, cut a state dict into a
rank's parts and put the ranks' parts together again.

An index is what a layout's slicer answers for a full tensor: a tuple of slices (one block), a list of such
tuples (several row blocks, e.g. the q, k and v rows of a fused qkv, concatenated in that order), or None
(the rank holds the whole tensor). `source` may be a tensor or a safetensors slice (`safe_open(...)
.get_slice(name)`), so a rank reads only its part of a file.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def read_part(source, idx) -> torch.Tensor:
    """`source[idx]` for a tensor or a safetensors slice; a list index (several row blocks, e.g. a fused
    qkv) reads its parts and concatenates them."""
    return torch.cat([source[i] for i in idx]) if isinstance(idx, list) else source[idx]


def shard_sliced(full_state: dict[str, torch.Tensor], slicer) -> dict[str, torch.Tensor]:
    """Local state dict from a full one; `slicer(name)` -> index of this rank's part or None (replicated)."""
    out = {}
    for name, tensor in full_state.items():
        idx = slicer(name)
        out[name] = tensor if idx is None else read_part(tensor, idx).clone()
    return out


def part_blocks(target: torch.Tensor, idx) -> Iterator[tuple[torch.Tensor, int]]:
    """(view of `target` at one block of `idx`, the part's first row in it) for each block: a list index's
    blocks are the part's rows one after another (as `read_part` concatenates them); any other, one block."""
    row = 0
    for block in idx if isinstance(idx, list) else [idx]:
        view = target[block]
        yield view, row
        row += view.shape[0]


def write_part(target: torch.Tensor, idx, part: torch.Tensor) -> None:
    """Inverse of `read_part`: `target[idx] = part`, block by block."""
    for view, row in part_blocks(target, idx):
        view.copy_(part[row : row + view.shape[0]])


def gather_sliced(shards: list[dict[str, torch.Tensor]], slicer) -> dict[str, torch.Tensor]:
    """Inverse of `shard_sliced` over all ranks: `slicer(name, rank)` as there, `shards` in rank order."""
    out = {}
    for name, first in shards[0].items():
        idxs = [slicer(name, rank) for rank in range(len(shards))]
        if idxs[0] is None:
            out[name] = first.clone()
            continue
        parts = [idx if isinstance(idx, list) else [idx] for idx in idxs]
        shape = [
            n if parts[0][0][d] == slice(None) else max(p[d].stop for ps in parts for p in ps)
            for d, n in enumerate(first.shape)
        ]
        out[name] = first.new_empty(shape)
        for shard, idx in zip(shards, idxs):  # a replicated KV head is written once per holder
            write_part(out[name], idx, shard[name])
    return out
