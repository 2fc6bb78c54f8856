"""Where a data stream stands in its epoch, and how N streams' positions continue in another number of streams.

An epoch reads the files of `data.train` -- JSONL annotation files or WebDataset shards, *parts* here -- in an order
its seed fixes (`sources`), each part a fixed sequence of rows (its records, shuffled with the same seed). N
data-parallel streams read the epoch's parts one of two ways (`reads`):

    dealt    stream r reads whole parts r, r + N, r + 2N, ... of those left in the epoch: each byte is fetched
             once in all. WebDataset shards, when at least DEAL_MIN x N of them are left
    strided  every stream reads every part and keeps its rows r, r + N, r + 2N, ... (JSONL files; a few shards)

A `Read` is one part as one stream reads it: the part's rows first + offset + step * j, j = 0, 1, ... (row
indices in the part's shuffled order; `first` > 0 when a resume starts it past rows read before).
A stream's position is (epoch, part, taken): it is in part `part` (a position in the epoch's order, -1 before its
first row) and has consumed `taken` of its rows of it; the parts before it in its reads are behind it, those after
it not begun. A resume into as many streams skips the parts behind unread and starts `part` `taken` rows in
(`resumed`): no re-read prefix, however deep into the epoch.

Another number of streams (`reshard`) gets a `Plan` for each epoch the old streams were in: the parts all of
whose readers had finished them (`done`) and, for the others, the row their consumed prefix ends at (`first`).
The new streams read the rest. Dealt parts have one reader: nothing is read twice and nothing left out, across
any number of reshards and whichever epochs the streams had drifted into. A strided part's consumed prefix ends
at first + min_i (offset_i + step * taken_i) over its readers not yet past it; the rows beyond that which streams
ahead of the slowest had read (their drift) are read again, never left out.

Pure Python on JSON-able dicts: checkpoints store the positions (`BatchLoader.state`), and the read tasks
import `own_rows`.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, NamedTuple

DEAL_MIN = 2  # deal shards only with >= 2 per stream: fewer leave the streams' shares (and epochs) far apart
MAX_SKIP_EXAMPLES = 50  # examples in the run summary; every skipped record goes to RUN_DIR/quarantine.jsonl


class Read(NamedTuple):
    """One part as one stream reads it: its rows first + offset + step * j (all rows in `split` order)."""

    part: int  # position in the epoch's order of the parts
    first: int = 0  # the row (in the part's shuffled order) reading starts at: > 0 after a resume
    offset: int = 0
    step: int = 1

    def item(self, path: str) -> dict[str, Any]:
        """The read as the row that `sources` splits in a Ray Data task (JSON types only)."""
        return {"path": path, **self._asdict()}


def own_rows(rows: list[dict[str, Any]], read: dict[str, Any], seed: int | None) -> list[dict[str, Any]]:
    """A part's rows, in file order -> a read's (`Read.item`): shuffled with the epoch's seed, then every `step`-th
    from `first` + `offset`, each tagged with its part so that the stream knows where it stands."""
    if seed is not None:
        random.Random(seed).shuffle(rows)
    start = read.get("first", 0) + read.get("offset", 0)
    return [{**r, "part": read.get("part", 0)} for r in rows[start :: read.get("step", 1)]]


def files_key(paths: list[str], deals: bool) -> str:
    """What positions count in: the files' names, in order, and whether they may be dealt (a short hash). Names,
    not whole paths, so that data moved to another folder or bucket resumes."""
    import hashlib

    names = "\n".join(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)
    return hashlib.sha256(f"{deals}\n{names}".encode()).hexdigest()[:16]


def plan_parts(plan: dict[str, Any] | None) -> tuple[set[int], dict[int, int]]:
    """(done, first) of a plan (None: a fresh epoch). `done` is stored as [start, end) ranges: every stream's
    checkpointed state carries the plans, and finished parts come in long runs."""
    if not plan:
        return set(), {}
    return {k for a, b in plan["done"] for k in range(a, b)}, {k: row for k, row in plan["first"]}


def _ranges(parts: set[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for k in sorted(parts):
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
    return out


def reads(parts: int, plan: dict[str, Any] | None, replica: int, num_replicas: int, deals: bool) -> list[Read]:
    """What stream `replica` of `num_replicas` reads of an epoch of `parts` parts, `plan` of it read before."""
    done, first = plan_parts(plan)
    left = [k for k in range(parts) if k not in done]
    if deals and len(left) >= DEAL_MIN * num_replicas:
        return [Read(k, first.get(k, 0)) for k in left[replica::num_replicas]]
    return [Read(k, first.get(k, 0), replica, num_replicas) for k in left]


def resumed(mine: list[Read], part: int, taken: int) -> list[Read]:
    """`mine` from position (part, taken) on: the parts before `part` left out, `taken` rows of it skipped."""
    if part < 0:
        return mine
    at = next((i for i, r in enumerate(mine) if r.part == part), None)
    if at is None:
        raise ValueError(f"data position: part {part} is not one this stream reads ({[r.part for r in mine]})")
    head = mine[at]
    return [head._replace(first=head.first + head.step * taken), *mine[at + 1 :]]


def _prefix(states: list[dict[str, Any]], epoch: int, plan: dict[str, Any] | None) -> dict[int, int | None]:
    """Per part of `epoch`, the row the old streams' consumed prefix ends at (None: finished by every reader)."""
    n, parts, deals = len(states), states[0]["parts"], states[0]["deals"]
    ends: dict[int, int | None] = {}
    for r, s in enumerate(states):
        mine = reads(parts, plan, r, n, deals)
        at = next((i for i, rd in enumerate(mine) if rd.part == s["part"]), -1) if s["epoch"] == epoch else -1
        for i, rd in enumerate(mine):
            if s["epoch"] > epoch or (s["epoch"] == epoch and i < at):
                ends.setdefault(rd.part, None)  # finished by this reader: it does not bound the prefix
                continue
            taken = s["taken"] if s["epoch"] == epoch and i == at else 0
            end = rd.first + rd.offset + rd.step * taken
            ends[rd.part] = end if ends.get(rd.part) is None else min(end, ends[rd.part])
    return ends


