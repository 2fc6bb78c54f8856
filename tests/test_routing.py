"""Fan-out / fan-in routing: every micro-batch encoded once by one vision replica, its gradient back to that
replica, no call before its inputs, at most `max_in_flight` graphs alive per vision replica, lockstep pools
padded to whole slots, and the assignment balanced by patches. No Ray: the submission list is the contract."""

from __future__ import annotations

import itertools
import random

import pytest

from dhp.models.parallel.routing import balance_text, check_fan, route, simulate_calls
from dhp.models.parallel.schedule import TEXT_FORWARD_BACKWARD, VISION_BACKWARD, VISION_FORWARD


def check(calls, patches, dv, vision_lockstep, text_lockstep, k):
    keys = {(t, i) for t, ps in enumerate(patches) for i in range(len(ps))}
    seen, encoder, alive = set(), {}, {}
    text_next = [0] * len(patches)
    for call in calls:
        if call.stage == "vision" and vision_lockstep or call.stage == "text" and text_lockstep:
            n = dv if call.stage == "vision" else len(patches)
            assert sorted(r for r, _ in call.members) == list(range(n)), call  # every replica joins
        else:
            assert len(call.members) == 1 and call.keys(), call
        for replica, key in call.members:
            if key is None:
                continue
            assert (call.kind, key) not in seen, f"{call.kind} of {key} twice"
            if call.kind == VISION_FORWARD:
                encoder[key] = replica
                alive[replica] = alive.get(replica, 0) + 1
                assert alive[replica] <= k, f"vision replica {replica}: more than {k} graphs alive"
            elif call.kind == TEXT_FORWARD_BACKWARD:
                assert (VISION_FORWARD, key) in seen and replica == key[0]
                assert key[1] == text_next[replica], "a text replica runs its micro-batches in order"
                text_next[replica] += 1
            else:
                assert (TEXT_FORWARD_BACKWARD, key) in seen and encoder[key] == replica, "gradient to its encoder"
                alive[replica] -= 1
            seen.add((call.kind, key))
    assert seen == {(kind, key) for kind in (VISION_FORWARD, TEXT_FORWARD_BACKWARD, VISION_BACKWARD) for key in keys}
    return encoder


@pytest.mark.parametrize(("dv", "dt"), [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize(("vision_lockstep", "text_lockstep"), list(itertools.product([False, True], repeat=2)))
def test_every_fan_routes_every_microbatch(dv, dt, vision_lockstep, text_lockstep):
    rng = random.Random(dv * 10 + dt)
    for k in (1, 2, 3):
        if check_fan(dv, dt, vision_lockstep, text_lockstep, k):
            continue
        for _ in range(5):
            patches = [[rng.choice([0, 16, 64, 256]) for _ in range(rng.randint(0, 5))] for _ in range(dt)]
            calls = route(patches, dv, vision_lockstep, text_lockstep, k)
            check(calls, patches, dv, vision_lockstep, text_lockstep, k)


def test_lockstep_text_needs_enough_in_flight():
    why = check_fan(1, 4, False, True, 3)
    assert "pipeline.max_in_flight>=4" in why and "2 or more replicas" in why
    assert check_fan(2, 4, False, True, 2) is None and check_fan(4, 1, True, False, 1) is None
    with pytest.raises(ValueError, match="max_in_flight"):
        route([[1], [1], [1], [1]], 1, False, True, 3)


def test_assignment_balances_patches_not_indices():
    # Fan-in, 2 vision replicas, 1 text replica: two heavy micro-batches at even indices. By index
    # (round robin) replica 0 would get both heavy ones; by patches each gets one.
    patches = [[1000, 10, 1000, 10]]
    encoder = check(route(patches, 2, False, False, 2), patches, 2, False, False, 2)
    load = [sum(patches[0][i] for (_, i), v in encoder.items() if v == r) for r in range(2)]
    assert load == [1010, 1010]
    # Fan-out, one vision replica for four text replicas: it encodes them round-robin by index, so every
    # text replica gets its first micro-batch early.
    calls = route([[5, 5], [5, 5], [5, 5], [5, 5]], 1, False, False, 4)
    forwards = [c.keys()[0] for c in calls if c.kind == VISION_FORWARD]
    assert forwards == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]


def test_text_replicas_get_balanced_tokens_and_keep_their_counts():
    # Replica 0's loader drew the two long samples: as loaded it runs 2 000 tokens while replica 1 runs 300.
    costs = [[1000, 1000], [200, 100]]
    keys = balance_text(costs)
    load = [sum(costs[t][i] for t, i in ks) for ks in keys]
    assert load == [1200, 1100]
    assert [len(ks) for ks in keys] == [2, 2]
    assert sorted(k for ks in keys for k in ks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(ks == sorted(ks, key=lambda k: (k[1], k[0])) for ks in keys)  # key order within a replica
    # Even costs stay where the loaders put them; counts follow the loaders (3 and 1 here).
    assert balance_text([[5, 5], [5, 5]]) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert [len(ks) for ks in balance_text([[9, 1, 1], [50]])] == [3, 1]
    # Where LPT with fixed counts would do worse (50 to the replica with room for three: 52 vs 50), the
    # loaders' split stays.
    assert balance_text([[9, 1, 1], [50]]) == [[(0, 0), (0, 1), (0, 2)], [(1, 0)]]


def test_more_vision_replicas_shorten_a_vision_bound_step():
    # Vision costs 3, text 1 per micro-batch; 4 actors in all. 2 + 2 replicas against 3 vision + 1 text.
    patches2, patches1 = [[1] * 6] * 2, [[1] * 12]
    even = simulate_calls(route(patches2, 2, False, False, 3), 1.5, 1.0, 1.5)[0]
    fan_in = simulate_calls(route(patches1, 3, False, False, 3), 1.5, 1.0, 1.5)[0]
    assert fan_in < even
    assert even >= 6 * 3.0 and fan_in >= 12 * 3.0 / 3  # no replica does its work faster than alone


def test_check_layout_takes_any_fan_and_refuses_what_cannot_run():
    from dhp.models.architectures import architecture_config
    from dhp.models.parallel.checks import check_layout
    from dhp.stages.config import ConfigError, load_config

    tiny = architecture_config("tiny")
    base = ["vision.parallelism=sequence", "vision.num_actors=2", "vision.degree=2"]
    check_layout(load_config("tiny", base + ["text.parallelism=tensor", "text.num_actors=8", "text.degree=2"]), tiny)
    check_layout(
        load_config(
            "tiny",
            [
                "vision.parallelism=none",
                "vision.num_actors=4",
                "vision.degree=1",
                "text.parallelism=tensor",
                "text.num_actors=4",
                "text.degree=4",
            ],
        ),
        tiny,
    )
    zero3_text = base + ["text.parallelism=zero3", "text.num_actors=4", "text.degree=1"]
    with pytest.raises(ConfigError, match=r"pipeline.max_in_flight>=4"):
        check_layout(load_config("tiny", zero3_text + ["pipeline.max_in_flight=3"]), tiny)
    check_layout(load_config("tiny", zero3_text + ["pipeline.max_in_flight=4"]), tiny)
    with pytest.raises(ConfigError, match=r"global_batch_size=6 is not divisible by the 4 text replicas"):
        check_layout(
            load_config(
                "tiny",
                base + ["text.parallelism=none", "text.num_actors=4", "text.degree=1", "training.global_batch_size=6"],
            ),
            tiny,
        )
