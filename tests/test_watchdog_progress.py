"""Slow is not hung: the step watchdog (stages/watchdog.py) judges a late step by its ranks' progress
(stages/progress.py), gives a batch of more work more time, still names a stopped rank and a rank that never
joins a collective, and a step that fails the same way after a restart stops the run.

The pools here are the default vision layout (sequence parallel 2: Ulysses all-to-alls) and one text actor,
fed hand-made global batches (no loaders); the first test builds them once for the module, the last leaves
them wedged.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
import torch

from dhp.dataflow.loader import GlobalBatch
from dhp.models.architectures import architecture_config
from dhp.models.qwen2_5_vl import IGNORE_INDEX, TextModel, VisionModel
from dhp.stages import driver, watchdog
from dhp.stages.config import load_config
from dhp.stages.progress import Progress, tracked
from dhp.stages.watchdog import StepClock, StepHung, Verdict, judge
from tests.conftest import write_image
from tests.test_parity import BASE, SP2, _microbatch


def test_automatic_deadline_scales_with_the_work_of_the_batch():
    clock = StepClock(0, min_s=0.5)
    for seconds, work in ((1.0, (10.0, 100.0)), (3.0, (30.0, 100.0)), (2.0, (20.0, 100.0))):
        clock.start(work=work)
        clock.stop(seconds)
    clock.start(work=(20.0, 100.0))  # the median step's work: the median's deadline
    assert clock.timeout_s() == 10 * 2.0
    clock.start(work=(400.0, 100.0))  # 20x the median step's patches: 20x the time, though the text is the same
    assert clock.work_ratio() == 20.0 and clock.timeout_s() == 20 * 10 * 2.0
    clock.start(work=(5.0, 50.0))  # less work never shortens it
    assert clock.timeout_s() == 10 * 2.0
    clock.start(work=(0.0, 3000.0))  # text only: 30x the tokens
    assert clock.timeout_s() == 30 * 10 * 2.0
    clock.start(scale=10)  # a checkpoint write: no work, 10 deadlines
    assert clock.window_s() == 10 * 10 * 2.0
    clock.stop()
    assert StepClock(0, min_s=0.5).work_ratio() == 1.0  # nothing known yet
    small = StepClock(0, min_s=60.0)
    small.start(work=(1.0, 1.0))
    small.stop(0.1)
    assert small.timeout_s() == 60.0  # at least training.step_timeout_min_s
    assert StepClock(7.5).timeout_s() == 7.5  # configured: as configured


def _rank(call: str | None, still_s: float, where: str = "") -> dict:
    return {"pid": 1, "count": 5, "still_s": still_s, "call": call, "where": where, "at": ""}


def test_judge_names_the_ranks_that_stand_still_in_a_call():
    w = 20.0
    moving = [
        ("vision", 0, _rank("forward", 0.1)),
        ("vision", 1, _rank("forward", 0.3)),
        ("text", 0, _rank(None, 50.0)),
    ]  # text waits for its inputs: never the one that hangs
    v = judge(moving, w, waited_s=60.0)
    assert v.hung == [] and not v.idle_stall and v.wait_s == pytest.approx(w - 0.1)
    # One rank waits in a collective for a peer that computes: the pool moves, nobody hangs.
    v = judge([("vision", 0, _rank("sync_grads", 45.0)), ("vision", 1, _rank("forward", 2.0))], w, 60.0)
    assert v.hung == [] and v.wait_s == pytest.approx(w - 2.0)
    # Both stand still (one never joined the collective the other waits in): both named.
    still = [
        ("vision", 0, _rank("forward", 21.0, "block 1 attn.qkv forward")),
        ("vision", 1, _rank("forward", 20.5, "block 1 attn.qkv forward")),
        ("text", 0, _rank(None, 25.0)),
    ]
    assert [(s, r) for s, r, _ in judge(still, w, 60.0).hung] == [("vision", 0), ("vision", 1)]
    # Standing still counts from when the driver began to wait at the earliest, and a look comes back no sooner
    # than RECHECK_S.
    assert judge(still, w, waited_s=19.9) == Verdict([], False, watchdog.RECHECK_S)
    # Nobody in a call and nothing moved for the window: the step waits on something outside the ranks.
    assert judge([("text", 0, _rank(None, 30.0))], w, 60.0).idle_stall
    assert judge([("text", 0, _rank(None, 5.0))], w, 60.0) == Verdict([], False, w - 5.0)


def test_progress_hooks_count_blocks_and_leave_gradients_alone():
    """Every block module's forward and its output's gradient move the counter, also when a block is recomputed
    (activation checkpointing) or run by its parts; the gradients are the same as without the hooks."""
    from dhp.models.activation_checkpointing import ActivationCheckpointing

    config = architecture_config("tiny")
    torch.manual_seed(0)
    grads = []
    for watched in (False, True):
        torch.manual_seed(0)
        vision, text = VisionModel(config), TextModel(config)
        ActivationCheckpointing("full").apply(vision.blocks())
        progress = Progress()
        if watched:
            progress.watch(vision.blocks() + text.blocks())
        pixels = torch.randn(16, 1176)
        embeds = vision(pixels, torch.tensor([[1, 4, 4]]))
        before = progress.count
        ids = torch.tensor([[1, 2] + [config.image_token_id] * 4 + [3, 4]])
        loss = text(
            ids,
            embeds,
            torch.arange(8).expand(3, 1, 8).clone(),
            torch.ones_like(ids),
            torch.tensor([[IGNORE_INDEX] * 6 + [3, 4]]),
        )
        loss.backward()
        grads.append([p.grad.clone() for p in [*vision.parameters(), *text.parameters()]])
        if watched:
            modules = sum(
                next(m.parameters(recurse=False), None) is not None for b in vision.blocks() for m in b.modules()
            )
            assert before == modules == 4 * 7  # a pre-hook each: norm1, qkv, proj, norm2, gate, up, down
            assert progress.count > 3 * before  # the text blocks, then every gradient and the recomputations
            assert progress.where == "block 0 norm1 backward"  # the last: the first vision block's first module
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Worker:
    def __init__(self):
        self.progress = Progress()

    def outer(self) -> str:
        return self.inner()

    def inner(self) -> str:
        return self.progress.call


def test_calls_mark_their_start_and_end():
    w = tracked(_Worker)()
    before = w.progress.count
    assert w.outer() == "outer"  # a call from within a call counts as the outer one
    assert w.progress.call is None and w.progress.count == before + 2
    assert w.progress.snapshot()["call"] is None


class _FakeTrainer:
    """Stands for the pools: the driver's restart loop is what is tested."""

    def __init__(self, *args, **kwargs):
        self.step, self.where, self.loaders = 0, {}, []

    def shutdown(self) -> None:
        pass


