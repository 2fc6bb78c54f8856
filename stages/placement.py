"""Where the two pools run: Ray placement groups reserved as the `pipeline.placement` mode asks.

The mode (`stages/placement_modes.py`: `shared`, one group whose bundle b holds vision actor b and text actor
b; `disjoint`, one group per pool) says which bundles to reserve and which bundle each actor takes; `PACK`
puts them on as few nodes as fit, other nodes allowed.

The groups are reserved before any actor starts, so a cluster too small for the layout fails here with a
clear message instead of leaving half the ranks waiting in a rendezvous; `check_resources` says so even
earlier, from the cluster's totals (custom resources of `vision/text.resources` included), and after a fault
waits for a replacement node first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from dhp.models.parallel.checks import replicas
from dhp.stages.config import Config, ConfigError, StageConfig
from dhp.stages.placement_modes import PlacementMode, PoolRequest


@dataclass
class Placement:
    mode: PlacementMode
    groups: list[PlacementGroup] = field(default_factory=list)
    vision: list[tuple[PlacementGroup, int]] = field(default_factory=list)  # (group, bundle) per actor
    text: list[tuple[PlacementGroup, int]] = field(default_factory=list)

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def _resources(s: StageConfig) -> dict[str, float]:
    """One actor's reservation; `resources` (custom ones, e.g. {vision_node: 1}) pin it to the nodes offering them."""
    return {"CPU": s.num_cpus_per_actor, "GPU": s.num_gpus_per_actor, **s.resources}


def place_pools(cfg: Config, timeout_s: float = 300, spares: tuple[int, int] = (0, 0)) -> Placement:
    """Reserve the pools' resources as `cfg.pipeline.placement` says, with room for (vision, text) `spares` actors
    beyond each pool's `num_actors` (`Trainer`); raises RuntimeError if they never fit."""
    v, t = cfg.vision, cfg.text
    mode = cfg.pipeline.placement_mode
    plan = mode.groups(
        PoolRequest(v.num_actors + spares[0], _resources(v)), PoolRequest(t.num_actors + spares[1], _resources(t))
    )
    groups = [placement_group(bundles, strategy="PACK") for bundles in plan.groups]
    placement = Placement(mode, groups)
    placement.vision = [(groups[g], b) for g, b in plan.vision]
    placement.text = [(groups[g], b) for g, b in plan.text]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        placement.remove()
        raise RuntimeError(
            f"the Ray cluster could not reserve the pools ({mode.name} placement: vision "
            f"{v.num_actors + spares[0]} x {_resources(v)}, text {t.num_actors + spares[1]} x {_resources(t)}) "
            f"within {timeout_s:g} s"
        )
    return placement


def describe(placement: Placement, where: dict[str, list[dict]]) -> str:
    """Start-up lines: for each pool, each actor's rank, node, bundle and devices (from `DistributedWorker.where`)."""
    lines = [f"placement: {placement.mode.name}"]
    for stage in ("vision", "text"):
        for rank, (w, (_, bundle)) in enumerate(zip(where[stage], getattr(placement, stage))):
            gpus = ",".join(map(str, w["gpu_ids"])) or "-"
            lines.append(
                f"  {stage:6s} rank {rank}: node {w['node_ip']} ({w['node_id'][:8]}) bundle {bundle} pid {w['pid']} "
                f"gpus {gpus} threads {w['threads']} device {w['device']}"
            )
    return "\n".join(lines)


LOADER_CPUS = 0.1  # the BatchLoader actor mostly waits on Ray Data


def data_cpus(cfg: Config) -> float:
    """The logical CPUs of `cfg`'s data streams: a loader per text replica and one for evaluation, each with its
    preprocessing workers."""
    return (replicas(cfg, "text") + 1) * (LOADER_CPUS + cfg.data.preprocess_workers * cfg.data.preprocess_num_cpus)


def check_resources(cfg: Config, wait_s: float = 0.0) -> None:
    """Fail fast when pools + data pipeline cannot all be placed: placed ranks would wait in rendezvous.

    `wait_s` > 0 (a rebuild after a fault): wait that long for the cluster to offer them first (a replacement
    node joining, an autoscaler adding one)."""
    need = {"CPU": data_cpus(cfg)}
    for s in (cfg.vision, cfg.text):
        for name, per_actor in _resources(s).items():
            need[name] = need.get(name, 0.0) + per_actor * s.num_actors
    deadline, told = time.monotonic() + wait_s, False
    while True:
        total = ray.cluster_resources()
        short = {name: (n, total.get(name, 0.0)) for name, n in need.items() if n > total.get(name, 0.0) + 1e-9}
        if not short:
            return
        if time.monotonic() >= deadline:
            break
        if not told:
            print(f"waiting up to {wait_s:g} s for the cluster to offer {_shortfall(short)}", flush=True)
            told = True
        time.sleep(1.0)
    name, (n, have) = next(iter(short.items()))
    if name in ("CPU", "GPU"):
        per_actor = "num_cpus_per_actor" if name == "CPU" else "num_gpus_per_actor"
        hint = (
            f"lower vision/text.{per_actor} (or data.preprocess_num_cpus), give a local Ray more logical CPUs "
            f"(ray.num_cpus), or add resources"
        )
    else:
        hint = f"start nodes that offer it (ray start --resources='{{\"{name}\": N}}') or change vision/text.resources"
    raise ConfigError(f"pools and data pipeline need {_shortfall(short)}: {hint}")


def _shortfall(short: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{n:g} {name} (the Ray cluster has {have:g})" for name, (n, have) in short.items())
