"""No silent hang, and slow is not hung: every step has a deadline, and past it a rank whose call stopped moving
is named with the call and the place it stands in.

A rank that stops (SIGSTOP, a deadlock holding the GIL, a wedged driver call) raises nothing: its peers
wait in their collectives (gloo's timeout is 10 minutes) and the driver in `ray.get`. So the driver waits on
a step's results only until `StepClock`'s deadline, then asks every stage actor for a `heartbeat`, which runs
in its own thread (stages/actor_group.py): an actor that cannot run does not answer, and is named with its
oldest unfinished call (`CallLedger`). One that answers says how far its current call has got
(stages/progress.py: a counter that the blocks' forward and backward hooks, the gradient sync's buckets and the
calls' starts and ends move). A step is judged by progress, not by time (`judge`): a pool whose executing ranks
all stood still for the deadline's length (the window) hangs, and those ranks are named with their call, the
block they stand in and the line; a pool where one of them moved is waited on (the ranks that stand still wait
in a collective for it), and looked at again when it could next have stood still for the window. A rank
without a call (waiting for its inputs from the other pool, or for the driver) is never the one that hangs.
Either way the result is a `StepHung` error, which the driver handles like a dead actor: every actor is
killed, the pools are rebuilt, training resumes from the last checkpoint (and a step that fails the same way
twice stops the run: stages/driver.py).

The automatic deadline scales with the step's work: the vision and text FLOPs of its global batch (its patches
and tokens, `flops.step_flops`) against those of the step behind the median step time, so a batch of 20x the
usual patches gets 20x the time before anyone is asked.

The data side has its own deadline, `data.timeout_s`, on progress: a late global batch (first row, evaluation
batch) whose streams read no record for two such periods (a read blocked on storage, a preprocessing worker
that stopped) is a `DataStalled`, which names each late stream's position (`BatchLoader.position`, answered
from its own thread) and is handled the same way: rebuild, resume.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from dhp.stages.actor_group import CallLedger

FIRST_STEP_S = 1800.0  # an attempt's first step: lazy allocation, kernel selection, cold caches
FLOOR_S = 120.0  # never less than this once step times are known (training.step_timeout_min_s)
FACTOR = 10.0  # x the median step time
HEARTBEAT_S = 5.0  # how long an actor has to answer its heartbeat
RECHECK_S = 1.0  # the shortest wait between two looks at a step whose ranks move


class StepHung(RuntimeError):
    """A step missed its deadline. `ranks`: (stage, rank, call) of every actor named: those that did not answer,
    else those that stood still."""

    def __init__(self, message: str, ranks: list[tuple[str, int, str]]):
        super().__init__(message)
        self.ranks = ranks


class StepClock:
    """The deadline of each step: `training.step_timeout_s`, or (0 = auto) FACTOR x the median of the step
    times seen so far x the step's work against the median step's (`work_ratio`), at least `min_s`
    (`training.step_timeout_min_s`); FIRST_STEP_S while none is known. Kept across restarts. The same length
    is the window a call may stand still once the deadline has passed (`judge`)."""

    def __init__(self, configured_s: float = 0.0, min_s: float = FLOOR_S):
        self.configured_s, self.min_s = configured_s, min_s
        self.steps: list[tuple[float, tuple[float, ...] | None]] = []  # (seconds, work) of the steps so far
        self.started: float | None = None  # None: no deadline (calls outside a step: tests, benchmarks)
        self.scale = 1.0
        self.work: tuple[float, ...] | None = None  # the running step's (vision, text) FLOPs, if known
        self.warm = False  # has this attempt finished a step (the first one pays warm-up)
        self.looks = 0  # heartbeat rounds past deadlines so far

    @property
    def times(self) -> list[float]:
        return [t for t, _ in self.steps]

    def work_ratio(self) -> float:
        """The running step's work / the work of the step behind the median step time (the mean of the two
        middle ones): the larger of the vision, the text and the total ratio, at least 1; 1 when unknown."""
        if self.work is None or not self.steps:
            return 1.0
        ordered = sorted(self.steps, key=lambda s: s[0])
        middle = [w for _, w in ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1] if w is not None]
        if not middle:
            return 1.0
        typical = [sum(parts) / len(middle) for parts in zip(*middle)]
        pairs = [*zip(self.work, typical), (sum(self.work), sum(typical))]
        return max([1.0] + [now / usual for now, usual in pairs if usual > 0])

    def timeout_s(self) -> float:
        if self.configured_s > 0:
            return self.configured_s
        auto = FACTOR * statistics.median(self.times) * self.work_ratio() if self.steps else 0.0
        return max(self.min_s if self.warm else FIRST_STEP_S, auto)

    def window_s(self) -> float:
        """How long a call may stand still: the running deadline's length."""
        return self.scale * self.timeout_s()

    def start(self, scale: float = 1.0, work: tuple[float, ...] | None = None) -> None:
        """A new deadline: `scale` x the step timeout from now (an evaluation pass of N batches: N); `work`: the
        step's (vision, text) FLOPs, which the automatic timeout scales with."""
        self.started, self.scale, self.work = time.monotonic(), scale, work

    def since_start_s(self) -> float:
        return time.monotonic() - self.started if self.started is not None else 0.0

    def remaining_s(self) -> float | None:
        if self.started is None:
            return None
        return max(0.0, self.started + self.window_s() - time.monotonic())

    def stop(self, step_s: float | None = None) -> None:
        """The deadline is met; `step_s`: the step's time, for the automatic timeout (with the work `start` got)."""
        self.started = None
        if step_s is not None:
            self.steps = (self.steps + [(step_s, self.work)])[-100:]
            self.warm = True
        self.work = None

    def new_attempt(self) -> None:
        self.warm, self.started, self.work = False, None, None


