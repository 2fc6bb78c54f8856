"""The README is a contract (its commands are the ones CI runs); the configuration page is generated."""

from __future__ import annotations

import re
from pathlib import Path

from dhp.scripts import config_reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_configuration_page_is_generated_and_current():
    """docs/configuration.md is what stages/config.py's comments say, and every key has one."""
    assert config_reference.undocumented() == [], "config fields without a comment on their declaration"
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == config_reference.render(), "stale: run python -m dhp.scripts.config_reference"
    for key in ("training.steps", "vision.parallelism", "text.lora.rank", "data.storage.endpoint_url"):
        assert f"| `{key}` |" in page


def test_ci_runs_the_readme_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    setup = next(b.strip() for b in blocks if "pip install" in b and "-e" in b)
    test = next(b.strip() for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci and test in ci
    assert "torch==2.13.0" in setup  # torch constrained in the setup command itself
