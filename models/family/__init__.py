"""Model families (models/family/base.py says what one answers) and the named shapes of all of them.

`model.name` picks a named shape, and with it its family; `model.path` a checkpoint, whose config.json's type
picks the family (`family_of`). Nothing else in dhp maps a model to its modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dhp.errors import ConfigError, one_line
from dhp.models.family.base import ModelFamily
from dhp.models.family.qwen2_5_vl import QWEN2_5_VL
from dhp.models.family.qwen3_vl import QWEN3_VL

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_5_VL, QWEN3_VL)


def shape_names() -> list[str]:
    return sorted(name for f in FAMILIES for name in f.shapes)


def family_of_shape(name: str) -> ModelFamily:
    for family in FAMILIES:
        if name in family.shapes:
            return family
    raise ValueError(f"unknown model.name {name!r}; known: {', '.join(shape_names())}")


def family_of(model_config: Any) -> ModelFamily:
    """The family of a model config (its transformers class)."""
    for family in FAMILIES:
        if family.owns(model_config):
            return family
    known = ", ".join(f.config_class.__name__ for f in FAMILIES)
    raise ValueError(f"no dhp model family for a {type(model_config).__name__}; dhp trains {known}")


def load_config(path: str | Path, attn_implementation: str | None = None) -> Any:
    """The model config of a checkpoint directory (its config.json), in its family's config class; a
    `ConfigError` naming `model.path` when there is none, or when its model is not one dhp trains."""
    from transformers import AutoConfig

    where = Path(path)
    if not (where / "config.json").is_file():
        why = "has no config.json" if where.is_dir() else "is not a directory"
        raise ConfigError(
            f"model.path={path} {why}: it must be a local Hugging Face checkpoint directory (config.json and "
            "*.safetensors)"
        )
    try:
        config = AutoConfig.from_pretrained(where)
        family_of(config)
    except Exception as e:  # noqa: BLE001 (a config.json transformers cannot read or validate, a model dhp does not train)
        raise ConfigError(f"model.path={path}: {one_line(e)}") from None
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
        for sub in (config.vision_config, config.text_config):
            sub._attn_implementation = attn_implementation
    return config
