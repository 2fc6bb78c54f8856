"""Security default: a local run listens on the loopback interface only (Ray's services, its workers, the
pools' TCPStore and gloo sockets). Checked from the kernel's socket tables, not from what Ray reports.

The run is a fresh interpreter: the check needs a Ray that dhp itself starts (`driver.init_ray`), while the
test session may already hold its own (`ray_session`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocess runs of dhp or its own Ray cluster (tests/README.md)

PROBE = """
import json, os
import ray, torch
from dhp.scripts.local_head import listeners, process_tree
from dhp.stages.actor_group import ActorGroup, DistributedWorker
from dhp.stages.config import load_config
from dhp.stages.driver import init_ray

class Probe(DistributedWorker):
    def total(self):
        import torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    def node_ip(self):
        return ray.util.get_node_ip_address()

init_ray(load_config("tiny", ["ray.num_cpus=2"]))
try:
    group = ActorGroup("probe", Probe, 2, num_cpus=0.1)
    out = {"totals": group.execute_all("total"), "ips": group.execute_all("node_ip"),
           "sockets": [[s.pid, s.name, s.host, s.port, s.loopback] for s in listeners(process_tree(os.getpid()))]}
    group.shutdown()
finally:
    ray.shutdown()
print("PROBE " + json.dumps(out))
"""


def test_local_run_binds_loopback_only():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray, started by dhp
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert out["totals"] == [2.0, 2.0]  # the gloo pairs are up
    assert set(out["ips"]) == {"127.0.0.1"}
    assert len({pid for pid, *_ in out["sockets"]}) >= 4, out["sockets"]  # gcs, raylet, workers at least
    exposed = [s for s in out["sockets"] if not s[4]]
    assert not exposed, f"listening on non-loopback addresses (pid, process, host, port): {exposed}"
