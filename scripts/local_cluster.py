"""A multi-node Ray cluster on this machine, loopback only: a head and worker nodes, each its own raylet and
object store (ray.cluster_utils.Cluster), for the node-loss tests and `dhp bench recovery`.

Every node binds to 127.0.0.1 (`rendezvous.local_ray_on_loopback`, Ray's single-machine mode; Cluster, unlike
`ray start`, lets such nodes join a head). `kill` removes a node the hard way: SIGKILL to its raylet, object
store and workers, as when a machine loses power. Must be used from the main thread (Ray installs signal
handlers while starting a node), in a process that is not itself connected to another Ray.
"""

from __future__ import annotations

import os
from typing import Any

from dhp.stages.rendezvous import local_ray_on_loopback

OBJECT_STORE_BYTES = 96 << 20


class LocalCluster:
    def __init__(self, head_cpus: int = 2, object_store_bytes: int = OBJECT_STORE_BYTES):
        local_ray_on_loopback()
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # drivers started from here bind to 127.0.0.1 too
        from ray.cluster_utils import Cluster

        self.object_store_bytes = object_store_bytes
        self.cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": head_cpus,
                "object_store_memory": object_store_bytes,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
            },
        )
        self.nodes: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, name: str, num_cpus: int, resources: dict[str, float]) -> str:
        """Start a worker node offering `resources`; returns its node id."""
        node = self.cluster.add_node(
            num_cpus=num_cpus,
            resources=resources,
            node_ip_address="127.0.0.1",
            object_store_memory=self.object_store_bytes,
        )
        self.nodes[name] = node
        return node.node_id

    def kill(self, name: str) -> None:
        """Every process of the node, at once (SIGKILL, no drain)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()
