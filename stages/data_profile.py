"""`dhp data profile` for a config: its training files and the preprocessing a run of it would use
(dataflow/length_profile.py measures the mix)."""

from __future__ import annotations

from typing import Any

from dhp.dataflow.length_profile import profile
from dhp.dataflow.preprocess import Preprocessor
from dhp.stages.config import Config
from dhp.stages.driver import resolve_data
from dhp.stages.trainer import model_config_of, preprocess_settings


def data_profile(cfg: Config, limit: int = 2000) -> dict[str, Any]:
    """The length mix of `cfg.data.train` (the synthetic set when it is empty), from at most `limit` records."""
    train, _, image_root = resolve_data(cfg)
    pre = Preprocessor(preprocess_settings(cfg, image_root, train), model_config_of(cfg))
    return profile(cfg, pre, train, limit)
