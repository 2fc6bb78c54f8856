"""ZeRO-3 for either stage: parameters, gradients and AdamW state sharded over the whole pool (FSDP2).

`apply_zero3(model, units, group_size, device)` wraps each unit (a vision or decoder block, the merger)
and then the root with torch's `fully_shard`; the model code is untouched. Every rank of the pool is
its own data-parallel replica (it sees its own samples); what is sharded is the state: each parameter
is split along dim 0 in `torch.chunk` order (rank r holds rows [r*c, (r+1)*c), c = ceil(n / world),
possibly none), all-gathered per unit just before that unit runs and freed after it, and its gradient
reduce-scattered in the unit's backward.

Gradients are *summed* over ranks (not averaged, FSDP's default): the trainer scales every
micro-batch's loss by 1 / label tokens of the whole global batch, so the sum is the mean loss's gradient
however the batch was split. FSDP2 implements a divide factor of 1 with a pre-multiplied sum that gloo
lacks, hence `set_force_sum_reduction_for_comms`.

Collectives per unit: forward all-gather of its parameters (P_u / N bytes in, P_u out per rank);
backward all-gather again (resharded after forward, as ZeRO-3 does) and reduce-scatter of the gradients.
They run on *every* call of every unit, so the sequence of collectives depends only on how many
forwards/backwards each rank runs, not on its data: the trainer keeps replicas in lockstep (it pads a
replica with fewer micro-batches with empty ones, and a rank with no image still runs the vision
units on a placeholder), which is the one thing this layout asks of the schedule (docs/design.md, invariant 2).

Checkpoints: `zero3_slice` is the dim-0 index of rank r's rows, so a rank reads only its rows
(`safe_open(...).get_slice`); `gather_zero3_state_dict` concatenates every rank's local rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dhp.models.parallel.layout import NOT_SHARDED, SKIP_SYNC, Layout, PoolRanks, VitShape


def apply_zero3(model: nn.Module, units: Iterable[nn.Module], world_size: int, device: torch.device) -> None:
    """Shard `model` (identical on every rank of the default group) ZeRO-3 style, in place.

    Build the optimizer afterwards: its parameters are then DTensors holding this rank's rows.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    if not any(p.is_meta for p in model.parameters()):  # a meta model is materialised shard by shard afterwards
        model.to(device)
    for unit in [*units, model]:  # the root last: it takes whatever no unit claimed (embeddings, lm_head)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    for p in model.parameters():
        p._dhp_sharded = True  # every rank holds distinct rows: each counts its own in the grad norm


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded parameter / gradient (a DTensor), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def zero3_slice(rank: int, world_size: int, rows: int) -> tuple[slice, ...]:
    """Rank `rank`'s rows of a tensor with `rows` rows, as `torch.chunk` (and FSDP2) assign them."""
    chunk = math.ceil(rows / world_size)
    start = min(rows, rank * chunk)
    return (slice(start, min(rows, start + chunk)),)


def gather_zero3_state_dict(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local rows (rank order); 0-dim tensors are not sharded."""
    return {
        name: first.clone() if first.ndim == 0 else torch.cat([s[name] for s in shards])
        for name, first in shards[0].items()
    }


def assign_local_rows(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy each rank's checkpoint rows into its ZeRO-3 shard (a DTensor's local tensor)."""
    own = module.state_dict()
    with torch.no_grad():
        for name, rows in state.items():
            target = local_tensor(own[name])
            if target.shape != rows.shape:
                raise ValueError(f"{name}: this rank's rows are {tuple(rows.shape)}, its shard {tuple(target.shape)}")
            target.copy_(rows)


class Zero3(Layout):
    """`zero3` (either stage): one copy of the model spread over the whole pool, every rank a replica.

    Replicas run in lockstep (the per-unit all-gathers span all ranks): the trainer pads a replica that
    has fewer micro-batches, and a rank with no image still encodes a placeholder. FSDP2 reduce-scatters
    (sums) the gradients in the backward itself, so there is no separate gradient sync, and every rank
    holds distinct rows of every gradient, so every rank reports its own share of the norm.
    """

    name = "zero3"
    takes_lora = False  # parameters added after fully_shard would be outside FSDP: unsharded, never reduced
    label = "ZeRO-3"
    stages = ("vision", "text")
    lockstep = True
    spans_pool = True
    assign_loaded = staticmethod(assign_local_rows)

    @classmethod
    def check_degree(cls, stage: str, degree: int) -> str | None:
        if degree != 1:
            return (
                f"{stage}.degree={degree}: zero3 shards the model over the whole pool and every actor reads "
                f"its own samples; use {stage}.degree=1 ({stage}.num_actors is both the shard and the "
                f"data-parallel size)"
            )
        return None

    def apply(self, model: nn.Module, ranks: PoolRanks) -> None:
        apply_zero3(model, model.shard_units(), ranks.world_size, ranks.device)

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        from dhp.models.weights.materialize import materialize_sharded

        materialize_sharded(model, device)

    def slicer(self, rank: int, full_shapes: dict[str, torch.Size]):
        # 0-dim tensors are not sharded (gather_zero3_state_dict keeps the first rank's)
        return lambda name: zero3_slice(rank, self.num_actors, full_shapes[name][0]) if full_shapes[name] else None

    def grad_sync_group(self, ranks: PoolRanks) -> Any:
        return SKIP_SYNC

    def optimizer_shard_group(self, ranks: PoolRanks) -> Any:
        return NOT_SHARDED  # the moments are DTensors like their parameters: already sharded over the pool

    @property
    def optimizer_fraction(self) -> float:
        return 1.0  # of what `state_numel` counts, which is already this rank's rows

    def reports_grad_norm(self, ranks: PoolRanks, param: nn.Parameter) -> bool:
        return True

    def gather(self, local_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return gather_zero3_state_dict(local_states)

    def vit_grad_sync_bytes(self, s: VitShape, b: int) -> float:
        """Per unit and micro-batch: all-gather forward + all-gather backward + reduce-scatter, padded shards."""
        n = self.num_actors
        return 3 * (n - 1) * s.params(pad_to=n) / n * b
