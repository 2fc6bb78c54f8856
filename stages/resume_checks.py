"""Whether this run can continue a checkpoint: clear stops before any rank or data stream is touched.

A resumed run may use another layout (resharded on load, models/weights/reshard.py) and another number of data
streams (`positions.reshard`), but not another model, another frozen base, other frozen modules, an older
dhp's checkpoint format or other training files. Each refusal says what would work instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dhp.models.family import load_config
from dhp.models.weights.export import read_meta
from dhp.stages.config import ConfigError


def check_resumable(ckpt: Path, model_config: Any, base: dict[str, Any], partial: list[str]) -> dict[str, Any]:
    """Refuse a checkpoint this run cannot continue; returns its meta (`models/export.write_meta`).

    `base`: where this run's frozen rest comes from (`Trainer._base`); `partial`: the stages of which only a
    part trains (`Trainer._partial_stages`)."""
    problem = model_mismatch(ckpt, model_config)
    if problem:
        raise ConfigError(
            f"checkpoint {ckpt} is of another model ({problem}): it can only be resumed by a run "
            f"of the model that wrote it"
        )
    meta = read_meta(ckpt)
    saved_base = meta.get("base")
    if saved_base and not same_base(saved_base, base):
        raise ConfigError(
            f"checkpoint {ckpt} holds only the trained tensors of {', '.join(meta['partial'])}; the rest is its "
            f"base (model.path={saved_base['path']}, model.init_seed={saved_base['init_seed']}, model.random_init="
            f"{saved_base.get('random_init', 'exact')}), but this run's base is model.path={base['path']}, "
            f"model.init_seed={base['init_seed']}, model.random_init={base['random_init']}: resume with the "
            f"same base"
        )
    if set(meta.get("partial", [])) != set(partial):
        raise ConfigError(
            f"checkpoint {ckpt} was written with other frozen modules (partial stages "
            f"{meta.get('partial', [])}): resume with the same vision.train / text.train"
        )
    if not any(ckpt.glob("*-moments.safetensors")):
        raise ConfigError(
            f"checkpoint {ckpt} was written by an older dhp (its AdamW state is not stored by parameter name, "
            f"no *-moments.safetensors): export its weights (dhp export-hf --checkpoint {ckpt} --out DIR) and "
            f"start a new run from model.path=DIR"
        )
    return meta


def check_positions(ckpt: Path, states: list[dict[str, Any]], files: tuple[int, str]) -> None:
    """A clear stop for data positions this run cannot continue, before any stream is touched. `files`: the
    number of this run's training files and their `positions.files_key` (names, order, format)."""
    if any("files" not in s for s in states):
        raise ConfigError(
            f"checkpoint {ckpt} stores its data position in an older form (a record count, before positions by "
            f"file): export its weights (dhp export-hf --checkpoint {ckpt} --out DIR) and start a new run from "
            f"model.path=DIR"
        )
    if any(s["files"] != files[1] for s in states):
        raise ConfigError(
            f"checkpoint {ckpt}'s data streams read {states[0]['parts']} files, not the {files[0]} of this "
            f"run's data.train (file names, their order and format must be the same): resume with the same "
            f"data.train"
        )


def model_mismatch(ckpt: Path, model_config: Any) -> str | None:
    """Which shapes of the checkpoint's model (its config.json) differ from this run's; None if none.
    The layout may differ (resharded on load), the model may not."""
    saved = load_config(ckpt)
    if type(saved) is not type(model_config):
        return f"model family {type(saved).__name__} vs {type(model_config).__name__}"
    shape_keys = {  # what decides the shape of some tensor: another value is another model
        "vision_config": (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "out_hidden_size",
            "in_channels",
            "patch_size",
            "spatial_merge_size",
            "temporal_patch_size",
        ),
        "text_config": (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
        ),
    }
    values = [
        (f"{sub}.{key}", *(getattr(getattr(c, sub), key, None) for c in (saved, model_config)))
        for sub, keys in shape_keys.items()
        for key in keys
    ]
    return ", ".join(f"{key} {a} vs {b}" for key, a, b in values if a != b) or None


def same_base(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether this run builds the base a partial checkpoint was trained on (`Trainer._base` of each)."""
    if not saved["path"]:  # a seeded init (checkpoints from before model.random_init were exact)
        seeded = (saved["init_seed"], saved.get("random_init", "exact"))
        return not here["path"] and seeded == (here["init_seed"], here["random_init"])
    return bool(here["path"]) and Path(saved["path"]).resolve() == Path(here["path"]).resolve()
