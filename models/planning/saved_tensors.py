"""Bytes autograd keeps for backward, counted by `saved_tensors_hooks`: what the memory plan calls activations.

Distinct storages only (a view saved twice, or by two ops, counts once), parameters as they are at that
moment excluded (FSDP2 swaps a unit's all-gathered parameters in while it runs; those are not activations).
Under non-reentrant activation checkpointing a checkpointed block's own saved tensors are taken by the
checkpoint's inner hooks and never reach these: what is counted is what stays alive until backward, the
block's inputs (saved by the checkpoint) included. Used by `dhp bench layouts` (scripts/layout_counts.py)
and by the stage workers' `measure_activations` (tests/test_plan_measured.py holds the plan to it).
"""

from __future__ import annotations

import torch
from torch import nn


class SavedBytes:
    """`with SavedBytes(model) as saved: out = model(x)`; afterwards `saved.total` is the kept bytes.

    Also usable from module hooks (`start()` in a forward pre-hook, `stop()` in the forward hook)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.total = 0
        self._seen: dict[int, int] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        params = {q.untyped_storage().data_ptr() for q in self.model.parameters() if not hasattr(q, "to_local")}
        storage = getattr(t, "elem", t).untyped_storage()  # the all-to-all's AsyncCollectiveTensor wraps one
        if storage.data_ptr() not in params:
            self._seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def start(self) -> None:
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def stop(self) -> int:
        assert self._hooks is not None, "stop() without start()"
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self.total = sum(self._seen.values())
        return self.total

    def __enter__(self) -> SavedBytes:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
