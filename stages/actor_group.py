"""A pool of Ray actors that form one torch.distributed world: one per model stage.

Each actor is its own process, so each pool gets its own default process group (gloo on CPU, nccl on
GPU) whose collectives never mix with the other pool's. Rank 0 listens on a free port of its node IP
(127.0.0.1 on a local run: stages/rendezvous.py); all ranks then join.
"""

from __future__ import annotations

import collections
import os
from datetime import timedelta
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dhp.models.parallel.layout import pool_ranks
from dhp.stages import rendezvous
from dhp.stages.progress import Progress, tracked
from dhp.stages.start_up import wait_all


class DistributedWorker:
    """Base class of stage workers: process-group setup, thread count, device.

    Stage calls run one at a time in the actor's default concurrency group; `heartbeat` runs in its own
    ("health", one thread), so it answers while a call computes or waits in a collective, and only a process
    that cannot run at all (stopped, deadlocked holding the GIL, gone) leaves it unanswered (stages/watchdog.py).
    It answers with `progress` (stages/progress.py): how far the current call has got, so a slow call that moves
    is told from one that stands still.
    """

    def __init__(self, rank: int, world_size: int, torch_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        self.progress = Progress()
        torch.set_num_threads(max(1, torch_threads))
        if torch.cuda.is_available() and ray.get_gpu_ids():
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def address(self) -> tuple[str, int]:
        """(node IP, port) of the pool's TCPStore, served by this (rank 0) actor on a socket it keeps open for
        its whole life: the store serves every world the pool forms (`init_process_group`)."""
        if getattr(self, "_store_socket", None) is None:
            host = ray.util.get_node_ip_address()
            self._store_socket = rendezvous.listen(host)
            self._store_address = host, self._store_socket.getsockname()[1]
        return self._store_address

    def init_process_group(
        self, master_addr: str, master_port: int, degree: int = 1, timeout_s: float = 600, world: int = 0
    ) -> None:
        """Join the pool's world number `world`, then split it into its model-parallel and data-parallel groups
        (`pool_ranks`).

        The actor opens one TCPStore (server on rank 0, client elsewhere) for its whole life and each world keys
        its rendezvous under its own prefix: a second store would take over the first one's socket descriptor
        (`master_listen_fd`) while the first one's server still runs, and a descriptor number closed by one and
        reused by the other aborts a rank or hangs a later `new_group`."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if rendezvous.is_loopback(master_addr):
            rendezvous.pin_collectives_to_loopback()
        if getattr(self, "_store", None) is None:
            sock = getattr(self, "_store_socket", None) if self.rank == 0 else None
            self._store = rendezvous.store(master_addr, master_port, self.world_size, self.rank, sock, timeout_s)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"world{world}/", self._store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.ranks = pool_ranks(self.rank, self.world_size, degree, self.device)

    def regroup(self, degree: int) -> None:
        """Split the same world into groups of `degree` instead (a reused pool of another layout). Every rank of
        the pool must call it at once, as `new_group` requires; the previous groups are destroyed."""
        import torch.distributed as dist

        old = {g for g in (self.ranks.model_group, self.ranks.dp_group) if g is not None}
        self.ranks = pool_ranks(self.rank, self.world_size, degree, self.device)
        for group in old:
            dist.destroy_process_group(group)

    def leave(self, world_size: int) -> None:
        """Leave the pool's world (every group of it destroyed); the next `init_process_group` joins one of
        `world_size` ranks. A reused pool of another size (`ActorGroup.resize`): every rank of the old world
        leaves; a rank beyond the new one waits as a spare. Destroying gloo groups is local to the rank."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.world_size = world_size

    def setup(self) -> None:
        """Work that needs the process groups (model construction in stage workers)."""

    def ping(self) -> int:
        return self.rank

    @ray.method(concurrency_group="health")
    def heartbeat(self) -> dict[str, Any]:
        return self.progress.snapshot()

    def where(self) -> dict[str, Any]:
        """Node, process and devices of this actor, for the start-up placement summary."""
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),  # several nodes may share an IP (one machine)
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "threads": torch.get_num_threads(),
            "device": str(self.device),
        }


