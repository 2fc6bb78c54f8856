"""Errors and message helpers every layer shares (config, data, models, stages), so none imports another for them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def one_line(error: BaseException) -> str:
    """An error's message on one line (for one-line CLI errors and skip details)."""
    return " ".join(str(error).split())
