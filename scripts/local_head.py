"""A throw-away Ray head node on 127.0.0.1 for tests and local trials of `ray job submit`.

`start_head` runs `ray start --head --block` as a child in its own session, with its own ports, temp dir
and auth token (token auth on), and waits until the job server answers. `LocalHead.stop` ends exactly
that head and what it spawned, never `ray stop`, which would stop every Ray on the machine (other
people's runs included).

Two things Ray 2.60 does not do on its own, and why the head's environment sets them:
  * On Linux, `--node-ip-address=127.0.0.1` is replaced by the host's routable IP
    (`services.resolve_ip_for_localhost`) and the GCS, raylet, object manager, dashboard agent and Ray
    Client server then listen on every interface. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, Ray's own
    single-machine mode, keeps the node IP at 127.0.0.1, so every one of them binds there.
  * On SIGTERM `ray start --block` first drains the node for up to 30 s
    (`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`); with nothing to drain that is only a delay, so it is 0.
The autoscaler's and the dashboard's metrics servers have fixed default ports (44217, 44227) that a
second Ray on the machine would collide on; they get free ports too.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

LOOPBACK = "127.0.0.1"
# AF_UNIX paths are limited to 107 bytes; Ray puts `session_<date>_<time>_<us>_<pid>/sockets/plasma_store`
# (about 64 bytes) under its temp dir.
MAX_TEMP_DIR_LEN = 40
# Every port the head opens, each a free one: `ray start` flags, and two environment variables.
PORT_FLAGS = {
    "gcs": "--port",
    "dashboard": "--dashboard-port",
    "client": "--ray-client-server-port",
    "node_manager": "--node-manager-port",
    "object_manager": "--object-manager-port",
    "agent_http": "--dashboard-agent-listen-port",
    "agent_grpc": "--dashboard-agent-grpc-port",
    "runtime_env_agent": "--runtime-env-agent-port",
    "metrics_export": "--metrics-export-port",
    "autoscaler_metrics": "AUTOSCALER_METRIC_PORT",
    "dashboard_metrics": "DASHBOARD_METRIC_PORT",
}


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProcStat(NamedTuple):
    """What dhp reads of one process in /proc/PID/stat."""

    name: str
    state: str
    ppid: int
    session: int
    start: int  # clock ticks after boot: with the pid, names one process (pids are reused)
    cpu_s: float  # user + system seconds, all threads


def proc_stat(pid: int) -> ProcStat | None:
    """/proc/PID/stat of process `pid`; None when the process is gone (or there is no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    cpu_s = (int(rest[11]) + int(rest[12])) / TICKS_PER_S
    return ProcStat(name, rest[0], int(rest[1]), int(rest[3]), int(rest[19]), cpu_s)


def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (start time, name) of `root`, its descendants and the rest of its session. Both, because Ray's
    workers keep the session but a job's entrypoint starts a new one (it stays a descendant)."""
    stats = {int(d.name): proc_stat(int(d.name)) for d in Path("/proc").iterdir() if d.name.isdigit()}
    stats = {pid: s for pid, s in stats.items() if s is not None}
    children: dict[int, list[int]] = {}
    for pid, s in stats.items():
        children.setdefault(s.ppid, []).append(pid)
    tree, todo = set(), [root, *(pid for pid, s in stats.items() if s.session == root)]
    while todo:
        pid = todo.pop()
        if pid not in tree and pid in stats:
            tree.add(pid)
            todo += children.get(pid, [])
    return {pid: (stats[pid].start, stats[pid].name) for pid in tree}


def alive(procs: dict[int, tuple[int, str]]) -> dict[int, tuple[int, str]]:
    """Those of `procs` still running: same pid and start time (not a reused pid), not a zombie."""
    out = {}
    for pid, (start, name) in procs.items():
        s = proc_stat(pid)
        if s is not None and s.start == start and s.state not in ("Z", "X"):
            out[pid] = (start, name)
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    addr = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))  # host-order words
    return str(addr.ipv4_mapped or addr)


def listeners(procs: dict[int, tuple[int, str]]) -> list[Listener]:
    """Every TCP socket in LISTEN state held by one of `procs`, from /proc/net/tcp{,6}."""
    owner: dict[str, tuple[int, str]] = {}
    for pid, (_, name) in procs.items():
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = (pid, name)
        except OSError:  # exited meanwhile
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:  # 0A: LISTEN
                host, port = f[1].split(":")
                out.append(Listener(*owner[f[9]], _address(host), int(port, 16)))
    return out


