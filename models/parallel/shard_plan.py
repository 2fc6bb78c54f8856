"""Who owns which patches under vision sequence parallelism: the plan every SP rank and the loader compute from
`image_grid_thw` alone (models/parallel/sequence_parallel.py runs the encoder on it).

transformers' `get_vision_window_index` gives the window order of merge units; expanded to patches it is the
*global window order* (image-major, frame-major, window-major). That sequence is cut into sp contiguous ranges
[bounds[r], bounds[r+1]) at window boundaries (each cut is the window boundary nearest to r * P / sp, so
|S_r - P / sp| <= the largest window). Seen per image this is a cut of the image's window-ordered sequence into sp
contiguous ragged pieces in rank order: a small image lives on one or two ranks, a rank may hold no patch of an
image, or no patch at all. Because the pieces are in rank order, the rank-major concatenation of the shards IS
the global window order. A family without windows (Qwen3-VL) is cut in raster order at merge-unit edges.

Its own module because the data loader cuts each micro-batch's pixels with it: the loader's process then needs
torch and the window index, not the encoder's modeling code (about 1.3 s of imports per loader process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

from dhp.models.family import family_of


@dataclass(frozen=True)
class ShardPlan:
    """Who owns which patches. Picklable, CPU tensors; the same object on every rank of the SP group.

    sp: SP degree. num_patches: P. merge_unit: patches per merged token (4).
    bounds: sp + 1 offsets into the global window order; rank r owns [bounds[r], bounds[r + 1]).
    lengths: S_r per rank (= bounds[r + 1] - bounds[r]).
    patch_index: per rank, long [S_r]: rows of `pixel_values` it owns, in window order.
    cu_window_seqlens: per rank, int32: its local window boundaries ([0] when S_r == 0).
    cu_seqlens: int32, full-attention segments (one per image frame) over the global window order.
    image_lengths: long [n_images, sp]: patches of image i held by rank r.
    window_index: long [P / 4]: transformers' window order of merge units (argsort -> raster order).
    """

    sp: int
    num_patches: int
    merge_unit: int
    bounds: tuple[int, ...]
    lengths: tuple[int, ...]
    patch_index: tuple[torch.Tensor, ...]
    cu_window_seqlens: tuple[torch.Tensor, ...]
    cu_seqlens: torch.Tensor
    image_lengths: torch.Tensor
    window_index: torch.Tensor

    def shard(self, pixel_values: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of the full `pixel_values` [P, 1176] that rank `rank` gets: [S_r, 1176]."""
        return pixel_values[self.patch_index[rank].to(pixel_values.device)]


def check_sp_degree(num_heads: int, sp: int) -> None:
    """Ulysses splits heads over the SP ranks: raise ValueError unless sp divides num_heads."""
    if sp < 1 or num_heads % sp:
        ok = ", ".join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)
        raise ValueError(f"sequence-parallel degree {sp} must divide the {num_heads} vision heads; use one of {ok}")


def plan_shards(grid_thw: torch.Tensor, sp: int, config) -> ShardPlan:
    """Cut the batch's window-ordered patch sequence into sp contiguous shards at window boundaries.

    `config` is a `Qwen2_5_VLConfig` or its `vision_config`. Cheap: integer work on grid_thw only.
    """
    vc = getattr(config, "vision_config", config)
    windowed = family_of(vc).windowed(vc)
    check_sp_degree(vc.num_heads, sp)
    grid_thw = grid_thw.detach().to("cpu", torch.long).reshape(-1, 3)
    unit = vc.spatial_merge_size**2
    num_patches = int(grid_thw.prod(-1).sum())
    window_index, cu_windows = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
    cu_seqlens = cu_windows
    if num_patches and windowed:
        merge, window, patch = vc.spatial_merge_size, vc.window_size, vc.patch_size
        window_index, cu_windows = get_vision_window_index(grid_thw, merge, window, patch)
        cu_seqlens = get_vision_cu_seqlens(grid_thw).to(torch.int32)
    elif num_patches:  # no windows (every block attends over whole images): raster order, cut at any merge unit
        window_index = torch.arange(num_patches // unit)
        cu_windows = torch.arange(0, num_patches + 1, unit, dtype=torch.int32)
        cu_seqlens = get_vision_cu_seqlens(grid_thw).to(torch.int32)
    order = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)  # patches in window order
    edges = cu_windows.long()
    bounds = [0]
    for r in range(1, sp):  # nearest window boundary to the ideal cut, never before the previous cut
        target = r * num_patches / sp
        best = int(edges[(edges.double() - target).abs().argmin()])
        bounds.append(max(best, bounds[-1]))
    bounds.append(num_patches)
    image_edges = torch.cat([torch.zeros(1, dtype=torch.long), grid_thw.prod(-1).cumsum(0)])
    lo, hi = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:])
    image_lengths = (torch.minimum(image_edges[1:, None], hi) - torch.maximum(image_edges[:-1, None], lo)).clamp(min=0)
    local_windows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        inner = edges[(edges > a) & (edges < b)]
        cut = torch.cat([torch.tensor([a]), inner, torch.tensor([b] if b > a else [])]) - a
        local_windows.append(cut.to(torch.int32))
    return ShardPlan(
        sp=sp,
        num_patches=num_patches,
        merge_unit=unit,
        bounds=tuple(bounds),
        lengths=tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])),
        patch_index=tuple(order[a:b] for a, b in zip(bounds[:-1], bounds[1:])),
        cu_window_seqlens=tuple(local_windows),
        cu_seqlens=cu_seqlens,
        image_lengths=image_lengths,
        window_index=window_index,
    )
