"""Checkpoint directories on disk: written atomically, verified before use, pruned to the newest few.

A checkpoint is `CKPT_ROOT/step_NNNNNN/`. It is assembled in `CKPT_ROOT/.tmp-step_NNNNNN/` (the actors and
the driver write their files there), every file is fsynced, then `MANIFEST` (each file's size and SHA-256)
is written and fsynced *last*, and the directory is renamed into place (atomic on POSIX) and the parent
fsynced. A crash at any point leaves either no `step_N` or a complete one: a `.tmp-*` left behind is
ignored and removed by the next save, and a `step_N` whose manifest is missing or disagrees with its files
is never chosen.

At real size a checkpoint is tens to hundreds of GB, so no single process hashes all of it: every rank hashes
the files it wrote (`file_entry`, in parallel across the pool) and hands the entries to `commit`, which
hashes only the driver's small files; `verify` hashes with a thread pool (hashlib releases the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "MANIFEST.json"
_STEP = re.compile(r"^step_(\d{6,})$")


def staging_dir(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step` (a stale one is removed first)."""
    tmp = root / f".tmp-step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def file_entry(path: Path) -> dict[str, int | str]:
    """The manifest entry of one file: its size and SHA-256 (what a rank returns for each file it wrote)."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, keep_last: int, hashed: dict[str, dict[str, int | str]] | None = None) -> Path:
    """fsync the files, write the manifest last, rename into place, prune; returns the final directory.

    `hashed`: manifest entries the writers computed themselves (name relative to `tmp` -> `file_entry`);
    only the other files are hashed here, and a listed file whose size changed since is an error."""
    hashed = hashed or {}
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {}
    for p in files:
        name = str(p.relative_to(tmp))
        entry = hashed.get(name)
        if entry is not None and entry["size"] != p.stat().st_size:
            raise RuntimeError(f"checkpoint file {p} changed after its writer hashed it")
        manifest[name] = entry or file_entry(p)
    for p in files:
        _fsync(p)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync(tmp / MANIFEST)
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    if final.exists():  # a re-run of the same step replaces it (the old one stays valid until the rename)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    prune(tmp.parent, keep_last)
    return final


def verify(ckpt: Path, checksums: bool = True) -> str | None:
    """None if every file listed in the manifest is there with its size and checksum; else what is wrong.
    `checksums=False`: sizes only (reading every byte of a 72B checkpoint takes minutes)."""
    path = ckpt / MANIFEST
    if not ckpt.is_dir():
        return "no such directory"
    if not path.is_file():
        return "no manifest (the write did not finish)"
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return "unreadable manifest"
    for name, want in manifest.items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} does not match its checksum"
    if not checksums:
        return None
    names = sorted(manifest)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, digest in zip(names, pool.map(lambda n: _sha256(ckpt / n), names)):
            if digest != manifest[name]["sha256"]:
                return f"{name} does not match its checksum"
    return None


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every `step_N` under root, oldest first (valid or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def latest_valid(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a note for each newer one that did not."""
    notes = []
    for _, ckpt in reversed(checkpoints(root)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt, notes
        notes.append(f"{ckpt.name}: {problem}")
    return None, notes


class ResumeFrom:
    """Where a run continues from (`training.resume`): one object per choice, asked by the driver.

    `auto` -> `Newest` (this run directory's newest checkpoint that verifies, or a fresh start), `none` ->
    `Fresh`, anything else -> `Given(path)` (a checkpoint of any run or layout; an unusable one is an error).
    """

    def point(self, run_dir: Path) -> Path | None:
        """The checkpoint to restore, None for a fresh start; FileNotFoundError if a named one is unusable."""
        raise NotImplementedError

    def check(self, checksums: bool = False) -> None:
        """FileNotFoundError if what this choice names is unusable, as far as its files' presence and sizes say
        (`checksums`: and their contents): the driver asks before Ray starts and the pools are built."""


class Newest(ResumeFrom):
    def point(self, run_dir: Path) -> Path | None:
        ckpt, notes = latest_valid(run_dir / "checkpoints")
        for note in notes:
            print(f"resume: skipping {note}", flush=True)
        return ckpt


class Fresh(ResumeFrom):
    def point(self, run_dir: Path) -> Path | None:
        return None


class Given(ResumeFrom):
    def __init__(self, path: Path) -> None:
        self.path = path

    def point(self, run_dir: Path) -> Path | None:
        self.check(checksums=True)
        return self.path

    def check(self, checksums: bool = False) -> None:
        problem = verify(self.path, checksums)
        if problem:
            raise FileNotFoundError(f"training.resume={self.path}: not a usable checkpoint ({problem})")


_RESUME_WORDS: dict[str, type[ResumeFrom]] = {"auto": Newest, "none": Fresh}


def resume_from(choice: str) -> ResumeFrom:
    """The `ResumeFrom` that `training.resume` names (a word, or a checkpoint path)."""
    known = _RESUME_WORDS.get(choice)
    return known() if known is not None else Given(Path(choice))


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints (0 = keep all); drop stale staging directories."""
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        for _, old in checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
