"""`none`: no model parallelism. Every actor holds the whole stage and is its own data-parallel replica.

Replicas read disjoint samples; their gradients are summed over the pool (`grad_sync_group` = the
data-parallel group, which here is every rank) before each replica steps its own, identical AdamW.
This is the base behaviour of `Layout`; the class exists so that every name maps to a class.
"""

from __future__ import annotations

from dhp.models.parallel.layout import Layout


class DataParallel(Layout):
    name = "none"
    label = "DP"
    stages = ("vision", "text")

    @classmethod
    def check_degree(cls, stage: str, degree: int) -> str | None:
        if degree != 1:
            return (
                f"{stage}.degree={degree} needs a parallel layout; with {stage}.parallelism=none use "
                f"{stage}.degree=1 ({stage}.num_actors then counts data-parallel replicas)"
            )
        return None
