"""The two stage pools as the driver sees them: each call returns object references at once.

A pool is `dp x degree` actors: data-parallel replica i is actors [i*degree, (i+1)*degree), its ranks
sharing one sample stream (sequence- or tensor-parallel inside the replica). Vision replica i feeds text
replica i, so both pools must have the same number of replicas. Every reference returned here can be
handed straight to the other pool: Ray moves the tensor actor to actor, the driver never fetches it.

Which transfer path a boundary tensor takes (the merged vision tokens [N, D] and their gradient):
- same node (shared or disjoint placement on one machine, the CPU default): the producer's return value
  is written once into Ray's shared-memory object store and the consumer on that node reads it from
  there; no socket, no driver hop. On CPU that is the only copy.
- different nodes: Ray's object manager pulls it node to node (one network copy).
- GPU actors: stage outputs are staged through host memory (`.cpu()` in the worker, `.to(device)` in the
  receiver): one device-to-host and one host-to-device copy. Ray Direct Transport would keep them on the
  GPU, but it runs its collectives on the actor's *default* process group (DESIGN.md §6), which here is
  the pool's own world, so it cannot link a vision actor to a text actor; CUDA IPC between two actors'
  pools is left for when that lands. The tensors are small (merged tokens: patches / 4 x hidden).
"""

from __future__ import annotations

import ray

from dhp.stages.actor_group import ActorGroup
from dhp.stages.config import Config, ConfigError

AVAILABLE = {"vision": ("none", "sequence", "tensor", "zero3"), "text": ("none", "tensor", "zero3")}


def data_parallel_size(cfg: Config) -> int:
    return cfg.vision.num_actors // cfg.vision.degree


def check_layout(cfg: Config, model_config=None) -> None:
    """Refuse, before anything starts, layouts that cannot run, saying what would.

    With the model's config, also the shape constraints: vision heads divisible by the SP degree,
    text heads / KV heads / vocabulary splittable by the TP degree.
    """
    for stage in ("vision", "text"):
        s = getattr(cfg, stage)
        if s.parallelism not in AVAILABLE[stage]:
            raise ConfigError(
                f"{stage}.parallelism={s.parallelism!r} is not available in this version; "
                f"available for {stage}: {', '.join(AVAILABLE[stage])}"
            )
        if s.parallelism == "none" and s.degree != 1:
            raise ConfigError(
                f"{stage}.degree={s.degree} needs a parallel layout; with {stage}.parallelism=none use "
                f"{stage}.degree=1 ({stage}.num_actors then counts data-parallel replicas)"
            )
        if s.parallelism == "zero3" and s.degree != 1:
            raise ConfigError(
                f"{stage}.degree={s.degree}: zero3 shards the model over the whole pool and every actor reads "
                f"its own samples; use {stage}.degree=1 ({stage}.num_actors is both the shard and the "
                f"data-parallel size)"
            )
    dp_v, dp_t = cfg.vision.num_actors // cfg.vision.degree, cfg.text.num_actors // cfg.text.degree
    if dp_v != dp_t:
        raise ConfigError(
            f"vision has {dp_v} data-parallel replicas (num_actors {cfg.vision.num_actors} / degree "
            f"{cfg.vision.degree}) but text has {dp_t}: each vision replica feeds one text replica, so they "
            f"must match, e.g. text.num_actors={dp_v * cfg.text.degree}"
        )
    if model_config is not None:
        from dhp.models.sequence_parallel import check_sp_degree
        from dhp.models.tensor_parallel import check_tp_degree
        from dhp.models.vision_tensor_parallel import check_vision_tp_degree

        try:
            if cfg.vision.parallelism == "sequence":
                check_sp_degree(model_config.vision_config.num_heads, cfg.vision.degree)
            if cfg.vision.parallelism == "tensor":
                check_vision_tp_degree(cfg.vision.degree, model_config.vision_config)
            if cfg.text.parallelism == "tensor":
                check_tp_degree(cfg.text.degree, model_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.training.global_batch_size % dp_v:
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} is not divisible by the {dp_v} "
            f"data-parallel replicas"
        )