class ActorGroup:
    """N actors of one worker class, with per-actor resources and their own process group."""

    def __init__(
        self,
        name: str,
        worker_cls: type,
        num_actors: int,
        init_args: tuple = (),
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        torch_threads: int = 1,
        degree: int = 1,
        placement_timeout_s: float = 300,
        placement: list[tuple[Any, int]] | None = None,
        ledger: CallLedger | None = None,
        tensor_transport: bool = False,
        spares: int = 0,
    ):
        """`placement`: (placement group, bundle index) per actor (placement.py); None = anywhere. Every call
        made through `actors` is written to `ledger` (which call each rank is in, for the hang report).
        `tensor_transport`: the actors may return tensors through Ray Direct Transport (`pipeline.boundary`);
        off unless asked, since Ray then runs every call of the actor on a background thread. `spares`: actors
        started beyond the `num_actors` of the world, idle until a `resize` takes them in (ranks after the
        world's; `placement` then has a place for each)."""
        if num_actors % degree:
            raise ValueError(f"{name}: {num_actors} actors cannot form groups of {degree}")
        self.name, self.degree, self.dp = name, degree, num_actors // degree
        self.actors: list[TrackedActor] = []
        self.spares: list[TrackedActor] = []  # started, outside the world until a `resize` takes them in
        self.ledger = ledger if ledger is not None else CallLedger()
        rdt = {"enable_tensor_transport": True} if tensor_transport else {}
        remote_cls = ray.remote(concurrency_groups={"health": 1}, **rdt)(tracked(worker_cls))  # calls mark progress

        def options(rank: int) -> dict[str, Any]:
            if placement is None:
                return {}
            group, bundle = placement[rank]
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, bundle)}

        def start() -> list[TrackedActor]:
            actors = [
                TrackedActor(
                    remote_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, **options(rank)).remote(
                        *init_args, rank=rank, world_size=num_actors, torch_threads=torch_threads
                    ),
                    name,
                    rank,
                    self.ledger,
                )
                for rank in range(num_actors + spares)
            ]
            pings = [a.ping.remote() for a in actors]
            # a rank answers once its process has started and imported torch and transformers
            waiting = f"{name} pool: {{ready}} of {{total}} ranks started after {{seconds:.0f}} s"
            ready = wait_all(pings, waiting, placement_timeout_s)
            if len(ready) < len(pings):  # a rendezvous with missing ranks would wait forever
                for actor in actors:
                    ray.kill(actor.handle, no_restart=True)
                raise RuntimeError(
                    f"only {len(ready)} of {num_actors} {name} actors started within {placement_timeout_s:g} s: "
                    f"the cluster lacks the resources ({num_cpus:g} CPU, {num_gpus:g} GPU per actor)"
                )
            try:
                ray.get(pings)  # a rank whose constructor raised, or whose process died, fails here
            except ray.exceptions.RayActorError:
                for actor in actors:
                    ray.kill(actor.handle, no_restart=True)
                raise
            return actors

        try:
            self.actors = start()
        except ray.exceptions.ActorDiedError as died:
            # A process that died before it answered anything (no state lost: no rank has joined the group yet)
            # is started again once: a process-level accident at start-up (seen once in CI: a rank's worker
            # exited before its first call) should not fail a run. A constructor that raises is not retried;
            # a second death is reported as is.
            if died.actor_init_failed:
                raise
            print(
                f"{name}: a rank's process died while starting ({str(died).splitlines()[0]}); starting the pool again",
                flush=True,
            )
            self.actors = start()
        self.actors, self.spares = self.actors[:num_actors], self.actors[num_actors:]
        self.worlds = 1  # worlds this pool has formed: each keys its rendezvous apart in the one store
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        ray.get([a.init_process_group.remote(master_addr, master_port, degree) for a in self.actors])
        built = [a.setup.remote() for a in self.actors]
        wait_all(built, f"{name} pool: {{ready}} of {{total}} ranks built after {{seconds:.0f}} s")
        ray.get(built)

    def __len__(self) -> int:
        return len(self.actors)

    def regroup(self, degree: int) -> None:
        """The driver's side of `DistributedWorker.regroup`: replicas of `degree` actors from now on."""
        if len(self.actors) % degree:
            raise ValueError(f"{self.name}: {len(self.actors)} actors cannot form groups of {degree}")
        self.degree, self.dp = degree, len(self.actors) // degree

    @property
    def capacity(self) -> int:
        """The actors this pool has started: those of its world and its idle spares."""
        return len(self.actors) + len(self.spares)

    def resize(self, num_actors: int, degree: int) -> None:
        """A world of this pool's first `num_actors` actors (their ranks unchanged), in groups of `degree`: a
        reused pool of another size. Every rank of the old world leaves it (`DistributedWorker.leave`) and the
        new world's ranks join a new one; the actors beyond it wait as spares. The same size only regroups.
        The caller then rebuilds each rank's model (`reconfigure`), whose groups are gone."""
        if num_actors == len(self.actors):
            self.regroup(degree)
            return
        every = self.actors + self.spares
        if not 0 < num_actors <= len(every):
            raise ValueError(f"{self.name}: {num_actors} actors asked of a pool of {len(every)}")
        ray.get([a.leave.remote(num_actors) for a in every])
        self.actors, self.spares = every[:num_actors], every[num_actors:]
        # the same rank 0 serves the store of every world the pool forms
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        world, self.worlds = self.worlds, self.worlds + 1
        ray.get([a.init_process_group.remote(master_addr, master_port, degree, world=world) for a in self.actors])
        self.regroup(degree)

    def replica(self, i: int) -> list:
        """The actors of data-parallel replica i, in model-parallel rank order."""
        return self.actors[i * self.degree : (i + 1) * self.degree]

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call `method` on every actor with the same arguments; references, in rank order."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get(self.execute_all_async(method, *args, **kwargs))

    def shutdown(self) -> None:
        for actor in self.actors + self.spares:
            ray.kill(actor.handle, no_restart=True)  # a stopped (SIGSTOP) process is killed all the same
        self.actors, self.spares = [], []


