"""The pipeline schedule: its order, its memory bound, its simulated time, and that it changes no gradient.

No Ray: the order of a list is the whole contract (Ray runs one submitter's actor tasks in that order).
Costs below are 0.5, 1, 2, 3 (exact in binary), so simulated times are exact and compared with ==.
"""

from __future__ import annotations

import pytest

from dhp.models.parallel.schedule import (
    TEXT_FORWARD_BACKWARD,
    VISION_BACKWARD,
    VISION_FORWARD,
    Op,
    max_alive,
    pipeline_schedule,
    simulate,
    stage_order,
)


def names(ops: list[Op]) -> list[str]:
    return [str(op) for op in ops]


def test_serial_order_is_exact_for_one_in_flight():
    assert pipeline_schedule(3, 1) == [
        Op(VISION_FORWARD, 0), Op(TEXT_FORWARD_BACKWARD, 0), Op(VISION_BACKWARD, 0),
        Op(VISION_FORWARD, 1), Op(TEXT_FORWARD_BACKWARD, 1), Op(VISION_BACKWARD, 1),
        Op(VISION_FORWARD, 2), Op(TEXT_FORWARD_BACKWARD, 2), Op(VISION_BACKWARD, 2),
    ]  # fmt: skip


def test_pipelined_orders_are_exact():
    assert names(pipeline_schedule(4, 2)) == "F0 F1 T0 B0 F2 T1 B1 F3 T2 B2 T3 B3".split()
    ops = pipeline_schedule(5, 3)
    assert names(stage_order(ops, "vision")) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4".split()
    assert names(stage_order(ops, "text")) == "T0 T1 T2 T3 T4".split()
    # More in flight than micro-batches: every forward first, then the backwards as the text pool frees them.
    assert names(pipeline_schedule(2, 5)) == "F0 F1 T0 B0 T1 B1".split()


def test_no_microbatches_no_ops():
    for k in (1, 3):
        ops = pipeline_schedule(0, k)
        assert ops == [] and max_alive(ops) == 0 and simulate(ops, 1.0, 1.0).makespan == 0.0


@pytest.mark.parametrize("k", range(1, 6))
@pytest.mark.parametrize("m", range(0, 9))
def test_schedule_invariants(m, k):
    ops = pipeline_schedule(m, k)
    assert sorted(ops, key=lambda op: (op.mb, op.kind)) == sorted(
        (Op(kind, i) for i in range(m) for kind in (VISION_FORWARD, TEXT_FORWARD_BACKWARD, VISION_BACKWARD)),
        key=lambda op: (op.mb, op.kind),
    )  # every op exactly once
    position = {op: n for n, op in enumerate(ops)}
    assert len(position) == len(ops)
    for i in range(m):  # each op's input is submitted before it
        f, t, b = (position[Op(kind, i)] for kind in (VISION_FORWARD, TEXT_FORWARD_BACKWARD, VISION_BACKWARD))
        assert f < t < b
    assert max_alive(ops) <= k
    assert max_alive(ops) == (min(k, m) if m else 0)
    assert [op.mb for op in stage_order(ops, "text")] == list(range(m))
    assert [op.mb for op in stage_order(ops, "vision") if op.kind == VISION_BACKWARD] == list(range(m))
    assert [op.mb for op in stage_order(ops, "vision") if op.kind == VISION_FORWARD] == list(range(m))
    assert len(stage_order(ops, "vision")) + len(stage_order(ops, "text")) == len(ops)


def test_max_alive_counts_along_the_list():
    f, b, t = VISION_FORWARD, VISION_BACKWARD, TEXT_FORWARD_BACKWARD
    assert max_alive([Op(f, 0), Op(f, 1), Op(t, 0), Op(b, 0), Op(f, 2), Op(f, 3)]) == 3
    assert max_alive([Op(t, 0)]) == 0


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_max_in_flight(bad):
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        pipeline_schedule(4, bad)


def test_invalid_counts_and_stage():
    with pytest.raises(ValueError, match="num_microbatches must be >= 0"):
        pipeline_schedule(-1, 2)
    with pytest.raises(ValueError, match="stage must be"):
        stage_order(pipeline_schedule(2, 1), "audio")