def test_a_step_failing_the_same_way_after_a_restart_stops_the_run(tmp_path, monkeypatch):
    stuck = [("text", 0, "forward_backward")]
    errors = [
        StepHung("step 3 ...: vision rank 1 stopped answering in forward", [("vision", 1, "forward")]),
        StepHung("step 3 ...: text rank 0 stood still 30 s in forward_backward", stuck),
        StepHung("step 3 ...: text rank 0 stood still 31 s in forward_backward", stuck),
    ]
    attempts = []

    def loop(cfg, trainer, run_dir, preemption, after_fault=False):
        attempts.append(after_fault)
        trainer.step = 3
        raise errors[len(attempts) - 1]

    import dhp.stages.trainer

    monkeypatch.setattr(dhp.stages.trainer, "Trainer", _FakeTrainer)
    monkeypatch.setattr(driver, "_loop", loop)
    monkeypatch.setattr(driver, "init_ray", lambda cfg: None)
    cfg = load_config(
        "tiny",
        [
            f"output.dir={tmp_path}",
            "output.name=run",
            f"data.synthetic.dir={tmp_path}/synth",
            "data.synthetic.num=4",
            "data.synthetic.eval_num=0",
            "training.max_restarts=5",
        ],
    )
    with pytest.raises(driver.TrainingFailed) as failed:
        driver.train(cfg)
    # Another rank's hang at the same step is another fault (restarted); the same one again stops the run.
    assert attempts == [False, True, True]
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        "step 3 failed the same way after restart 2, so it would again: a rank hung both times, at "
    ), message
    assert "stood still 30 s in forward_backward" in message and "stood still 31 s in forward_backward" in message
    assert "stopping instead of restarting up to training.max_restarts times" in message


# -- on the pools --------------------------------------------------------------------------------------------

SMALL, BIG = (56, 56), (1400, 1400)  # 16 and 10 000 patches


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, dict]:
    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample

    root = tmp_path_factory.mktemp("watchdog_data")
    settings = PreprocessSettings(str(root), min_pixels=56 * 56, max_pixels=BIG[0] * BIG[1], max_seq_len=4096)
    pre = Preprocessor(settings, architecture_config("tiny"))
    out = {}
    for name, size in (("small", SMALL), ("big", BIG)):
        write_image(root / f"{name}.png", size, seed=len(out))
        record = {
            "image": f"{name}.png",
            "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."}],
        }
        out[name] = decode_sample(pre({"source": "t", "record": json.dumps(record)})["sample"])
    return out


@pytest.fixture(scope="module")
def pools(ray_session, samples):
    """A trainer of vision SP2 + one text actor, and its ordinary and its 20x-patches global batches."""
    from dhp.stages.trainer import Trainer

    cfg = load_config(
        "tiny",
        BASE
        + SP2
        + [
            "training.step_timeout_min_s=1",
            "training.warmup_steps=1",
            "vision.num_cpus_per_actor=0.1",
            "text.num_cpus_per_actor=0.1",
        ],
    )
    trainer = Trainer(cfg)
    small = GlobalBatch([_microbatch([samples["small"]], cfg) for _ in range(2)], epoch=0)
    big = GlobalBatch([_microbatch([samples["big"]], cfg), _microbatch([samples["small"]], cfg)], epoch=0)
    try:
        yield trainer, small, big
    finally:
        trainer.shutdown()


