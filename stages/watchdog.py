"""No silent hang: every step has a deadline, and a missed one names the rank that stopped answering.

A rank that stops (SIGSTOP, a deadlock holding the GIL, a wedged driver call) raises nothing: its peers
wait in their collectives (gloo's timeout is 10 minutes) and the driver in `ray.get`. So the driver waits on
a step's results only until `StepClock.deadline`, then asks every stage actor for a `heartbeat`, which runs
in its own thread (stages/actor_group.py): an actor that computes or waits in a collective answers, one
that cannot run does not. The call each silent rank was in is its oldest unfinished call (`CallLedger`).
The result is a `StepHung` error, which the driver handles like a dead actor: every actor is killed, the
pools are rebuilt, training resumes from the last checkpoint.

The data side has its own deadline, `data.timeout_s`, on progress: a late global batch (first row, evaluation
batch) whose streams read no record for two such periods (a read blocked on storage, a preprocessing worker
that stopped) is a `DataStalled`, which names each late stream's position (`BatchLoader.position`, answered
from its own thread) and is handled the same way: rebuild, resume.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import ray

from dhp.stages.actor_group import CallLedger

FIRST_STEP_S = 1800.0  # an attempt's first step: lazy allocation, kernel selection, cold caches
FLOOR_S = 120.0  # never less than this once step times are known
FACTOR = 10.0  # x the median step time
HEARTBEAT_S = 5.0  # how long an actor has to answer its heartbeat


class StepHung(RuntimeError):
    """A step missed its deadline. `silent`: (stage, rank, call) of every actor that did not answer."""

    def __init__(self, message: str, silent: list[tuple[str, int, str]]):
        super().__init__(message)
        self.silent = silent


class StepClock:
    """The deadline of each step: `training.step_timeout_s`, or (0 = auto) FACTOR x the median of the step
    times seen so far, at least FLOOR_S; FIRST_STEP_S while none is known. Kept across restarts."""

    def __init__(self, configured_s: float = 0.0):
        self.configured_s = configured_s
        self.times: list[float] = []
        self.started: float | None = None  # None: no deadline (calls outside a step: tests, benchmarks)
        self.scale = 1.0
        self.warm = False  # has this attempt finished a step (the first one pays warm-up)

    def timeout_s(self) -> float:
        if self.configured_s > 0:
            return self.configured_s
        auto = FACTOR * statistics.median(self.times) if self.times else 0.0
        return max(FLOOR_S if self.warm else FIRST_STEP_S, auto)

    def start(self, scale: float = 1.0) -> None:
        """A new deadline: `scale` x the step timeout from now (an evaluation pass of N batches: N)."""
        self.started, self.scale = time.monotonic(), scale

    def remaining_s(self) -> float | None:
        if self.started is None:
            return None
        return max(0.0, self.started + self.scale * self.timeout_s() - time.monotonic())

    def stop(self, step_s: float | None = None) -> None:
        """The deadline is met; `step_s`: the step's time, for the automatic timeout."""
        self.started = None
        if step_s is not None:
            self.times = (self.times + [step_s])[-100:]
            self.warm = True

    def new_attempt(self) -> None:
        self.warm, self.started = False, None


def wait_or_hang(refs: list[ray.ObjectRef], clock: StepClock, what: str, pools: list[tuple[str, Any]],
                 where: dict[str, list[dict]], ledger: CallLedger) -> list[Any]:
    """`ray.get(refs)`, unless they are not all done by the clock's deadline: then `StepHung`, naming who."""
    if refs:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=clock.remaining_s())
        if pending:
            raise diagnose(clock, what, pools, where, ledger)
    return ray.get(refs)