def wait_or_hang(
    refs: list[ray.ObjectRef],
    clock: StepClock,
    what: str,
    pools: list[tuple[str, Any]],
    where: dict[str, list[dict]],
    ledger: CallLedger,
) -> list[Any]:
    """`ray.get(refs)`; past the clock's deadline, the ranks are looked at (`look`) until the refs are done
    (ranks that move) or one stands still for the window (`StepHung`, naming who)."""
    if refs:
        timeout, waiting = clock.remaining_s(), time.monotonic()
        while True:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            if not pending:
                break
            waited = min(clock.since_start_s(), time.monotonic() - waiting)
            try:
                timeout = look(clock, what, pools, where, ledger, waited)
            except StepHung:
                if ray.wait(refs, num_returns=len(refs), timeout=0)[1]:
                    raise
                break  # the results came while the ranks were asked (a look can take seconds): nothing hangs
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


@dataclass
class Verdict:
    """`judge`'s answer: the ranks that hang (stage, rank, heartbeat), whether nothing moves with no rank in a
    call (the step waits on something outside the ranks), and how long to wait before looking again."""

    hung: list[tuple[str, int, dict]] = field(default_factory=list)
    idle_stall: bool = False
    wait_s: float = 0.0


def judge(answers: list[tuple[str, int, dict]], window_s: float, waited_s: float) -> Verdict:
    """Which of the ranks that answered (stage, rank, `Progress.snapshot()`) hang, after the driver waited
    `waited_s` for these results (within the step) with the window `window_s`. A rank in a call stands still
    for the seconds since its progress last moved, not counting from before the wait (the driver may have been
    busy: a rank that finished its calls meanwhile did not stand still on them). A pool whose ranks in a call
    all stood still for the window hangs; one where any moved within it does not (the others wait in a
    collective for it). With no rank in a call at all, the step hangs once no rank moved for the window."""

    def still(a: dict) -> float:
        return min(float(a.get("still_s", waited_s)), waited_s)

    busy: dict[str, list[tuple[str, int, dict]]] = {}
    for stage, rank, a in answers:
        if a.get("call"):
            busy.setdefault(stage, []).append((stage, rank, a))
    if not busy:
        quiet = min((still(a) for _, _, a in answers), default=waited_s)
        if quiet >= window_s:
            return Verdict(idle_stall=True)
        return Verdict(wait_s=max(RECHECK_S, window_s - quiet))
    verdict = Verdict(wait_s=window_s)
    for ranks in busy.values():
        quiet = min(still(a) for _, _, a in ranks)
        if quiet >= window_s:
            verdict.hung += ranks
        else:
            verdict.wait_s = min(verdict.wait_s, window_s - quiet)
    verdict.wait_s = max(RECHECK_S, verdict.wait_s)
    return verdict