def reshard(states: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `BatchLoader.state()`s of `n` streams that continue where the streams of `states` stopped (module
    docstring). n == len(states): `states` themselves. Counters are run totals: skips by reason and their
    examples go to stream 0, `good` is split evenly."""
    if n == len(states) or n == 0:  # n == 0: a trainer without training streams has nothing to position
        return list(states)[:n]
    if not states or n < 0:
        raise ValueError(f"cannot reshard {len(states)} data positions into {n}")
    low = min(s["epoch"] for s in states)
    held = next(s for s in states if s["epoch"] == low)["plans"]  # every stream got the same plans at the last
    # reshard, the ones of epochs it has not reached yet included
    high = max([*(s["epoch"] for s in states), *map(int, held)])
    plans = {}
    for epoch in range(low, high + 1):
        old = held.get(str(epoch))
        done, _ = plan_parts(old)
        ends = _prefix(states, epoch, old)
        plan = {
            "done": _ranges(done | {k for k, e in ends.items() if e is None}),
            "first": sorted([k, e] for k, e in ends.items() if e),
        }
        if plan["done"] or plan["first"]:
            plans[str(epoch)] = plan
    good = sum(s["good"] for s in states)
    skipped: Counter[str] = Counter()
    for s in states:
        skipped.update(s["skipped"])
    examples = [e for s in states for e in s["skip_examples"]][:MAX_SKIP_EXAMPLES]
    return [
        {
            "epoch": low,
            "cursor": 0,
            "source": "",
            "good": good // n + (r < good % n),
            "skipped": dict(skipped) if r == 0 else {},
            "skip_examples": examples if r == 0 else [],
            "parts": states[0]["parts"],
            "deals": states[0]["deals"],
            "files": states[0]["files"],
            "plans": plans,
            "part": -1,
            "taken": 0,
        }
        for r in range(n)
    ]
