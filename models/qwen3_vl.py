"""Qwen3-VL split into its two trainable halves, built from transformers' own classes.

`VisionModel` wraps transformers' `Qwen3VLVisionModel` (patch embed, learned position embedding interpolated to
each image's grid, full-attention blocks, merger, DeepStack mergers) and `TextModel` wraps `Qwen3VLTextModel`
(token embedding, Qwen3 decoder with q/k RMSNorm and interleaved mRoPE) plus the `lm_head` Linear: the modules
`Qwen3VLForConditionalGeneration` holds, under the same attribute names as models/qwen2_5_vl.py, so parameter
names map 1:1 onto the Hugging Face checkpoint names (`hf_name`) and both stages load, export and lay out as
Qwen2.5-VL's do.

What crosses the boundary per micro-batch is ONE tensor [N, (1 + k) * D] (N merged image tokens, D the text
hidden size, k = len(deepstack_visual_indexes)): row i is the merged embedding of image token i, then its k
DeepStack features, side by side. Every boundary layout routes rows (by position), so each text rank receives
the embeddings and the DeepStack features of exactly its own positions, and the gradient, of the same shape,
returns to the vision rank that produced the rows, with no second channel (stages/boundary.py).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLVisionModel

from dhp.models import qwen2_5_vl
from dhp.models.window_attention import group_segment_attention


class VisionModel(qwen2_5_vl.VisionModel):
    """Pixels -> [P / merge_size**2, (1 + k) * text_hidden]: merged embeddings, then the k DeepStack features.

    Input as Qwen2.5-VL's: `pixel_values` [P, C*T*p*p] in the image processor's order, `grid_thw` [n_images, 3].
    Rows are in raster order, image after image (no windows: the order transformers' merger gives).
    """

    def __init__(self, config: Qwen3VLConfig):
        nn.Module.__init__(self)
        # fp32 whatever the config's `dtype` says: the stage's precision is dhp's setting (models/precision.py)
        self.visual = Qwen3VLVisionModel._from_config(config.vision_config, dtype=torch.float32)
        group_segment_attention(self.visual)  # one attention call per image / frame-pair size, not per segment
        self.deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.out_dim = config.vision_config.out_hidden_size * (1 + self.deepstack)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if grid_thw.numel() == 0:  # a text-only micro-batch: nothing to encode, nothing to send
            return pixel_values.new_zeros(0, self.out_dim)
        pixel_values = pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        out = self.visual(pixel_values, grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def shard_units(self) -> list[nn.Module]:
        """The modules a sharded layout gathers one at a time (blocks, mergers); the rest goes with the root."""
        return [*self.visual.blocks, self.visual.merger, *self.visual.deepstack_merger_list]


class TextModel(qwen2_5_vl.TextModel):
    """Token ids + boundary rows -> loss: the merged embeddings scattered into `<|image_pad|>` and `<|video_pad|>`
    positions (in text order) and the
    DeepStack features added to the outputs of the first k decoder layers there, as `Qwen3VLModel.forward` does
    (`visual_pos_masks`, `Qwen3VLTextModel._deepstack_process`). The loss, packing and the layer list are
    Qwen2.5-VL's (the parent class)."""

    language_model_class = Qwen3VLTextModel

    def __init__(self, config: Qwen3VLConfig, packed: bool = False):
        super().__init__(config, packed)
        self.deepstack = len(config.vision_config.deepstack_visual_indexes)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        vision_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, L] ids, [N_img_tokens, (1 + k) * H] boundary rows, [3, B, L] positions, [B, L] mask -> [B, L, H]."""
        embeds = self.language_model.embed_tokens(input_ids)
        width = embeds.shape[-1]
        # images and videos alike, in text order: `Qwen3VLModel.forward`'s image and video masks joined
        image_mask = (input_ids == self.image_token_id) | (input_ids == self.video_token_id)
        if int(image_mask.sum()) != vision_embeds.shape[0] or vision_embeds.shape[-1] != width * (1 + self.deepstack):
            raise ValueError(
                f"{int(image_mask.sum())} <|image_pad|> / <|video_pad|> tokens of width {width} and "
                f"{self.deepstack} DeepStack features, but boundary rows of shape {tuple(vision_embeds.shape)}"
            )
        deepstack = None
        if vision_embeds.shape[0]:
            merged, *deepstack = vision_embeds.to(embeds.dtype).split(width, dim=-1)
            embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), merged)
        out = self.language_model(
            inputs_embeds=embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            visual_pos_masks=image_mask if deepstack else None,
            deepstack_visual_embeds=deepstack or None,
            **self._packed_kwargs(cu_seqlens, embeds.device),
        )
        return out.last_hidden_state


def rope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    config: Qwen3VLConfig,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """3-D mRoPE position ids [3, L] of one unpadded sample of images, videos and text, computed by transformers'
    `get_rope_index` (a method of `Qwen3VLModel` that reads only `config` and `get_vision_position_ids`: a stand-in
    `self` suffices). It places each temporal patch of a video as an image of its own: the time is in the text's
    timestamps (dataflow/video_formats.py), so `second_per_grid_ts` is not read."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    stand_in = types.SimpleNamespace(
        config=config,
        get_vision_position_ids=functools.partial(Qwen3VLModel.get_vision_position_ids, None),
    )
    ids = input_ids.view(1, -1)
    # mm_token_type_ids: text 0, image 1, video 2 (get_rope_index's convention)
    token_types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    grid = image_grid_thw if image_grid_thw.numel() else None
    # get_rope_index splits the video grids into their temporal patches in place: it gets a copy
    videos = video_grid_thw.clone() if video_grid_thw is not None and video_grid_thw.numel() else None
    positions, _ = Qwen3VLModel.get_rope_index(
        stand_in, ids, mm_token_type_ids=token_types, image_grid_thw=grid, video_grid_thw=videos
    )
    return positions[:, 0]