class CallLedger:
    """The actor calls the driver submitted and has not yet seen finish, per (stage, rank), oldest first: the
    call a hung rank is in is its oldest unfinished one (an actor runs its calls in order). Each entry holds
    the call's first return reference, which pins that object (a boundary tensor, say), so finished entries
    are dropped from the head of their actor's queue whenever a call is added to it, and all at step ends."""

    def __init__(self) -> None:
        self.queues: dict[tuple[str, int], collections.deque] = {}

    def add(self, ref: ray.ObjectRef, stage: str, rank: int, method: str) -> None:
        queue = self.queues.setdefault((stage, rank), collections.deque())
        self._drop_finished(queue)
        queue.append((ref, method))

    @staticmethod
    def _drop_finished(queue: collections.deque) -> None:
        while queue:
            done, _ = ray.wait([queue[0][0]], timeout=0, fetch_local=False)
            if not done:
                return
            queue.popleft()

    def in_call(self) -> dict[tuple[str, int], str]:
        """(stage, rank) -> the method of its oldest unfinished call."""
        out = {}
        for key, queue in self.queues.items():
            self._drop_finished(queue)
            if queue:
                out[key] = queue[0][1]
        return out

    def clear(self) -> None:
        self.queues.clear()


class TrackedActor:
    """An actor handle whose calls are written to a `CallLedger` as (stage, rank, method). `handle` is the
    Ray handle itself (for `ray.kill`)."""

    def __init__(self, handle: Any, stage: str, rank: int, ledger: CallLedger):
        self.handle, self.stage, self.rank, self.ledger = handle, stage, rank, ledger

    def __getattr__(self, name: str) -> _TrackedMethod:
        handle = self.__dict__.get("handle")  # absent while copy/pickle probes a bare instance
        if handle is None:
            raise AttributeError(name)
        return _TrackedMethod(getattr(handle, name), self, name)


class _TrackedMethod:
    def __init__(self, method: Any, actor: TrackedActor, name: str):
        self.method, self.actor, self.name = method, actor, name

    def options(self, **kwargs: Any) -> _TrackedMethod:
        return _TrackedMethod(self.method.options(**kwargs), self.actor, self.name)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        out = self.method.remote(*args, **kwargs)
        first = out[0] if isinstance(out, list) and out else out
        if isinstance(first, ray.ObjectRef) and self.name != "heartbeat":
            self.actor.ledger.add(first, self.actor.stage, self.actor.rank, self.name)
        return out
