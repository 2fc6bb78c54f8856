"""Data positions (dataflow/positions.py) without a cluster: streams simulated over parts of known sizes, each
row named (epoch, part, row). A resume in the same layout continues each stream's sequence exactly; a resume into
another number of streams, repeated, leaves no row of any epoch out, and reads none twice where parts are dealt."""

from __future__ import annotations

import random
from collections import Counter
from itertools import islice

import pytest

from dhp.dataflow.positions import reads, reshard, resumed

Row = tuple[int, int, int]  # (epoch, part, row)


def _rows(sizes: list[int], state: dict, r: int, n: int, epochs: int) -> list[Row]:
    """What stream r of n reads from `state` on, through epoch `epochs` - 1 (BatchLoader._epoch_rows' order)."""
    out = []
    for x in range(state["epoch"], epochs):
        mine = reads(len(sizes), state["plans"].get(str(x)), r, n, state["deals"])
        if x == state["epoch"]:
            mine = resumed(mine, state["part"], state["taken"])
        out += [(x, rd.part, row) for rd in mine for row in range(rd.first + rd.offset, sizes[rd.part], rd.step)]
    return out


def _after(state: dict, taken_rows: list[Row]) -> dict:
    """`state` after consuming `taken_rows`, as BatchLoader tracks it (epoch, part, taken; plans of later epochs)."""
    epoch, part, taken = state["epoch"], state["part"], state["taken"]
    for x, k, _ in taken_rows:
        if x != epoch:
            epoch, part, taken = x, -1, 0
        if k != part:
            part, taken = k, 0
        taken += 1
    plans = {e: p for e, p in state["plans"].items() if int(e) >= epoch}
    return {**state, "epoch": epoch, "part": part, "taken": taken, "plans": plans}


def _fresh(sizes: list[int], deals: bool) -> dict:
    return {
        "epoch": 0,
        "cursor": 0,
        "source": "",
        "good": 0,
        "skipped": {},
        "skip_examples": [],
        "parts": len(sizes),
        "deals": deals,
        "files": "k",
        "plans": {},
        "part": -1,
        "taken": 0,
    }


def _scenario(rng: random.Random) -> tuple[list[int], bool, list[int]]:
    sizes = [rng.choice([0, 1, 3, 4, 5, 6, 9]) for _ in range(rng.randint(1, 30))]
    return sizes, rng.random() < 0.7, [rng.randint(1, 8) for _ in range(rng.randint(2, 6))]


@pytest.mark.parametrize("seed", range(0, 3000, 10))
def test_resumes_continue_exactly_and_reshards_leave_nothing_out(seed):
    """300 chains (of 3000 seeds checked once: all pass) of up to 6 layouts of 1-8 streams over 1-30 parts."""
    rng = random.Random(seed)
    sizes, deals, counts = _scenario(rng)
    epochs = 4
    states = [_fresh(sizes, deals) for _ in range(counts[0])]
    consumed: Counter[Row] = Counter()
    strided = False
    for n, next_n in zip(counts, counts[1:]):
        plans = states[0]["plans"]  # the same for every stream after a reshard
        strided |= any(
            rd.step > 1
            for x in range(epochs)
            for r in range(n)
            for rd in reads(len(sizes), plans.get(str(x)), r, n, deals)
        )
        for r, s in enumerate(states):
            ahead = _rows(sizes, s, r, n, epochs)
            c = rng.randint(0, max(0, len(ahead) - sum(sizes)))  # leave the last epoch unread
            states[r] = _after(s, ahead[:c])
            consumed.update(ahead[:c])
            # the same layout resumes exactly where the stream stood
            assert _rows(sizes, states[r], r, n, epochs) == ahead[c:]
        states = reshard(states, next_n)
        assert len(states) == next_n and (n == next_n or all(s["part"] == -1 and s["taken"] == 0 for s in states))
    n = counts[-1]
    strided |= any(
        rd.step > 1
        for x in range(epochs)
        for r in range(n)
        for rd in reads(len(sizes), states[0]["plans"].get(str(x)), r, n, deals)
    )
    rest = [row for r, s in enumerate(states) for row in _rows(sizes, s, r, n, epochs)]
    everything = {(x, k, i) for x in range(epochs) for k, size in enumerate(sizes) for i in range(size)}
    low = min(s["epoch"] for s in states)
    assert len(rest) == len(set(rest))  # the new streams are disjoint
    assert {row for row in everything if row[0] >= low} <= set(rest) | set(consumed)  # nothing left out
    assert {row for row in everything if row[0] < low} <= set(consumed)
    twice = (consumed - Counter(set(consumed))) + Counter(set(consumed) & set(rest))
    if deals and not strided:
        assert not twice, f"dealt parts read twice: {sorted(twice)[:5]}"


