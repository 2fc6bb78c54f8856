"""Fan-out and fan-in: which vision replica encodes each text replica's micro-batch, and the call order.

The two pools have their own data-parallel sizes, `Dv` vision replicas and `Dt` text replicas, chosen
independently (a 2-GPU encoder serving four TP-2 LLM replicas, or four encoder replicas feeding one TP-4
LLM). The data streams are the text replicas' (one loader each: a micro-batch's loss and label tokens
belong to one text replica); each micro-batch ("key" (t, i): text replica t's i-th) is encoded by one
vision replica, which gets its gradient back in the backward.

Assignment (`route`): by patch count, not by index. Largest micro-batch first, each to the vision replica
with the fewest patches so far (LPT); each replica then encodes its share in key order (i, t), the order
the text replicas need them in. Lockstep layouts (ZeRO-3: collectives span every replica of the pool)
run in *slots*: every replica of the pool joins every call, padded with `None` members where it has nothing.
  vision lockstep: the keys, in key order, are cut into slots of Dv; within a slot LPT again.
  text lockstep:   text slot i = every text replica's i-th micro-batch; all of them must be encoded before
                   its call, so a vision replica gets at most ceil(Dt / Dv) of one slot and needs
                   `pipeline.max_in_flight` >= that many graphs alive (`check_fan`).

Order. Each vision unit (a replica, or the whole pool when lockstep) runs the one-forward-one-backward order
of `schedule.pipeline_schedule` over its positions: at most `max_in_flight` forward graphs alive. Each text
unit runs its micro-batches in order. A text call needs the forwards of its keys, a vision backward the
text calls of its keys. The calls are merged into one submission list in which every call comes after
what it needs; since every actor runs the calls of one submitter in submission order (schedule.py), that
list cannot deadlock: the earliest unfinished call always has its inputs and a free actor. Such a list
exists because every position of a vision queue holds a larger key than the one K positions before it,
and a text call waits only on smaller keys (the argument is written out at `_merge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhp.models.parallel.schedule import (
    DEPENDS_ON,
    TEXT_FORWARD_BACKWARD,
    VISION_BACKWARD,
    VISION_FORWARD,
    pipeline_schedule,
    stage_order,
)

Key = tuple[int, int]  # (text replica t, index i of the micro-batch in t's list)


@dataclass(frozen=True)
class Call:
    """One submission: `kind` on every (replica, key) member; a key None is a lockstep pool's padding.
    `slot` is the position in the unit's order (a vision forward and its backward share it)."""

    kind: str
    slot: int
    members: tuple[tuple[int, Key | None], ...]

    @property
    def stage(self) -> str:
        return "text" if self.kind == TEXT_FORWARD_BACKWARD else "vision"

    def keys(self) -> list[Key]:
        return [k for _, k in self.members if k is not None]