@ray.remote(num_cpus=0)
def _ask(handles: list[Any], method: str, timeout_s: float) -> list[Any]:
    """Each of `handles`' answer to `method()` within `timeout_s` (MISSING if none, GONE if the call failed: a
    dead actor, whose error must not take the whole report with it). Sent from this task, not from the driver:
    Ray submits a caller's calls to an actor in order, so the driver's question would queue behind its own
    calls that wait on a hung rank's outputs."""
    refs = [getattr(h, method).remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answered = set(ready)

    def answer(ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref) if ref in answered else MISSING
        except ray.exceptions.RayError:
            return GONE

    return [answer(ref) for ref in refs]


MISSING = "<no answer>"
GONE = "<gone: its actor died>"


def diagnose(clock: StepClock, what: str, pools: list[tuple[str, Any]], where: dict[str, list[dict]],
             ledger: CallLedger) -> StepHung:
    """Heartbeat every stage actor; those that do not answer within HEARTBEAT_S are the hung ranks."""
    ranks = [(stage, rank, a.handle) for stage, pool in pools for rank, a in enumerate(pool.actors)]
    answers = ray.get(_ask.remote([h for _, _, h in ranks], "heartbeat", HEARTBEAT_S))
    in_call = ledger.in_call()
    silent = [(stage, rank, in_call.get((stage, rank), "no call"), a)
              for (stage, rank, _), a in zip(ranks, answers) if a in (MISSING, GONE)]
    head = f"{what} did not finish within training.step_timeout_s={clock.timeout_s():g} s"
    if not silent:
        calls = ", ".join(f"{s} rank {r} in {m}" for (s, r), m in sorted(in_call.items())) or "none"
        return StepHung(f"{head}; every rank answers its heartbeat (a collective waiting on itself?); "
                        f"unfinished calls: {calls}", [])
    who = "; ".join(
        f"{stage} rank {rank} (pid {where[stage][rank]['pid']}, node {where[stage][rank]['node_id'][:8]}) "
        f"{'died' if a == GONE else 'stopped answering'} in {method}" for stage, rank, method, a in silent)
    return StepHung(f"{head}: {who}", [(stage, rank, method) for stage, rank, method, _ in silent])


class DataStalled(RuntimeError):
    """The data pipeline did not deliver within `data.timeout_s`: a fault, like a hung rank (rebuild, resume)."""


def wait_for_data(refs: list[ray.ObjectRef], loaders: list[Any], timeout_s: float, what: str) -> list[Any]:
    """`ray.get(refs)`, where `refs[i]` is a call of `loaders[i]` (a `BatchLoader` actor). A stream may be slow (slow
    storage, a large annotation file read whole before its first record) but must move: every `timeout_s` (0: no
    deadline) the late streams are asked where they stand, and if none moved since the last time, `DataStalled`
    names them. An error of a stream itself (no usable sample, ...) is raised as it is."""
    if timeout_s <= 0 or not refs:
        return ray.get(refs)
    before = None
    while True:
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if not late:
            return ray.get(refs)
        ray.get(ready)  # a stream that failed on its own raises its own error, not a stall
        which = [i for i, ref in enumerate(refs) if ref in set(late)]
        where = ray.get(_ask.remote([loaders[i] for i in which], "position", HEARTBEAT_S))
        if where == before:
            streams = "; ".join(f"stream {i}: {w['where'] if isinstance(w, dict) else w}" for i, w in zip(which, where))
            raise DataStalled(
                f"{what}: the data pipeline read nothing for 2 x data.timeout_s={timeout_s:g} s ({streams}); "
                f"a read blocked on storage or a stopped preprocessing worker (raise data.timeout_s if the "
                f"storage is this slow)"
            )
        for i, w in zip(which, where):
            if isinstance(w, dict) and w["read"] and 2 * sum(w["skipped"].values()) >= w["read"]:
                print(f"warning: {what}: {skipping(i, w)}", flush=True)
        before = where


def skipping(stream: int, position: dict[str, Any]) -> str:
    """Why a late stream that reads is late: most of what it read for the batch was skipped (`BatchLoader.position`).
    Said while it goes on, because a stream stops with "no usable sample" only once it has read every file without
    one, which at 100k shards is hours of reading when a setting keeps every record out."""
    read, skipped, example = position["read"], position["skipped"], position["example"]
    reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    last = f"; the last: {example['source']}: {example['error']} ({example['detail']})" if example else ""
    return (f"data stream {stream} is late: {sum(skipped.values())} of the {read} records it read for this batch "
            f"were skipped ({reasons}){last}. It keeps reading; every skipped record is in RUN_DIR/quarantine.jsonl "
            f"once a batch arrives. If every record is skipped, check data.image_root, data.webdataset.caption and "
            f"data.max_seq_len against the last one")
