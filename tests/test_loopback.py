"""Security default: a local run listens on the loopback interface only (Ray's services, its workers, the
pools' TCPStore and gloo sockets). Checked from the kernel's socket tables, not from what Ray reports."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import ray
import torch

from dhp.stages.actor_group import ActorGroup, DistributedWorker
from dhp.stages.config import load_config
from dhp.stages.driver import init_ray


def _tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pids: set[int]) -> dict[str, int]:
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # exited, or not ours to read
            continue
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # /proc stores each 32-bit word host-order
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped or addr)


def listening(root: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state owned by `root` or its descendants."""
    inodes = _socket_inodes(_tree(root))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                host, port = f[1].split(":")
                out.append((_address(host), int(port, 16), inodes[f[9]]))
    return out


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
        sockets = listening(os.getpid())
        assert len({pid for _, _, pid in sockets}) >= 4, sockets  # gcs, raylet, workers at least
        exposed = [s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback]
        assert not exposed, f"listening on non-loopback addresses: {exposed}"
        group.shutdown()
    finally:
        ray.shutdown()
