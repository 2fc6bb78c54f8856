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

from dhp.stages import step_logs
from dhp.stages.checkpoint_files import MANIFEST, checkpoints, latest_valid
from dhp.stages.config import load_config
from dhp.stages.driver import train

STEPS, K = 4, 2


def _cfg(tmp_path, name: str, *extra: str):
    return load_config(
        "tiny",
        [
            f"output.dir={tmp_path}/runs",
            f"output.name={name}",
            f"data.synthetic.dir={tmp_path}/synth",
            "data.synthetic.num=48",
            "data.synthetic.eval_num=8",
            f"training.steps={STEPS}",
            f"training.checkpoint_every={K}",
            "training.keep_last=0",
            "training.eval_every=0",
            "training.eval_batches=1",
            "training.warmup_steps=2",
            *extra,
        ],
    )


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in step_logs.read(run)}


def test_resumed_run_equals_uninterrupted_run(trainers, tmp_path):
    # (the per-rank checkpoints are compared, not a Hugging Face export)
    full = train(_cfg(tmp_path, "full", "output.save_final_checkpoint=false"), trainers=trainers)
    run = tmp_path / "runs" / "full"
    assert [s for s, _ in checkpoints(run / "checkpoints")] == [K, STEPS]

    # "Stopped after step K": the same run directory without anything written after step K's checkpoint.
    resumed_run = tmp_path / "runs" / "resumed"
    shutil.copytree(run, resumed_run)
    shutil.rmtree(resumed_run / "checkpoints" / f"step_{STEPS:06d}")
    (resumed_run / f".tmp-step_{K + 1:06d}").mkdir()  # a write that was killed half-way is ignored
    resumed = train(_cfg(tmp_path, "resumed", "output.save_final_checkpoint=false"), trainers=trainers)
    assert resumed["resumed_from"].endswith(f"step_{K:06d}") and full["resumed_from"] is None

    assert _losses(resumed_run) == _losses(run)  # every step, bit for bit, including those after K
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(resumed_run / "tensorboard"))
    board.Reload()  # the copied events of steps 1-STEPS plus the resumed ones from K+1: each step once (purge_step)
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (s, pytest.approx(v)) for s, v in sorted(_losses(run).items())
    ]
    a, b = (r / "checkpoints" / f"step_{STEPS:06d}" for r in (run, resumed_run))
    moments = {f.name for f in a.glob("*-moments.safetensors")}  # by name, one per rank, in the manifest
    assert len(moments) == 4 and moments <= json.loads((a / MANIFEST).read_text()).keys()
    for f in sorted(a.glob("*.safetensors")):  # weights and AdamW moments
        x, y = load_file(f), load_file(b / f.name)
        assert x.keys() == y.keys() and all((x[n] == y[n]).all() for n in x), f.name
    for f in sorted(a.glob("*-state.pt")):  # scheduler, RNG (the moments are in *-moments.safetensors above)
        x, y = (torch.load(p, weights_only=True) for p in (f, b / f.name))
        assert x["scheduler"] == y["scheduler"] and torch.equal(x["rng"], y["rng"])


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


# Resume into another layout: A's step-2 checkpoint resumed in B must give, after step 3, the parameters the
# run gets in A (fp32, up to summation order: other TP/DP sizes add the same terms in another order).
SP2_TP2 = (
    "vision.parallelism=sequence",
    "vision.num_actors=2",
    "vision.degree=2",
    "text.parallelism=tensor",
    "text.num_actors=2",
    "text.degree=2",
)
NONE_TP4 = (
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "text.parallelism=tensor",
    "text.num_actors=4",
    "text.degree=4",
)
TP2_DP2 = (
    "vision.parallelism=none",
    "vision.num_actors=2",
    "vision.degree=1",
    "text.parallelism=tensor",
    "text.num_actors=4",
    "text.degree=2",
)
SMALL = (
    "vision.num_cpus_per_actor=0.1",
    "text.num_cpus_per_actor=0.1",
    "training.steps=3",
    "training.checkpoint_every=2",
    "data.synthetic.num=24",
    "data.synthetic.eval_num=0",  # no evaluation: step 3's loss and parameters are compared
)


def _hf_params(run) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted((run / "checkpoint").glob("*.safetensors")) for n, t in load_file(f).items()}


