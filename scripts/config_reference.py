"""docs/configuration.md, generated from stages/config.py: each key is documented once, where it is declared.

A field's documentation is the comment on its declaration line, with the comment lines right above it in
front (for the fields whose explanation needs more than one line). The page lists every key of `Config`
with its type and default; `tests/test_docs.py` fails when the page is stale or a field has no comment.

    python -m dhp.scripts.config_reference            # rewrite docs/configuration.md
    python -m dhp.scripts.config_reference --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

from dhp.stages import config as config_module

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from the comments in `stages/config.py` by `python -m dhp.scripts.config_reference`; edit those,
not this page (`tests/test_docs.py` fails when it is stale).

A run's configuration is a preset from `configs/` (`--config tiny`, the default, or a YAML path) plus
`KEY=VALUE` overrides: `dhp train training.steps=20 text.degree=2`. `dhp config [KEY=VALUE ...]` prints the
resolved configuration. An unknown key, a wrong type or an out-of-range value stops the run before Ray
starts, with one line naming the key, the expected type and the file the value came from.
"""


def field_docs(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment text, for every annotated field of every class in `source`."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    docs = {}
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above = []
            line = node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            docs[(cls.name, node.target.id)] = " ".join(above + trailing)
    return docs


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if not isinstance(f.default, str) else f'"{f.default}"'
    return repr(f.default_factory())


def rows(cls: type, docs: dict[tuple[str, str], str], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) of every leaf key under `cls`, in declaration order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
        doc = docs.get((owner.__name__, f.name), "")
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            out.append((f"{prefix}{f.name}", "section", "", doc))
            out += rows(factory, docs, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", _type_name(hints[f.name]), _default(f), doc))
    return out


def undocumented() -> list[str]:
    """Keys whose declaration carries no comment."""
    docs = field_docs(Path(config_module.__file__).read_text())
    return [key for key, kind, _, doc in rows(config_module.Config, docs) if not doc and kind != "section"]


def render() -> str:
    docs = field_docs(Path(config_module.__file__).read_text())
    parts = [HEADER]
    for key, kind, default, doc in rows(config_module.Config, docs):
        cell = doc.replace("|", "\\|")
        if kind == "section":
            depth = "##" if "." not in key else "###"
            parts.append(f"\n{depth} `{key}`\n\n{cell}\n\n| key | type | default | meaning |\n|---|---|---|---|")
            continue
        type_cell = f"`{kind}`".replace("|", "\\|")
        parts.append(f"| `{key}` | {type_cell} | `{default}` | {cell} |")
    return "\n".join(parts).replace("\n\n\n", "\n\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = p.parse_args(argv)
    page = render()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text() != page
        print("docs/configuration.md is stale: run python -m dhp.scripts.config_reference" if stale else "up to date")
        return int(stale)
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
