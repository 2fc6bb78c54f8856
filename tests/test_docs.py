"""The README is a contract: its commands are the ones CI runs, and it documents every config key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dhp.stages.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out += _keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_config_key_is_in_the_reference():
    missing = [k for k in _keys(Config) if f"`{k}`" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_ci_runs_the_readme_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    setup = next(b.strip() for b in blocks if "pip install" in b and "-e" in b)
    test = next(b.strip() for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci and test in ci
    assert "torch==2.13.0" in setup  # torch constrained in the setup command itself