def test_a_stream_ahead_by_an_epoch_keeps_its_progress():
    """Dealt shards of unequal size: stream 0 finished its share of epoch 0 and is 3 rows into epoch 1 while
    stream 1 is still in epoch 0. Resumed into one stream, epoch 0 continues where stream 1 stood and epoch 1
    leaves out what stream 0 read of it."""
    sizes = [9, 1, 9, 1]
    a, b = _fresh(sizes, True), _fresh(sizes, True)
    ra, rb = _rows(sizes, a, 0, 2, 2), _rows(sizes, b, 1, 2, 2)
    part_a = sum(sizes[rd.part] for rd in reads(4, None, 0, 2, True))
    a, b = _after(a, ra[: part_a + 3]), _after(b, rb[:1])
    assert (a["epoch"], b["epoch"]) == (1, 0)
    (one,) = reshard([a, b], 1)
    rest = _rows(sizes, one, 0, 1, 2)
    assert len(rest) == 2 * sum(sizes) - part_a - 3 - 1 and not set(rest) & set(ra[: part_a + 3] + rb[:1])
    assert len(reshard([a, b], 2)) == 2 and reshard([a, b], 2)[0] is a and reshard([a, b], 0) == []
    # resumed into 2 streams again before the one stream reached epoch 1: epoch 1's plan is kept, not dropped
    again = reshard([one], 2)
    assert again[0]["plans"] == one["plans"] and "1" in one["plans"]
    rest = [row for r, s in enumerate(again) for row in _rows(sizes, s, r, 2, 2)]
    assert len(rest) == len(set(rest)) and not set(rest) & set(ra[: part_a + 3] + rb[:1])


def test_counters_are_run_totals_on_stream_zero():
    old = [
        {**_fresh([4], False), "good": 3, "skipped": {"bad_json": 1}, "skip_examples": ["x"]},
        {**_fresh([4], False), "good": 4, "skipped": {"bad_json": 2, "no_image": 1}},
    ]
    new = reshard(old, 3)
    assert [s["good"] for s in new] == [3, 2, 2]
    assert new[0]["skipped"] == {"bad_json": 3, "no_image": 1} and new[0]["skip_examples"] == ["x"]
    assert all(s["skipped"] == {} and s["skip_examples"] == [] for s in new[1:])


def test_shards_are_dealt_only_with_two_per_stream():
    assert [rd.part for rd in reads(8, None, 1, 4, True)] == [1, 5]  # whole shards r, r + N
    assert all(rd.step == 1 for rd in reads(8, None, 1, 4, True))
    assert [(rd.offset, rd.step) for rd in reads(7, None, 1, 4, True)] == [(1, 4)] * 7  # too few: a stride of each
    assert [(rd.offset, rd.step) for rd in reads(8, None, 1, 4, False)] == [(1, 4)] * 8  # JSONL never deals
    plan = {"done": [[0, 2]], "first": [[2, 3]]}  # parts 0 and 1 done: [start, end) ranges
    assert reads(8, plan, 0, 2, True)[0] == (2, 3, 0, 1)  # a resharded epoch: done parts left out, begun ones on
    assert next(islice(iter(reads(8, plan, 0, 4, True)), 1)) == (2, 3, 0, 4)  # 6 left < 2 x 4: strided from row 3
