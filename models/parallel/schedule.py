"""The micro-batch pipeline of one global batch: the order in which the driver submits stage calls.

Why an order is a schedule: every stage call is an async Ray actor task submitted by the one driver, and a
synchronous single-threaded actor runs the tasks of one submitter in submission order — a task whose
arguments are not ready yet holds back everything submitted after it (Ray's actor task ordering; it only
breaks with `allow_out_of_order_execution` or task retries, neither of which the pools use). So the order
of a pool's calls in the list below *is* that pool's execution order, and a call starts once its pool is
free and its input exists: T_i needs F_i's embeddings, B_i needs T_i's gradients.

A bubble is time a pool sits idle inside the step because it waits on the other pool. Submitting
F0,T0,B0,F1,T1,B1,... leaves each pool idle while the other works: the vision pool waits through T_i
before B_i, the text pool through B_i and F_(i+1) before T_(i+1). The vision pool can lead because its
forward depends on nothing but pixels: F_(i+1) may run while the text pool works on i. Running ahead
costs memory — each forwarded but not yet backwarded micro-batch keeps its activation graph alive on the
vision actors — so at most `max_in_flight` (K) of them are alive: vision order F0..F(K-1), B0, FK, B1,
F(K+1), ..., then the remaining B's (one-forward-one-backward after a warm-up of K forwards).

The pipeline fills and drains once per global batch: the optimizer step needs every gradient of both
pools (the grad-norm clip spans both), so it is a synchronization point after the last B. Replicas have
their own actors, so each replica gets this schedule and the interleaving across replicas does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

VISION_FORWARD, TEXT_FORWARD_BACKWARD, VISION_BACKWARD = "vision_forward", "text_forward_backward", "vision_backward"
KINDS = (VISION_FORWARD, TEXT_FORWARD_BACKWARD, VISION_BACKWARD)
_SHORT = {VISION_FORWARD: "F", TEXT_FORWARD_BACKWARD: "T", VISION_BACKWARD: "B"}
DEPENDS_ON = {TEXT_FORWARD_BACKWARD: VISION_FORWARD, VISION_BACKWARD: TEXT_FORWARD_BACKWARD}  # what waits on what

Cost = float | Callable[[int], float]


@dataclass(frozen=True)
class Op:
    kind: str
    mb: int

    @property
    def stage(self) -> str:
        return "text" if self.kind == TEXT_FORWARD_BACKWARD else "vision"

    def __str__(self) -> str:  # "F3", "T3", "B3": schedules read like the literature's diagrams
        return f"{_SHORT[self.kind]}{self.mb}"


def pipeline_schedule(num_microbatches: int, max_in_flight: int) -> list[Op]:
    """Submission order for one replica's micro-batches; max_in_flight=1 is the serial F0,T0,B0,F1,..."""
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1 (1 = serial, no vision run-ahead), got {max_in_flight}")
    warmup = min(max_in_flight, num_microbatches)
    ops = [Op(VISION_FORWARD, i) for i in range(warmup)]
    for i in range(num_microbatches):
        # B_i straight after T_i frees mb i's graph before the next forward makes a new one, so at most K
        # are alive; with K >= 2, F_(i+1) is queued before B_i, so the text pool's next input never waits on B_i.
        ops += [Op(TEXT_FORWARD_BACKWARD, i), Op(VISION_BACKWARD, i)]
        if i + warmup < num_microbatches:
            ops.append(Op(VISION_FORWARD, i + warmup))
    return ops


def stage_order(ops: list[Op], stage: str) -> list[Op]:
    """The sub-sequence one pool executes ("vision" or "text")."""
    if stage not in ("vision", "text"):
        raise ValueError(f"stage must be 'vision' or 'text', got {stage!r}")
    return [op for op in ops if op.stage == stage]


def max_alive(ops: list[Op]) -> int:
    """Peak number of vision forward graphs alive (forwarded, not yet backwarded) along the order."""
    alive = peak = 0
    for op in ops:
        alive += {VISION_FORWARD: 1, VISION_BACKWARD: -1}.get(op.kind, 0)
        peak = max(peak, alive)
    return peak


@dataclass
class Timeline:
    spans: dict[Op, tuple[float, float]]  # op -> (start, end), in submission order
    makespan: float

    def busy(self, stage: str) -> float:
        return sum(end - start for op, (start, end) in self.spans.items() if op.stage == stage)

    def bubble(self) -> float:
        """1 - busiest pool's busy fraction: the same definition as `trace.busy_fractions`."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - max(self.busy("vision"), self.busy("text")) / self.makespan


def simulate(ops: list[Op], vision_cost: Cost, text_cost: Cost, vision_backward_cost: Cost | None = None) -> Timeline:
    """Predict when each op runs: two pools, each executing its sub-sequence of `ops` one call at a time.

    An op starts when its pool has finished the previous op of its sub-sequence and its dependency has
    finished (T_i after F_i, B_i after T_i). Costs are seconds, constant or a function of the micro-batch
    index; `text_cost` is a whole forward+backward, `vision_backward_cost` defaults to `vision_cost`.
    Transfers, Ray overhead and the optimizer step are not modelled: this is the best case for the order.
    """
    costs = {
        VISION_FORWARD: vision_cost,
        TEXT_FORWARD_BACKWARD: text_cost,
        VISION_BACKWARD: vision_cost if vision_backward_cost is None else vision_backward_cost,
    }
    free = {"vision": 0.0, "text": 0.0}
    spans: dict[Op, tuple[float, float]] = {}
    # One pass in list order is exact: an op's start depends only on its pool's previous op and on its
    # dependency, and a valid order lists both before it.
    for op in ops:
        if op.kind not in KINDS:
            raise ValueError(f"unknown op kind {op.kind!r}")
        if op in spans:
            raise ValueError(f"{op} appears twice")
        ready = 0.0
        if op.kind in DEPENDS_ON:
            dep = Op(DEPENDS_ON[op.kind], op.mb)
            if dep not in spans:
                raise ValueError(f"{op} is listed before its dependency {dep}")
            ready = spans[dep][1]
        cost = costs[op.kind]
        duration = float(cost(op.mb) if callable(cost) else cost)
        if duration < 0:
            raise ValueError(f"negative cost {duration} for {op}")
        start = max(free[op.stage], ready)
        spans[op] = (start, start + duration)
        free[op.stage] = start + duration
    return Timeline(spans, max((end for _, end in spans.values()), default=0.0))
