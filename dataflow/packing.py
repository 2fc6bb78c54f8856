"""Samples of one global batch -> token-budget micro-batches, split into what each stage may see.

Two forms of a micro-batch's text (`data.packing`):
- padded: right-padded to its longest sample, so its cost is `batch x padded length`; samples are sorted
  by length before greedy grouping so that similar lengths share a micro-batch and little of the budget
  goes to padding;
- packed: its samples back to back in one sequence [1, T] (T = the sum of their lengths, no padding), with
  `cu_seqlens` [n + 1] saying where each starts. The decoder attends inside each sample only
  (models/packed_attention.py); each sample's mRoPE positions are its own (they restart at its first token);
  each sample's first label is -100, so the causal shift never asks a sample's last token to predict the
  next sample's first one (unpacked, that label is never a target either).

The split is the boundary contract with the stages: the vision pool gets only pixels and grid sizes, the text
pool only token ids, labels, mask (padded) or cu_seqlens (packed) and positions. Both forms put the visuals'
`<|image_pad|>` and `<|video_pad|>` tokens in sample order, the order of `vision_inputs`' images and videos (a video
is one grid of t > 1 temporal patches: dataflow/video.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.labels import IGNORE_INDEX, count_label_tokens


@dataclass
class MicroBatchMeta:
    """Scalars the driver schedules with; the tensors themselves never pass through it."""

    samples: int
    tokens: int  # real (unpadded) tokens
    padded_tokens: int  # batch x padded length (packed: the sequence's length, = tokens)
    label_tokens: int  # tokens carrying loss after the causal shift
    images: int
    patches: int


def pack(lengths: list[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Indices grouped so that each group's cost is <= budget, longest first. Padded, a group costs
    len(group) x max(length in group); `packed`, the sum of its lengths (first fit: a sample joins the first
    group it fits in)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    room: list[int] = []  # packed: tokens each group can still take
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"sample of {lengths[i]} tokens exceeds the micro-batch budget {budget}")
        if packed:
            fits = next((g for g, left in enumerate(room) if lengths[i] <= left), None)
            if fits is None:
                groups.append([])
                room.append(budget)
                fits = len(groups) - 1
            groups[fits].append(i)
            room[fits] -= lengths[i]
        # Longest-first order: a group's padded length is its first member's length.
        elif groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def vision_inputs(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """pixel_values [sum P, 1176] f32 and image_grid_thw [n_images, 3] i64, in sample order."""
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]).long(),
    }


def text_inputs(samples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / labels / attention_mask [B, L] and position_ids [3, B, L], right-padded.

    Padded positions get label -100 and mask 0; their position id (1) is never attended to.
    """
    length = max(s["input_ids"].shape[0] for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    positions = torch.ones((3, batch, length), dtype=torch.long)
    for b, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        input_ids[b, :n] = s["input_ids"]
        labels[b, :n] = s["labels"]
        mask[b, :n] = 1
        positions[:, b, :n] = s["position_ids"]
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": positions}


def packed_text_inputs(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """input_ids / labels [1, T], position_ids [3, 1, T] and cu_seqlens [n + 1] (int32): the samples back to
    back, each with its own positions, and its first label -100 (module docstring)."""
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    labels = torch.cat([s["labels"] for s in samples]).long()
    labels[cu_seqlens[:-1].long()] = IGNORE_INDEX
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).long()[None],
        "labels": labels[None],
        "position_ids": torch.cat([s["position_ids"] for s in samples], dim=1).long()[:, None],
        "cu_seqlens": cu_seqlens,
    }


def microbatch_inputs(
    samples: list[dict[str, torch.Tensor]], pad_id: int, packed: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(vision inputs, text inputs) of one micro-batch: the text padded, or `packed`."""
    text = packed_text_inputs(samples) if packed else text_inputs(samples, pad_id)
    return vision_inputs(samples), text


def meta_of(vision: dict[str, torch.Tensor], text: dict[str, torch.Tensor]) -> MicroBatchMeta:
    packed = "cu_seqlens" in text
    return MicroBatchMeta(
        samples=text["cu_seqlens"].shape[0] - 1 if packed else text["input_ids"].shape[0],
        tokens=text["input_ids"].numel() if packed else int(text["attention_mask"].sum()),
        padded_tokens=text["input_ids"].numel(),
        label_tokens=count_label_tokens(text["labels"]),
        images=vision["image_grid_thw"].shape[0],
        patches=vision["pixel_values"].shape[0],
    )
