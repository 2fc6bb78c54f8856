"""From per-rank local tensors back to the full model, for any stage layout.

`local_states` are the `StageWorker.local_state()` dicts (module names) of the ranks that together hold
one copy of a stage, in rank order: one replica's model-parallel ranks for `tensor` / `sequence` /
`none` (sequence-parallel and unsharded ranks hold full replicas: rank 0's is taken), every rank of the
pool for `zero3`. Used by the workers when they export and by `dhp export-hf` on saved shards.
"""

from __future__ import annotations

from typing import Any

import torch


def gather_stage_state(
    stage: str, parallelism: str, local_states: list[dict[str, torch.Tensor]], model_config: Any
) -> dict[str, torch.Tensor]:
    if parallelism == "zero3":
        from dhp.models.zero3 import gather_zero3_state_dict

        return gather_zero3_state_dict(local_states)
    if parallelism == "tensor" and stage == "text":
        from dhp.models.tensor_parallel import gather_full_state_dict

        return gather_full_state_dict(local_states, model_config)
    if parallelism == "tensor" and stage == "vision":
        from dhp.models.vision_tensor_parallel import gather_full_vision_state_dict

        return gather_full_vision_state_dict(local_states, model_config.vision_config)
    return local_states[0]


def state_ranks(parallelism: str, degree: int, num_actors: int) -> list[int]:
    """Pool ranks whose local states make one full copy (see the module docstring)."""
    return list(range(num_actors)) if parallelism == "zero3" else list(range(degree))
