"""How a rank builds its part of a stage: meta build, precision, layout, allocation, fill — one function, so the
workers (stages/stage_worker.py) and the memory benchmark (scripts/measure_build.py) run the same code.

Peak host memory is this rank's tensors plus one full tensor: the model is built on `meta` (recording the
seeded init, models/weights/materialize.py), given its precision's dtype, laid out (TP slicing, ZeRO-3 rows) while
still on meta, allocated (`layout.materialize`: only what the rank holds), then filled either from its
checkpoint slices (`model.path`: one tensor read and copied at a time, straight into its parameter) or
from its part of the seeded init (`model.random_init`: replayed one full tensor at a time, or drawn per part).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dhp.models.parallel.layout import Layout, PoolRanks
from dhp.models.precision import Precision
from dhp.models.weights.hf_checkpoint import into_model, load_stage_weights
from dhp.models.weights.materialize import build_on_meta
from dhp.models.weights.random_init import Exact, RandomInit


def build_stage(
    build_model: Callable[[], nn.Module],
    layout: Layout,
    ranks: PoolRanks,
    precision: Precision,
    seed: int,
    path: str | Path | None = None,
    freeze: Callable[[nn.Module], None] | None = None,
    init: RandomInit | None = None,
) -> tuple[nn.Module, dict[str, torch.Size]]:
    """-> (this rank's model on `ranks.device`, in train mode; the full (unsharded) shape of every tensor).

    `build_model()` constructs the full stage (it runs on meta: nothing allocated); `seed` seeds it, as the
    single-process build `torch.manual_seed(seed); build_model()` would be. From a checkpoint the model loads
    the names under its `checkpoint_prefixes` (the other stage's are not its business). `freeze(model)` sets
    `requires_grad` (models/fine_tuning.py) before the layout wraps the parameters, which keep it. Without a
    checkpoint, `init` fills the rank's tensors (models/weights/random_init.py; default: the exact single-process init).
    """
    torch.manual_seed(seed)
    model, recipe = build_on_meta(build_model)
    full_shapes = {n: t.shape for n, t in model.state_dict().items()}
    precision.cast(model)  # values below (loaded, or replayed in fp32) are copied in this dtype
    if freeze is not None:
        freeze(model)
    layout.apply(model, ranks)  # on meta: shapes only
    layout.materialize(model, ranks.device)  # this rank's tensors, uninitialised
    slicer = layout.slicer(ranks.rank, full_shapes)
    if path:
        load_stage_weights(
            model,
            model.hf_name,
            path,
            model.checkpoint_prefixes,
            slicer=slicer,
            full_shapes=full_shapes,
            assign=layout.assign_loaded,
        )
    else:  # each part copied in as made
        (init or Exact()).fill(recipe, slicer, into_model(model, layout.assign_loaded), seed, ranks.device)
    return model.to(ranks.device).train(), full_shapes