def slot_cap(num_text: int, num_vision: int) -> int:
    """Most micro-batches of one text slot a vision replica encodes when the text pool runs in lockstep."""
    return -(-num_text // num_vision)


def check_fan(
    num_vision: int, num_text: int, vision_lockstep: bool, text_lockstep: bool, max_in_flight: int
) -> str | None:
    """Why this fan cannot run (None if it can). A text pool in lockstep needs all Dt micro-batches of a
    slot encoded before the slot's call, i.e. ceil(Dt/Dv) graphs alive on a vision replica."""
    if num_vision < 1 or num_text < 1:
        return f"each pool needs at least one replica (vision {num_vision}, text {num_text})"
    need = slot_cap(num_text, num_vision)
    if text_lockstep and max_in_flight < need:
        return (
            f"the text pool runs in lockstep (zero3): each of its steps takes one micro-batch from each of its "
            f"{num_text} replicas, all encoded first, so each of the {num_vision} vision replicas holds up to "
            f"{need} forward graphs: set pipeline.max_in_flight>={need}, or give the vision pool "
            f"{slot_cap(num_text, max_in_flight)} or more replicas"
        )
    return None


def _lpt(keys: list[Key], patches: dict[Key, int], load: list[int], free: list[int] | None = None) -> dict[Key, int]:
    """Largest first, each to the least-loaded replica (with room left in `free`, if given)."""
    out = {}
    for key in sorted(keys, key=lambda k: (-patches[k], k[1], k[0])):
        choices = [v for v in range(len(load)) if free is None or free[v] > 0]
        v = min(choices, key=lambda v: (load[v], v))
        out[key], load[v] = v, load[v] + patches[key]
        if free is not None:
            free[v] -= 1
    return out


def balance_text(costs: list[list[float]]) -> list[list[Key]]:
    """The micro-batches each text replica runs: as many as its loader made, the costliest first to the replica
    with the least cost so far that has room (LPT with each replica's count kept). `costs[t][i]`: the cost of
    text replica t's i-th micro-batch as its loader made it (`balance.text_cost`: padded tokens, or with
    `data.balance` tokens and patches). Returns per replica the loaders' keys it runs, in key order; never a
    larger most-loaded replica than the loaders' own split.

    Why: the loaders deal each replica the same number of samples, not the same tokens, and the step waits on
    the replica that drew the long ones. Any assignment trains the same model: every micro-batch's loss is
    scaled by the global batch's label tokens and the gradients are summed over the replicas. The counts stay,
    so a replica never runs with nothing and the vision routing's constraints are unchanged."""
    cost = {(t, i): c for t, cs in enumerate(costs) for i, c in enumerate(cs)}
    owner = _lpt(list(cost), cost, [0] * len(costs), free=[len(cs) for cs in costs])
    dealt = [sorted((k for k in cost if owner[k] == t), key=lambda k: (k[1], k[0])) for t in range(len(costs))]
    loaded = [[(t, i) for i in range(len(cs))] for t, cs in enumerate(costs)]
    # LPT with fixed counts can do worse than the loaders did (a replica with room for many takes the largest)
    return min((dealt, loaded), key=lambda ks: max((sum(cost[k] for k in r) for r in ks), default=0))


def route(
    patches: list[list[int]], num_vision: int, vision_lockstep: bool, text_lockstep: bool, max_in_flight: int
) -> list[Call]:
    """The submission order of one global batch. patches[t][i]: patches of text replica t's micro-batch i."""
    why = check_fan(num_vision, len(patches), vision_lockstep, text_lockstep, max_in_flight)
    if why:
        raise ValueError(why)
    num_text, longest = len(patches), max(map(len, patches), default=0)
    cost = {(t, i): n for t, ps in enumerate(patches) for i, n in enumerate(ps)}
    ordered = sorted(cost, key=lambda k: (k[1], k[0]))  # key order: index first, then text replica
    # Text units: their slots of (replica, key) members.
    if text_lockstep:
        text_units = [
            [tuple((t, (t, i) if i < len(patches[t]) else None) for t in range(num_text)) for i in range(longest)]
        ]
    else:
        text_units = [[((t, (t, i)),) for i in range(len(patches[t]))] for t in range(num_text)]
    # Vision units: slots of (replica, key) members, in key order.
    load = [0] * num_vision
    if vision_lockstep:
        groups = [[k for k in ordered if k[1] == i] for i in range(longest)] if text_lockstep else [ordered]
        slots = []
        for group in groups:
            for start in range(0, len(group), num_vision):
                chunk = _lpt(group[start : start + num_vision], cost, load, free=[1] * num_vision)
                where = {v: k for k, v in chunk.items()}
                slots.append(tuple((v, where.get(v)) for v in range(num_vision)))
        vision_units = [slots]
    else:
        if text_lockstep:  # at most ceil(Dt / Dv) of one text slot per vision replica
            owner = {}
            for i in range(longest):
                group = [k for k in ordered if k[1] == i]
                owner |= _lpt(group, cost, load, free=[slot_cap(len(group), num_vision)] * num_vision)
        else:
            owner = _lpt(ordered, cost, load)
        vision_units = [[((v, k),) for k in ordered if owner[k] == v] for v in range(num_vision)]
    return _merge(vision_units, text_units, max_in_flight)


def _merge(vision_units: list[list[tuple]], text_units: list[list[tuple]], max_in_flight: int) -> list[Call]:
    """One list of every unit's calls, each after what it needs.

    Why one exists: a vision forward at position p waits on the backward at p - K, which waits on the text
    calls of that position's keys; keys grow along a vision queue, so those are smaller than p's. A text
    call waits on its predecessor (smaller keys) and on forwards of its own keys. By induction over keys,
    every call waits only on calls of smaller keys or on forwards of its own, never on itself. Under a text
    lockstep the same holds with "key" read as "text slot", given `check_fan`'s bound on K.
    """
    sequences = []
    for slots in vision_units:
        order = stage_order(pipeline_schedule(len(slots), max_in_flight), "vision")
        sequences.append([Call(op.kind, op.mb, slots[op.mb]) for op in order])
    for slots in text_units:
        sequences.append([Call(TEXT_FORWARD_BACKWARD, i, members) for i, members in enumerate(slots)])
    done: set[tuple[str, Key]] = set()
    calls, heads = [], [0] * len(sequences)
    while any(h < len(s) for h, s in zip(heads, sequences)):
        progressed = False
        for u, seq in enumerate(sequences):
            while heads[u] < len(seq):
                call = seq[heads[u]]
                if call.kind in DEPENDS_ON and any((DEPENDS_ON[call.kind], k) not in done for k in call.keys()):
                    break
                calls.append(call)
                done.update((call.kind, k) for k in call.keys())
                heads[u] += 1
                progressed = True
        if not progressed:  # unreachable when check_fan passed: the docstring's argument
            raise RuntimeError(f"routing deadlock at {[s[h] for h, s in zip(heads, sequences) if h < len(s)]}")
    return calls


def simulate_calls(
    calls: list[Call],
    forward_s: float | dict[Key, float],
    text_s: float | dict[Key, float],
    backward_s: float | dict[Key, float],
    resources: Any = None,
) -> tuple[float, dict[Any, float]]:
    """Best-case makespan of `calls` (seconds per call of each kind, padding included; no transfers), and
    each resource's busy seconds: each replica runs its calls in list order, one at a time, a lockstep call
    on all its members at once; a call starts when its resources are free and its inputs exist
    (`schedule.simulate` for many replicas). A kind's seconds are one figure for every call, or one per key
    (micro-batches of different sizes): a lockstep call lasts as long as its slowest member's.
    `resources(call)` names what a call occupies (default: its actors, (stage, replica)); devices shared by
    both pools make their calls take turns."""
    seconds = {VISION_FORWARD: forward_s, TEXT_FORWARD_BACKWARD: text_s, VISION_BACKWARD: backward_s}

    def call_s(call: Call) -> float:
        s = seconds[call.kind]
        return max(s[k] for k in call.keys()) if isinstance(s, dict) else s

    free: dict[Any, float] = {}
    busy: dict[Any, float] = {}
    ends: dict[tuple[str, Key], float] = {}
    for call in calls:
        actors = resources(call) if resources else [(call.stage, r) for r, _ in call.members]
        ready = max(
            [ends[(DEPENDS_ON[call.kind], k)] for k in call.keys()] if call.kind in DEPENDS_ON else [], default=0.0
        )
        cost = call_s(call)
        end = max([ready] + [free.get(a, 0.0) for a in actors]) + cost
        free.update((a, end) for a in actors)
        busy.update((a, busy.get(a, 0.0) + cost) for a in set(actors))
        ends.update(((call.kind, k), end) for k in call.keys())
    return max(free.values(), default=0.0), busy
