"""Security default: a local run listens on the loopback interface only (Ray's services, its workers, the
pools' TCPStore and gloo sockets). Checked from the kernel's socket tables, not from what Ray reports."""

from __future__ import annotations

import os

import ray
import torch

from dhp.scripts.local_head import listeners, process_tree
from dhp.stages.actor_group import ActorGroup, DistributedWorker
from dhp.stages.config import load_config
from dhp.stages.driver import init_ray


class _Worker(DistributedWorker):
    def total(self) -> float:
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def test_local_run_binds_loopback_only():
    assert not ray.is_initialized()
    cfg = load_config("tiny", ["ray.num_cpus=2"])
    os.environ.pop("RAY_ADDRESS", None)
    init_ray(cfg)
    try:
        group = ActorGroup("probe", _Worker, 2, num_cpus=0.1)
        assert group.execute_all("total") == [2.0, 2.0]  # the gloo pairs are up
        assert set(group.execute_all("node_ip")) == {"127.0.0.1"}
        sockets = listeners(process_tree(os.getpid()))
        assert len({s.pid for s in sockets}) >= 4, sockets  # gcs, raylet, workers at least
        exposed = [s for s in sockets if not s.loopback]
        assert not exposed, f"listening on non-loopback addresses: {exposed}"
        group.shutdown()
    finally:
        ray.shutdown()
