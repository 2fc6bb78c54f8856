"""A run's per-step JSONL files, written as each step ends.

    RUN_DIR/metrics.jsonl     one line per step: loss, throughput, busy fractions, eval loss when evaluated
    RUN_DIR/quarantine.jsonl  one line per skipped record: its step, source location (file:line) and reason
    RUN_DIR/samples.jsonl     one line per step and data-parallel stream: the ids (epoch, source) it trained,
                              the audit that no sample is lost or repeated across faults and resumes

A resumed run keeps the lines of the steps before its resume point as they were and rewrites the rest, so that
each file holds every step once, whatever faults happened in between.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAMES = ("metrics", "quarantine", "samples")


def read(run_dir: Path, name: str = "metrics") -> list[dict[str, Any]]:
    """The records of RUN_DIR/`name`.jsonl (one of `NAMES`), one per line, in step order."""
    return [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]


def lines_before(path: Path, step: int) -> list[str]:
    """JSONL lines of `path` whose `step` is before `step` (what a resumed run keeps)."""
    if step <= 1 or not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step]


class StepLogs:
    """The three files of a run that starts at step `first`; a context manager (closes them). `losses`: the
    training loss of every step logged so far, the kept ones first."""

    def __init__(self, run_dir: Path, first: int):
        paths = {name: run_dir / f"{name}.jsonl" for name in NAMES}
        kept = {name: lines_before(path, first) for name, path in paths.items()}
        self.losses: list[float] = [json.loads(line)["loss"] for line in kept["metrics"]]
        self._files = {name: open(path, "w") for name, path in paths.items()}
        for name, f in self._files.items():
            f.writelines(line + "\n" for line in kept[name])

    def __enter__(self) -> StepLogs:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self._files.values():
            f.close()

    def skipped(self, step: int, batches: list) -> None:
        """Every record the loaders skipped for `step`'s global batches, with where it came from and why."""
        quarantine = self._files["quarantine"]
        for b in batches:
            quarantine.writelines(json.dumps({"step": step, **q}) + "\n" for q in b.quarantined)
        quarantine.flush()

    def trained(self, step: int, batches: list, record: dict[str, Any]) -> None:
        """`step`'s metrics `record` and the samples each stream's global batch held."""
        self._files["metrics"].write(json.dumps(record) + "\n")
        self._files["metrics"].flush()
        self._files["samples"].writelines(
            json.dumps({"step": step, "replica": r, "ids": b.ids}) + "\n" for r, b in enumerate(batches)
        )
        self._files["samples"].flush()
        self.losses.append(record["loss"])
