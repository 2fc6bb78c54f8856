"""The vision stage on one actor: pixels in, merged embeddings out, their gradient back in.

Boundary (sending side). `forward` returns the merged vision embeddings of one micro-batch,
[sum_i t_i*h_i*w_i / 4, text_hidden] in raster order, image after image: exactly the rows the text stage
scatters into its `<|image_pad|>` positions. The autograd graph stays here, keyed by micro-batch id,
until `backward` receives d(loss)/d(embeddings) of the same shape from the text stage.
"""

from __future__ import annotations

from typing import Any

import torch

from dhp.models.qwen2_5_vl import VisionModel
from dhp.stages.stage_worker import StageWorker


class VisionWorker(StageWorker):
    stage = "vision"
    owned_prefixes = ("model.visual.",)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending: dict[int, torch.Tensor] = {}  # micro-batch id -> embeddings with their graph

    def build_model(self, model_config: Any) -> VisionModel:
        return VisionModel(model_config)

    def forward(self, mb_id: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.autocast():
            embeds = self.model(inputs["pixel_values"].to(self.device), inputs["image_grid_thw"].to(self.device))
        if embeds.requires_grad:
            self.pending[mb_id] = embeds
        return embeds.detach().float().cpu()

    def backward(self, mb_id: int, grad: torch.Tensor) -> int:
        embeds = self.pending.pop(mb_id, None)  # None: a text-only micro-batch had nothing to encode
        if embeds is not None and embeds.numel():
            embeds.backward(grad.to(device=embeds.device, dtype=embeds.dtype))
        return mb_id

    @torch.no_grad()
    def forward_eval(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.eval()
        try:
            with self.autocast():
                out = self.model(inputs["pixel_values"].to(self.device), inputs["image_grid_thw"].to(self.device))
        finally:
            self.model.train()
        return out.float().cpu()
