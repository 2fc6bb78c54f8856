"""The vision stage on one actor: pixels in, merged embeddings out, their gradient back in.

Boundary (sending side). `forward` returns the merged vision embeddings of one micro-batch,
[sum_i t_i*h_i*w_i / 4, W] in raster order (W: the family's `boundary_width`, the text hidden size times one plus
the DeepStack features, stages/boundary.py), image after image: exactly the rows the text stage
scatters into its `<|image_pad|>` positions. The autograd graph stays here, keyed by micro-batch id,
until `backward` receives d(loss)/d(embeddings) of the same shape from the text stage.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dhp.models.family import family_of
from dhp.models.planning.saved_tensors import SavedBytes
from dhp.stages.boundary import WireTensor
from dhp.stages.stage_worker import StageWorker, recorded


class VisionWorker(StageWorker):
    stage = "vision"

    def build_model(self, model_config: Any) -> torch.nn.Module:
        return family_of(model_config).vision_model(model_config)

    def _placeholder(self) -> dict[str, torch.Tensor]:
        """One 28x28 image of zeros (4 patches, 1 merged token).

        Under a lockstep layout (ZeRO-3) a rank with no image in a micro-batch (or a padding micro-batch)
        still has to join every block's all-gather and reduce-scatter (docs/design.md, invariant 2): it
        encodes this, sends nothing on and backpropagates zeros through it, so every gradient it adds is exactly 0.
        """
        v = self.model_config.vision_config
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
        return {"pixel_values": torch.zeros(4, patch), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    def _encode(self, inputs: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """This rank's merged tokens: all of them, or (SP) its window-ordered shard [S_r / 4, D]."""
        if inputs is None or (self.layout.lockstep and inputs["image_grid_thw"].numel() == 0):
            return self._encode(self._placeholder())[:0]  # rows of nothing, graph of everything
        pixels, grid = inputs["pixel_values"].to(self.device), inputs["image_grid_thw"]
        with self.autocast():
            return self.layout.vision_forward(self.model, pixels, grid, self.ranks)

    @recorded("forward")
    def forward(self, mb_id: int, inputs: dict[str, torch.Tensor] | None) -> WireTensor | torch.Tensor:
        """inputs None: a padding micro-batch of a lockstep (ZeRO-3) replica."""
        measuring = self._measured is not None and inputs is not None  # measure_activations: the encoder call
        with (
            SavedBytes(self.model) if measuring else contextlib.nullcontext() as saved,
            torch.set_grad_enabled(self.trains),
        ):  # a frozen encoder keeps no graph
            embeds = self._encode(inputs)
        if measuring:
            patches = int(inputs["image_grid_thw"].prod(-1).sum())  # the replica's, also under SP
            self._measured.append({"patches": patches, "bytes": saved.total})
        if self.trains:  # a frozen encoder gets no backward (nor any gradient to lose)
            # the embeddings with their graph until the backward; None: a text-only micro-batch, nothing to encode
            self.step_ledger.forwarded(mb_id, embeds if embeds.requires_grad else None)
        with self.moving():  # in the dtype it was computed in: bf16 under autocast, half fp32's bytes to move
            return self.transport.send(embeds)  # [n, D]: bytes on the host, or the GPU tensor (stages/boundary.py)

    @recorded("backward")
    def backward(self, mb_id: int, grad: WireTensor | torch.Tensor | None) -> int:
        """grad None: a padding micro-batch, whose (placeholder) output got no gradient: zeros."""
        # raises if this rank never encoded `mb_id` (a gradient sent to the wrong rank): stages/step_ledger.py
        embeds = self.step_ledger.backward(mb_id)  # None: a text-only micro-batch had nothing to encode
        if embeds is not None:
            # Even an empty SP shard runs its backward: its graph holds the all-to-alls the other ranks
            # of the replica are about to join (docs/design.md, invariant 2).
            with self.moving():
                grad = (
                    torch.zeros_like(embeds)
                    if grad is None
                    else self.transport.receive(grad, embeds.device).to(embeds.dtype)
                )
            embeds.backward(grad)
        return mb_id

    @torch.no_grad()
    def forward_eval(self, inputs: dict[str, torch.Tensor]) -> WireTensor | torch.Tensor:
        self.model.eval()
        try:
            return self.transport.send(self._encode(inputs))
        finally:
            self.model.train()
