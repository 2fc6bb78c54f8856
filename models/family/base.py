"""What a model family is: the one object that says which modules, shapes, checkpoints and plans a model has.

Every part of dhp that depends on the model asks its family (`family_of(model_config)`, models/family/__init__.py)
instead of testing a model name: the stage workers build `vision_model` / `text_model`, the layouts ask which
vision blocks need the sequence-parallel all-to-all and whether they can lay the family out at all, the data
pipeline asks for the mRoPE positions, the boundary for its width, weights for the config class. A new family is
one subclass in one file (its stage modules in a file of their own) and its parity cases.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn


class ModelFamily:
    """The answers dhp needs about one model family; each family overrides them (the base holds no model)."""

    name: ClassVar[str] = ""  # how docs and errors name it
    label: ClassVar[str] = ""  # e.g. "Qwen2.5-VL"
    # named shapes: `model.name` -> {"vision": vision config kwargs, "text": text config kwargs}
    shapes: ClassVar[dict[str, dict[str, Any]]] = {}
    # the layouts (`parallelism` values) each stage can use with this family; the others are refused up front
    layouts: ClassVar[dict[str, tuple[str, ...]]] = {}
    # the special token ids a named shape's config gets (image / video pads, vision start / end)
    token_ids: ClassVar[dict[str, int]] = {}
    # the per-channel mean and std images are normalised with (the released checkpoints' preprocessor config):
    # OpenAI CLIP's, as transformers' Qwen2-VL image processor defaults to
    image_mean: ClassVar[tuple[float, float, float]] = (0.48145466, 0.4578275, 0.40821073)
    image_std: ClassVar[tuple[float, float, float]] = (0.26862954, 0.26130258, 0.27577711)

    # --- configs ---------------------------------------------------------------------------------------

    @property
    def config_class(self) -> type:
        raise NotImplementedError

    @property
    def hf_class(self) -> type:
        """transformers' whole model (`...ForConditionalGeneration`): the single-process reference and what an
        export is loaded back with."""
        raise NotImplementedError

    def shape_config(self, name: str, attn_implementation: str = "sdpa") -> Any:
        """The config of the named shape `name` (one of `shapes`), in `config_class`, with `token_ids`."""
        arch = self.shapes[name]
        text = dict(arch["text"])
        config = self.config_class(
            vision_config=dict(arch["vision"]),
            text_config=text,
            tie_word_embeddings=text["tie_word_embeddings"],
            **self.token_ids,
        )
        config._attn_implementation = attn_implementation
        return config

    def owns(self, model_config: Any) -> bool:
        """Whether `model_config` (the whole model's, or its vision or text part) is this family's."""
        return isinstance(model_config, (self.config_class, *self.config_class.sub_configs.values()))

    # --- stage modules ---------------------------------------------------------------------------------

    def vision_model(self, model_config: Any) -> nn.Module:
        """The vision stage's module: pixels -> what crosses the boundary, `[N, boundary_width]`."""
        return self.stage_module_class("vision")(model_config)

    def text_model(self, model_config: Any, packed: bool = False) -> nn.Module:
        """The text stage's module: tokens + the boundary's rows -> summed loss."""
        return self.stage_module_class("text")(model_config, packed=packed)

    def stage_module_class(self, stage: str) -> type:
        """The class of `stage`'s module (its `hf_name` and `checkpoint_prefixes`)."""
        raise NotImplementedError

    # Modules of a decoder layer's `self_attn` whose one weight normalises every head (text TP sums their gradients)
    text_head_norms: ClassVar[tuple[str, ...]] = ()

    # --- vision encoder structure ----------------------------------------------------------------------

    def full_attention_blocks(self, vision_config: Any) -> list[int]:
        """Vision blocks attending over the whole image: under sequence parallelism each needs the all-to-all
        (the others attend inside windows a rank holds whole)."""
        raise NotImplementedError

    def windowed(self, vision_config: Any) -> bool:
        """Whether some vision blocks attend inside windows (then the merged tokens run in window order)."""
        return len(self.full_attention_blocks(vision_config)) < vision_config.depth

    # Each temporal patch of a video (a frame pair) is its own attention segment, an image's frame as it were:
    # transformers' `get_vision_cu_seqlens` repeats h x w per temporal patch (`merge_temporal` False), both in the
    # full-attention blocks and (window order) inside the windows; the time model's attention terms ask this
    frame_attention: ClassVar[bool] = True
    # Ops one vision block's and one merger's forward dispatch (aten ops, views excluded: about a kernel each on a
    # GPU; one attention call per block), the time model's per-kernel overhead: each family's own modules differ
    # (Qwen2.5-VL's fp32 RMSNorms are five ops, Qwen3-VL's LayerNorms one); tests/test_plan_video.py counts them
    vision_block_ops: ClassVar[int]
    vision_merger_ops: ClassVar[int]

    def vision_attention_ops(self, lengths: list[int]) -> int:
        """Ops a full-attention vision block dispatches beyond `vision_block_ops` over attention segments of these
        lengths (images, a video's temporal patches). dhp's grouped attention (models/window_attention.py), which
        both families' ViTs use: one call per distinct length; past one, each group's q/k/v gathers and its
        call, then the concatenation and the gather back to sequence order."""
        groups = len(set(lengths))
        return 0 if groups <= 1 else 4 * groups + 1

    # Linears of one vision block's MLP: 3 for a gated MLP (gate, up, down), 2 for a plain one (the FLOP count)
    vision_mlp_linears: ClassVar[int] = 3
    # The vision blocks' and mergers' norms: LayerNorm (weight and bias; keeps mean and rstd) or RMSNorm (the
    # memory plan's saved-tensor count, models/parallel/layout.py `VitShape`)
    vision_layer_norm: ClassVar[bool] = False

    def vision_position_embeddings(self, vision_config: Any) -> int:
        """Rows of the ViT's learned absolute position embedding (0: none, rotary positions only)."""
        return 0

    def deepstack_indexes(self, vision_config: Any) -> list[int]:
        """Vision blocks whose outputs (through their own mergers) are added to the first decoder layers."""
        return []

    def boundary_width(self, model_config: Any) -> int:
        """Columns of one boundary row: the merged embedding, then one DeepStack feature per deepstack block,
        each `text_hidden` wide (stages/boundary.py)."""
        return model_config.text_config.hidden_size * (1 + len(self.deepstack_indexes(model_config.vision_config)))

    def deepstack_mergers(self, visual: nn.Module) -> list[nn.Module]:
        """The DeepStack mergers of transformers' vision model `visual`, in `deepstack_indexes` order."""
        return []

    def add_position_embeds(
        self, visual: nn.Module, x: torch.Tensor, grid_thw: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """`x` [S, D], the patch embeddings of patches `index` (of all the batch's, processor order), plus their
        learned absolute position embeddings where the family has them (the sequence-parallel forward)."""
        return x

    def merge(self, merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`merger` (a merger of transformers' vision model) on x [S, D] -> [S / merge_unit, out], S = 0 included
        (a rank holding no patch still runs it, so its parameters get their zero gradients)."""
        raise NotImplementedError

    def vision_tp_role(self, name: str) -> tuple[str, str, bool] | None:
        """How vision tensor parallelism splits parameter `name` of the vision stage: (`qkv` | `column` | `row`, the
        width split: `hidden` | `mlp` | `merger`, whether it is a bias); None: replicated."""
        raise NotImplementedError

    def vision_mlp_out(self, mlp: nn.Module) -> nn.Module:
        """The row-parallel Linear closing a vision block's MLP."""
        raise NotImplementedError

    def vision_merger_linears(self, visual: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
        """(column-parallel Linear, row-parallel Linear) of each merger of transformers' vision model `visual`."""
        raise NotImplementedError

    # --- data --------------------------------------------------------------------------------------------

    def rope_positions(
        self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor, model_config: Any, *video: torch.Tensor | None
    ) -> torch.Tensor:
        """3-D mRoPE position ids [3, L] of one unpadded sample, as the family's transformers model computes them
        (`video`: the video grids and seconds per temporal patch, where the family's positions take them)."""
        raise NotImplementedError

    @property
    def video_format(self) -> Any:
        """How the data pipeline samples, sizes and writes this family's videos (dataflow/video_formats.py)."""
        from dhp.dataflow.video_formats import VIDEO_FORMAT

        return VIDEO_FORMAT

    # --- layouts -----------------------------------------------------------------------------------------

    def check_layout(self, stage: str, parallelism: str) -> str | None:
        """Why `stage` cannot use `parallelism` with this family (None: it can)."""
        ok = self.layouts.get(stage, ())
        if parallelism in ok:
            return None
        return f"{stage}.parallelism={parallelism} is not available for {self.label} models; available: {', '.join(ok)}"

    def __repr__(self) -> str:
        return f"<model family {self.name}>"


def tp_role(plan: list[tuple[Any, str, str]], name: str) -> tuple[str, str, bool] | None:
    """`vision_tp_role` from a plan of (compiled name pattern, split, width split), the first match winning."""
    for pattern, split, width in plan:
        if pattern.search(name):
            return split, width, name.endswith(".bias")
    return None
