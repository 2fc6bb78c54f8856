"""stages/rebalance.py: which pool gives ranks to which, from measured busy fractions (no Ray)."""

from __future__ import annotations

import json

import pytest

from dhp.errors import ConfigError
from dhp.models.parallel.layouts import make_layout
from dhp.stages import step_logs
from dhp.stages.config import RebalanceConfig, load_config
from dhp.stages.rebalance import decide, sized

POLICY = RebalanceConfig(enabled=True, measure_steps=3, threshold=0.2, min_gain=0.1, cooldown_steps=4)


def steps(vision: float, text: float, n: int = 3) -> list[dict[str, float]]:
    return [{"vision_busy": vision, "text_busy": text}] * n


def layouts(v: tuple[str, int, int], t: tuple[str, int, int]):
    return make_layout("vision", v[0], v[1], v[2]), make_layout("text", t[0], t[1], t[2])


def test_busy_vision_takes_a_rank_from_idle_text():
    vision, text = layouts(("none", 1, 2), ("none", 1, 2))
    move = decide(steps(0.95, 0.3), vision, text, POLICY, steps_since_move=10, max_in_flight=3, global_batch_size=8)
    assert move is not None
    assert (move.giver, move.taker, move.ranks) == ("text", "vision", 1)
    assert (move.vision.num_actors, move.text.num_actors) == (3, 1)
    assert "text -> vision" in move.line()


def test_balanced_pools_and_small_gains_stay():
    vision, text = layouts(("none", 1, 2), ("none", 1, 2))
    kw = dict(steps_since_move=10, max_in_flight=3, global_batch_size=8)
    assert decide(steps(0.6, 0.5), vision, text, POLICY, **kw) is None
    # differ by more than the threshold, but moving one rank would make text the bottleneck at 0.9 / 1 > 0.9 x 0.95
    assert decide(steps(0.95, 0.45), vision, text, POLICY, **kw) is None


def test_cooldown_and_measure_window_hold_the_decision():
    vision, text = layouts(("none", 1, 2), ("none", 1, 2))
    kw = dict(max_in_flight=3, global_batch_size=8)
    assert decide(steps(0.95, 0.3), vision, text, POLICY, steps_since_move=3, **kw) is None
    assert decide(steps(0.95, 0.3, n=2), vision, text, POLICY, steps_since_move=10, **kw) is None


def test_degrees_must_divide_the_new_sizes():
    # text TP 2 on 4 ranks can only give 2 (to 2 ranks, one replica); a vision SP-2 pool only takes pairs
    vision, text = layouts(("sequence", 2, 2), ("tensor", 2, 4))
    move = decide(steps(0.95, 0.2), vision, text, POLICY, steps_since_move=10, max_in_flight=3, global_batch_size=8)
    assert move is not None and move.ranks == 2
    assert (move.vision.num_actors, move.vision.degree, move.text.num_actors, move.text.degree) == (4, 2, 2, 2)
    # 3 vision ranks cannot be SP 2
    assert sized(make_layout("vision", "sequence", 2, 2), 3) is None


def test_text_replicas_must_split_the_global_batch():
    vision, text = layouts(("none", 1, 3), ("none", 1, 3))
    kw = dict(steps_since_move=10, max_in_flight=3)
    # the best move leaves 2 text replicas: a batch of 6 splits over them, one of 3 does not (and 1 replica gains too
    # little)
    move = decide(steps(0.6, 0.2), vision, text, POLICY, global_batch_size=6, **kw)
    assert move is not None and (move.vision.num_actors, move.text.num_actors) == (4, 2)
    assert decide(steps(0.6, 0.2), vision, text, POLICY, global_batch_size=3, **kw) is None


def test_idle_vision_gives_to_busy_text():
    vision, text = layouts(("zero3", 1, 3), ("none", 1, 1))
    move = decide(steps(0.2, 0.95), vision, text, POLICY, steps_since_move=10, max_in_flight=3, global_batch_size=8)
    assert move is not None and (move.giver, move.taker) == ("vision", "text")
    assert move.vision.num_actors >= 1 and move.vision.num_actors + move.text.num_actors == 4


def test_config_section_is_off_by_default_and_checked():
    assert load_config("tiny").pipeline.rebalance.enabled is False
    cfg = load_config("tiny", ["pipeline.rebalance.enabled=true", "pipeline.rebalance.measure_steps=2"])
    assert cfg.pipeline.rebalance.enabled and cfg.pipeline.rebalance.measure_steps == 2
    with pytest.raises(ConfigError, match="pipeline.rebalance.threshold"):
        load_config("tiny", ["pipeline.rebalance.threshold=1.5"])


@pytest.mark.slow
def test_a_run_whose_mix_shifts_moves_a_rank_to_vision_and_trains_every_sample_once(trainers, tmp_path, capsys):
    """`dhp bench rebalance --quick` on the shared trainers: 2 steps of small photos and a passage, then 4 of large
    photos. The text pool idles after the shift and gives a rank to vision; the run checkpoints and resumes in the new
    sizes, and its one epoch trains each record exactly once. The fixed layouts train the second part for the
    comparison."""
    from dhp.scripts.bench.rebalance import QUICK, run, table

    row = run(QUICK, tmp_path, trainers=trainers)
    (move,) = row["moves"]
    assert (move["giver"], move["taker"], move["ranks"]) == ("text", "vision", 1), move
    assert (move["vision_actors"], move["text_actors"]) == (2, 1)
    assert move["after_step"] > row["first_part_steps"]  # not before: the quick run's first decision is on the shift
    assert "rebalance: 1 rank(s) text -> vision" in capsys.readouterr().out
    run_dir = tmp_path / "runs" / "moved"
    sizes = load_config(str(run_dir / "config.yaml"))
    assert (sizes.vision.num_actors, sizes.text.num_actors) == (2, 1)
    rows = step_logs.read(run_dir, "samples")
    assert sorted({r["step"] for r in rows}) == list(range(1, 7))
    # every record of the one epoch once, none skipped: a skip would pull the next part's records forward
    assert json.loads((run_dir / "summary.json").read_text())["skipped"]["counts"] == {}
    ids = [tuple(i) for r in rows for i in r["ids"]]
    records = QUICK["small"] + QUICK["large"]
    assert sorted(ids) == sorted((0, f"{tmp_path / 'shifting.jsonl'}:{n}") for n in range(1, records + 1))
    first_part = {tuple(i) for r in rows if r["step"] <= row["first_part_steps"] for i in r["ids"]}
    assert {int(source.rsplit(":", 1)[1]) for _, source in first_part} == set(range(1, QUICK["small"] + 1))
    assert set(row["fixed_s"]) == {"v1/t2", "v2/t1"} and all(v > 0 for v in row["fixed_s"].values())
    assert row["moved_large_s"] > 0 and row["after_over_best"] == row["moved_large_s"] / min(row["fixed_s"].values())
    assert "after the move / best fixed" in table(row)
