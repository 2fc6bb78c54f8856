"""The one place that maps a layout name to its class (models/parallel/layout.py says what a layout answers).

| stage  | `parallelism` | class                   | file                            |
|--------|---------------|-------------------------|---------------------------------|
| both   | `none`        | `DataParallel`          | models/parallel/data_parallel.py         |
| vision | `sequence`    | `SequenceParallel`      | models/parallel/sequence_parallel.py     |
| vision | `tensor`      | `VisionTensorParallel`  | models/parallel/vision_tensor_parallel.py|
| text   | `tensor`      | `TensorParallel`        | models/parallel/tensor_parallel.py       |
| both   | `zero3`       | `Zero3`                 | models/parallel/zero3.py                 |
"""

from __future__ import annotations

from typing import Any

from dhp.models.parallel.data_parallel import DataParallel
from dhp.models.parallel.layout import Layout
from dhp.models.parallel.sequence_parallel import SequenceParallel
from dhp.models.parallel.tensor_parallel import TensorParallel
from dhp.models.parallel.vision_tensor_parallel import VisionTensorParallel
from dhp.models.parallel.zero3 import Zero3

_CLASSES: tuple[type[Layout], ...] = (DataParallel, SequenceParallel, VisionTensorParallel, TensorParallel, Zero3)
LAYOUTS: dict[tuple[str, str], type[Layout]] = {(stage, c.name): c for c in _CLASSES for stage in c.stages}


def available(stage: str) -> tuple[str, ...]:
    """Layout names a stage can use, in a stable order."""
    return tuple(name for (s, name) in LAYOUTS if s == stage)


def layout_class(stage: str, parallelism: str) -> type[Layout]:
    try:
        return LAYOUTS[(stage, parallelism)]
    except KeyError:
        raise ValueError(
            f"{stage}.parallelism={parallelism!r} is not available in this version; "
            f"available for {stage}: {', '.join(available(stage))}"
        ) from None


def make_layout(stage: str, parallelism: str, degree: int = 1, num_actors: int = 1, model_config: Any = None) -> Layout:
    """The layout object of one stage (`model_config` is needed by shape checks, slicers and gathers)."""
    return layout_class(stage, parallelism)(stage, degree, num_actors, model_config)


def stage_layout(cfg: Any, stage: str, model_config: Any = None) -> Layout:
    """The layout a run's config gives `stage` (`cfg.vision` / `cfg.text`: parallelism, degree, num_actors)."""
    s = getattr(cfg, stage)
    return make_layout(stage, s.parallelism, s.degree, s.num_actors, model_config)
