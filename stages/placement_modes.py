"""`pipeline.placement`: one object per way of placing the two pools, asked by placement, the plan and the time model.

A mode answers two questions and nothing reads the `placement` string but `placement_mode`:
  `shares_devices`  vision actor b and text actor b sit on one device and take turns on it (the memory plan
                    adds their peaks; the time model lets their busy times add up on it)
  `groups(v, t)`    the Ray placement groups to reserve (bundles of resources) and, per actor, its
                    (group, bundle): `stages/placement.py` reserves exactly this

`shared` (colocated): bundle b holds vision actor b and text actor b (round-robin when the pools differ in
size) with the sum of their resources, so a vision actor and a text actor with 0.5 GPU each share one GPU.
`disjoint`: each pool gets its own group, one bundle per actor, so no GPU or CPU share is split between them.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

Resources = dict[str, float]


class PoolRequest(NamedTuple):
    """One pool's ask: `num_actors` actors of `per_actor` resources each."""

    num_actors: int
    per_actor: Resources


class GroupPlan(NamedTuple):
    """What to reserve: the bundles of each placement group, and (group, bundle) for every actor of each pool."""

    groups: list[list[Resources]]
    vision: list[tuple[int, int]]
    text: list[tuple[int, int]]


def bundle(parts: list[Resources]) -> Resources:
    """The sum of `parts`, as one Ray bundle."""
    total = {k: sum(p.get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p})}
    # Ray refuses an empty bundle; a pool configured with 0 CPUs still needs a token reservation.
    return {k: v for k, v in total.items() if v > 0} or {"CPU": 0.01}


class PlacementMode:
    name: ClassVar[str] = ""
    shares_devices: ClassVar[bool] = False

    def groups(self, vision: PoolRequest, text: PoolRequest) -> GroupPlan:
        raise NotImplementedError


class Shared(PlacementMode):
    name = "shared"
    shares_devices = True

    def groups(self, vision: PoolRequest, text: PoolRequest) -> GroupPlan:
        n = max(vision.num_actors, text.num_actors)
        members: list[list[Resources]] = [[] for _ in range(n)]
        for pool in (vision, text):
            for i in range(pool.num_actors):
                members[i % n].append(pool.per_actor)
        return GroupPlan(
            [[bundle(m) for m in members]],
            [(0, i % n) for i in range(vision.num_actors)],
            [(0, j % n) for j in range(text.num_actors)],
        )


class Disjoint(PlacementMode):
    name = "disjoint"
    shares_devices = False

    def groups(self, vision: PoolRequest, text: PoolRequest) -> GroupPlan:
        return GroupPlan(
            [[bundle([pool.per_actor])] * pool.num_actors for pool in (vision, text)],
            [(0, i) for i in range(vision.num_actors)],
            [(1, j) for j in range(text.num_actors)],
        )


PLACEMENTS: dict[str, type[PlacementMode]] = {m.name: m for m in (Shared, Disjoint)}


def placement_mode(name: str) -> PlacementMode:
    """The mode `pipeline.placement` names; ValueError listing the known ones otherwise."""
    if name not in PLACEMENTS:
        raise ValueError(f"pipeline.placement={name!r}: known placements are {', '.join(PLACEMENTS)}")
    return PLACEMENTS[name]()
