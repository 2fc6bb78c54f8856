"""The text stage on one actor: tokens + vision embeddings in, loss out, embedding gradient back.

Boundary (receiving side). `vision_embeds` is [N, text_hidden] with N = number of `<|image_pad|>`
tokens in `input_ids`, rows in the order those tokens appear (batch-major). The returned gradient has
the same shape and order, so the vision stage can apply it to the tensor it produced.
"""

from __future__ import annotations

from typing import Any

import torch

from dhp.models.qwen2_5_vl import TextModel
from dhp.stages.stage_worker import StageWorker


class TextWorker(StageWorker):
    stage = "text"
    owned_prefixes = ("model.language_model.", "lm_head.")

    def build_model(self, model_config: Any) -> TextModel:
        return TextModel(model_config)

    def _loss_sum(self, inputs: dict[str, torch.Tensor], vision_embeds: torch.Tensor) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        with self.autocast():
            hidden = self.model.hidden_states(
                inputs["input_ids"], vision_embeds, inputs["position_ids"], inputs["attention_mask"]
            )
            return self.model.loss_sum(hidden, inputs["labels"])

    def forward_backward(
        self, mb_id: int, inputs: dict[str, torch.Tensor], vision_embeds: torch.Tensor, loss_scale: float
    ) -> tuple[float, torch.Tensor]:
        """Loss of this micro-batch x loss_scale (1 / label tokens of the global batch), and dL/d(embeds).

        Scaling by the global batch's label-token count makes the accumulated gradient that of the mean
        loss over the whole global batch, however it was split into micro-batches.
        """
        embeds = vision_embeds.to(self.device).requires_grad_(True)
        loss = self._loss_sum(inputs, embeds) * loss_scale
        loss.backward()
        grad = embeds.grad if embeds.grad is not None else torch.zeros_like(embeds)
        return float(loss.detach()), grad.cpu()

    @torch.no_grad()
    def forward_eval(self, inputs: dict[str, torch.Tensor], vision_embeds: torch.Tensor) -> float:
        """Summed (not averaged) loss, so the driver can average over all eval label tokens."""
        self.model.eval()
        try:
            return float(self._loss_sum(inputs, vision_embeds.to(self.device)))
        finally:
            self.model.train()
