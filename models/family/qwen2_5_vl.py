"""The Qwen2.5-VL family: window-attention ViT (a few full-attention blocks), Qwen2 decoder with 3-D mRoPE.

Its stage modules are models/qwen2_5_vl.py (transformers' own classes). Named shapes: the published ones are
copied from the Hugging Face `config.json` of each released model; `tiny` is ours: the smallest shape that still
exercises every code path (window attention and full attention blocks, grouped-query attention, 3-D mRoPE, the
real 151 k vocabulary of the real tokenizer).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig

from dhp.models.family.base import ModelFamily, tp_role

_QWEN_VOCAB = 151936  # >= len(tokenizer) == 151665; the released 3B/7B/32B checkpoints pad further

_VISION_7B_CLASS = dict(  # the ViT is the same 32-block, 1280-wide encoder in every released size
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    fullatt_block_indexes=[7, 15, 23, 31],
    window_size=112,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    tokens_per_second=2,
    hidden_act="silu",
)


def _released_text(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tie: bool
) -> dict[str, Any]:
    """Text config of a released size: only these numbers differ between 3B, 7B, 32B and 72B."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vision=dict(  # the released block structure at toy width: 2 of 4 blocks full-attention
            _VISION_7B_CLASS,
            depth=4,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            fullatt_block_indexes=[1, 3],
            out_hidden_size=64,
        ),
        text=dict(
            vocab_size=_QWEN_VOCAB,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_5_vl_3b": dict(
        vision=dict(_VISION_7B_CLASS, out_hidden_size=2048),
        text=_released_text(151936, 2048, 11008, layers=36, heads=16, kv_heads=2, tie=True),
    ),
    "qwen2_5_vl_7b": dict(
        vision=dict(_VISION_7B_CLASS, out_hidden_size=3584),
        text=_released_text(152064, 3584, 18944, layers=28, heads=28, kv_heads=4, tie=False),
    ),
    "qwen2_5_vl_32b": dict(
        vision=dict(_VISION_7B_CLASS, intermediate_size=3456, out_hidden_size=5120),
        text=_released_text(152064, 5120, 27648, layers=64, heads=40, kv_heads=8, tie=False),
    ),
    "qwen2_5_vl_72b": dict(
        vision=dict(_VISION_7B_CLASS, intermediate_size=3456, out_hidden_size=8192),
        text=_released_text(152064, 8192, 29568, layers=80, heads=64, kv_heads=8, tie=False),
    ),
}


# The vision TP plan (models/parallel/vision_tensor_parallel.py): (name pattern, split, width split)
_VISION_TP = [
    (re.compile(r"\.attn\.qkv\.(weight|bias)$"), "qkv", "hidden"),
    (re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias)$"), "column", "mlp"),
    (re.compile(r"\.merger\.mlp\.0\.(weight|bias)$"), "column", "merger"),
    (re.compile(r"\.attn\.proj\.weight$"), "row", "hidden"),
    (re.compile(r"\.mlp\.down_proj\.weight$"), "row", "mlp"),
    (re.compile(r"\.merger\.mlp\.2\.weight$"), "row", "merger"),
]


# The special tokens of the Qwen2.5-VL and Qwen3-VL tokenizer (the same vocabulary)
QWEN_VL_TOKEN_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
)


class Qwen2_5_VL(ModelFamily):
    name = "qwen2_5_vl"
    label = "Qwen2.5-VL"
    shapes = SHAPES
    layouts = {"vision": ("none", "sequence", "tensor", "zero3"), "text": ("none", "tensor", "zero3")}
    token_ids = QWEN_VL_TOKEN_IDS
    vision_block_ops = 32
    vision_merger_ops = 9

    @property
    def config_class(self) -> type:
        return Qwen2_5_VLConfig

    @property
    def hf_class(self) -> type:
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration

    def stage_module_class(self, stage: str) -> type:
        from dhp.models.qwen2_5_vl import TextModel, VisionModel

        return {"vision": VisionModel, "text": TextModel}[stage]

    def full_attention_blocks(self, vision_config: Any) -> list[int]:
        return list(vision_config.fullatt_block_indexes)

    def vision_tp_role(self, name: str) -> tuple[str, str, bool] | None:
        return tp_role(_VISION_TP, name)

    def vision_mlp_out(self, mlp: nn.Module) -> nn.Module:
        return mlp.down_proj

    def vision_merger_linears(self, visual: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
        return [(visual.merger.mlp[0], visual.merger.mlp[2])]

    def merge(self, merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0]:
            return merger(x)
        return merger.mlp(merger.ln_q(x).view(0, merger.hidden_size))  # view(-1, ...) is ambiguous on zero rows

    def rope_positions(
        self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor, model_config: Any, *video: torch.Tensor | None
    ) -> torch.Tensor:
        from dhp.models.qwen2_5_vl import rope_positions

        return rope_positions(input_ids, image_grid_thw, model_config, *video)


QWEN2_5_VL = Qwen2_5_VL()
