"""The parts of fault tolerance that need no cluster: step deadlines, the preemption handler, injected
save faults, custom-resource placement and its config, a rank that dies while its pool starts (the faults
themselves: test_faults.py)."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from dhp.stages import watchdog
from dhp.stages.actor_group import ActorGroup, DistributedWorker
from dhp.stages.config import ConfigError, load_config
from dhp.stages.fault_injection import VARIABLE, save_fault
from dhp.stages.placement import _resources
from dhp.stages.placement_modes import Disjoint, PoolRequest, Shared, bundle, placement_mode
from dhp.stages.preemption import Preempted, Preemption
from dhp.stages.watchdog import StepClock


def test_step_deadline_is_configured_or_ten_times_the_median_with_floors():
    assert StepClock(7.5).timeout_s() == 7.5
    clock = StepClock(0)
    assert clock.timeout_s() == watchdog.FIRST_STEP_S  # nothing measured: warm-up allowance
    for seconds in (1.0, 30.0, 2.0):
        clock.stop(seconds)
    assert clock.timeout_s() == max(watchdog.FLOOR_S, 10 * 2.0)
    clock.stop(40.0), clock.stop(50.0)
    assert clock.timeout_s() == 10 * 30.0  # median of 1, 2, 30, 40, 50
    clock.new_attempt()  # a rebuilt attempt warms up again
    assert clock.timeout_s() == watchdog.FIRST_STEP_S
    assert clock.remaining_s() is None  # no deadline outside a step
    clock.start(scale=2)
    assert 2 * watchdog.FIRST_STEP_S - 5 < clock.remaining_s() <= 2 * watchdog.FIRST_STEP_S


def test_preemption_records_the_first_signal_and_a_second_ctrl_c_interrupts():
    p = Preemption(grace_s=30)
    before = signal.getsignal(signal.SIGTERM)
    with p.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.requested and p.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    assert str(Preempted(4, None, "SIGTERM")) == "preempted at step 4, checkpoint none"


def test_injected_save_fault_fires_once_on_its_rank_and_step(tmp_path):
    staging = tmp_path / ".tmp-step_000004"
    staging.mkdir()
    assert VARIABLE not in os.environ
    save_fault("text", 0, staging)  # unset: nothing
    # The test's own environment, not the process's: the background runs' processes inherit the latter.
    planted = {VARIABLE: "enospc@text:0:4"}
    save_fault("text", 1, staging, planted)  # another rank
    save_fault("text", 0, tmp_path / ".tmp-step_000006", planted)  # another step
    with pytest.raises(OSError) as e:
        save_fault("text", 0, staging, planted)
    assert e.value.errno == errno.ENOSPC
    save_fault("text", 0, staging, planted)  # once per run
    with pytest.raises(PermissionError):
        save_fault("vision", 1, staging, {VARIABLE: "eacces@vision:1:4"})


def test_placement_modes_say_what_to_reserve():
    v, t = PoolRequest(2, {"CPU": 0.5, "GPU": 0.5}), PoolRequest(3, {"CPU": 0.25, "GPU": 0.5})
    shared = Shared().groups(v, t)  # one group; bundle b holds vision b and text b, round-robin on the larger pool
    assert shared.groups == [[{"CPU": 0.75, "GPU": 1.0}, {"CPU": 0.75, "GPU": 1.0}, {"CPU": 0.25, "GPU": 0.5}]]
    assert shared.vision == [(0, 0), (0, 1)] and shared.text == [(0, 0), (0, 1), (0, 2)]
    disjoint = Disjoint().groups(v, PoolRequest(1, {"CPU": 0.0}))  # one group per pool, one bundle per actor
    assert disjoint.groups == [[{"CPU": 0.5, "GPU": 0.5}] * 2, [{"CPU": 0.01}]]  # Ray refuses an empty bundle
    assert disjoint.vision == [(0, 0), (0, 1)] and disjoint.text == [(1, 0)]
    assert load_config("tiny").pipeline.shared
    assert not load_config("tiny", ["pipeline.placement=disjoint"]).pipeline.shared
    with pytest.raises(ValueError, match="known placements are shared, disjoint"):
        placement_mode("spread")


def test_custom_resources_reach_the_bundles_and_are_checked():
    cfg = load_config("tiny", ["vision.resources={vision_node: 1}", "text.resources={text_node: 0.5}"])
    assert cfg.vision.resources == {"vision_node": 1.0} and cfg.text.resources == {"text_node": 0.5}
    assert bundle([_resources(cfg.vision), _resources(cfg.text)]) == {"CPU": 0.5, "text_node": 0.5, "vision_node": 1.0}
    with pytest.raises(ConfigError, match="vision.resources"):
        load_config("tiny", ["vision.resources=3"])
    with pytest.raises(ConfigError, match="resources must be >= 0"):
        load_config("tiny", ["text.resources={gpu_host: -1}"])
    with pytest.raises(ConfigError, match="on_checkpoint_error"):
        load_config("tiny", ["training.on_checkpoint_error=ignore"])


class _DiesAtStart(DistributedWorker):
    """A pool worker whose rank 1 exits in its constructor on the first `deaths` attempts (each constructor
    appends its rank to `marker`), or whose constructor raises when `deaths` is -1."""

    def __init__(self, marker: str, deaths: int, rank: int, world_size: int, torch_threads: int = 1):
        super().__init__(rank, world_size, torch_threads)
        with open(marker, "a") as f:
            f.write(f"{rank}\n")
        if deaths < 0:
            raise ValueError("a constructor that raises")
        if rank == 1 and len(open(marker).read().splitlines()) <= 2 * deaths:
            os._exit(1)


@pytest.mark.parametrize("deaths", [1, 2, -1], ids=["once", "twice", "raises"])
def test_rank_dying_at_start_is_started_again_once(ray_session, tmp_path, capsys, deaths):
    marker = tmp_path / "attempts"
    args = dict(init_args=(str(marker), deaths), num_cpus=0.1)
    if deaths == 1:
        pool = ActorGroup("vision", _DiesAtStart, 2, **args)
        try:
            assert pool.execute_all("ping") == [0, 1]  # the second attempt formed its group
        finally:
            pool.shutdown()
        assert "vision: a rank's process died while starting" in capsys.readouterr().out
    else:
        with pytest.raises(ray_session.exceptions.ActorDiedError):
            ActorGroup("vision", _DiesAtStart, 2, **args)
    attempts = {1: 2, 2: 2, -1: 1}[deaths]  # a constructor that raises is a bug, not an accident: no retry
    assert len(marker.read_text().splitlines()) == 2 * attempts


class _Rank:
    def __init__(self, answer_after_s: float = 0.0):
        self.answer_after_s = answer_after_s

    def heartbeat(self) -> str:
        import time

        time.sleep(self.answer_after_s)
        return "ok"


def test_a_stall_report_says_why_a_stream_did_not_say_where_it_stands():
    """The stall report's words for each of `_ask`'s answers: a position, a silent loader, a dead one."""
    where = {"where": "epoch 0, 3 records into it, last record a.jsonl:3", "read": 3, "skipped": {}, "example": None}
    assert watchdog.stream_position(where) == "epoch 0, 3 records into it, last record a.jsonl:3"
    silent = watchdog.stream_position(watchdog.MISSING)
    assert (
        silent
        == f"its loader did not answer within {watchdog.HEARTBEAT_S:g} s (still starting, or its process is stuck)"
    )
    assert watchdog.stream_position(watchdog.GONE) == "its loader died"


def test_asking_ranks_names_the_silent_and_the_dead_without_losing_the_answers(ray_session):
    """`_ask` (the hang report's and the stall report's question): one rank answers, one is too slow, one's actor
    is dead. The dead one's error is its answer (GONE), not an exception that loses the others'."""
    ray = ray_session
    cls = ray.remote(num_cpus=0.01)(_Rank)
    ok, slow, dead = cls.remote(), cls.remote(30), cls.remote()
    ray.get([ok.heartbeat.remote(), dead.heartbeat.remote()])
    ray.kill(dead)
    try:
        answers = ray.get(watchdog._ask.remote([ok, slow, dead], "heartbeat", 3))
        assert answers == ["ok", watchdog.MISSING, watchdog.GONE]
    finally:
        ray.kill(slow), ray.kill(ok)
