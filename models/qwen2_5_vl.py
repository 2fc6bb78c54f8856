"""Qwen2.5-VL split into its two trainable halves, built from transformers' own classes.

Nothing here re-implements the model: `VisionModel` wraps transformers'
`Qwen2_5_VisionTransformerPretrainedModel` (patch embed, 32 blocks, merger) and `TextModel` wraps
`Qwen2_5_VLTextModel` (token embedding, decoder) plus the `lm_head` Linear, exactly the modules that
`Qwen2_5_VLForConditionalGeneration` holds. Parameter names map 1:1 onto the Hugging Face checkpoint
names (`hf_name`), which is what lets a stage load only its own tensors from a checkpoint and lets an
export be read back by `Qwen2_5_VLForConditionalGeneration.from_pretrained`.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig
from transformers.loss.loss_utils import fixed_cross_entropy
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLTextModel,
)

from dhp.labels import IGNORE_INDEX
from dhp.models.packed_attention import varlen_kernel
from dhp.models.window_attention import group_segment_attention


class VisionModel(nn.Module):
    """Pixels -> merged vision embeddings, in the raster order the text stage expects.

    Input: `pixel_values` [P, C*T*p*p] (P patches of all images, concatenated, in the image
    processor's order) and `grid_thw` [n_images, 3]. Output: [P / merge_size**2, text_hidden].
    """

    checkpoint_prefixes = ("model.visual.",)  # the checkpoint names this stage owns (and loads)

    def __init__(self, config: Qwen2_5_VLConfig):
        super().__init__()
        # fp32 whatever the config's `dtype` says: the stage's precision is dhp's setting (models/precision.py)
        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=torch.float32)
        group_segment_attention(self.visual)  # one attention call per window length, not per window
        self.out_dim = config.vision_config.out_hidden_size

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if grid_thw.numel() == 0:  # a text-only micro-batch: nothing to encode, nothing to send
            return pixel_values.new_zeros(0, self.out_dim)
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        return self.visual(pixel_values, grid_thw=grid_thw).pooler_output

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharded layout gathers one at a time (blocks, merger); the rest goes with the root."""
        return [*self.visual.blocks, self.visual.merger]

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order (what activation checkpointing chooses from)."""
        return list(self.visual.blocks)

    @staticmethod
    def hf_name(name: str) -> str:
        return "model." + name


class TextModel(nn.Module):
    """Token ids + vision embeddings -> loss, with the merge of the two done as transformers does it.

    `<|image_pad|>` and `<|video_pad|>` positions of `input_ids` receive the rows of `vision_embeds` in order
    (`masked_scatter`, as in `Qwen2_5_VLModel.forward`, which scatters images and videos separately: the rows
    come in placeholder order, dataflow/preprocess.py, so one scatter is the same); positions are the 3-D mRoPE ids.

    `packed`: the micro-batches are packed (dataflow/packing.py), one sequence of several samples with their
    `cu_seqlens`; the decoder layers then attend with `varlen_kernel()` (models/packed_attention.py), inside each
    sample only. Unpacked input still works and attends as SDPA would.
    """

    checkpoint_prefixes = ("model.language_model.", "lm_head.")
    language_model_class = Qwen2_5_VLTextModel  # transformers' decoder (a subclass names its family's)

    def __init__(self, config: Qwen2_5_VLConfig, packed: bool = False):
        super().__init__()
        text_config = varlen_kernel().text_config(config.text_config) if packed else config.text_config
        self.packed = packed
        # fp32 whatever the config's `dtype` says (models/precision.py)
        self.language_model = self.language_model_class._from_config(text_config, dtype=torch.float32)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.image_token_id = config.image_token_id
        self.video_token_id = config.video_token_id
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        vision_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, L] ids, [N_img_tokens, H] vision rows, [3, B, L] positions, [B, L] mask -> [B, L, H]. A packed
        sequence: B = 1, no mask, and `cu_seqlens` [n + 1], where each of its n samples starts (then L)."""
        embeds = self.language_model.embed_tokens(input_ids)
        image_mask = (input_ids == self.image_token_id) | (input_ids == self.video_token_id)
        if int(image_mask.sum()) != vision_embeds.shape[0]:
            raise ValueError(
                f"{int(image_mask.sum())} <|image_pad|> / <|video_pad|> tokens but {vision_embeds.shape[0]} vision "
                "embeddings"
            )
        if vision_embeds.shape[0]:
            embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), vision_embeds.to(embeds.dtype))
        out = self.language_model(
            inputs_embeds=embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **self._packed_kwargs(cu_seqlens, embeds.device),
        )
        return out.last_hidden_state

    def _packed_kwargs(self, cu_seqlens: torch.Tensor | None, device: torch.device) -> dict:
        if cu_seqlens is None:
            return {}
        if not self.packed:  # its layers would attend across the samples
            raise ValueError("a packed micro-batch (cu_seqlens) reached a TextModel built with packed=False")
        return varlen_kernel().model_kwargs(cu_seqlens, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        vision_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Summed loss of the batch: `hidden_states` then `loss_sum` (one call, so wrappers such as FSDP
        that act on `forward` see the whole use of the parameters)."""
        hidden = self.hidden_states(input_ids, vision_embeds, position_ids, attention_mask, cu_seqlens)
        return self.loss_sum(hidden, labels)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy over labelled positions.

        The logits are computed only where a label exists: the other positions contribute neither to
        the loss nor to any gradient, and on a 152 k vocabulary they are most of the memory and FLOPs.
        The shift matches transformers' `ForCausalLMLoss` (position i predicts label i+1).
        """
        shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        keep = shift_labels != IGNORE_INDEX
        logits = self.lm_head(hidden[keep]).float()
        return fixed_cross_entropy(logits, shift_labels[keep], num_items_in_batch=1)

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharded layout gathers one at a time (decoder layers); the rest goes with the root."""
        return list(self.language_model.layers)

    def blocks(self) -> list[nn.Module]:
        """The decoder layers, in order (what activation checkpointing chooses from)."""
        return list(self.language_model.layers)

    @staticmethod
    def hf_name(name: str) -> str:
        return name if name.startswith("lm_head.") else "model." + name


def rope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    config: Qwen2_5_VLConfig,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """3-D mRoPE position ids [3, L] of one unpadded sample, computed by transformers' `get_rope_index`.

    `image_grid_thw` / `video_grid_thw`: the grids of the sample's images / videos, each in the order of its
    pad runs; `second_per_grid_ts` [n_videos]: seconds per temporal patch of each video (the time positions of a
    video advance by tokens_per_second x that per temporal patch).
    `get_rope_index` is a method of `Qwen2_5_VLModel` but reads only `config` and the static
    `get_vision_position_ids`; a stand-in `self` lets the data pipeline call it without a model.
    """
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    stand_in = types.SimpleNamespace(
        config=config,
        get_vision_position_ids=functools.partial(Qwen2_5_VLModel.get_vision_position_ids, None),
    )
    ids = input_ids.view(1, -1)
    # mm_token_type_ids: text 0, image 1, video 2 (get_rope_index's convention)
    token_types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    grid = image_grid_thw if image_grid_thw.numel() else None
    videos = video_grid_thw if video_grid_thw is not None and video_grid_thw.numel() else None
    positions, _ = Qwen2_5_VLModel.get_rope_index(
        stand_in,
        ids,
        mm_token_type_ids=token_types,
        image_grid_thw=grid,
        video_grid_thw=videos,
        second_per_grid_ts=second_per_grid_ts if videos is not None else None,
    )
    return positions[:, 0]
