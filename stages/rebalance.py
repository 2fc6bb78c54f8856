"""Whether to move ranks between the two pools, decided from the busy fractions the steps measured.

A pure function of numbers and layout objects (no Ray): `decide` takes the last steps' `vision_busy` /
`text_busy` (stages/trace.py `busy_fractions`, one pair per step) and the two pools' layouts, and answers
which pool gives how many ranks to the other, or nothing. The work of a pool is taken as its busy fraction x
its ranks (rank-steps), spread evenly over the ranks it would have after the move; the predicted busiest
pool's busy fraction is compared with the measured one.

Hysteresis, so that a layout does not flap between two shapes: a move needs the pools' busy fractions to differ
by `threshold` and the predicted busiest pool to be at least `min_gain` less busy than now, and no move is
considered within `cooldown_steps` of the last one (nor before `measure_steps` steps were measured in the
present layout). Which sizes a pool may take is the layouts' answer (`sized`): the degree must divide the new
size, the layout class must accept its degree (`check_degree`) and the model its shape (`check_shape`), and the
fan of the two pools must run (models/parallel/routing.py `check_fan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

from dhp.models.parallel.layout import Layout
from dhp.models.parallel.routing import check_fan

STAGES = ("vision", "text")


@dataclass(frozen=True)
class Move:
    """`ranks` ranks leave the `giver` pool and join the `taker`; the two layouts the run resumes into."""

    giver: str
    taker: str
    ranks: int
    vision: Layout
    text: Layout
    reason: str

    def record(self, step: int) -> dict[str, Any]:
        """What RUN_DIR/summary.json's `rebalanced` lists for this move, made after step `step`."""
        return {
            "after_step": step,
            "giver": self.giver,
            "taker": self.taker,
            "ranks": self.ranks,
            "vision_actors": self.vision.num_actors,
            "text_actors": self.text.num_actors,
            "line": self.line(),
        }

    def line(self) -> str:
        """The one line a run logs when it moves."""
        return (
            f"rebalance: {self.ranks} rank(s) {self.giver} -> {self.taker} "
            f"(vision {self.vision.num_actors}, text {self.text.num_actors} actors): {self.reason}"
        )


def sized(layout: Layout, num_actors: int) -> Layout | None:
    """The same layout over `num_actors` ranks, or None when the layout cannot run at that size."""
    if num_actors < 1:
        return None
    candidate = type(layout)(layout.stage, layout.degree, num_actors, layout.model_config)
    if candidate.dp < 1 or candidate.dp * candidate.degree != num_actors:
        return None
    if type(layout).check_degree(layout.stage, layout.degree):
        return None
    if layout.model_config is not None:
        try:
            candidate.check_shape(layout.model_config)
        except ValueError:
            return None
    return candidate


def decide(
    busy: list[dict[str, float]],
    vision: Layout,
    text: Layout,
    policy: Any,
    steps_since_move: int,
    max_in_flight: int,
    global_batch_size: int,
) -> Move | None:
    """The move these measurements call for, or None.

    busy: one dict per measured step in the present layout, with `vision_busy` and `text_busy`;
    policy: the `pipeline.rebalance` section (measure_steps, threshold, min_gain, cooldown_steps);
    steps_since_move: steps run since the last move (or since the start)."""
    if steps_since_move < policy.cooldown_steps or len(busy) < policy.measure_steps:
        return None
    window = busy[-policy.measure_steps :]
    measured = {s: median(b[f"{s}_busy"] for b in window) for s in STAGES}
    if abs(measured["vision"] - measured["text"]) < policy.threshold:
        return None
    layouts = {"vision": vision, "text": text}
    taker = max(STAGES, key=lambda s: measured[s])
    giver = "text" if taker == "vision" else "vision"
    work = {s: measured[s] * layouts[s].num_actors for s in STAGES}
    now = max(measured.values())
    best: tuple[float, int, Layout, Layout] | None = None
    for k in range(1, layouts[giver].num_actors):
        new = {
            giver: sized(layouts[giver], layouts[giver].num_actors - k),
            taker: sized(layouts[taker], layouts[taker].num_actors + k),
        }
        if new[giver] is None or new[taker] is None:
            continue
        if global_batch_size % new["text"].dp:
            continue
        if check_fan(new["vision"].dp, new["text"].dp, new["vision"].lockstep, new["text"].lockstep, max_in_flight):
            continue
        predicted = max(work[s] / new[s].num_actors for s in STAGES)
        if best is None or predicted < best[0] - 1e-9:
            best = (predicted, k, new["vision"], new["text"])
    if best is None or best[0] > now * (1.0 - policy.min_gain):
        return None
    predicted, k, new_vision, new_text = best
    reason = (
        f"median busy over {len(window)} steps vision {measured['vision']:.2f}, text {measured['text']:.2f}; "
        f"the busiest pool's time predicted at {predicted:.2f} of the present step (now {now:.2f})"
    )
    return Move(giver, taker, k, new_vision, new_text, reason)


class Rebalanced(Exception):  # noqa: N818 (a control-flow signal, like Preempted: not an error)
    """The loop checkpointed step `step` at `checkpoint` to resume it in `config`, the moved layout."""

    def __init__(self, move: Move, step: int, checkpoint: Any, config: Any):
        super().__init__(move.line())
        self.move, self.step, self.checkpoint, self.config = move, step, checkpoint, config


class Rebalancer:
    """One attempt's measurements (`pipeline.rebalance`): `after_step` returns the config the run should move into,
    or None. A new attempt (after a move or a fault) starts measuring afresh, and its cool-down with it."""

    def __init__(self, cfg: Any, model_config: Any):
        self.cfg, self.model_config = cfg, model_config
        self.busy: list[dict[str, float]] = []

    def after_step(self, record: dict[str, Any]) -> tuple[Move, Any] | None:
        policy = self.cfg.pipeline.rebalance
        if not policy.enabled:
            return None
        self.busy.append({f"{s}_busy": record[f"{s}_busy"] for s in STAGES})
        from dhp.models.parallel.layouts import stage_layout

        move = decide(
            self.busy,
            stage_layout(self.cfg, "vision", self.model_config),
            stage_layout(self.cfg, "text", self.model_config),
            policy,
            steps_since_move=len(self.busy),
            max_in_flight=self.cfg.pipeline.max_in_flight,
            global_batch_size=self.cfg.training.global_batch_size,
        )
        return None if move is None else (move, moved_config(self.cfg, move))


def moved_config(cfg: Any, move: Move) -> Any:
    """`cfg` with the pools' sizes of `move` (and the same everything else)."""
    import copy

    new = copy.deepcopy(cfg)
    new.vision.num_actors, new.text.num_actors = move.vision.num_actors, move.text.num_actors
    return new
