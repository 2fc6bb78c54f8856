"""Activation checkpointing: which of a stage's transformer blocks drop their activations and recompute them.

Applied from outside, to transformers' own blocks (`Qwen2_5_VLVisionBlock`, `Qwen2_5_VLDecoderLayer`, both
`GradientCheckpointingLayer`s): a chosen block gets `gradient_checkpointing = True` and torch's non-reentrant
`checkpoint` as its function, exactly what `model.gradient_checkpointing_enable()` sets, but per block so
`every_n` can pick. transformers checkpoints the block's `forward`, so module hooks on the block itself
(FSDP2's all-gathers) stay outside the checkpoint; hooks inside it (tensor parallelism's all-reduces on
projections) run again in the recomputation. Where a layout runs the blocks itself (sequence parallelism's
Ulysses loop), it asks `maybe_checkpoint` for each block.

Collectives inside a recomputed block (TP all-reduces, Ulysses all-to-alls) run again during backward.
Every rank of a group checkpoints the same blocks (the setting is per pool) and backward visits them in the
same reverse order on every rank, so the recomputed collectives match (docs/design.md, invariant 2), a rank holding no
patches included: it recomputes its empty block and joins.

| `activation_checkpointing` | blocks recomputed | saved per block |
|---|---|---|
| `none` | none | every intermediate |
| `full` | all | the block's input only |
| `every_n` | blocks 0, N, 2N, ... (`activation_checkpointing_every: N`) | mixed |
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "every_n")


@dataclass(frozen=True)
class ActivationCheckpointing:
    mode: str = "none"
    every: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation_checkpointing={self.mode!r}: choose one of {', '.join(MODES)}")
        if self.every < 1:
            raise ValueError(f"activation_checkpointing_every={self.every} must be >= 1")

    @classmethod
    def of(cls, stage: Any) -> ActivationCheckpointing:
        """The setting of a stage's config (`vision` / `text`: `activation_checkpointing`, `..._every`)."""
        return cls(stage.activation_checkpointing, stage.activation_checkpointing_every)

    @property
    def recomputes(self) -> bool:
        """Whether any block recomputes."""
        return self.mode != "none"

    @property
    def recomputes_all(self) -> bool:
        """Whether every block recomputes (`full`, or `every_n` with N = 1): the least activation memory."""
        return self.mode == "full" or (self.mode == "every_n" and self.every == 1)

    def chosen(self, num_blocks: int) -> list[int]:
        """Indices of the blocks that recompute."""
        if self.mode == "none":
            return []
        step = 1 if self.mode == "full" else self.every
        return list(range(0, num_blocks, step))

    def apply(self, blocks: Sequence[nn.Module]) -> int:
        """Turn checkpointing on for the chosen blocks (off for the others); returns how many recompute."""
        chosen = set(self.chosen(len(blocks)))
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i in chosen
            block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        return len(chosen)


def maybe_checkpoint(block: nn.Module, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`fn(*args)`, recomputed in backward if `block` was chosen (for layouts that run a block's parts)."""
    if getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