# --- simulate -----------------------------------------------------------------------------------------------
# Tv, Tt, Tb: vision forward, text forward+backward, vision backward, per micro-batch.
# Serial (K=1): nothing overlaps, so the step is M * (Tv + Tt + Tb).
# K >= 2 in the cases below: the text pool starts after F0 and the last B follows the last T, and the vision
# pool does M * (Tv + Tb) of work, so makespan >= max(M*(Tv+Tb), Tv + M*Tt + Tb); hand-stepping the
# timeline (e.g. spans in test_simulated_spans) shows no pool ever waits beyond that, so it is equal.
CASES = {  # name: (Tv, Tt, Tb)
    "balanced": (0.5, 1.0, 0.5),  # per micro-batch, vision pool 1 = text pool 1
    "vision_2to1": (1.0, 1.0, 1.0),  # (1, 1) with the default backward = forward cost
    "vision_3to1": (1.0, 1.0, 2.0),
    "text_3to1": (0.5, 3.0, 0.5),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", range(1, 9))
def test_serial_makespan(case, m):
    tv, tt, tb = CASES[case]
    timeline = simulate(pipeline_schedule(m, 1), tv, tt, tb)
    assert timeline.makespan == m * (tv + tt + tb)
    # The pools never overlap: the busiest one waits for the other's share of the step (a ratio: thirds
    # round, so approx here, unlike the times).
    assert timeline.bubble() == pytest.approx(min(tv + tb, tt) / (tv + tt + tb), rel=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", range(2, 6))
@pytest.mark.parametrize("m", range(1, 9))
def test_pipelined_makespan(case, k, m):
    tv, tt, tb = CASES[case]
    timeline = simulate(pipeline_schedule(m, k), tv, tt, tb)
    assert timeline.makespan == max(m * (tv + tb), tv + m * tt + tb)


def test_pipelined_makespan_closed_forms():
    m = 8
    assert simulate(pipeline_schedule(m, 2), 0.5, 1.0, 0.5).makespan == m + 1  # balanced: M*1 + fill/drain 1
    assert simulate(pipeline_schedule(m, 2), 1.0, 1.0).makespan == 2 * m  # default Tb = Tv: vision-bound
    assert simulate(pipeline_schedule(m, 2), 1.0, 1.0, 2.0).makespan == 3 * m  # vision-bound, never idle
    assert simulate(pipeline_schedule(m, 2), 0.5, 3.0, 0.5).makespan == 3 * m + 1  # text-bound + F0 + B_last
    balanced = simulate(pipeline_schedule(m, 3), 0.5, 1.0, 0.5)
    assert balanced.bubble() == 1 - m / (m + 1)
    assert simulate(pipeline_schedule(m, 1), 0.5, 1.0, 0.5).bubble() == 0.5


def test_simulated_spans():
    timeline = simulate(pipeline_schedule(2, 2), 0.5, 1.0, 0.5)
    assert {str(op): span for op, span in timeline.spans.items()} == {
        "F0": (0.0, 0.5), "F1": (0.5, 1.0), "T0": (0.5, 1.5), "B0": (1.5, 2.0), "T1": (1.5, 2.5), "B1": (2.5, 3.0),
    }  # fmt: skip
    assert timeline.busy("vision") == 2.0 and timeline.busy("text") == 2.0


def test_simulate_callable_costs():
    m = 4
    vision, text, back = (lambda mb: mb + 1.0), (lambda mb: 2.0 * mb), (lambda mb: 0.5)
    serial = simulate(pipeline_schedule(m, 1), vision, text, back)
    assert serial.makespan == sum(vision(i) + text(i) + back(i) for i in range(m))  # 10 + 12 + 2
    # F_i costs i+1, T_i costs 2i: the text pool always waits for F_i, which ends at 1+2+...+(i+1) (vision
    # pool runs ahead with K >= M); T3 ends at 10 + 6 = 16, B3 after it: 16.5.
    assert simulate(pipeline_schedule(m, m), vision, text, back).makespan == 16.5


def test_simulate_rejects_invalid_orders():
    f, t, b = Op(VISION_FORWARD, 0), Op(TEXT_FORWARD_BACKWARD, 0), Op(VISION_BACKWARD, 0)
    with pytest.raises(ValueError, match="before its dependency"):
        simulate([t, f, b], 1.0, 1.0)
    with pytest.raises(ValueError, match="before its dependency"):
        simulate([f, b, t], 1.0, 1.0)
    with pytest.raises(ValueError, match="twice"):
        simulate([f, f], 1.0, 1.0)
    with pytest.raises(ValueError, match="negative cost"):
        simulate([f], -1.0, 1.0)


# --- the schedule changes when things run, never what is computed ----------------------------------------------
class FakeVision:
    """emb = w * x; backward adds d loss / d w = g * x, remembering each term in order."""

    def __init__(self, w: float):
        self.w, self.alive, self.terms, self.calls, self.peak = w, {}, [], [], 0

    def forward(self, mb: int, x: float) -> float:
        self.calls.append(f"F{mb}")
        self.alive[mb] = x  # the "activation graph" kept until the backward
        self.peak = max(self.peak, len(self.alive))
        return self.w * x

    def backward(self, mb: int, g: float) -> None:
        self.calls.append(f"B{mb}")
        self.terms.append(g * self.alive.pop(mb))


class FakeText:
    """loss = v * (emb - y)^2; accumulates d loss / d v and returns d loss / d emb."""

    def __init__(self, v: float):
        self.v, self.terms, self.calls = v, [], []

    def forward_backward(self, mb: int, emb: float, y: float) -> float:
        self.calls.append(f"T{mb}")
        self.terms.append((emb - y) ** 2)
        return 2 * self.v * (emb - y)


def run(ops: list[Op], xs: list[float], ys: list[float]) -> tuple[FakeVision, FakeText]:
    vision, text = FakeVision(0.7), FakeText(1.3)
    embs, grads = {}, {}  # what Ray object refs would carry between the pools
    for op in ops:
        if op.kind == VISION_FORWARD:
            embs[op.mb] = vision.forward(op.mb, xs[op.mb])
        elif op.kind == TEXT_FORWARD_BACKWARD:
            grads[op.mb] = text.forward_backward(op.mb, embs.pop(op.mb), ys[op.mb])
        else:
            vision.backward(op.mb, grads.pop(op.mb))
    return vision, text


@pytest.mark.parametrize("k", [2, 3, 7])
def test_accumulated_gradients_match_serial(k):
    m = 7
    # Values of very different magnitude: float sums in another order would differ, so == checks the order.
    xs = [0.1 * 10.0**i for i in range(m)]
    ys = [1.0 / (i + 3) for i in range(m)]
    serial_v, serial_t = run(pipeline_schedule(m, 1), xs, ys)
    piped_v, piped_t = run(pipeline_schedule(m, k), xs, ys)
    assert piped_v.terms == serial_v.terms and piped_t.terms == serial_t.terms
    assert sum(piped_v.terms) == sum(serial_v.terms) and sum(piped_t.terms) == sum(serial_t.terms)
    assert piped_v.calls == names(stage_order(pipeline_schedule(m, k), "vision"))
    assert piped_t.calls == [f"T{i}" for i in range(m)]
    assert serial_v.peak == 1 and piped_v.peak == min(k, m)
    assert piped_v.alive == {}
