"""Checks of a run's two layouts before anything starts: degrees, shapes, fan-in/fan-out, transport, batch split.

Each layout class says what it needs (models/parallel/layout.py); this is the one function that asks them all,
so `dhp train`, `dhp plan` and the planner refuse the same configurations with the same message.
"""

from __future__ import annotations

from typing import Any

from dhp.errors import ConfigError


def replicas(cfg: Any, stage: str) -> int:
    """Data-parallel replicas of a pool: its actors / its degree (the text pool's = sample streams)."""
    s = getattr(cfg, stage)
    return s.num_actors // s.degree


def check_layout(cfg: Any, model_config=None) -> None:
    """Refuse, before anything starts, layouts that cannot run, saying what would.

    Each layout class says what it needs (`check_degree`; with the model's config, `check_shape`: vision
    heads divisible by the SP degree, text heads / KV heads / vocabulary splittable by the TP degree).
    The replica counts are free (fan-out and fan-in, routing.py) except where a lockstep text pool needs
    more vision forwards alive than `pipeline.max_in_flight` allows (`routing.check_fan`).
    """
    from dhp.models.fine_tuning import FineTuning
    from dhp.models.parallel.layouts import layout_class, stage_layout
    from dhp.models.parallel.routing import check_fan
    from dhp.models.weights.random_init import random_init

    ft = FineTuning(cfg)
    if ft.lora is not None and not layout_class("text", cfg.text.parallelism).takes_lora:
        raise ConfigError(
            f"text.train=lora is not available with text.parallelism={cfg.text.parallelism}: use none or tensor"
        )
    frozen = [f"{stage}.train={getattr(cfg, stage).train}" for stage in ("vision", "text") if ft.partial(stage)]
    if frozen and not cfg.model.path and not random_init(cfg.model.random_init).same_in_every_layout:
        raise ConfigError(
            f"model.random_init={cfg.model.random_init} cannot be the frozen base of "
            f"{', '.join(frozen)}: a checkpoint holds only what trains and the base is rebuilt at "
            f"resume, which this init does not do the same under another layout or device; use "
            f"model.random_init=exact or model.path"
        )
    for stage in ("vision", "text"):
        s = getattr(cfg, stage)
        try:
            why = layout_class(stage, s.parallelism).check_degree(stage, s.degree)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if why:
            raise ConfigError(why)
    dp_v, dp_t = replicas(cfg, "vision"), replicas(cfg, "text")
    if model_config is not None:
        from dhp.models.family import family_of

        for stage in ("vision", "text"):  # the model's family says which layouts it has
            why = family_of(model_config).check_layout(stage, getattr(cfg, stage).parallelism)
            if why:
                raise ConfigError(why)
        try:
            for stage in ("vision", "text"):
                stage_layout(cfg, stage, model_config).check_shape(model_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    lockstep = {stage: layout_class(stage, getattr(cfg, stage).parallelism).lockstep for stage in ("vision", "text")}
    why = check_fan(dp_v, dp_t, lockstep["vision"], lockstep["text"], cfg.pipeline.max_in_flight)
    if why:
        raise ConfigError(why)
    why = cfg.pipeline.transport.check(cfg)
    if why:
        raise ConfigError(why)
    if cfg.training.global_batch_size % dp_t:
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} is not divisible by the {dp_t} text "
            f"replicas (text.num_actors {cfg.text.num_actors} / text.degree {cfg.text.degree}), which each take "
            f"an equal share: e.g. training.global_batch_size={max(1, cfg.training.global_batch_size // dp_t) * dp_t}"
        )
