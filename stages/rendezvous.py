"""Where dhp's processes listen: the loopback interface on a local run, the node's own IP on a cluster.

Nothing dhp starts by default listens on a non-loopback address:
  * a locally started Ray (no `ray.address`, no RAY_ADDRESS) is told its node IP is 127.0.0.1, so the GCS,
    raylet, object manager and every worker bind there (`local_ray_on_loopback`);
  * torch.distributed's TCPStore listens on every interface when it opens its own socket, so rank 0 opens
    the socket itself, bound to the rank's node IP, and hands the TCPStore its descriptor (`listen`,
    `store`);
  * gloo (and nccl's bootstrap) bind to the interface the host name resolves to unless told otherwise, so
    on a loopback world they are pointed at the loopback interface (`pin_collectives_to_loopback`).
On a multi-node cluster the node IP is what the other nodes reach, and that is what is bound (never `*`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_ray_on_loopback() -> None:
    """Make the next local `ray.init()` bind its services to 127.0.0.1.

    Ray has no public switch for this: on Linux `ray.init` deliberately maps 127.0.0.1 to the host's
    reachable IP (`services.resolve_ip_for_localhost`) so that other nodes could join. Its own
    single-machine mode (the default on macOS/Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) uses the
    loopback IP; the constant is read when the node IP is resolved, so setting it before `ray.init`
    suffices. A cluster joined through an address is never affected.
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def listen(host: str) -> socket.socket:
    """A listening TCP socket on `host` (an ephemeral port), kept open so no other process takes the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def store(host: str, port: int, world_size: int, rank: int, sock: socket.socket | None, timeout_s: float):
    """The pool's TCPStore: rank 0 serves it on `sock` (from `listen`), the others connect to host:port."""
    import torch.distributed as dist

    master = rank == 0
    return dist.TCPStore(
        host,
        port,
        world_size,
        master,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.fileno() if master else None,
    )


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def pin_collectives_to_loopback() -> None:
    """gloo pairs and nccl's bootstrap sockets on the loopback interface (an explicit user setting wins)."""
    lo = loopback_interface()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
