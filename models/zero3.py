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
units on a placeholder), which is the one thing this layout asks of the schedule (invariant 2).

Checkpoints: `zero3_slice` is the dim-0 index of rank r's rows, so a rank reads only its rows
(`safe_open(...).get_slice`); `gather_zero3_state_dict` concatenates every rank's local rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def apply_zero3(model: nn.Module, units: Iterable[nn.Module], world_size: int, device: torch.device) -> None:
    """Shard `model` (identical on every rank of the default group) ZeRO-3 style, in place.

    Build the optimizer afterwards: its parameters are then DTensors holding this rank's rows.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
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
