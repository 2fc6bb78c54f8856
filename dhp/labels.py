"""The label convention the data writes and the loss reads: -100 marks a position that carries no loss.

A module of its own, importing only torch, so that what packs batches (dataflow/packing.py, in every data
stream's process) need not import the model code and transformers' modeling modules with it.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the causal shift: the denominator of the mean loss."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())
