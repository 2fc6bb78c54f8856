"""dataflow/balance.py: samples dealt to micro-batches by predicted cost keep every sample once, keep the token
budget, and leave the costliest micro-batch no costlier than `pack`'s on a long-tailed mix. No Ray."""

from __future__ import annotations

import random

import pytest

from dhp.dataflow.balance import balance_groups, sample_cost
from dhp.dataflow.packing import pack


def long_tail(seed: int, n: int) -> tuple[list[int], list[float]]:
    """Small images (64-400 patches) and one in eight 8-16x larger; text tokens = merged patches + caption."""
    rng = random.Random(seed)
    lengths, costs = [], []
    for _ in range(n):
        patches = rng.randint(64, 400) * (rng.randint(8, 16) if rng.random() < 0.125 else 1)
        tokens = patches // 4 + rng.randint(10, 60)
        lengths.append(tokens)
        costs.append(sample_cost(tokens, patches))
    return lengths, costs


def group_costs(groups: list[list[int]], costs: list[float]) -> list[float]:
    return [sum(costs[i] for i in g) for g in groups]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_every_sample_once_within_the_budget(seed, packed):
    lengths, costs = long_tail(seed, 48)
    budget = 4 * max(lengths)
    groups = balance_groups(lengths, costs, budget, packed)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        ls = [lengths[i] for i in g]
        assert (sum(ls) if packed else len(ls) * max(ls)) <= budget


@pytest.mark.parametrize("packed", [False, True])
def test_costliest_micro_batch_no_worse_than_pack(packed):
    worse, better = 0, 0
    for seed in range(20):
        lengths, costs = long_tail(seed, 48)
        budget = 4 * max(lengths)
        old = max(group_costs(pack(lengths, budget, packed), costs))
        new = max(group_costs(balance_groups(lengths, costs, budget, packed), costs))
        worse += new > old
        better += new < old
    assert worse == 0 and better > 0, (worse, better)


def test_mismatched_costs_are_refused():
    with pytest.raises(ValueError, match="2 lengths but 1 costs"):
        balance_groups([5, 6], [1.0], 100)
