"""Which configs may take over another trainer's actors (`Trainer.reuse`): those whose actors are of one kind;
and a pool formed into worlds of other sizes on the same actors (`ActorGroup.resize`).

The reused trainers themselves are checked by the parity tests, which run through `TrainerCache`
(tests/conftest.py): a trainer rebuilt on another run's actors must train exactly like the reference.
"""

from __future__ import annotations

import pytest
import torch

from dhp.stages.actor_group import ActorGroup, DistributedWorker
from dhp.stages.config import load_config
from dhp.stages.trainer import actor_kind, pool_shape

SP2_TP2 = [
    "vision.parallelism=sequence",
    "vision.num_actors=2",
    "vision.degree=2",
    "text.parallelism=tensor",
    "text.num_actors=2",
    "text.degree=2",
]


@pytest.mark.parametrize(
    "other",
    [
        ["vision.activation_checkpointing=full", "text.activation_checkpointing=full"],
        ["vision.parallelism=tensor"],  # the same ranks and groups, another layout built on them
        ["vision.train=none", "training.lr=1e-3", "model.dtype=bfloat16"],
        ["text.degree=1", "text.parallelism=none"],  # tp2 -> dp2: the same processes, regrouped (`regroup`)
    ],
    ids=["checkpointing", "vision-tp", "run-settings", "degree"],
)
def test_what_is_built_on_the_actors_keeps_the_shape(other):
    assert pool_shape(load_config("tiny", SP2_TP2 + other)) == pool_shape(load_config("tiny", SP2_TP2))


@pytest.mark.parametrize(
    "other",
    [
        ["vision.num_actors=4"],  # sp2 x dp2: more processes
        ["text.num_cpus_per_actor=0.5"],  # other reservations
        ["text.torch_threads=2"],  # set once, when the process starts
        ["pipeline.placement=disjoint"],  # other placement groups
    ],
    ids=["actors", "cpus", "threads", "placement"],
)
def test_what_fixes_the_actors_changes_the_shape(other):
    assert pool_shape(load_config("tiny", SP2_TP2 + other)) != pool_shape(load_config("tiny", SP2_TP2))


@pytest.mark.parametrize(
    ("other", "same_kind"),
    [
        (["vision.num_actors=4"], True),  # more of the same processes: a larger world of them (`resize`)
        (["vision.num_actors=1", "vision.degree=1", "vision.parallelism=none"], True),
        (["text.num_cpus_per_actor=0.5"], False),
        (["text.torch_threads=2"], False),
        (["pipeline.placement=disjoint"], False),
    ],
    ids=["more", "fewer", "cpus", "threads", "placement"],
)
def test_the_number_of_actors_is_not_their_kind(other, same_kind):
    kinds = actor_kind(load_config("tiny", SP2_TP2 + other)), actor_kind(load_config("tiny", SP2_TP2))
    assert (kinds[0] == kinds[1]) is same_kind


class _Summer(DistributedWorker):
    def total(self) -> float:
        """The sum over the world of each rank's 1, through its model and data-parallel groups too."""
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        for group in (self.ranks.model_group, self.ranks.dp_group):
            dist.all_reduce(torch.ones(1), group=group)
        return float(t)


def test_a_pool_resized_again_and_again_keeps_one_store(ray_session):
    """Every world a pool forms on its actors meets at the first actor's one TCPStore: a second store per world
    took over a closed socket's descriptor number and aborted or hung a later world's groups."""
    pool = ActorGroup("probe", _Summer, 2, num_cpus=0.01, spares=1)
    try:
        store = ray_session.get(pool.actors[0].address.remote())
        for n, degree in [(1, 1), (3, 1), (2, 2), (3, 3), (2, 1)]:
            pool.resize(n, degree)
            assert (len(pool.actors), len(pool.spares), pool.degree) == (n, 3 - n, degree)
            assert pool.execute_all("total") == [float(n)] * n
            assert ray_session.get(pool.actors[0].address.remote()) == store
    finally:
        pool.shutdown()
