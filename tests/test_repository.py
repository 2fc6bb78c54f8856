"""The repository's shape: layers import downwards only, and the project speaks of itself only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ""}


def _runtime_imports(path: Path) -> list[str]:
    """Modules `path` imports when it runs: every import statement except those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    skipped = {id(n) for node in guarded for child in node.body for n in ast.walk(child)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_models_and_dataflow_import_nothing_from_stages():
    hits = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in ("models", "dataflow")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _runtime_imports(path)
        if name == "dhp.stages" or name.startswith("dhp.stages.")
    ]
    assert hits == []


def test_the_import_walk_sees_a_stages_import(tmp_path):
    """The walk above can fail: a run-time import is seen, one under TYPE_CHECKING is not."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dhp.stages.config import Config\n"
        "def f():\n    from dhp.stages.pools import StagePool\n"
    )
    assert _runtime_imports(module) == ["typing", "dhp.stages.pools"]


def test_storage_imports_no_torch():
    """Reading object storage is a data concern: it must not pay for torch (2 s) in every preprocessing worker."""
    code = "import sys, dhp.dataflow.storage; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# Words that belong to the place dhp is built in, not to dhp: a user has never heard of them.
FOREIGN = re.compile(
    r"\b(lent|lends?|lending|workplace|device tool)\b|\bissues? \d+|\bitems? \d+(?! of)"
    r"|\b(device|work|next|this|first|second|third|earlier|later) sessions?\b|\bsession script\b",
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in files if Path(f).suffix in TEXT_SUFFIXES and (ROOT / f).is_file()]


def foreign_words(text: str) -> list[str]:
    return [m.group(0) for m in FOREIGN.finditer(text)]


def test_the_project_speaks_of_itself_only():
    hits = []
    for path in _tracked_text_files():
        if path == Path(__file__):
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{i}: {w!r}" for w in foreign_words(line)]
    assert hits == [], "\n".join(hits[:40])


def test_foreign_words_are_caught():
    assert foreign_words("on the lent H100 (issue 14, item 3), next device session") == [
        "lent",
        "issue 14",
        "item 3",
        "device session",
    ]
    assert foreign_words("the test session's Ray; a Ray session; 3 items of 5; excellent") == []


def test_nothing_points_outside_the_repository():
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _tracked_text_files()
        if p != Path(__file__)
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if "../shared" in line
    ]
    assert hits == []


def test_design_citations_resolve():
    """Code cites docs/design.md by invariant number or by section title; each must exist there."""
    design = (ROOT / "docs" / "design.md").read_text()
    invariants = set(re.findall(r"^(\d+)\. \*\*", design, re.M))
    headings = set(re.findall(r"^#+ (.+)$", design, re.M))
    bad = []
    for path in _tracked_text_files():
        if path == Path(__file__):
            continue
        text = " ".join(path.read_text(errors="replace").split())  # a citation may wrap; "# " of comments stays
        text = text.replace(" # ", " ")
        bad += [
            f"{path.relative_to(ROOT)}: invariant {n}"
            for n in re.findall(r"docs/design\.md, invariants? (\d+)", text)
            if n not in invariants
        ]
        bad += [
            f"{path.relative_to(ROOT)}: {title!r}"
            for title in re.findall(r"docs/design\.md, \"([^\"]+)\"", text)
            if title not in headings
        ]
        bad += [f"{path.relative_to(ROOT)}: DESIGN" for _ in re.findall(r"\bDESIGN(?:\.md)?\b", text)]
    assert invariants == {"1", "2", "3", "4", "5"}
    assert bad == []
