"""Errors and message helpers every layer shares (config, data, models, stages), so none imports another for them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class DataError(ValueError):
    """Data that cannot train (no usable sample in a stream's files), phrased for the person who chose them. Raised
    in a loader actor, it reaches the driver as Ray's wrapper, which is an instance of it too (`cause`: this)."""


def one_line(error: BaseException) -> str:
    """An error's message on one line (for one-line CLI errors and skip details)."""
    return " ".join(str(error).split())