def _patches(batch: GlobalBatch) -> int:
    return sum(mb.meta.patches for mb in batch.microbatches)


def test_a_step_of_20x_the_patches_completes(pools):
    """With the automatic deadline (a small minimum, so it is 10 x the median step): the batch of 300x the
    patches (a step of ~15x the median's time here) gets ~300x the deadline; then with a configured deadline of
    a fraction of that step, its ranks are looked at while they move, and nothing is declared hung either."""
    trainer, small, big = pools
    assert _patches(big) >= 20 * _patches(small)
    deadlines = []
    start = trainer.clock.start

    def recording(*args, **kwargs):
        start(*args, **kwargs)
        deadlines.append((trainer.clock.timeout_s(), trainer.clock.work_ratio()))

    trainer.clock.start = recording
    try:
        for batch in (small, small, small, big):
            trainer.train_step([batch])
        assert deadlines[-1][1] >= 20  # vision work (FLOPs of the patches) against the median step's
        median = sorted(trainer.clock.times[:3])[1]
        assert deadlines[-1][0] == pytest.approx(10 * median * deadlines[-1][1])
        big_s = trainer.clock.times[-1]
        # The same batch with a window of a fraction of its time: looked at, moving, finished.
        trainer.clock.configured_s = window = max(1.0, big_s / 3)
        looks = trainer.clock.looks
        stats = trainer.train_step([big])
        print(
            f"big step: {big_s:.2f} s against a median of {median:.2f} s; again with a {window:.2f} s window: "
            f"{stats['step_time_s']:.2f} s, {trainer.clock.looks - looks} looks; deadlines (s, work ratio): "
            f"{deadlines}"
        )
        assert trainer.clock.looks > looks or stats["step_time_s"] < window
    finally:
        trainer.clock.start = start
        trainer.clock.configured_s = 0.0


def _hang_s(trainer, batch) -> tuple[float, StepHung]:
    started = time.monotonic()
    with pytest.raises(StepHung) as hung:
        trainer.train_step([batch])
    return time.monotonic() - started, hung.value


def test_a_stopped_rank_is_named(pools):
    """SIGSTOP: the rank does not answer its heartbeat at the deadline, and it alone is named. Then SIGCONT:
    the step's calls finish and the pools go on."""
    trainer, small, _ = pools
    trainer.clock.configured_s = 2.0
    pid = trainer.where["vision"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        took, hung = _hang_s(trainer, small)
    finally:
        os.kill(pid, signal.SIGCONT)
    trainer.clock.stop()
    print(f"stopped rank: StepHung after {took:.1f} s: {hung}")
    assert hung.ranks == [("vision", 1, "forward")], str(hung)
    assert str(hung).endswith(
        f"vision rank 1 (pid {pid}, node {trainer.where['vision'][1]['node_id'][:8]}) stopped answering in forward"
    )
    assert 2.0 <= took < 2.0 + watchdog.HEARTBEAT_S + 5
    ray.get([a.ping.remote() for _, pool in trainer.pools() for a in pool.actors])  # behind the step's calls
    trainer.optimizer_step()  # closes the step the driver gave up on
    trainer.train_step([small])  # still answering


def test_a_rank_that_never_joins_a_collective_is_named(pools):
    """Vision rank 1 never joins its first Ulysses all-to-all (it waits, answering heartbeats); rank 0 waits in
    it. Both stand still in the same block: named with their call, block and line once they stood still for
    the window. (Leaves the pools wedged: the last test.)"""
    trainer, small, _ = pools
    trainer.clock.configured_s = 2.0
    ray.get(
        trainer.vision.actors[1].handle.__ray_call__.remote(
            lambda worker: __import__("dhp.stages.fault_injection").stages.fault_injection.never_join(
                "dhp.models.parallel.sequence_parallel", "all_to_all_single_autograd"
            )
        )
    )
    took, hung = _hang_s(trainer, small)
    print(f"rank that never joins: StepHung after {took:.1f} s: {hung}")
    assert hung.ranks == [("vision", 0, "forward"), ("vision", 1, "forward")], str(hung)
    message = str(hung)
    assert message.startswith(f"step {trainer.step} made no progress for 2 s (training.step_timeout_s=2 s): ")
    first_full = architecture_config("tiny").vision_config.fullatt_block_indexes[0]
    for rank in (0, 1):
        assert f"vision rank {rank} (pid " in message
    assert message.count(f"in forward (block {first_full} attn.qkv forward, at ") == 2, message
    assert "fault_injection.py" in message  # the rank that never joined stands in the hook, not in the collective
    assert 2.0 <= took < 2.0 + 5
