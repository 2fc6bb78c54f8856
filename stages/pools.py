"""The two stage pools as the driver sees them: each call returns object references at once.

A pool is `dp x degree` actors: data-parallel replica i is actors [i*degree, (i+1)*degree), its ranks
working on one micro-batch at a time (sequence- or tensor-parallel inside the replica). The two pools'
replica counts are independent: each text replica has its own sample stream and any vision replica may
encode any of its micro-batches (models/parallel/routing.py). Every reference returned here can be handed
straight to the other pool: Ray moves the tensor actor to actor, the driver never fetches it.

Which transfer path a boundary tensor takes (the merged vision tokens [N, D] and their gradient):
- same node (shared or disjoint placement on one machine, the CPU default): the producer's return value
  is written once into Ray's shared-memory object store and the consumer on that node reads it from
  there; no socket, no driver hop. On CPU that is the only copy.
- different nodes: Ray's object manager pulls it node to node (one network copy).
- GPU actors (`pipeline.boundary=host`): stage outputs are staged through host memory (a `WireTensor`): one
  device-to-host and one host-to-device copy. `pipeline.boundary=cuda_ipc` keeps them on the GPU when the
  two pools share one (Ray Direct Transport's CUDA IPC: the receiver maps the sender's memory). Ray's
  collective transports (gloo, NCCL) are not used: they run on the actor's *default* process group
  (docs/design.md, "Facts about CPU machines and GPU machines the code relies on"), which here is the
  pool's own world, so they cannot link a vision actor to a text actor.
  Which calls cross and with which Ray transport: `_crossing` below; the transport itself: stages/boundary.py.
"""

from __future__ import annotations

from typing import Any

import ray

from dhp.models.parallel.layout import Layout
from dhp.stages.actor_group import ActorGroup
from dhp.stages.boundary import HostTransport, Transport


class StagePool(ActorGroup):
    """A lockstep layout (`layout.lockstep`, ZeRO-3) needs every replica to run every call (its collectives
    span all ranks): the routing (models/parallel/routing.py) pads its calls with `None` micro-batches, which only
    such a pool acts on. Which ranks run a call and whose output crosses the boundary is the layout's answer."""

    layout: Layout  # the stage's layout object, set by the trainer
    transport: Transport = HostTransport()  # how boundary tensors travel (`pipeline.boundary`), set by the trainer
    trains: bool = True  # False: nothing of the stage trains (models/fine_tuning.py): no backward, no step

    @property
    def zero3(self) -> bool:
        """One copy of the model spread over the whole pool (its replicas are not independent copies)."""
        return self.layout.spans_pool

    def state_ranks(self, replica: int = 0) -> list:
        """The actors whose local states together make one full copy of the model."""
        return [self.actors[r] for r in self.layout.state_ranks(replica)]

    def full_state(self, replica: int = 0, grads: bool = False) -> ray.ObjectRef:
        """Ref of the full parameters (or gradients) of one replica, assembled on its first rank."""
        first, *others = self.state_ranks(replica)
        return first.full_state_of.remote(*[a.local_state.remote(grads) for a in others], grads=grads)

    def sync_grads(self) -> list[ray.ObjectRef]:
        """Sum gradients across data-parallel replicas (every rank joins)."""
        return self.execute_all_async("sync_grads")

    def grad_sq_norm(self) -> list[ray.ObjectRef]:
        """Squared norm contributions; summed over all ranks they give the pool's squared grad norm."""
        return self.execute_all_async("grad_sq_norm")

    def optimizer_step(self, clip_coef: float) -> list[ray.ObjectRef]:
        return self.execute_all_async("optimizer_step", clip_coef)

    def close_global_batch(self) -> list[ray.ObjectRef]:
        """Each rank's broken step invariants (a list of lines, empty when none): stages/step_ledger.py."""
        return self.execute_all_async("close_global_batch")

    def _crossing(self, method: Any) -> Any:
        """An actor method whose return value crosses to the other pool, under the boundary's Ray transport."""
        return method.options(tensor_transport=self.transport.ray_transport) if self.transport.direct else method


class VisionPool(StagePool):
    def forward(self, replica: int, mb_id: int, inputs: list[ray.ObjectRef] | None) -> list[ray.ObjectRef]:
        """inputs[j]: rank j's pixels -> refs of the merged-token shards, one per rank (boundary.py).

        inputs None: a padding micro-batch (see the class docstring): no call unless the layout is lockstep.
        The layout says what each rank encodes and whose output crosses (`rank_inputs`, `crossing`)."""
        per_rank = self.layout.rank_inputs(inputs)
        return self.layout.crossing(
            [self._crossing(a.forward).remote(mb_id, x) for a, x in zip(self.replica(replica), per_rank)]
        )

    def backward(self, replica: int, mb_id: int, grads: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """grads[j]: d loss / d crossing output j; none only for a padding micro-batch (zeros)."""
        per_rank = self.layout.rank_grads(grads)
        return [a.backward.remote(mb_id, g) for a, g in zip(self.replica(replica), per_rank)]

    def forward_eval(self, replica: int, inputs: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        per_rank = self.layout.rank_inputs(inputs)
        return self.layout.crossing(
            [self._crossing(a.forward_eval).remote(x) for a, x in zip(self.replica(replica), per_rank)]
        )


class TextPool(StagePool):
    def forward_backward(
        self,
        replica: int,
        mb_id: int,
        inputs: ray.ObjectRef | None,
        shards: list[ray.ObjectRef],
        loss_scale: float,
        want_grads: bool = True,
    ) -> tuple[ray.ObjectRef | None, list[ray.ObjectRef]]:
        """-> (ref of the micro-batch's scaled loss, refs of d loss / d shard, one per vision rank; none
        unless `want_grads`: a frozen vision pool has no use for them).

        Every rank of the replica runs (tensor-parallel collectives need all of them); rank 0's loss and
        gradients are the replica's. Only rank 0 sends the gradients back: the other ranks compute the same
        ones, and copying each to host memory and the object store would be (degree - 1) x the embedding
        gradient of waste per micro-batch (7/8 of it at TP 8). inputs None: a padding micro-batch (class
        docstring): (None, []) unless the layout is lockstep.
        """
        if inputs is None and not self.layout.lockstep:
            return None, []
        first, *others = self.replica(replica)
        send = bool(shards) and want_grads
        separate = send and self.transport.direct  # one return per Ray Direct Transport call
        out = first.forward_backward.options(num_returns=1 + len(shards) * (send and not separate)).remote(
            mb_id, inputs, loss_scale, *shards, send_grads=send
        )
        out = out if send and not separate else [out]  # one return is a bare reference
        if separate:
            out += [self._crossing(first.gradient).remote(mb_id, j) for j in range(len(shards))]
        for a in others:
            a.forward_backward.options(num_returns=1).remote(mb_id, inputs, loss_scale, *shards, send_grads=False)
        return out[0], list(out[1:])

    def forward_eval(self, replica: int, inputs: ray.ObjectRef, shards: list[ray.ObjectRef]) -> ray.ObjectRef:
        return [a.forward_eval.remote(inputs, *shards) for a in self.replica(replica)][0]
