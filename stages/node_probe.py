"""Which nodes are gone: asked of the nodes themselves, not only of Ray's node table.

Ray lists a node as dead only once its health checks have failed, seconds after the calls of its actors fail, so
a fault seen right after a node loss still finds the node listed alive. A zero-CPU task pinned to each node
answers sooner: one that does not run within the timeout (or cannot be placed) is on a node that is gone. This
module imports only Ray, so that the probe's worker process starts in well under a second.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0, max_retries=0)
def _here() -> str:
    return ray.get_runtime_context().get_node_id()


def lost_nodes(nodes: set[str], timeout_s: float | None) -> set[str]:
    """Those of `nodes` (node ids) that Ray lists dead or that did not run a pinned task within `timeout_s` (None:
    Ray's node table only, no probe)."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    listed = nodes & alive
    if timeout_s is None:
        return nodes - listed
    probes = [
        _here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote() for node in listed
    ]
    ready, pending = ray.wait(probes, num_returns=len(probes), timeout=timeout_s)
    for ref in pending:  # a task for a node that is gone would otherwise wait for it forever
        ray.cancel(ref)
    answered = set()
    for ref in ready:  # each probe answers with the id of the node it ran on
        try:
            answered.add(ray.get(ref))
        except ray.exceptions.RayError:
            pass
    return nodes - answered
