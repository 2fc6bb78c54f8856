"""LoRA on the language model's Linear layers (peft's formulation), added from outside and split like its base
layer under tensor parallelism.

    y = base(x) + (alpha / r) * B(A(dropout(x)))    A: [r, in] kaiming-uniform (nn.Linear's, peft's); B: [out, r] zeros

Each target Linear gets `lora_A` / `lora_B` children (names `...q_proj.lora_A.weight`, peft's without its adapter
name) and a forward hook that adds the update. The hook is put in front of the module's other hooks, so under
tensor parallelism a row-parallel layer's update joins its partial sum before the all-reduce.

Under TP a factor is split where its base is (`tensor_parallel.tp_slice` answers for the factors too, so
checkpoints, resharding and export read them like any weight): a column-parallel base (q/k/v, gate/up: output
rows split) keeps its rows of B and a whole A; a row-parallel base (o, down: input columns split) keeps its
columns of A and a whole B. A factor that several ranks hold whole gets only a partial gradient on each (the
other factor's part differs from rank to rank), so `tensor_parallel.sum_partial_grads` sums it over those
holders before the step: A of a column-parallel layer over the whole TP group, B of a row-parallel one
likewise, B of a replicated KV head over the ranks sharing that head. Each gradient element is counted once in
the grad norm (`_dhp_sharded` on the lowest holder).

Dropout under TP draws the one-process mask. The global RNG is in the same state on every rank of every layout
when training starts (the stage build seeds it and draws the same amount whatever the layout; the factors are
made with `skip_init`, so their construction draws nothing; a resume restores it), and every rank draws as one
process would: a column-parallel layer's replicated input the same mask on every rank, a row-parallel layer's
split input (`ColumnsDropout`) the mask of the whole width, keeping its own columns. Activation checkpointing
restores the global RNG before recomputing. `tests/test_lora.py` holds TP 2's gradients to one rank's.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dhp.errors import ConfigError
from dhp.models.parallel.layout import Layout, PoolRanks


def _add_update(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    return output + module.lora_B(module.lora_A(module.lora_dropout(x))) * module.lora_scaling


class _KeptMask(torch.autograd.Function):
    """x * mask / (1 - p), keeping for backward only the bool mask (1 byte per element, as CUDA's fused dropout),
    not the scaled mask in x's dtype that `x * factor` would keep. The same arithmetic as `F.dropout`'s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.p = p
        return x * mask.to(x.dtype).div_(1 - p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype).div_(1 - ctx.p), None, None


class ColumnsDropout(nn.Module):
    """Dropout of this rank's columns `cols` of an input whose last dimension (`width` in one process) is split
    over the TP ranks: the mask is the whole width's, drawn by `F.dropout` itself on a tensor of ones of the one
    process's shape, dtype and device (so the same RNG draws on any device: bernoulli_ on CPU, the fused
    `native_dropout` on CUDA), and sliced, so the ranks' masks are its parts."""

    def __init__(self, p: float, width: int, cols: slice):
        super().__init__()
        self.p, self.width, self.cols = p, width, cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        ones = torch.ones(*x.shape[:-1], self.width, dtype=x.dtype, device=x.device)
        # this rank's columns as a new bool tensor: a view would keep the whole width alive
        return _KeptMask.apply(x, F.dropout(ones, self.p, training=True)[..., self.cols] != 0, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, width={self.width}, cols={self.cols}"


def _dropout(p: float, a_slice: Any, width: int) -> nn.Module:
    """The dropout in front of A: A's columns are the input's, so a split A (row-parallel base) means a split input."""
    if not p:
        return nn.Identity()
    cols = a_slice[1] if isinstance(a_slice, tuple) and len(a_slice) > 1 else slice(None)
    if cols == slice(None):
        return nn.Dropout(p)
    return ColumnsDropout(p, width, cols)


def lora_targets(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """(module name, Linear) of the decoder's Linears whose last name part is one of `targets`."""
    found = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith("language_model.layers.") and n.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise ValueError(f"text.lora.targets {targets} match no Linear of the language model's layers")
    return found


def target_names(spec: Any) -> list[str]:
    return [t.strip() for t in spec.targets.split(",") if t.strip()]


def factor_shapes(full_shapes: dict[str, Any], spec: Any, layers: list[str] | None = None) -> dict[str, torch.Size]:
    """Full shapes of the factors of `layers` (module names; None: every decoder Linear `spec.targets` names,
    found in `full_shapes` alone, as the memory plan needs on the meta device): A [r, in], B [out, r]."""
    if layers is None:
        targets = target_names(spec)
        layers = [
            n[: -len(".weight")]
            for n, shape in full_shapes.items()
            if n.startswith("language_model.layers.")
            and n.endswith(".weight")
            and len(shape) == 2
            and n.split(".")[-2] in targets
        ]
        if not layers:  # what `lora_targets` raises in the worker, said before anything starts
            raise ConfigError(f"text.lora.targets {targets} match no Linear of the language model's layers")
    out = {}
    for name in layers:
        out_f, in_f = full_shapes[f"{name}.weight"]
        out[f"{name}.lora_A.weight"] = torch.Size([spec.rank, in_f])
        out[f"{name}.lora_B.weight"] = torch.Size([out_f, spec.rank])
    return out


def add_lora(
    model: nn.Module, spec: Any, layout: Layout, ranks: PoolRanks, full_shapes: dict[str, torch.Size], seed: int
) -> None:
    """Give every target Linear of `model` (a laid-out TextModel) its LoRA factors, this rank's parts of them.

    `spec`: rank, alpha, dropout, targets (`text.lora`). The full factors' shapes are added to `full_shapes`.
    A is drawn whole from a generator seeded by `seed` and the layer's name (the same on every rank, in any
    layout), then sliced; B starts at zero.
    """
    found = lora_targets(model, target_names(spec))
    full_shapes.update(factor_shapes(full_shapes, spec, [name for name, _ in found]))
    replica_ranks = layout.state_ranks(ranks.replica)
    slicers = [layout.slicer(r, full_shapes) for r in replica_ranks]
    for name, linear in found:
        weight = linear.weight
        full_a = torch.empty(full_shapes[f"{name}.lora_A.weight"])
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=g)
        for factor, full in (("lora_A", full_a), ("lora_B", torch.zeros(full_shapes[f"{name}.lora_B.weight"]))):
            key = f"{name}.{factor}.weight"
            parts = [repr(s(key) if s else None) for s in slicers]
            mine = slicers[ranks.model_rank](key) if slicers[ranks.model_rank] else None
            local = full if mine is None else full[mine]
            # skip_init: nn.Linear's own init would draw from the global RNG, by an amount that depends on the layout
            sub = nn.utils.skip_init(
                nn.Linear, local.shape[1], local.shape[0], bias=False, device=weight.device, dtype=weight.dtype
            )
            with torch.no_grad():
                sub.weight.copy_(local)
            setattr(linear, factor, sub)
            holders = [j for j, p in enumerate(parts) if p == parts[ranks.model_rank]]
            sub.weight._dhp_sharded = ranks.model_rank == holders[0]
            if len(holders) > 1:
                distinct = list(dict.fromkeys(parts))
                sub.weight._dhp_partial = (distinct.index(parts[ranks.model_rank]), len(distinct), ranks.model_group)
        mine_a = slicers[ranks.model_rank](f"{name}.lora_A.weight") if slicers[ranks.model_rank] else None
        linear.lora_dropout = _dropout(spec.dropout, mine_a, full_shapes[f"{name}.lora_A.weight"][1])
        linear.lora_scaling = spec.alpha / spec.rank
        linear.register_forward_hook(_add_update, prepend=True)


def is_lora_factor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
