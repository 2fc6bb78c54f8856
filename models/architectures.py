"""Named model shapes, so a config can say `model.name: qwen2_5_vl_7b` without a checkpoint.

Each family owns its shapes (models/family/): Qwen2.5-VL's `tiny` and released sizes, Qwen3-VL's
`qwen3_vl_tiny`. The name picks the family too.
"""

from __future__ import annotations

from typing import Any

from dhp.models.family import FAMILIES, family_of_shape

ARCHITECTURES: dict[str, dict[str, Any]] = {name: arch for f in FAMILIES for name, arch in f.shapes.items()}


def architecture_config(name: str, attn_implementation: str = "sdpa") -> Any:
    """The config of a named shape (see ARCHITECTURES), in its family's config class."""
    return family_of_shape(name).shape_config(name, attn_implementation)
