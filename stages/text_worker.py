"""The text stage on one actor: tokens + vision embeddings in, loss out, embedding gradient back.

Boundary (receiving side). `vision_embeds` is [N, W] (W: the family's `boundary_width`, stages/boundary.py)
with N = number of `<|image_pad|>` tokens in `input_ids`, rows in the order those tokens appear (batch-major;
packed, sample after sample).
The returned gradient has the same shape and order, so the vision stage can apply it to the tensor it
produced.

With `data.packing` a micro-batch's text is one sequence of several samples and their `cu_seqlens`
(dataflow/packing.py); the model is built to attend inside each sample (models/packed_attention.py). Every
tensor-parallel rank gets the same sequence, as it gets the same padded batch, and splits heads and columns,
never the sequence, so nothing else changes under any text layout.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dhp.models.family import family_of
from dhp.models.lora import add_lora
from dhp.models.planning.saved_tensors import SavedBytes
from dhp.models.qwen2_5_vl import IGNORE_INDEX
from dhp.stages.boundary import WireTensor, assemble, shard_gradients
from dhp.stages.stage_worker import StageWorker, recorded


class TextWorker(StageWorker):
    stage = "text"

    def build_model(self, model_config: Any) -> torch.nn.Module:
        return family_of(model_config).text_model(model_config, packed=self.cfg.data.packing)

    def adapt(self) -> None:
        if self.fine_tuning.lora is not None:  # models/lora.py: this rank's parts of the factors, split as the base
            add_lora(
                self.model,
                self.fine_tuning.lora,
                self.layout,
                self.ranks,
                self.full_shapes,
                seed=self.cfg.model.init_seed,
            )

    def setup(self) -> None:
        super().setup()
        if self.fine_tuning.partial(self.stage):
            # A frozen language model (or a LoRA one, whose base is frozen) still owes the vision side d loss / d
            # embeddings, and its embedding output needs a gradient only on the TP rank that sends it back. The
            # decoder's input is made to require grad in every training forward, so every micro-batch (text-only
            # and padding ones included) runs the same backward on every rank, and with it the same TP / ZeRO-3
            # collectives (docs/design.md, invariant 2: a copy-to-region whose input needs no gradient skips
            # its all-reduce).
            self.model.language_model.embed_tokens.register_forward_hook(_require_grad)

    def _measuring_changed(self, on: bool) -> None:
        """The decoder (embedding output to final norm) only: the logits of the labelled positions are the
        plan's transients, not activations. `forward_backward` adds `step_bytes` to each record: the same plus
        what the rest of the forward keeps (embedding lookup, logits, loss), which `dhp bench peers` compares
        with a whole-model peer."""
        for h in getattr(self, "_measure_hooks", []):
            h.remove()
        self._measure_hooks = []
        if not on:
            return
        decoder = self.model.language_model
        saved = SavedBytes(self.model)

        def start(module, args, kwargs):
            if torch.is_grad_enabled():
                self._tokens = int(kwargs["inputs_embeds"].shape[:2].numel())
                saved.start()

        def stop(module, args, kwargs, output):
            if torch.is_grad_enabled():
                self._measured.append({"tokens": self._tokens, "bytes": saved.stop()})

        self._measure_hooks = [
            decoder.register_forward_pre_hook(start, with_kwargs=True),
            decoder.register_forward_hook(stop, with_kwargs=True),
        ]

    def _null_inputs(self) -> dict[str, torch.Tensor]:
        """Two text tokens, the second labelled: runs every layer and lm_head; used with loss_scale 0.

        A ZeRO-3 replica that has run out of micro-batches still has to join the others' per-layer
        all-gathers and reduce-scatters (docs/design.md, invariant 2); its contribution to every gradient is exactly 0.
        """
        ids = torch.zeros(1, 2, dtype=torch.long)
        return {
            "input_ids": ids,
            "labels": torch.tensor([[IGNORE_INDEX, 0]]),
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(2).expand(3, 1, 2).clone(),
        }

    def _loss_sum(self, inputs: dict[str, torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if shards:
            vision_embeds = assemble(shards, inputs.get("merged_index"))
        else:  # a padding micro-batch with no vision call behind it
            width = family_of(self.model_config).boundary_width(self.model_config)
            vision_embeds = torch.zeros(0, width, device=self.device)
        with self.autocast():
            return self.model(
                inputs["input_ids"],
                vision_embeds,
                inputs["position_ids"],
                inputs.get("attention_mask"),  # none when packed
                inputs["labels"],
                inputs.get("cu_seqlens"),
            )

    @recorded("forward_backward")
    def forward_backward(
        self,
        mb_id: int,
        inputs: dict[str, torch.Tensor] | None,
        loss_scale: float,
        *shards: WireTensor | torch.Tensor,
        send_grads: bool = True,
    ) -> tuple | float:
        """(loss of this micro-batch x loss_scale, d loss / d shard_1, ..., d loss / d shard_k); with
        `send_grads` False only the loss, and the shards' gradients are not even computed (the pool asks
        this of every rank but the replica's first: theirs would be identical copies). Under a Ray Direct
        Transport boundary (one return per call) only the loss, and the gradients wait for `gradient`.

        loss_scale is 1 / label tokens of the whole global batch (all replicas), which makes the
        accumulated, data-parallel-summed gradient that of the mean loss over the global batch, however
        it was split into replicas and micro-batches. `shards` are the vision ranks' outputs (boundary.py).
        The backward's collectives do not depend on `send_grads`: they run on every rank either way.
        """
        self.step_ledger.forwarded(mb_id)  # a second call for one micro-batch raises, before any collective
        if inputs is None:  # padding for a lockstep (ZeRO-3) replica: no data, every collective
            inputs, loss_scale = self._null_inputs(), 0.0
        with self.moving():
            received = [self.transport.receive(s, self.device).requires_grad_(send_grads) for s in shards]
        measuring = self._measured is not None
        with SavedBytes(self.model) if measuring else contextlib.nullcontext() as outside:
            loss = self._loss_sum(inputs, received) * loss_scale
        if measuring and self._measured:  # + what the decoder's own hooks did not see: embeddings, logits, loss
            self._measured[-1]["step_bytes"] = self._measured[-1]["bytes"] + outside.total
        loss.backward()
        if send_grads and self.transport.direct:  # shard j -> its gradient, until `gradient` sends it
            left = dict(enumerate(shard_gradients(received)))
            if left:
                self.step_ledger.keep(mb_id, left)
            else:
                self.step_ledger.backward(mb_id)
            return float(loss.detach())
        self.step_ledger.backward(mb_id)  # nothing of it left to send
        if not send_grads:
            return float(loss.detach())
        with self.moving():
            return (float(loss.detach()), *[self.transport.send(g) for g in shard_gradients(received)])

    @recorded("gradient")
    def gradient(self, mb_id: int, j: int) -> torch.Tensor:
        """d loss / d shard j of micro-batch `mb_id`, kept by its `forward_backward` (Ray Direct Transport
        boundary: the pool asks once per shard, right after that call). Raises if this rank holds no such gradient
        (stages/step_ledger.py)."""
        left = self.step_ledger.owe(mb_id, f"the gradient of shard {j} of")
        if not left or j not in left:
            self.step_ledger.fail(
                f"the gradient of shard {j} of micro-batch {mb_id}, which this rank does not hold "
                f"(sent already, or no such shard; held: {sorted(left or [])})"
            )
        g = left.pop(j)
        if not left:
            self.step_ledger.backward(mb_id)  # every shard's gradient is sent: nothing owed
        return self.transport.send(g)  # no copy: it stays on the device (not timed as one)

    @torch.no_grad()
    def forward_eval(self, inputs: dict[str, torch.Tensor], *shards: WireTensor | torch.Tensor) -> float:
        """Summed (not averaged) loss, so the driver can average over all eval label tokens."""
        self.model.eval()
        try:
            return float(self._loss_sum(inputs, [self.transport.receive(s, self.device) for s in shards]))
        finally:
            self.model.train()


def _require_grad(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not output.requires_grad:
        output = output.detach().requires_grad_()
    return output
