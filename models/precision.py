"""What precision a stage keeps its model states in: one object per mode, asked by the workers and the plan.

| `model.precision` | parameters | gradients | AdamW moments | bytes / parameter | compute |
|---|---|---|---|---:|---|
| `fp32` (default) | fp32 (master) | fp32 | 2 x fp32 | 16 | fp32; bf16 autocast on GPU with `model.dtype: bfloat16` |
| `bf16` | bf16 | bf16 | 2 x bf16 | 8 | bf16 (the reference implementation's mode: no fp32 master) |

Optimizer moments are further divided by the ZeRO-1 group a layout shards them over
(`Layout.optimizer_fraction`). The dtype of every built tensor comes from here, never from a checkpoint's
`config.json` (`torch_dtype`): stages are built in fp32 (the seeded init is generated in fp32 either way,
so a bf16 run starts from the fp32 run's weights, rounded) and then cast to `param_dtype`.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
from torch import nn


class Precision:
    name: ClassVar[str] = ""
    param_dtype: ClassVar[torch.dtype] = torch.float32
    param_bytes: ClassVar[int] = 4
    grad_bytes: ClassVar[int] = 4
    optimizer_bytes: ClassVar[int] = 8  # AdamW: exp_avg + exp_avg_sq

    @property
    def bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def cast(self, model: nn.Module) -> None:
        """Give the stage's parameters (still on `meta`: nothing allocated) their dtype; buffers keep theirs."""
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != self.param_dtype:
                    p.data = p.data.to(self.param_dtype)

    def autocast(self, device: torch.device, compute_dtype: str):
        return contextlib.nullcontext()

    def compute_dtype(self, model_dtype: str) -> str:
        """The dtype matrix work runs in (`model.dtype` names it under fp32 master weights)."""
        return "bfloat16"


class Fp32Master(Precision):
    name = "fp32"

    def autocast(self, device: torch.device, compute_dtype: str):
        if device.type == "cuda" and compute_dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def compute_dtype(self, model_dtype: str) -> str:
        return model_dtype


class PureBf16(Precision):
    name = "bf16"
    param_dtype = torch.bfloat16
    param_bytes, grad_bytes, optimizer_bytes = 2, 2, 4


PRECISIONS: dict[str, Precision] = {p.name: p for p in (Fp32Master(), PureBf16())}


def precision_of(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"model.precision={name!r}: choose one of {', '.join(PRECISIONS)}") from None
