"""The Qwen3-VL family: a ViT with full attention in every block (2-D RoPE plus a learned position embedding
interpolated to each grid) and DeepStack (the outputs of `deepstack_visual_indexes` blocks, through their own
mergers, are added to the first decoder layers at the image positions); the Qwen3 decoder (q/k RMSNorm,
interleaved mRoPE, `head_dim` of its own).

Its stage modules are models/qwen3_vl.py (transformers' own classes). Named shapes: `qwen3_vl_tiny`, ours, the
smallest shape with every code path of the family on (DeepStack from two of four vision blocks into the first two
of three decoder layers, grouped-query attention, a `head_dim` that is not hidden / heads, the real 151 k
vocabulary), and the released dense sizes `qwen3_vl_2b`, `qwen3_vl_8b`, `qwen3_vl_32b` (for `dhp plan` and a
random-init run; their checkpoints load through `model.path`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from transformers import Qwen3VLConfig

from dhp.models.family.base import ModelFamily, tp_role
from dhp.models.family.qwen2_5_vl import QWEN_VL_TOKEN_IDS

_QWEN_VOCAB = 151936

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_vl_tiny": dict(
        vision=dict(
            depth=4,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,  # an 8 x 8 learned grid, interpolated to each image's
            deepstack_visual_indexes=[1, 2],
            hidden_act="gelu_pytorch_tanh",
        ),
        text=dict(
            vocab_size=_QWEN_VOCAB,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
                "mrope_interleaved": True,
            },
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}


def _released(vision: dict[str, Any], hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict:
    """A released dense size: the numbers of its Hugging Face `config.json` (every size: 8 KV heads of 128, the
    interleaved mRoPE of sections [24, 20, 20] at theta 5e6, a 262 144-token window)."""
    text = dict(
        vocab_size=_QWEN_VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    return dict(vision=dict(vision, out_hidden_size=hidden), text=text)


# The two released encoders: 24 blocks of 1024 (2B, 4B) and 27 of 1152 (8B, 32B), DeepStack from three blocks
_VIT_SMALL = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
    hidden_act="gelu_pytorch_tanh",
)
_VIT_LARGE = dict(_VIT_SMALL, depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24])
SHAPES.update(
    qwen3_vl_2b=_released(_VIT_SMALL, 2048, 6144, layers=28, heads=16, tie=True),
    qwen3_vl_8b=_released(_VIT_LARGE, 4096, 12288, layers=36, heads=32, tie=False),
    qwen3_vl_32b=_released(_VIT_LARGE, 5120, 25600, layers=64, heads=64, tie=False),
)

# The vision TP plan (models/parallel/vision_tensor_parallel.py): the merger and the DeepStack mergers alike
_MERGERS = r"\.(merger|deepstack_merger_list\.\d+)"
_VISION_TP = [
    (re.compile(r"\.attn\.qkv\.(weight|bias)$"), "qkv", "hidden"),
    (re.compile(r"\.blocks\.\d+\.mlp\.linear_fc1\.(weight|bias)$"), "column", "mlp"),
    (re.compile(_MERGERS + r"\.linear_fc1\.(weight|bias)$"), "column", "merger"),
    (re.compile(r"\.attn\.proj\.weight$"), "row", "hidden"),
    (re.compile(r"\.blocks\.\d+\.mlp\.linear_fc2\.weight$"), "row", "mlp"),
    (re.compile(_MERGERS + r"\.linear_fc2\.weight$"), "row", "merger"),
]


class Qwen3_VL(ModelFamily):
    name = "qwen3_vl"
    label = "Qwen3-VL"
    shapes = SHAPES
    layouts = {"vision": ("none", "sequence", "tensor", "zero3"), "text": ("none", "tensor", "zero3")}
    token_ids = QWEN_VL_TOKEN_IDS
    # 0.5 per channel, as transformers' Qwen3VLVideoProcessor defaults to for frames (the same encoder)
    image_mean = image_std = (0.5, 0.5, 0.5)
    vision_mlp_linears = 2  # linear_fc1, linear_fc2
    vision_layer_norm = True
    text_head_norms = ("q_norm", "k_norm")
    vision_block_ops = 20
    vision_merger_ops = 4  # the merger and each DeepStack merger

    @property
    def config_class(self) -> type:
        return Qwen3VLConfig

    @property
    def hf_class(self) -> type:
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration

    def stage_module_class(self, stage: str) -> type:
        from dhp.models.qwen3_vl import TextModel, VisionModel

        return {"vision": VisionModel, "text": TextModel}[stage]

    def full_attention_blocks(self, vision_config: Any) -> list[int]:
        return list(range(vision_config.depth))

    def vision_position_embeddings(self, vision_config: Any) -> int:
        return vision_config.num_position_embeddings

    def deepstack_indexes(self, vision_config: Any) -> list[int]:
        return list(vision_config.deepstack_visual_indexes)

    def deepstack_mergers(self, visual: nn.Module) -> list[nn.Module]:
        return list(visual.deepstack_merger_list)

    def add_position_embeds(
        self, visual: nn.Module, x: torch.Tensor, grid_thw: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        # the learned grid resampled to each image's, as `Qwen3VLVisionModel.forward` does, for these patches only
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=visual.config.spatial_merge_size,
        )
        indices, weights = indices[index], weights[index]
        return x + (visual.pos_embed(indices) * weights[:, :, None]).sum(1).to(x.dtype)

    def vision_tp_role(self, name: str) -> tuple[str, str, bool] | None:
        return tp_role(_VISION_TP, name)

    def vision_mlp_out(self, mlp: nn.Module) -> nn.Module:
        return mlp.linear_fc2

    def vision_merger_linears(self, visual: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
        return [(m.linear_fc1, m.linear_fc2) for m in (visual.merger, *visual.deepstack_merger_list)]

    def merge(self, merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0]:
            return merger(x)
        # zero rows: `view(-1, ...)` is ambiguous, so the merger's steps with the shape spelled out
        shaped = x.view(0, merger.hidden_size)
        h = merger.norm(shaped) if merger.use_postshuffle_norm else merger.norm(x).view(0, merger.hidden_size)
        return merger.linear_fc2(merger.act_fn(merger.linear_fc1(h)))

    def rope_positions(
        self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor, model_config: Any, *video: torch.Tensor | None
    ) -> torch.Tensor:
        from dhp.models.qwen3_vl import rope_positions

        return rope_positions(input_ids, image_grid_thw, model_config, *video)

    @property
    def video_format(self) -> Any:
        # a timestamp in the text before each temporal patch; positions per temporal patch, as for an image
        from dhp.dataflow.video_formats import QWEN3_VIDEO_FORMAT

        return QWEN3_VIDEO_FORMAT


QWEN3_VL = Qwen3_VL()