def free_ports(n: int) -> list[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (held together while chosen, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalHead:
    proc: subprocess.Popen
    root: Path
    temp_dir: Path
    token_path: Path
    ports: dict[str, int]
    own_temp_dir: bool = False
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (start time, name), every pid met

    @property
    def gcs_address(self) -> str:
        return f"{LOOPBACK}:{self.ports['gcs']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['dashboard']}"

    def token(self) -> str:
        return self.token_path.read_text().strip()

    def client_env(self) -> dict[str, str]:
        """Environment for `ray job ...` against this head: its address and token, auth mode token."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS")}
        env.update(RAY_ADDRESS=self.dashboard_url, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        return env

    def processes(self) -> dict[int, tuple[int, str]]:
        """The head's processes now (pid -> (start time, name)); remembered for `stop`'s final check."""
        now = process_tree(self.proc.pid)
        self.seen.update(now)
        return now

    def listeners(self) -> list[Listener]:
        """Every listening TCP socket of the head's processes, read from the kernel's tables."""
        return listeners(self.processes())

    def log_tail(self, chars: int = 3000) -> str:
        path = self.root / "head.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """SIGTERM to `ray start` (it tears its node down), then SIGKILL to whatever of the head outlived
        that. Returns the processes that needed the SIGKILL; afterwards none of `seen` is alive."""
        self.processes()
        forced: list[str] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                forced.append(f"{self.proc.pid} ray start")
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own process group (start_new_session)
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)  # workers notice their raylet is gone and exit by themselves
        for pid, (_, name) in alive(self.seen).items():
            forced.append(f"{pid} {name}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return forced


def start_head(
    root: Path,
    *,
    num_cpus: int = 2,
    resources: dict[str, float] | None = None,
    object_store_bytes: int = 256 << 20,
    timeout_s: float = 90.0,
) -> LocalHead:
    """Start a head bound to 127.0.0.1 with token auth, state under `root`; returns once jobs are accepted."""
    root.mkdir(parents=True, exist_ok=True)
    token_path = root / "auth_token"
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
    temp_dir, own = root / "ray", False
    if len(str(temp_dir)) > MAX_TEMP_DIR_LEN:
        temp_dir, own = Path(tempfile.mkdtemp(prefix="dhp-ray-")), True
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        raise FileNotFoundError(f"{ray_bin}: the `ray` command of this Python environment is missing")
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        f"--node-ip-address={LOOPBACK}",
        f"--dashboard-host={LOOPBACK}",
        "--include-dashboard=true",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_bytes}",
        "--disable-usage-stats",
    ]
    cmd += [f"{flag}={ports[name]}" for name, flag in PORT_FLAGS.items() if flag.startswith("--")]
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        AUTOSCALER_METRIC_PORT=str(ports["autoscaler_metrics"]),
        DASHBOARD_METRIC_PORT=str(ports["dashboard_metrics"]),
        PATH=f"{ray_bin.parent}{os.pathsep}{env.get('PATH', '')}",  # a job's entrypoint finds `dhp` here
    )
    with open(root / "head.log", "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    head = LocalHead(proc, root, temp_dir, token_path, ports, own)
    try:
        _wait_for_job_server(head, timeout_s)
    except BaseException:
        head.stop()
        raise
    return head


def _wait_for_job_server(head: LocalHead, timeout_s: float) -> None:
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {head.token()}"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never via a proxy
    deadline = time.monotonic() + timeout_s
    while True:
        head.processes()
        if head.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with status {head.proc.returncode}:\n{head.log_tail()}")
        try:
            with opener.open(request, timeout=5) as r:
                # a submission goes through the head node's dashboard agent: the job server answers before the
                # agent listens, and a submit then fails "No available agent" after 10 s (on a busy machine)
                if r.status == 200 and any(x.port == head.ports["agent_http"] for x in head.listeners()):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not up yet (the job module loads after the dashboard's HTTP server)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head's job server did not answer within {timeout_s:.0f} s:\n{head.log_tail()}")
        time.sleep(0.5)
