"""Checkpoint and resume: a run stopped after step k and resumed equals the uninterrupted run, exactly.

The sequence + tensor layout of the default run (vision SP2 with ZeRO-1 AdamW, text TP2), pipelined, with
the real Ray Data loader mid-epoch. The interrupted run is the uninterrupted run's directory with its
later checkpoint removed, so everything after step k is recomputed from what the step-k checkpoint holds.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dhp.stages.checkpoint_files import MANIFEST, checkpoints, latest_valid
from dhp.stages.config import ConfigError, load_config
from dhp.stages.driver import train

STEPS, K = 6, 3


def _cfg(tmp_path, name: str, *extra: str):
    return load_config("tiny", [
        f"output.dir={tmp_path}/runs", f"output.name={name}", f"data.synthetic.dir={tmp_path}/synth",
        "data.synthetic.num=48", "data.synthetic.eval_num=8", f"training.steps={STEPS}",
        f"training.checkpoint_every={K}", "training.keep_last=0", "training.eval_every=0",
        "training.eval_batches=1", "training.warmup_steps=2", *extra,
    ])


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_resumed_run_equals_uninterrupted_run(ray_session, tmp_path):
    full = train(_cfg(tmp_path, "full"))
    run = tmp_path / "runs" / "full"
    assert [s for s, _ in checkpoints(run / "checkpoints")] == [K, STEPS]

    # "Stopped after step K": the same run directory without anything written after step K's checkpoint.
    resumed_run = tmp_path / "runs" / "resumed"
    shutil.copytree(run, resumed_run)
    shutil.rmtree(resumed_run / "checkpoints" / f"step_{STEPS:06d}")
    (resumed_run / ".tmp-step_000005").mkdir()  # a write that was killed half-way is ignored
    resumed = train(_cfg(tmp_path, "resumed"))
    assert resumed["resumed_from"].endswith(f"step_{K:06d}") and full["resumed_from"] is None

    assert _losses(resumed_run) == _losses(run)  # every step, bit for bit, including those after K
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(resumed_run / "tensorboard"))
    board.Reload()  # the copied events of steps 1-6 plus the resumed ones from K+1: each step once (purge_step)
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == \
        [(s, pytest.approx(v)) for s, v in sorted(_losses(run).items())]
    a, b = (r / "checkpoints" / f"step_{STEPS:06d}" for r in (run, resumed_run))
    for f in sorted(a.glob("*.safetensors")):
        x, y = load_file(f), load_file(b / f.name)
        assert x.keys() == y.keys() and all((x[n] == y[n]).all() for n in x), f.name
    for f in sorted(a.glob("*-state.pt")):  # optimizer moments, scheduler, RNG
        x, y = (torch.load(p, weights_only=True) for p in (f, b / f.name))
        assert x["scheduler"] == y["scheduler"] and torch.equal(x["rng"], y["rng"])
        for k, st in x["optimizer"]["state"].items():
            assert all(torch.equal(v, y["optimizer"]["state"][k][n]) for n, v in st.items()), f.name

    # Another layout cannot pick up these shards: a clear error, not a crash in a worker.
    with pytest.raises(ConfigError, match="resuming across layouts is not supported"):
        train(_cfg(tmp_path, "resumed", "text.parallelism=none", "text.num_actors=1", "text.degree=1"))


def test_checkpoint_choice_skips_incomplete_and_corrupt(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        d = root / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "w.bin").write_bytes(bytes([step]) * 10)
    from dhp.stages.checkpoint_files import commit, staging_dir

    tmp = staging_dir(root, 4)
    (tmp / "w.bin").write_bytes(b"x" * 10)
    good = commit(tmp, keep_last=0)
    assert good.name == "step_000004" and (good / MANIFEST).is_file() and not tmp.exists()
    assert latest_valid(root)[0] == good
    (good / "w.bin").write_bytes(b"y" * 10)  # same size, different bytes
    newest, notes = latest_valid(root)
    assert newest is None and "step_000004: w.bin does not match its checksum" in notes
    assert any("no manifest" in n for n in notes)  # steps 1-3 never got a manifest (killed mid-write)

    tmp = staging_dir(root, 5)
    (tmp / "w.bin").write_bytes(b"z")
    commit(tmp, keep_last=2)  # prunes to the newest two directories
    assert [s for s, _ in checkpoints(root)] == [4, 5]
    assert latest_valid(root)[0] == root / "step_000005"