class StagePool(ActorGroup):
    """Under ZeRO-3 (`zero3`) one copy of the model is spread over the whole pool, and every replica must
    run every call (the per-block all-gathers span all ranks): the trainer pads short replicas with
    `None` micro-batches, which only a `zero3` pool acts on."""

    parallelism = "none"  # the stage's layout, set by the trainer

    @property
    def zero3(self) -> bool:
        return self.parallelism == "zero3"

    def state_ranks(self, replica: int = 0) -> list:
        """The actors whose local states together make one full copy of the model."""
        return self.actors if self.zero3 else self.replica(replica)

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

    def save_weights(self, out_dir: str) -> ray.ObjectRef:
        """Rank 0 of replica 0 writes the stage's full tensors; the other ranks' shards go to it by ref."""
        first, *others = self.state_ranks(0)
        return first.save_weights.remote(out_dir, *[a.local_state.remote() for a in others])


class VisionPool(StagePool):
    def forward(self, replica: int, mb_id: int, inputs: list[ray.ObjectRef] | None) -> list[ray.ObjectRef]:
        """inputs[j]: rank j's pixels -> refs of the merged-token shards, one per rank (boundary.py).

        inputs None: a padding micro-batch (see the class docstring): no shards unless zero3."""
        if inputs is None:
            inputs = [None] * self.degree if self.zero3 else []
        if self.parallelism == "tensor":
            # Every TP rank encodes the same pixels and ends with the same full merged sequence: one
            # shard (rank 0's) crosses the boundary; the others only join the all-reduces.
            return [a.forward.remote(mb_id, x) for a, x in zip(self.replica(replica), inputs * self.degree)][:1]
        return [a.forward.remote(mb_id, x) for a, x in zip(self.replica(replica), inputs)]

    def backward(self, replica: int, mb_id: int, grads: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """grads[j]: d loss / d shard j. Fewer grads than ranks only for a padding micro-batch (zeros)."""
        if self.zero3 and not grads:
            grads = [None] * self.degree
        if self.parallelism == "tensor" and grads:
            grads = grads * self.degree  # the replicated output's gradient, to every TP rank (row-parallel adjoint)
        return [a.backward.remote(mb_id, g) for a, g in zip(self.replica(replica), grads)]

    def forward_eval(self, replica: int, inputs: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        if self.parallelism == "tensor":  # as in `forward`: all ranks run, rank 0's output crosses
            return [a.forward_eval.remote(inputs[0]) for a in self.replica(replica)][:1]
        return [a.forward_eval.remote(x) for a, x in zip(self.replica(replica), inputs)]


class TextPool(StagePool):
    def forward_backward(
        self, replica: int, mb_id: int, inputs: ray.ObjectRef | None, shards: list[ray.ObjectRef], loss_scale: float
    ) -> tuple[ray.ObjectRef | None, list[ray.ObjectRef]]:
        """-> (ref of the micro-batch's scaled loss, refs of d loss / d shard, one per vision rank).

        Every rank of the replica runs (tensor-parallel collectives need all of them); rank 0's loss and
        gradients are the replica's — the others are identical copies. inputs None: a padding
        micro-batch (class docstring): (None, []) unless zero3.
        """
        if inputs is None and not self.zero3:
            return None, []
        outs = [
            a.forward_backward.options(num_returns=1 + len(shards)).remote(mb_id, inputs, loss_scale, *shards)
            for a in self.replica(replica)
        ]
        return outs[0][0], list(outs[0][1:])

    def forward_eval(self, replica: int, inputs: ray.ObjectRef, shards: list[ray.ObjectRef]) -> ray.ObjectRef:
        return [a.forward_eval.remote(inputs, *shards) for a in self.replica(replica)][0]
