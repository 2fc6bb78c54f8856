"""The two stage pools as the driver sees them: each call returns object references at once.

Layout today: one actor per pool (`parallelism: none`); the sequence/tensor-parallel layouts extend
these methods (fan a micro-batch out to a replica's ranks, pick rank 0's loss) without changing the
driver. Every reference returned here can be handed straight to the other pool: Ray moves the tensor
actor to actor through the object store, the driver never fetches it.
"""

from __future__ import annotations

import ray

from dhp.stages.actor_group import ActorGroup
from dhp.stages.config import Config, ConfigError


def check_layout(cfg: Config) -> None:
    for stage in ("vision", "text"):
        s = getattr(cfg, stage)
        if s.parallelism != "none" or s.num_actors != 1 or s.degree != 1:
            raise ConfigError(
                f"{stage}.parallelism={s.parallelism!r} with num_actors={s.num_actors}, degree={s.degree} is not "
                f"available in this version: use {stage}.parallelism=none {stage}.num_actors=1 {stage}.degree=1"
            )


class StagePool(ActorGroup):
    def grad_sq_norm(self) -> list[ray.ObjectRef]:
        return self.execute_all_async("grad_sq_norm")

    def optimizer_step(self, clip_coef: float) -> list[ray.ObjectRef]:
        return self.execute_all_async("optimizer_step", clip_coef)


class VisionPool(StagePool):
    def forward(self, mb_id: int, inputs: ray.ObjectRef) -> ray.ObjectRef:
        """-> ref of merged embeddings [N_image_tokens, text_hidden], raster order."""
        return self.actors[0].forward.remote(mb_id, inputs)

    def backward(self, mb_id: int, grad: ray.ObjectRef) -> ray.ObjectRef:
        return self.actors[0].backward.remote(mb_id, grad)

    def forward_eval(self, inputs: ray.ObjectRef) -> ray.ObjectRef:
        return self.actors[0].forward_eval.remote(inputs)


class TextPool(StagePool):
    def forward_backward(
        self, mb_id: int, inputs: ray.ObjectRef, embeds: ray.ObjectRef, loss_scale: float
    ) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        """-> (ref of this micro-batch's scaled loss, ref of d loss / d embeds)."""
        return self.actors[0].forward_backward.options(num_returns=2).remote(mb_id, inputs, embeds, loss_scale)

    def forward_eval(self, inputs: ray.ObjectRef, embeds: ray.ObjectRef) -> ray.ObjectRef:
        return self.actors[0].forward_eval.remote(inputs, embeds)
