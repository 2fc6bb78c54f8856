"""The vision encoder's segment attention with one attention call per distinct segment length.

Why: transformers' `Qwen2_5_VLVisionAttention`, unless flash-attn is installed, splits q/k/v at
`cu_seqlens` and calls the attention function once per segment, after a device-to-host sync
(`lengths.tolist()`) in every block. A 1 792 px image (16 384 patches) has 256 windows of 64 patches in
each of the 28 windowed blocks: ~7 000 attention calls of a few tiny kernels per forward, again in the
recomputation and the backward. The windows of one image have at most four lengths (inner, right edge,
bottom edge, corner) and equal-length segments are independent attention problems of the same shape, so
they stack along the batch dimension: one SDPA call per length, ~4 per block instead of hundreds.

`segment_attention(attn, q, k, v, cu_seqlens)`: q/k/v [S, h, hd] (S rows of the packed sequence, h heads
of hd) -> [S, h, hd]; row i attends exactly to the rows of its own segment [cu[j], cu[j+1]), as transformers
computes it (bidirectional, `attn.scaling`, the config's attention function: sdpa or eager; flash-attn's
varlen kernel takes the segments itself, and so does torch's own where the function is sdpa on a GPU in
bf16/fp16: `models/torch_varlen.py`, one call per block). Segments of length L, n of them -> q[rows].view(n, L, h, hd),
then back to sequence order with one gather (none when every segment has the same length).
The rows are worked out once per `cu_seqlens` tensor (cached by identity: a forward passes the same two
tensors, windows and whole images, to all 32 blocks and to their recomputation), so the sync happens
twice per forward, not per block.

`group_segment_attention(visual)` applies it from outside to a transformers ViT: each block's attention
becomes `GroupedVisionAttention` (Qwen2.5-VL) or `GroupedQwen3VisionAttention` (Qwen3-VL, whose blocks all attend
per image or video frame pair, with the same per-segment loop in transformers), a subclass whose only change is
that step; parameters, hooks and names unchanged. dhp's sequence-parallel forward calls `segment_attention`
directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLVisionAttention,
    apply_rotary_pos_emb_vision,
    eager_attention_forward,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention
from transformers.utils.generic import is_flash_attention_requested

from dhp.models import torch_varlen


@dataclass
class SegmentGroups:
    """Segments of a packed sequence grouped by length. groups: (L, n, rows) per distinct length L > 0, rows
    the n*L sequence rows of its segments in order (a slice when they are one contiguous range); inverse: the
    position in the concatenated group outputs of each sequence row (None: they are already in order)."""

    total: int
    groups: list[tuple[int, int, slice | torch.Tensor]]
    inverse: torch.Tensor | None
    _on: dict[torch.device, tuple] = field(default_factory=dict)

    @property
    def longest(self) -> int:
        """The longest segment's length (0 when there is none)."""
        return max((length for length, _, _ in self.groups), default=0)

    def on(self, device: torch.device) -> tuple[list[tuple[int, int, slice | torch.Tensor]], torch.Tensor | None]:
        """The groups' index tensors on `device` (moved once per device)."""
        if device not in self._on:
            move = lambda t: t if isinstance(t, slice) or t is None else t.to(device)  # noqa: E731
            self._on[device] = ([(n, c, move(r)) for n, c, r in self.groups], move(self.inverse))
        return self._on[device]