def look(
    clock: StepClock,
    what: str,
    pools: list[tuple[str, Any]],
    where: dict[str, list[dict]],
    ledger: CallLedger,
    waited_s: float,
) -> float:
    """Heartbeat every stage actor: those that do not answer within HEARTBEAT_S hang; else `judge` says from
    their progress (`waited_s`: how long the driver has waited for the results). Raises `StepHung`, or returns
    the seconds to wait before looking again."""
    clock.looks += 1
    ranks = [(stage, rank, a.handle) for stage, pool in pools for rank, a in enumerate(pool.actors)]
    answers = ray.get(_ask.remote([h for _, _, h in ranks], "heartbeat", HEARTBEAT_S))
    in_call = ledger.in_call()

    def node(stage: str, rank: int) -> str:
        w = where[stage][rank]
        return f"{stage} rank {rank} (pid {w['pid']}, node {w['node_id'][:8]})"

    silent = [
        (stage, rank, in_call.get((stage, rank), "no call"), a)
        for (stage, rank, _), a in zip(ranks, answers)
        if a in (MISSING, GONE)
    ]
    if silent:
        head = f"{what} did not finish within training.step_timeout_s={clock.timeout_s():g} s"
        who = "; ".join(
            f"{node(stage, rank)} {'died' if a == GONE else 'stopped answering'} in {method}"
            for stage, rank, method, a in silent
        )
        raise StepHung(f"{head}: {who}", [(stage, rank, method) for stage, rank, method, _ in silent])
    alive = [(stage, rank, a if isinstance(a, dict) else {}) for (stage, rank, _), a in zip(ranks, answers)]
    window = clock.window_s()
    verdict = judge(alive, window, waited_s)
    if not verdict.hung and not verdict.idle_stall:
        return verdict.wait_s
    knob = (
        f"training.step_timeout_s={clock.configured_s:g} s"
        if clock.configured_s > 0
        else (
            f"training.step_timeout_s=0: auto, {FACTOR:g} x the median step x this batch's work "
            f"{clock.work_ratio():.3g} x the median's, at least training.step_timeout_min_s={clock.min_s:g} s"
        )
    )
    head = f"{what} made no progress for {window:.3g} s ({knob})"
    if verdict.idle_stall:
        calls = ", ".join(f"{s} rank {r} in {m}" for (s, r), m in sorted(in_call.items())) or "none"
        raise StepHung(
            f"{head}; no rank is in a call and none moved (the step waits on something outside "
            f"them); unfinished calls: {calls}",
            [(s, r, m) for (s, r), m in sorted(in_call.items())],
        )

    def stands(a: dict) -> str:
        place = ", ".join(p for p in (a.get("where"), f"at {a['at']}" if a.get("at") else "") if p)
        return f"stood still {min(a['still_s'], waited_s):.1f} s in {a['call']}" + (f" ({place})" if place else "")

    who = "; ".join(f"{node(stage, rank)} {stands(a)}" for stage, rank, a in verdict.hung)
    raise StepHung(f"{head}: {who}", [(stage, rank, a["call"]) for stage, rank, a in verdict.hung])


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
            streams = "; ".join(f"stream {i}: {stream_position(w)}" for i, w in zip(which, where))
            raise DataStalled(
                f"{what}: the data pipeline read nothing for 2 x data.timeout_s={timeout_s:g} s ({streams}); "
                f"a read blocked on storage or a stopped preprocessing worker (raise data.timeout_s if the "
                f"storage is this slow)"
            )
        for i, w in zip(which, where):
            if isinstance(w, dict) and w["read"] and 2 * sum(w["skipped"].values()) >= w["read"]:
                print(f"warning: {what}: {skipping(i, w)}", flush=True)
        before = where


def stream_position(answer: Any) -> str:
    """A stream's answer to `position` (`_ask`'s), for people: where it stands, or why it did not say."""
    if isinstance(answer, dict):
        return answer["where"]
    if answer == GONE:
        return "its loader died"
    return f"its loader did not answer within {HEARTBEAT_S:g} s (still starting, or its process is stuck)"


def skipping(stream: int, position: dict[str, Any]) -> str:
    """Why a late stream that reads is late: most of what it read for the batch was skipped (`BatchLoader.position`).
    Said while it goes on, because a stream stops with "no usable sample" only once it has read every file without
    one, which at 100k shards is hours of reading when a setting keeps every record out."""
    read, skipped, example = position["read"], position["skipped"], position["example"]
    reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    last = f"; the last: {example['source']}: {example['error']} ({example['detail']})" if example else ""
    return (
        f"data stream {stream} is late: {sum(skipped.values())} of the {read} records it read for this batch "
        f"were skipped ({reasons}){last}. It keeps reading; every skipped record is in RUN_DIR/quarantine.jsonl "
        f"once a batch arrives. If every record is skipped, check data.image_root, data.webdataset.caption and "
        f"data.max_seq_len against the last one"
    )
