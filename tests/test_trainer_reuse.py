"""Which configs may take over another trainer's actors (`Trainer.reuse`): those whose pools have one shape.

The reused trainers themselves are checked by the parity tests, which run through `TrainerCache`
(tests/conftest.py): a trainer rebuilt on another run's actors must train exactly like the reference.
"""

from __future__ import annotations

import pytest

from dhp.stages.config import load_config
from dhp.stages.trainer import pool_shape

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