def group_segments(cu_seqlens: torch.Tensor) -> SegmentGroups:
    """Group the segments [cu[j], cu[j+1]) by length (empty ones dropped; rows outside [cu[0], cu[-1]) are
    not attended and must not exist: cu[0] == 0 and cu[-1] == S)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    starts: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            starts.setdefault(b - a, []).append(a)
    total = bounds[-1] if bounds else 0
    if len(starts) == 1:
        ((length, firsts),) = starts.items()
        if firsts == list(range(0, total, length)):  # one length, back to back: a view, no gather
            return SegmentGroups(total, [(length, len(firsts), slice(0, total))], None)
    groups, order = [], []
    for length, firsts in starts.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(length)).reshape(-1)
        groups.append((length, len(firsts), rows))
        order.append(rows)
    inverse = torch.argsort(torch.cat(order)) if order else None
    return SegmentGroups(total, groups, inverse)


_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # cu_seqlens tensor -> (its _version, SegmentGroups)


@torch.compiler.disable  # host work on a tensor's values: a compiled block (models/compilation.py) runs it as Python
def segment_groups(cu_seqlens: torch.Tensor) -> SegmentGroups:
    """`group_segments`, cached per tensor object (recomputed if it was modified in place)."""
    version = -1 if cu_seqlens.is_inference() else cu_seqlens._version  # inference tensors keep no counter
    hit = _GROUPS.get(cu_seqlens)
    if hit is None or hit[0] != version:
        hit = (version, group_segments(cu_seqlens))
        _GROUPS[cu_seqlens] = hit
    return hit[1]


def segment_attention(
    attn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Bidirectional attention inside each segment of cu_seqlens: q/k/v [S, h, hd] -> [S, h, hd]. `attn`: a
    `Qwen2_5_VLVisionAttention` (its config picks the attention function; its scaling and dropout apply).
    `max_seqlen`: the longest segment, if the caller knows it (the varlen kernels need it; else it is read from
    cu_seqlens once per tensor, through the cached grouping)."""
    s, heads, hd = q.shape
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    dropout = attn.attention_dropout if attn.training else 0.0
    common = dict(attention_mask=None, scaling=attn.scaling, dropout=dropout, is_causal=False, **kwargs)
    flash_attn = is_flash_attention_requested(attn.config)
    sdpa_varlen = not dropout and attn.config._attn_implementation == "sdpa" and _torch_varlen_usable(q)
    if s and (flash_attn or sdpa_varlen):
        # a varlen kernel takes the segments as they are (flash-attn's, or torch's: models/torch_varlen.py); the
        # longest segment from the cached grouping: read on the host once per cu_seqlens, not once per block
        cu = cu_seqlens.to(q.device, torch.int32)
        longest = int(max_seqlen) if max_seqlen is not None else _longest(cu_seqlens)
        if not flash_attn:
            return torch_varlen.attend(q, k, v, cu, longest, causal=False, scale=attn.scaling)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, S, hd]
        out = interface(
            attn, q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, **common
        )[0]
        return out.reshape(s, heads, hd)
    return _attend_by_length(interface, attn, q, k, v, cu_seqlens, common)


@torch.compiler.disable  # one call per segment length, chosen on the host: run as Python inside a compiled block
def _longest(cu_seqlens: torch.Tensor) -> int:
    return segment_groups(cu_seqlens).longest


@torch.compiler.disable  # likewise
def _attend_by_length(interface, attn, q, k, v, cu_seqlens: torch.Tensor, common: dict) -> torch.Tensor:
    """`segment_attention` without a varlen kernel: the segments of each length stacked along the batch."""
    s, heads, hd = q.shape
    plan = segment_groups(cu_seqlens)
    if plan.total != s:
        raise ValueError(f"cu_seqlens covers {plan.total} rows but q has {s}")
    groups, inverse = plan.on(q.device)
    if not groups:  # an empty shard: keep the (empty) result attached to the graph, so every weight gets a grad
        return v.reshape(s, heads, hd)
    outs = []
    for length, count, rows in groups:
        a, b, c = (t[rows].view(count, length, heads, hd).transpose(1, 2) for t in (q, k, v))  # [n, h, L, hd]
        outs.append(interface(attn, a, b, c, **common)[0].reshape(count * length, heads, hd))  # from [n, L, h, hd]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if inverse is None else out[inverse]


def _torch_varlen_usable(q: torch.Tensor) -> bool:
    return torch_varlen.kernel() is not None and torch_varlen.usable(q)


class _GroupedForward:
    """The forward of transformers' vision attention (Qwen2.5-VL's and Qwen3-VL's are the same: qkv, the vision
    rotary embedding, attention inside each segment of `cu_seqlens`, proj) with `segment_attention` as its attention
    step, so hooks and a changed `num_heads` (vision TP) apply as before. Input [S, D], output [S, D]."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        s = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(s, 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        out = segment_attention(self, q, k, v, cu_seqlens, max_seqlen, **kwargs)
        return self.proj(out.reshape(s, -1).contiguous())


class GroupedVisionAttention(_GroupedForward, Qwen2_5_VLVisionAttention):
    """transformers' Qwen2.5-VL vision attention, one attention call per segment length (parameters, names and
    everything but the attention step unchanged)."""


class GroupedQwen3VisionAttention(_GroupedForward, Qwen3VLVisionAttention):
    """transformers' Qwen3-VL vision attention, likewise: its blocks attend over whole images and each temporal
    patch of a video, so several images or frames of one size are one call."""


# transformers' vision attention class -> dhp's grouped subclass of it
GROUPED = {Qwen2_5_VLVisionAttention: GroupedVisionAttention, Qwen3VLVisionAttention: GroupedQwen3VisionAttention}


def group_segment_attention(visual: torch.nn.Module) -> None:
    """Give every block of a transformers ViT (Qwen2.5-VL's or Qwen3-VL's) its grouped attention (in place; same
    parameters)."""
    for block in visual.blocks:
        grouped = GROUPED.get(type(block.attn))
        if grouped is not None:
            block.attn.__class__ = grouped
