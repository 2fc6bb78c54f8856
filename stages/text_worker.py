"""The text stage on one actor: tokens + vision embeddings in, loss out, embedding gradient back.

Boundary (receiving side). `vision_embeds` is [N, text_hidden] with N = number of `<|image_pad|>`
tokens in `input_ids`, rows in the order those tokens appear (batch-major). The returned gradient has
the same shape and order, so the vision stage can apply it to the tensor it produced.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dhp.models.qwen2_5_vl import TextModel
from dhp.models.tensor_parallel import apply_tensor_parallel, gather_full_state_dict, tp_slice
from dhp.stages.boundary import assemble, shard_gradients
from dhp.stages.stage_worker import StageWorker


class TextWorker(StageWorker):
    stage = "text"
    owned_prefixes = ("model.language_model.", "lm_head.")

    def build_model(self, model_config: Any) -> TextModel:
        return TextModel(model_config)

    def parallelize(self) -> None:
        if self.stage_cfg.parallelism == "tensor":
            apply_tensor_parallel(self.model, self.model_group)

    def checkpoint_slicer(self):
        if self.stage_cfg.parallelism != "tensor":
            return None
        return functools.partial(tp_slice, rank=self.model_rank, tp=self.degree, config=self.model_config)

    def full_state(self, local_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.stage_cfg.parallelism == "tensor":
            return gather_full_state_dict(local_states, self.model_config)
        return local_states[0]

    def _loss_sum(self, inputs: dict[str, torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        vision_embeds = assemble(shards, inputs.get("merged_index"))
        with self.autocast():
            hidden = self.model.hidden_states(
                inputs["input_ids"], vision_embeds, inputs["position_ids"], inputs["attention_mask"]
            )
            return self.model.loss_sum(hidden, inputs["labels"])

    def forward_backward(
        self, mb_id: int, inputs: dict[str, torch.Tensor], loss_scale: float, *shards: torch.Tensor
    ) -> tuple:
        """(loss of this micro-batch x loss_scale, d loss / d shard_1, ..., d loss / d shard_k).

        loss_scale is 1 / label tokens of the whole global batch (all replicas), which makes the
        accumulated, data-parallel-summed gradient that of the mean loss over the global batch, however
        it was split into replicas and micro-batches. `shards` are the vision ranks' outputs (boundary.py).
        """
        received = [s.to(self.device).requires_grad_(True) for s in shards]
        loss = self._loss_sum(inputs, received) * loss_scale
        loss.backward()
        return (float(loss.detach()), *shard_gradients(received))

    @torch.no_grad()
    def forward_eval(self, inputs: dict[str, torch.Tensor], *shards: torch.Tensor) -> float:
        """Summed (not averaged) loss, so the driver can average over all eval label tokens."""
        self.model.eval()
        try:
            return float(self._loss_sum(inputs, [s.to(self.device) for s in shards]))
        finally:
            self.model.train()