# The largest pools first: their trainer (vision 2, text 4) is then rebuilt for every other layout here (`trainers`),
# where starting with SP2 / TP2 built one of 2 + 2 actors and then another of 2 + 4.
@pytest.mark.parametrize(
    ("a", "b"), [(TP2_DP2, NONE_TP4), (SP2_TP2, NONE_TP4)], ids=["tp2xdp2_to_tp4", "sp2-tp2_to_none-tp4"]
)
def test_resume_into_another_layout(trainers, tmp_path, capsys, a, b):
    """Weights, AdamW moments and steps, LR schedule and the data position all carry over: a wrong moment
    or a sample trained twice / not at all would move step 3's parameters far more than 1e-6. TP2 x DP2 ->
    TP4 also reshards ZeRO-1's moments (each on one replica) and two data streams into one."""
    # uninterrupted; resuming in A equals it exactly (the test above)
    train(_cfg(tmp_path, "a", *SMALL, *a), trainers=trainers)
    ckpt = tmp_path / "runs" / "a" / "checkpoints" / "step_000002"
    resumed = train(_cfg(tmp_path, "b", *SMALL, *b, f"training.resume={ckpt}"), trainers=trainers)
    assert resumed["resumed_from"] == str(ckpt) and "resume: resharding" in capsys.readouterr().out
    (ra, rb) = (tmp_path / "runs" / name for name in ("a", "b"))
    assert _losses(rb).keys() == {3} and _losses(rb)[3] == pytest.approx(_losses(ra)[3], rel=1e-5)
    x, y = _hf_params(ra), _hf_params(rb)
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(y[name], x[name], atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_data_positions_of_an_older_dhp_or_other_files_are_refused(tmp_path):
    from dhp.dataflow.positions import files_key
    from dhp.stages import resume_checks
    from dhp.stages.config import ConfigError

    paths = ["/d/a.tar", "/d/b.tar", "/d/c.tar"]
    key = files_key(paths, True)
    now = {"epoch": 0, "parts": 3, "files": key, "part": 1, "taken": 4, "plans": {}}
    resume_checks.check_positions(tmp_path, [now, now], (3, key))
    resume_checks.check_positions(tmp_path, [now], (3, files_key([f"s3://b/x/{p[3:]}" for p in paths], True)))  # moved
    with pytest.raises(ConfigError, match="older form.*dhp export-hf"):
        resume_checks.check_positions(tmp_path, [{"epoch": 0, "cursor": 8}], (3, key))
    for other in ([*paths, "/d/d.tar"], paths[::-1]):
        with pytest.raises(ConfigError, match="read 3 files, not the .* of this run's data.train"):
            resume_checks.check_positions(tmp_path, [now], (len(other), files_key(other, True)))
    with pytest.raises(ConfigError, match="read 3 files, not the 3"):
        resume_checks.check_positions(tmp_path, [now], (3, files_key(paths, False)))  # another format


def test_another_model_is_refused(tmp_path):
    from dhp.models.architectures import architecture_config
    from dhp.stages import resume_checks

    config = architecture_config("tiny")
    config.save_pretrained(tmp_path)
    assert resume_checks.model_mismatch(tmp_path, config) is None
    config.text_config.num_hidden_layers = 3
    assert resume_checks.model_mismatch(tmp_path, config) == "text_config.num_hidden_layers 2 vs 3"


def test_training_resume_names_one_choice_object(tmp_path):
    from dhp.stages.checkpoint_files import Fresh, Given, Newest, commit, resume_from, staging_dir

    run_dir = tmp_path / "run"
    assert isinstance(resume_from("auto"), Newest) and isinstance(resume_from("none"), Fresh)
    assert resume_from("auto").point(run_dir) is None  # nothing written yet: a fresh start
    tmp = staging_dir(run_dir / "checkpoints", 3)
    (tmp / "w.bin").write_bytes(b"w")
    ckpt = commit(tmp, keep_last=0)
    assert resume_from("auto").point(run_dir) == ckpt and resume_from("none").point(run_dir) is None
    given = resume_from(str(ckpt))
    assert isinstance(given, Given) and given.point(tmp_path / "another_run") == ckpt
    with pytest.raises(FileNotFoundError, match="training.resume=.*not a usable checkpoint"):
        resume_from(str(tmp_path / "nowhere")).point(run_dir)
