"""Step time of a configuration on a named device, before anything runs (`dhp plan --time`).

The workload: every sample `P` patches, an image's (`--image-patches`) and/or videos' (`--video FRAMESxHxW`:
ceil(FRAMES / temporal_patch_size) temporal patches of a frame's patches), and `T` text tokens besides its P/4
merged vision tokens (`--text-tokens`, default 512, plus what the family's video format writes around a video:
Qwen3-VL's `<t seconds>` per temporal patch), `data.microbatch_tokens // (P/4 + T)` samples per micro-batch (at
least 1), `training.global_batch_size` samples per step. Throughput is vision tokens (patches) per second over
the whole job, as the reference counts it. A real length mix (`--data-profile`, models/planning/length_mix.py)
gives each micro-batch its own `MicroBatchShape`: its visuals' patches and temporal patches (attention is per
image, and per temporal patch of a video: `ModelFamily.frame_attention`), its samples' lengths (padded: batch x
longest, packed: their sum; attention per sample) and text tokens; `step_time_of` costs every micro-batch at its
own sizes and schedules those.

One micro-batch, per rank of each pool (seconds = work / the profile's rate for that kind of work):
- compute by op class: vision linear (patch embed, blocks, merger: `flops.vision_linear_flops_per_patch`),
  window attention, full attention; text linear, attention (causal: half the L x L score work), lm_head
  (on the T labelled positions). Forward 1, backward 2 (input and weight gradients; attention: the profile's
  measured backward/forward ratio, 2 on a datasheet), text attention at the causal rate; divided by the
  layout's shard of the work (`work_share`: sequence and tensor parallel 1/degree). Small vision matmuls
  read the profile's measured matmul curve at their width.
- recomputation: activation checkpointing runs the chosen blocks' forward again in the backward (compute
  and, for sequence/tensor parallel, their collectives).
- collectives: the layouts' own byte counts (`Layout.vit_comm_bytes`: Ulysses all-to-alls, vision TP
  all-reduces; text TP: 2 all-reduces of [L, H] per layer forward and 2 backward), plus a latency each;
  ZeRO-3's per-unit all-gathers and reduce-scatter every micro-batch (`vit_grad_sync_bytes` and its text
  analogue), overlapped with compute by its prefetch on a GPU: the larger of the two counts (on a CPU, gloo
  takes the cores the compute needs: the sum).
- memory (measured profiles): elementwise work is bound by memory bandwidth: the activations the memory plan
  counts, `Profile.memory_passes` passes, and each backward's gradient accumulation into `.grad` (3 x the
  rank's gradient bytes). A datasheet profile has 0: its fitted efficiency stands for that work.
- overhead: kernels (the family's ops per vision block and per merger, `ModelFamily.vision_block_ops` /
  `vision_merger_ops`, and what a full-attention block's attention calls add over the micro-batch's segments,
  `vision_attention_ops`; per decoder layer `TEXT_LAYER_OPS`; x the profile's launch latency) and one Ray call
  each.
- measured stages (a CPU `dhp bench ops` profile): the compute parts of each call (`COMPUTE_PARTS`) divided
  by the profile's `efficiency.vision_forward / vision_backward / text`, the op model's share of the same
  call timed on real transformers stages; ZeRO-3 per unit and per parameter byte as measured on FSDP2
  (`zero3_unit_s`, `zero3_s_per_byte`) rather than from the collectives' bytes; the DTensor optimizer's and
  ZeRO-1's broadcasts per parameter tensor.
- boundary: the merged vision tokens [S*P/4, boundary width] cross to the text pool and their gradient comes
  back: device -> host -> object store -> host -> device, both ways (the family's width: Qwen3-VL's rows carry
  one DeepStack feature per deepstack block beside the merged embedding).
The micro-batch calls are then placed on devices (shared: vision and text actor b on device b, taking
turns; disjoint: each pool its own) in the order the trainer submits them (`routing.route` +
`schedule.pipeline_schedule`), and simulated: the makespan; the *bubble* is the busiest device's idle
time in it. Per step on top: the gradient synchronisation of data-parallel replicas (all-reduce +
ZeRO-1 broadcast) and the AdamW step (memory bound: params, grads and moments read, params and moments
written), both pools in turn on a shared device.

Fine-tuning modes (models/fine_tuning.py, the object the memory plan asks too): a frozen ViT runs no backward
call at all; a merger-only ViT's backward is the mergers' weight gradients (nothing below it needs one); a
frozen or LoRA language model's backward computes input gradients only (forward 1, backward 1 for its
Linears and lm_head; the embeddings still need theirs), plus the LoRA factors' three passes; gradient
accumulation, gradient sync and AdamW count only what trains.

Stated simplifications: a lockstep call lasts as long as its largest member's; communication inside
a node unless the group spans more GPUs than a node has; no overlap of TP/SP collectives with compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dhp.models.fine_tuning import FineTuning
from dhp.models.lora import is_lora_factor
from dhp.models.planning.hardware import Profile
from dhp.models.planning.memory_plan import held_numel, held_numels, stage_shapes, text_activations

TEXT_LAYER_OPS = 36  # per decoder layer forward (fp32 RMSNorms are several kernels each)
BACKWARD_OPS = 2  # backward kernels per forward kernel
# The parts a real module's speed stands behind (what `dhp bench ops` times on real stages, scripts/bench/ops_stages.py)
COMPUTE_PARTS = (
    "linear",
    "window_attention",
    "full_attention",
    "attention",
    "lm_head",
    "kernels",
    "memory",
    "recompute",
)


@dataclass
class Workload:
    """One sample of `image_patches` vision patches (its images' and videos': `of` counts them from sizes) and
    `text_tokens` text tokens (a video's markup included: `of` asks its family's video format); `nodes` the GPUs
    are spread over. `visuals`: (temporal patches, patches of each) of every visual, in order (empty: one image
    of `image_patches`); `merge_unit`: patches per merged token."""

    image_patches: int
    text_tokens: int = 512
    nodes: int = 1
    visuals: tuple[tuple[int, int], ...] = ()
    merge_unit: int = 4

    def __post_init__(self) -> None:
        if self.visuals and sum(t * n for t, n in self.visuals) != self.image_patches:
            raise ValueError(f"visuals {self.visuals} do not add up to {self.image_patches} patches")

    @property
    def sample_tokens(self) -> int:
        return self.image_patches // self.merge_unit + self.text_tokens

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(temporal patches, patches of each) of every visual of the sample."""
        return self.visuals or ((1, self.image_patches),)

    @classmethod
    def of(
        cls,
        vc: Any,
        images: list[tuple[int, int]] = (),
        videos: list[tuple[int, int, int]] = (),
        text_tokens: int = 512,
        nodes: int = 1,
        image_patches: list[int] = (),
        fps: float = 2.0,
    ) -> Workload:
        """A sample of `images` (height, width pixels), `videos` (sampled frames, height, width, at `fps` frames a
        second: `data.video.fps`) and images of `image_patches` patches each for the vision config `vc`: their
        patches as `visual_patches` counts them; `text_tokens` plus what the family's video format writes for
        each video besides its pad tokens and the one vision start / end pair an image has too (Qwen3-VL: a
        timestamp and a start / end pair per temporal patch)."""
        from dhp.models.family import family_of

        family = family_of(vc)
        visuals = [(1, visual_patches(vc, 1, h, w)) for h, w in images] + [(1, int(p)) for p in image_patches]
        markup = 0
        for f, h, w in videos:
            t = -(-f // vc.temporal_patch_size)
            visuals.append((t, visual_patches(vc, f, h, w) // t))
            markup += family.video_format.markup_tokens(f, fps, vc.temporal_patch_size)
        patches = sum(t * n for t, n in visuals)
        return cls(patches, text_tokens + markup, nodes, tuple(visuals), vc.spatial_merge_size**2)


def visual_patches(vc: Any, frames: int, height: int, width: int) -> int:
    """Patches of an image (`frames` 1) or a video of `frames` frames, `height` x `width` pixels, as the Qwen-VL
    processors cut them: each side rounded to a multiple of patch x merge (transformers' `smart_resize`, no pixel
    bounds), `temporal_patch_size` frames per temporal patch (an image is repeated to fill one, a video's last
    frame to fill its last)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if frames < 1 or height < 1 or width < 1:
        raise ValueError(
            f"a visual needs at least one frame of at least 1 x 1 pixels, not {frames} x {height} x {width}"
        )
    factor = vc.patch_size * vc.spatial_merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=factor * factor, max_pixels=2**62)
    return -(-frames // vc.temporal_patch_size) * (h // vc.patch_size) * (w // vc.patch_size)


@dataclass(frozen=True)
class MicroBatchShape:
    """What one micro-batch holds: the patches of each of its images (and videos), in order, and each sample's
    sequence length and text tokens (its labelled positions: the sequence less the merged vision tokens);
    `packed`: one sequence of the samples back to back (`data.packing`), else right-padded to the longest;
    `frames`: the temporal patches of each visual of `images` (a video's frame pairs; empty: one each)."""

    images: tuple[int, ...]
    lengths: tuple[int, ...]
    text_tokens: tuple[int, ...]
    packed: bool = False
    frames: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.frames and (
            len(self.frames) != len(self.images) or any(t < 1 or n % t for n, t in zip(self.images, self.frames))
        ):
            raise ValueError(f"frames {self.frames} are not a whole number of temporal patches of {self.images}")

    @classmethod
    def uniform(cls, cfg: Any, w: Workload) -> MicroBatchShape:
        """The micro-batch of `w`: `samples_per_microbatch` samples of `w`'s visuals each."""
        n = samples_per_microbatch(cfg, w)
        shapes = w.shapes
        images = tuple(t * p for t, p in shapes) * n
        frames = tuple(t for t, _ in shapes) * n if any(t > 1 for t, _ in shapes) else ()
        return cls(images, (w.sample_tokens,) * n, (w.text_tokens,) * n, cfg.data.packing, frames)

    def attention_segments(self, per_frame: bool) -> list[tuple[int, int]]:
        """(segments, patches of each) of every visual: a video's temporal patches each attend on their own
        where the family's encoder cuts them so (`per_frame`), else the visual is one segment."""
        frames = self.frames or (1,) * len(self.images)
        return [(t, n // t) if per_frame else (1, n) for n, t in zip(self.images, frames)]

    @property
    def patches(self) -> int:
        return sum(self.images)

    @property
    def merged_tokens(self) -> int:
        return sum(p // 4 for p in self.images)

    @property
    def samples(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        """Positions the decoder computes: the sum of the lengths packed, batch x longest padded."""
        return sum(self.lengths) if self.packed else self.samples * max(self.lengths, default=0)

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs of full (non-causal) attention over the sequences: each sample's own when packed,
        the padded square of each row when padded (SDPA computes the masked positions too)."""
        if self.packed:
            return sum(n * n for n in self.lengths)
        return self.samples * max(self.lengths, default=0) ** 2


def _shape(cfg: Any, w: Workload | MicroBatchShape) -> MicroBatchShape:
    return w if isinstance(w, MicroBatchShape) else MicroBatchShape.uniform(cfg, w)


@dataclass
class CallCost:
    """Seconds of one call on each of its ranks, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def compute(self) -> float:
        return sum(v for k, v in self.parts.items() if k in COMPUTE_PARTS)

    def scale_compute(self, efficiency: float) -> None:
        """Divide the compute parts by a measured efficiency (predicted / measured on a real stage call)."""
        for k in COMPUTE_PARTS:
            if k in self.parts:
                self.parts[k] /= efficiency


def samples_per_microbatch(cfg: Any, w: Workload) -> int:
    return max(1, cfg.data.microbatch_tokens // w.sample_tokens)


def _recomputed_share(s: Any, blocks: int) -> float:
    from dhp.models.activation_checkpointing import ActivationCheckpointing

    return len(ActivationCheckpointing.of(s).chosen(blocks)) / blocks


def _bytes(cfg: Any, stage: str) -> int:
    from dhp.models.planning.memory_plan import activation_bytes_per_element

    return activation_bytes_per_element(cfg, stage)


def _window_patches(vc: Any) -> int:
    return (vc.window_size // vc.patch_size) ** 2


def vision_calls(cfg: Any, mc: Any, prof: Profile, w: Workload | MicroBatchShape) -> tuple[CallCost, CallCost]:
    """(forward, backward) of one vision micro-batch on one rank: `w`'s (`MicroBatchShape.uniform`) or the
    given one's images."""
    from dhp.models.family import family_of
    from dhp.models.parallel.layout import VitShape
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.planning import flops

    vc, s = mc.vision_config, cfg.vision
    family = family_of(vc)
    layout = stage_layout(cfg, "vision", mc)
    share, b = 1.0 / layout.work_shards, _bytes(cfg, "vision")
    mb = _shape(cfg, w)
    p = mb.patches
    full = VitShape.of(vc).full
    width = vc.hidden_size / layout.width_shards  # TP: narrower matmuls
    linear = flops.vision_linear_flops_per_patch(vc) * p * share / prof.matmul_rate(width)
    head_dim = vc.hidden_size // vc.num_heads
    windowed = vc.depth > full  # a family with no window blocks has no window size
    # Attention is per image, and per temporal patch of a video where the family's encoder cuts it so: a
    # segment's patches attend within it (full blocks) or within their window of it
    segments = mb.attention_segments(family.frame_attention)
    in_window = sum(t * n * min(n, _window_patches(vc)) for t, n in segments) if windowed else 0
    window = 4 * vc.hidden_size * in_window * (vc.depth - full)
    window_s = window * share / prof.attention_rate("window_attention", head_dim)
    in_image = sum(t * n * n for t, n in segments)
    full_s = 4 * vc.hidden_size * in_image * full * share / prof.attention_rate("attention", head_dim)
    shape = VitShape.of(vc)
    comm_bytes = layout.vit_comm_bytes(shape, p, b)
    collective, count = layout.vit_collective, layout.vit_collectives(shape)  # count: each way
    comm = 0.0  # seconds of one direction's collectives: `count` of the average message
    if count:
        n = layout.degree
        tensor = comm_bytes / (2 * count) / ((2 if collective == "all_reduce" else 1) * (n - 1) / n)
        comm = count * prof.collective_s(collective, tensor, n, _nodes_spanned(n, prof))
    recompute = _recomputed_share(s, vc.depth)
    # the family's kernels: its blocks' and its mergers' (Qwen3-VL: the merger and the DeepStack mergers), and
    # what its full-attention blocks' attention calls add over these segments (window blocks: one call each)
    lengths = [n for t, n in segments for _ in range(t)]
    ops = family.vision_block_ops * vc.depth + family.vision_merger_ops * shape.mergers
    ops = (ops + full * family.vision_attention_ops(lengths)) * prof.op_latency_s
    ft = FineTuning(cfg)
    blocks_train = ft.groups["vision_blocks"].trains
    fwd, bwd = CallCost(), CallCost()
    for part, sec in (("linear", linear), ("window_attention", window_s), ("full_attention", full_s)):
        fwd.add(part, sec)
        if blocks_train:
            bwd.add(part, (2 if part == "linear" else prof.attention_backward_ratio) * sec)
            bwd.add("recompute", recompute * sec)
    if not blocks_train and ft.trains("vision"):  # merger only: its weight gradients, nothing below it
        mergers = VitShape.of(vc).mergers  # the merger and any DeepStack mergers train
        bwd.add("linear", mergers * flops.merger_flops_per_patch(vc) * p * share / prof.matmul_rate(width))
    fwd.add("collectives", comm)
    fwd.add("kernels", ops)
    if blocks_train:
        bwd.add("collectives", comm)
        bwd.add("recompute", recompute * comm)
        bwd.add("kernels", ops * (BACKWARD_OPS + recompute))
    if prof.memory_passes:
        traffic = layout.vit_activation_bytes(shape, p, b) / (prof.memory_gbps * 1e9)
        fwd.add("memory", traffic)
        if blocks_train:
            bwd.add("memory", (prof.memory_passes - 1) * traffic)
            bwd.add("recompute", recompute * traffic)
        bwd.add("memory", _grad_accumulate_s(layout, mc, prof, "vision", cfg))
    fwd.scale_compute(prof.efficiency.get("vision_forward", 1.0))
    bwd.scale_compute(prof.efficiency.get("vision_backward", 1.0))
    if layout.spans_pool:  # ZeRO-3 gathers each unit forward and backward, reduce-scatters its gradients
        rate = prof.comm_rate("all_gather", _nodes_spanned(layout.num_actors, prof))
        f, g = _zero3_s(
            prof,
            cfg,
            mc,
            "vision",
            layout.vit_grad_sync_bytes(shape, b) / rate,
            backward_of=None if blocks_train else ft.trainable,
        )
        _overlap(fwd, f, prof)
        _overlap(bwd, g, prof)
    boundary = _boundary_s(cfg, mc, prof, mb.merged_tokens)
    fwd.add("boundary", boundary)
    fwd.add("calls", prof.call_latency_s + prof.efficiency.get("call_s", 0.0))
    if not ft.trains("vision"):  # a frozen ViT: the trainer sends no gradient back and calls no backward
        return fwd, CallCost()
    bwd.add("boundary", boundary)
    bwd.add("calls", prof.call_latency_s + prof.efficiency.get("call_s", 0.0))
    return fwd, bwd


def text_call(cfg: Any, mc: Any, prof: Profile, w: Workload | MicroBatchShape) -> CallCost:
    """One text forward + backward on one rank: `w`'s micro-batch (`MicroBatchShape.uniform`) or the given
    one."""
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.planning import flops

    tc, s = mc.text_config, cfg.text
    layout = stage_layout(cfg, "text", mc)
    share, b = 1.0 / layout.work_shards, _bytes(cfg, "text")
    mb = _shape(cfg, w)
    layers = tc.num_hidden_layers
    tokens = mb.tokens
    width = tc.hidden_size / layout.width_shards  # TP: narrower matmuls
    linear = flops.text_linear_flops_per_token(tc) * tokens * share / prof.matmul_rate(width)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    causal = 0.5 * 4 * tc.num_attention_heads * head_dim * layers * mb.attention_pairs * share
    attention = causal / prof.attention_rate("causal_attention", head_dim)
    head = flops.lm_head_flops_per_token(tc) * sum(mb.text_tokens) * share / prof.matmul_rate(tc.hidden_size)
    recompute = _recomputed_share(s, layers)
    ft = FineTuning(cfg)
    weights_train = ft.groups["text"].trains and ft.lora is None  # frozen / LoRA base: input gradients only
    passes = 3 if weights_train else 2
    cost = CallCost()
    for part, sec in (("linear", linear), ("attention", attention), ("lm_head", head)):
        cost.add(part, (passes if part != "attention" else 1 + prof.attention_backward_ratio) * sec)
    if ft.lora is not None:  # the factors: forward, input and weight gradients, on this rank's share of them
        held = held_numels(layout, stage_shapes(mc, "text", ft.lora), 0)
        factors = sum(v for n, v in held.items() if is_lora_factor(n))
        cost.add("linear", 3 * 2 * factors * tokens / prof.matmul_rate(ft.lora.rank))
    cost.add("recompute", recompute * (linear + attention))
    if layout.width_shards > 1:
        # [L, H] all-reduces: 2 per layer forward (o, down) and 2 backward (in front of qkv, gate/up), the
        # vocab-parallel embedding's output and the gradient in front of lm_head; recomputed layers repeat
        # their forward's 2
        t = layout.degree
        one = prof.collective_s("all_reduce", tokens * tc.hidden_size * b, t, _nodes_spanned(t, prof))
        cost.add("collectives", (4 * layers + 2) * one)
        cost.add("recompute", 2 * layers * recompute * one)
    backward_ops = BACKWARD_OPS if weights_train else 1
    cost.add("kernels", TEXT_LAYER_OPS * layers * (1 + backward_ops + recompute) * prof.op_latency_s)
    if prof.memory_passes:
        traffic = text_activations(tc, tokens, layout.width_shards, b)[0]
        traffic /= prof.memory_gbps * 1e9
        cost.add("memory", prof.memory_passes * traffic + _grad_accumulate_s(layout, mc, prof, "text", cfg))
        cost.add("recompute", recompute * traffic)
    cost.scale_compute(prof.efficiency.get("text", 1.0))
    if layout.spans_pool:
        n = layout.num_actors
        params = _numel(mc, "text")
        gather = 3 * (n - 1) / n * params * b / prof.comm_rate("all_gather", _nodes_spanned(n, prof))
        _overlap(cost, sum(_zero3_s(prof, cfg, mc, "text", gather)), prof)
    cost.add("calls", prof.call_latency_s + prof.efficiency.get("call_s", 0.0))
    return cost


def _grad_accumulate_s(layout: Any, mc: Any, prof: Profile, stage: str, cfg: Any) -> float:
    """Every backward adds a gradient as large as the rank's parameters into `.grad` (read both, write one;
    the embedding's is dense: its whole table, whatever the tokens)."""
    from dhp.models.precision import precision_of

    held, _ = _trained(cfg, mc, layout, stage)
    return 3 * held * precision_of(cfg.model.precision).grad_bytes / (prof.memory_gbps * 1e9)


def _trained(cfg: Any, mc: Any, layout: Any, stage: str) -> tuple[int, int]:
    """(elements, tensors) of rank 0's share of what trains in `stage` (models/fine_tuning.py)."""
    ft = FineTuning(cfg)
    held = held_numels(layout, stage_shapes(mc, stage, ft.lora), 0)
    trained = [v for n, v in held.items() if ft.trainable(n) and v]
    return sum(trained), len(trained)


def _zero3_s(
    prof: Profile, cfg: Any, mc: Any, stage: str, bytes_model_s: float, backward_of: Callable[[str], bool] | None = None
) -> tuple[float, float]:
    """(forward, backward) seconds of ZeRO-3's work on one call: where the profile measured FSDP2 (gloo), per
    unit (the stage's shard units and the root) and per parameter byte; else the bytes' model: a third (the
    forward's all-gathers) and two thirds (the backward's all-gathers and reduce-scatters) of `bytes_model_s`.
    `backward_of`: the parameters the backward reaches, when only the top of the stage does (a merger-only ViT:
    the merger's unit and the root gather and reduce-scatter, the frozen blocks below see no backward)."""
    from dhp.models.precision import precision_of

    vc, tc = mc.vision_config, mc.text_config
    units = (vc.depth + 1 if stage == "vision" else tc.num_hidden_layers) + 1  # blocks (+ merger), the root
    numel = _numel(mc, stage)
    back_units, back_numel = units, numel
    if backward_of is not None:
        back_units, back_numel = 2, sum(math.prod(v) for n, v in _shapes(mc, stage).items() if backward_of(n))
    if not (prof.zero3_unit_s and prof.zero3_s_per_byte):
        return bytes_model_s / 3, 2 * bytes_model_s / 3 * back_numel / numel
    b = precision_of(cfg.model.precision).param_bytes
    (uf, ub), (bf, bb) = prof.zero3_unit_s, prof.zero3_s_per_byte
    return uf * units + bf * numel * b, ub * back_units + bb * back_numel * b


def _overlap(cost: CallCost, comm_s: float, prof: Profile) -> None:
    """Prefetched collectives hide under compute on a GPU (their own stream): only what exceeds it shows. On
    a CPU, gloo's copies and reductions take the same cores the compute needs: nothing hides."""
    cost.add("collectives", comm_s if prof.kind == "cpu" else max(0.0, comm_s - cost.total))


def _nodes_spanned(group: int, prof: Profile) -> int:
    return math.ceil(group / prof.devices_per_node) if prof.kind == "gpu" else 1


def _boundary_s(cfg: Any, mc: Any, prof: Profile, merged_tokens: int) -> float:
    from dhp.models.planning.memory_plan import boundary_row_bytes

    # the family's row: Qwen3-VL's carries its DeepStack features beside the merged embedding
    nbytes = merged_tokens * boundary_row_bytes(cfg, mc, "vision")
    hops = 2 / prof.h2d_gbps if prof.kind == "gpu" else 0.0
    return nbytes * (hops + 1 / prof.object_store_gbps) / 1e9


def _shapes(mc: Any, stage: str) -> dict:
    return stage_shapes(mc, stage)


def _numel(mc: Any, stage: str) -> int:
    return sum(math.prod(v) for v in _shapes(mc, stage).values())


def step_extras(cfg: Any, mc: Any, prof: Profile, stage: str) -> dict[str, float]:
    """Once per step on one rank of `stage`: gradient sync of data-parallel copies, the AdamW step."""
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.precision import precision_of

    layout = stage_layout(cfg, stage, mc)
    prec = precision_of(cfg.model.precision)
    held = held_numel(layout, _shapes(mc, stage), 0)
    copies = 1 if layout.spans_pool else layout.num_actors * held // max(1, _numel(mc, stage))
    trained, tensors = _trained(cfg, mc, layout, stage)  # DTensor dispatch and ZeRO-1: per parameter tensor
    if not trained:  # a frozen stage neither syncs nor steps
        return {"grad_sync": 0.0, "optimizer": 0.0}
    sync = 0.0
    if copies > 1:  # all-reduce of the gradients, then ZeRO-1's broadcast of what each stepped
        sent = (copies - 1) / copies * trained * (2 * prec.grad_bytes + prec.param_bytes)
        sync = sent / prof.comm_rate("all_reduce", _nodes_spanned(layout.num_actors, prof))
    stepped = trained * layout.optimizer_fraction
    adam = prof.optimizer_s(stepped, 2 * prec.param_bytes + prec.grad_bytes + 2 * prec.optimizer_bytes)
    if layout.spans_pool:
        adam += tensors * prof.zero3_optimizer_s_per_tensor
    elif layout.optimizer_fraction < 1:
        adam += tensors * prof.zero1_step_s_per_tensor
    return {"grad_sync": sync, "optimizer": adam}


def _devices(cfg: Any, prof: Profile) -> tuple[Any, Any]:
    """(vision rank -> device, text rank -> device): shared bundles, disjoint pools; on a CPU profile
    the OS spreads every actor over the cores."""
    nv, nt = cfg.vision.num_actors, cfg.text.num_actors
    if prof.kind == "cpu":
        cores = prof.devices_per_node
        return (lambda i: i % cores), (lambda j: (nv + j) % cores)
    if cfg.pipeline.shared:
        bundles = max(nv, nt)
        return (lambda i: i % bundles), (lambda j: j % bundles)
    return (lambda i: i), (lambda j: nv + j)


def step_time(cfg: Any, mc: Any, prof: Profile, w: Workload) -> dict[str, Any]:
    """The predicted step of `w`: every text replica's share of the global batch in micro-batches of
    `samples_per_microbatch` samples, each `w`'s visuals (`step_time_of`)."""
    from dhp.models.parallel.checks import replicas

    dt = replicas(cfg, "text")
    samples = samples_per_microbatch(cfg, w)
    per_text = -(-cfg.training.global_batch_size // dt)
    mb = MicroBatchShape.uniform(cfg, w)
    batches = [[mb] * -(-per_text // samples) for _ in range(dt)]
    result = step_time_of(cfg, mc, prof, batches, vision_patches=cfg.training.global_batch_size * w.image_patches)
    visuals = [list(v) for v in w.shapes]
    return {**result, "image_patches": w.image_patches, "text_tokens": w.text_tokens, "visuals": visuals}


def step_time_of(
    cfg: Any, mc: Any, prof: Profile, batches: list[list[MicroBatchShape]], vision_patches: int | None = None
) -> dict[str, Any]:
    """The predicted step of one global batch, `batches[t]` the micro-batches of text replica t in the order
    its loader makes them: seconds, its parts (per pool, per micro-batch call and per step), the simulated
    makespan and bubble, vision tokens/s (`vision_patches`, default the batches' patches, over the step).
    Each micro-batch's calls cost what its own sizes cost; the pipeline schedule of `routing.route` places
    them. `per_call_s` are the calls of the micro-batch with the most patches (the one memory is planned for)."""
    from dhp.models.parallel.checks import replicas
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.parallel.routing import route, simulate_calls
    from dhp.models.parallel.schedule import TEXT_FORWARD_BACKWARD, VISION_BACKWARD, VISION_FORWARD

    vl, tl = stage_layout(cfg, "vision", mc), stage_layout(cfg, "text", mc)
    dv, dt = replicas(cfg, "vision"), replicas(cfg, "text")
    if len(batches) != dt:
        raise ValueError(f"{len(batches)} text replicas' micro-batches for a text pool of {dt} replicas")
    costs: dict[MicroBatchShape, tuple[CallCost, CallCost, CallCost]] = {}  # once per distinct micro-batch
    for mbs in batches:
        for mb in mbs:
            if mb not in costs:
                costs[mb] = (*vision_calls(cfg, mc, prof, mb), text_call(cfg, mc, prof, mb))
    shape_of = {(t, i): mb for t, mbs in enumerate(batches) for i, mb in enumerate(mbs)}
    seconds = {
        kind: {k: costs[mb][j].total for k, mb in shape_of.items()}
        for j, kind in enumerate((VISION_FORWARD, VISION_BACKWARD, TEXT_FORWARD_BACKWARD))
    }
    calls = route(
        [[mb.patches for mb in mbs] for mbs in batches], dv, vl.lockstep, tl.lockstep, cfg.pipeline.max_in_flight
    )
    v_dev, t_dev = _devices(cfg, prof)

    def resources(call: Any) -> list[Any]:
        layout, dev = (vl, v_dev) if call.stage == "vision" else (tl, t_dev)
        return sorted(
            {dev(rank) for r, _ in call.members for rank in layout.state_ranks(r)[: layout.degree]}
            if not layout.spans_pool
            else {dev(r) for r, _ in call.members}
        )

    makespan, busy = simulate_calls(
        calls, seconds[VISION_FORWARD], seconds[TEXT_FORWARD_BACKWARD], seconds[VISION_BACKWARD], resources
    )
    extras = {stage: step_extras(cfg, mc, prof, stage) for stage in ("vision", "text")}
    shared = prof.kind == "cpu" or cfg.pipeline.shared
    tail = {
        k: (extras["vision"][k] + extras["text"][k]) if shared else max(extras["vision"][k], extras["text"][k])
        for k in ("grad_sync", "optimizer")
    }
    step = makespan + sum(tail.values())
    # Parts per rank: each call's parts are its slowest member's (a lockstep call waits for it); the calls of
    # one shape counted together, spread over the units that run them
    units = {"vision": 1 if vl.lockstep else dv, "text": 1 if tl.lockstep else dt}
    counts: dict[MicroBatchShape, list[int]] = {mb: [0, 0] for mb in costs}
    for call in calls:
        slowest = max(call.keys(), key=lambda k: seconds[call.kind][k])
        if call.kind != VISION_BACKWARD:
            counts[shape_of[slowest]][call.stage == "text"] += 1
    parts: dict[str, float] = {}
    for stage in ("vision", "text"):
        for mb, (fwd, bwd, text) in costs.items():
            n = counts[mb][stage == "text"] / units[stage]
            for c in (fwd, bwd) if stage == "vision" else (text,):
                for part, sec in c.parts.items():
                    key = f"{stage}.{part}"
                    parts[key] = parts.get(key, 0.0) + sec * n
        for k, sec in extras[stage].items():
            parts[f"{stage}.{k}"] = sec
    bubble = makespan - max(busy.values(), default=0.0)
    every = [mb for mbs in batches for mb in mbs]
    largest = max(every, key=lambda mb: (mb.patches, mb.tokens))
    fwd, bwd, text = costs[largest]
    patches = sum(mb.patches for mb in every) if vision_patches is None else vision_patches
    return {
        "step_s": step,
        "vision_tokens_per_s": patches / step,
        "global_batch_size": cfg.training.global_batch_size,
        "makespan_s": makespan,
        "bubble_s": bubble,
        "tail_s": tail,
        "microbatches_per_text_replica": max(map(len, batches)),
        "samples_per_microbatch": largest.samples,
        "largest_microbatch_patches": largest.patches,
        "per_call_s": {"vision_forward": fwd.total, "text": text.total, "vision_backward": bwd.total},
        "parts_s": parts,
        "profile": prof.name,
    }
