"""Samples of one global batch -> token-budget micro-batches, split into what each stage may see.

A micro-batch is right-padded to its longest sample, so its cost is `batch x padded length`; samples
are sorted by length before greedy packing so that similar lengths share a micro-batch and little of
the budget goes to padding. The split is the boundary contract with the stages: the vision pool gets
only pixels and grid sizes, the text pool only token ids, labels, mask and positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhp.models.qwen2_5_vl import IGNORE_INDEX, count_label_tokens


@dataclass
class MicroBatchMeta:
    """Scalars the driver schedules with; the tensors themselves never pass through it."""

    samples: int
    tokens: int  # real (unpadded) tokens
    padded_tokens: int  # batch x padded length
    label_tokens: int  # tokens carrying loss after the causal shift
    images: int
    patches: int


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that len(group) x max(length in group) <= budget (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"sample of {lengths[i]} tokens exceeds the micro-batch budget {budget}")
        # Longest-first order: a group's padded length is its first member's length.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
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


def meta_of(vision: dict[str, torch.Tensor], text: dict[str, torch.Tensor]) -> MicroBatchMeta:
    return MicroBatchMeta(
        samples=text["input_ids"].shape[0],
        tokens=int(text["attention_mask"].sum()),
        padded_tokens=text["input_ids"].numel(),
        label_tokens=count_label_tokens(text["labels"]),
        images=vision["image_grid_thw"].shape[0],
        patches=vision["pixel_values"].shape[0],
    )
