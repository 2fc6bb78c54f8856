"""Memory plan: what one rank of each pool will hold, before anything starts (`dhp plan`, and `dhp train`'s check).

Per rank, in bytes, counted on the meta device (nothing allocated):

- model states: the layout's elements (`state_numel`) x the precision's bytes for parameters, and for the
  gradients and AdamW moments of what trains (`FineTuning`: LoRA factors included); the moments of the
  busiest rank of the layout's ZeRO-1 group (`zero1_partition`); what the AdamW implementation
  (`training.optimizer`, models/optimizer.py) allocates while it steps: nothing when fused (auto on CUDA), one
  moment of the rank's largest optimizer group for foreach (auto on CPU);
- activations kept for backward at the configured `data.microbatch_tokens`: vision with every token of a
  micro-batch an image token (4 patches each: the most a micro-batch can carry), from the layouts' own
  saved-tensor formulas (`vit_activation_bytes`), times the vision graphs alive at once (`vision_graphs`:
  each vision micro-batch in flight keeps its graph until its backward); text for one micro-batch (forward
  and backward are one call) from the per-token count below; with activation checkpointing a recomputed
  block keeps only its input. Both are checked, for every layout of the parity test, against what the
  actors' saved-tensor hooks count (tests/test_plan_measured.py: within 10 %; measured on CPU in fp32,
  exact for the decoder); a video's patches count as an image's: what a vision block keeps is linear in its
  patches (SDPA keeps q, k, v, its output and logsumexp, no score matrix), so how the encoder cuts attention
  (per image, per temporal patch of a video, per window) changes no byte;
- the boundary: the rows a vision rank sends (`boundary_rows`, the family's `boundary_width` wide: Qwen3-VL's
  carry its DeepStack features too) stay with each graph in flight until their gradient comes back, and the text
  rank holds the rows it received through its call; each pool's transients hold one gradient of them;
- transients: the largest of the logits of a micro-batch's labelled positions (fp32, with their gradient,
  vocabulary split under TP) and one block's working set (also what a checkpointed block rebuilds in
  backward), plus ZeRO-3's all-gathered unit (with prefetch: two).

Text decoder layer, saved per token (transformers' Qwen2_5_VLDecoderLayer under SDPA, TP degree t, hidden
H, MLP I, n heads of width d, KV width per rank K_t = max(1, kv_heads / t) x d: KV heads are replicated
when t exceeds them): replicated, each of the two RMSNorms keeps its input, rsqrt and x x rsqrt (2H + 1,
fp32: Qwen2RMSNorm computes in fp32) and its output (H, which the next Linear saves); split by t: the
rotated q (H), the attention output (H, also o_proj's input), SDPA's logsumexp (n, fp32), gate, act(gate),
up and act(gate) x up (4I); per rank the rotated k and v (2 K_t). Once: cos and sin (2d, unless every layer
is recomputed) and the final norm's input, rsqrt, x x rsqrt (2H + 1, fp32). Qwen3-VL's decoder (its family's
`text_head_norms`): the query is n x head_dim wide, not H (q and the attention output count that width), and
the per-head RMSNorms on q and k keep their input, rsqrt and x x rsqrt (fp32).

A plan is an estimate with stated assumptions, not an allocator trace: the CUDA caching allocator's
fragmentation and the CUDA context (~0.5-1 GiB) come on top, which is why the check keeps a margin
(`MARGIN`). The table says which device memory it compared against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dhp.models.activation_checkpointing import ActivationCheckpointing
from dhp.models.fine_tuning import FineTuning
from dhp.models.lora import factor_shapes, target_names

GIB = 2**30
MARGIN = 0.9  # a plan fits when its total is at most this share of the device: allocator slack, CUDA context


@dataclass
class RankPlan:
    stage: str
    layout: str
    degree: int
    num_actors: int
    precision: str
    activation_checkpointing: str
    params: int
    grads: int
    optimizer: int
    optimizer_step_temp: int
    activations: int
    transients: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.optimizer_step_temp + self.activations + self.transients

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def meta_stage(model_config: Any, stage: str) -> torch.nn.Module:
    from dhp.models.family import family_of

    family = family_of(model_config)
    with torch.device("meta"):
        return family.text_model(model_config) if stage == "text" else family.vision_model(model_config)


def full_shapes(model_config: Any, stage: str, module: torch.nn.Module | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape from a build on the meta device; a tied tensor once."""
    module = module if module is not None else meta_stage(model_config, stage)
    seen: set[int] = set()
    shapes = {}
    for n, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            shapes[n] = tuple(t.shape)
    return shapes


def activation_bytes_per_element(cfg: Any, stage: str) -> int:
    """2 where matrix work runs in bf16 (pure bf16 states, or bf16 autocast on a GPU), else 4."""
    from dhp.models.precision import precision_of

    on_gpu = getattr(cfg, stage).num_gpus_per_actor > 0
    compute = precision_of(cfg.model.precision).compute_dtype(cfg.model.dtype)
    pure = precision_of(cfg.model.precision).param_bytes == 2
    return 2 if pure or (on_gpu and compute == "bfloat16") else 4


def model_state_bytes(
    layout: Any,
    precision: Any,
    shapes: dict[str, tuple[int, ...]],
    rank: int = 0,
    fine_tuning: Any = None,
    optimizer: Any = None,
) -> dict[str, int]:
    """Parameter, gradient and AdamW bytes rank `rank` holds (the layout's elements, the precision's bytes),
    and what the AdamW implementation `optimizer` (models/optimizer.py) allocates while it steps: nothing when
    fused, one moment of the largest optimizer group for foreach, about two of the largest tensor for the for
    loop; None counts foreach's, the most of the three. With `fine_tuning` (models/fine_tuning.py: the plan's
    case) gradients and moments only for what trains, in its optimizer groups, and the moments of the busiest
    rank of the ZeRO-1 group (`zero1_partition`); without, everything trains in one group and the moments are
    the group's even share (`dhp bench memory`'s per-rank average, which sums to the checkpoint's)."""
    from dhp.models.optimizer import IMPLEMENTATIONS

    held = held_numels(layout, shapes, rank)
    trained = [n for n in shapes if fine_tuning is None or fine_tuning.trainable(n)]
    grads = sum(held[n] for n in trained)
    if fine_tuning is None:
        ranks = [[[held[n] * layout.optimizer_fraction for n in trained]]]
    else:
        ranks = zero1_partition(layout, [(n, held[n], len(shapes[n])) for n in trained if held[n]], fine_tuning)
    optimizer = optimizer or IMPLEMENTATIONS["foreach"]
    moment_bytes = precision.optimizer_bytes / 2  # exp_avg and exp_avg_sq: a temporary has their dtype
    return {
        "params": sum(held.values()) * precision.param_bytes,
        "grads": grads * precision.grad_bytes,
        "optimizer": round(max(sum(map(sum, groups)) for groups in ranks) * precision.optimizer_bytes),
        "optimizer_step_temp": round(max(optimizer.step_temp_numel(groups) for groups in ranks) * moment_bytes),
    }


def zero1_partition(layout: Any, trained: list[tuple[str, int, int]], fine_tuning: Any) -> list[list[list[float]]]:
    """Per rank of a ZeRO-1 group, per optimizer group, the elements of AdamW state of each parameter that rank
    steps, in the order its optimizer holds them; from (name, held elements, ndim) of the rank's trainable
    parameters in model order. torch's ZeroRedundancyOptimizer puts whole parameters, group by group and
    largest first, on the rank with the fewest elements so far. With few trainable tensors (a merger-only ViT:
    5) that is far from an even split. A layout whose moments are not split this way (ZeRO-3's are sharded like
    their parameters) is one rank with `optimizer_fraction` of each parameter, in model order."""
    grouped = [g["params"] for g in fine_tuning.grouped(trained)]  # element counts, group by group
    group = round(1 / layout.optimizer_fraction) if layout.optimizer_fraction > 0 else 1
    if group <= 1 or layout.spans_pool:
        return [[[numel * layout.optimizer_fraction for numel in numels] for numels in grouped]]
    ranks: list[list[list[float]]] = [[[] for _ in grouped] for _ in range(group)]
    sizes = [0] * group
    for g, numels in enumerate(grouped):
        for numel in sorted(numels, reverse=True):
            r = sizes.index(min(sizes))
            ranks[r][g].append(float(numel))
            sizes[r] += numel
    return ranks


def held_numels(layout: Any, shapes: dict, rank: int, _cache: dict = {}) -> dict[str, int]:  # noqa: B006
    """Elements of each tensor of `shapes` rank `rank` holds, from the layout's slicer, once per layout and
    shapes: a layout search asks for the same ones again."""
    key = (type(layout), layout.stage, layout.degree, layout.num_actors, id(shapes), rank)
    if key not in _cache:
        _cache[key] = (shapes, layout.held_numels(shapes, rank))  # holds `shapes`, so its id stays its own
    return _cache[key][1]


def held_numel(layout: Any, shapes: dict, rank: int) -> int:
    """`layout.state_numel`, cached (`held_numels`)."""
    return sum(held_numels(layout, shapes, rank).values())


def text_activations(
    t: Any,
    tokens: int,
    tp: int,
    b: int,
    recomputed: int = 0,
    frozen: bool = False,
    lora: Any = None,
    mask_bytes: int = 1,
) -> tuple[float, float]:
    """(bytes the decoder keeps for backward at the end of its forward, one layer's share) for `tokens`
    tokens at TP degree `tp`, `b` bytes per element, `recomputed` layers checkpointed: the per-token count
    of this module's docstring. `frozen`: the weights take no gradient (text.train none or lora), only the
    embeddings do; `lora`: the `text.lora` spec of the factors on it."""
    from dhp.models.family import family_of

    h, i, n = t.hidden_size, t.intermediate_size, t.num_attention_heads
    d = getattr(t, "head_dim", None) or h // n
    kv_heads = max(1, t.num_key_value_heads // tp)
    kv = kv_heads * d
    q = n * d  # the query width: Qwen3's head_dim is its own, not h / n
    norm = (2 * h + 1) * 4 + h * b
    per_token = 2 * norm + b * (2 * q + 4 * i) / tp + 4 * n / tp + 2 * b * kv
    # per-head RMSNorms on q and k (Qwen3: q_norm, k_norm) keep their input, rsqrt and x x rsqrt in fp32
    head_norms = bool(family_of(t).text_head_norms)
    per_token += head_norms * 4 * ((2 * q + n) / tp + 2 * kv + kv_heads)
    final = (2 * h + 1) * 4
    if frozen:
        per_token = frozen_layer_bytes(h, i, n, kv, tp, b, lora, mask_bytes, q)
        per_token += head_norms * 4 * ((q + n) / tp + kv + kv_heads)  # input and rsqrt: the gradient to q, k
        final = (h + 1) * 4
    per_layer = tokens * per_token
    layers = t.num_hidden_layers
    rope = 2 * d * b if recomputed < layers else 0
    kept = (layers - recomputed) * per_layer + tokens * (recomputed * h * b + rope + final)
    return kept, per_layer


def frozen_layer_bytes(
    h: int, i: int, n: int, kv: int, tp: int, b: int, lora: Any = None, mask_bytes: int = 1, q: int | None = None
) -> float:
    """Bytes per token a decoder layer with frozen weights keeps so that the gradient reaches its input: a
    Linear keeps nothing (its input serves only its weight's gradient), an RMSNorm its input and rsqrt (fp32),
    attention what SDPA saves (q, k, v, output, logsumexp), the MLP gate, act(gate) and up. LoRA factors
    bring back the inputs of their layers (A's gradient; q/k/v share the attention norm's output, gate/up the
    MLP norm's, o's is the attention output SDPA keeps anyway) and keep A's output, r wide (B's gradient).
    With `text.lora.dropout` > 0 each factor's input is its own dropout output, kept with its mask:
    `mask_bytes` per element (CUDA's fused dropout keeps a bool mask, 1; on a CPU the mask is a tensor of the
    input's dtype, measured), and 1 for the split input of a row-parallel layer under TP (`lora.ColumnsDropout`
    keeps a bool mask on any device). `q`: the query width when it is not `h` (Qwen3's own head_dim)."""
    q = h if q is None else q  # the query width (n heads x head_dim)
    kept = 2 * (h + 1) * 4 + b * (2 * q + 3 * i) / tp + 4 * n / tp + 2 * b * kv
    if lora is not None:
        targets = set(target_names(lora))
        kept += b * lora.rank * len(targets)
        if lora.dropout > 0:
            width = {"o_proj": q / tp, "down_proj": i / tp}  # row-parallel: their input is split
            mask = {t: 1 if tp > 1 and t in width else mask_bytes for t in targets}
            kept += sum((b + mask[t]) * width.get(t, h) for t in targets)
        else:
            kept += b * h * (bool(targets & {"q_proj", "k_proj", "v_proj"}) + bool(targets & {"gate_proj", "up_proj"}))
            kept += b * i / tp * ("down_proj" in targets)
    return kept


def kept_activations(cfg: Any, model_config: Any, stage: str, size: int) -> tuple[float, float]:
    """(bytes one rank of `stage` keeps for backward at the end of a micro-batch's forward, one block's
    working set) for `size` patches (vision: the replica's, the layout divides them) or tokens (text), with
    the configured layout, precision and activation checkpointing."""
    from dhp.models.parallel.layout import VitShape
    from dhp.models.parallel.layouts import stage_layout

    s = getattr(cfg, stage)
    layout = stage_layout(cfg, stage, model_config)
    b = activation_bytes_per_element(cfg, stage)
    ac = ActivationCheckpointing.of(s)
    ft = FineTuning(cfg)
    if stage == "vision":
        shape = VitShape.of(model_config.vision_config)
        block = layout.vit_activation_bytes(shape, size, b) / shape.depth  # one block, and then some
        if not ft.groups["merger"].trains:  # a frozen ViT runs under no_grad
            return 0.0, block
        if not ft.groups["vision_blocks"].trains:  # nothing in the blocks needs a gradient: only the merger keeps
            return layout.merger_activation_bytes(shape, size, b), block
        return layout.vit_activation_bytes(shape, size, b, len(ac.chosen(shape.depth))), block
    t = model_config.text_config
    return text_activations(
        t,
        size,
        layout.degree,
        b,
        len(ac.chosen(t.num_hidden_layers)),
        frozen=not ft.groups["text"].trains or ft.lora is not None,
        lora=ft.lora,
        mask_bytes=1 if s.num_gpus_per_actor > 0 else b,
    )


def boundary_row_bytes(cfg: Any, model_config: Any, stage: str) -> int:
    """Bytes of one boundary row as `stage` holds it: the family's width (Qwen3-VL: the merged embedding and one
    DeepStack feature per deepstack block, side by side) in the stage's activation dtype."""
    from dhp.models.family import family_of

    return family_of(model_config).boundary_width(model_config) * activation_bytes_per_element(cfg, stage)


def boundary_rows(cfg: Any, model_config: Any, patches: int) -> float:
    """Boundary rows one vision rank sends for a micro-batch of `patches` patches: one per merge unit, of its own
    part where the loader cuts the micro-batch per rank (sequence parallelism), else of all of them."""
    from dhp.models.parallel.layouts import stage_layout

    merged = patches / model_config.vision_config.spatial_merge_size**2
    return merged / max(1, stage_layout(cfg, "vision", model_config).loader_shards)


def vision_graphs(cfg: Any) -> int:
    """How many vision forward graphs one vision rank keeps alive at once: `pipeline.max_in_flight` run ahead
    of their backwards, but never more than a step has micro-batches, and a micro-batch holds at least one
    sample (the step's graphs are all freed by its backwards, before the optimizer step). On an H200 the
    uncapped count planned the 7B's vision rank at 11.69 GiB for 8.07 allocated (16 k patches, a step of 2
    micro-batches: 3 graphs counted, 2 alive)."""
    return min(cfg.pipeline.max_in_flight, cfg.training.global_batch_size)


def stage_plan(cfg: Any, model_config: Any, stage: str, vision_patches: int | None = None) -> RankPlan:
    """One rank of `stage`; `vision_patches`: patches of one vision micro-batch when known (`dhp plan
    --time`), else the most `data.microbatch_tokens` can carry (every token an image token)."""
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.precision import precision_of

    s = getattr(cfg, stage)
    layout = stage_layout(cfg, stage, model_config)
    prec = precision_of(cfg.model.precision)
    module, _ = meta_build(model_config, stage)
    ft = FineTuning(cfg)
    shapes = stage_shapes(model_config, stage, ft.lora)
    tokens = cfg.data.microbatch_tokens
    row = boundary_row_bytes(cfg, model_config, stage)
    if stage == "vision":  # every token an image token: 4 patches each
        patches = 4 * tokens if vision_patches is None else vision_patches
        activations, transients = kept_activations(cfg, model_config, stage, patches)
        # each graph in flight keeps its output rows until their gradient comes back, one gradient at a time
        rows = boundary_rows(cfg, model_config, patches)
        activations = (activations + rows * row) * vision_graphs(cfg)
        transients += rows * row
    else:
        activations, per_block = kept_activations(cfg, model_config, stage, tokens)
        logits = tokens * model_config.text_config.vocab_size / layout.degree * 4 * 2
        # the boundary rows received (every token an image token) stay through the call, their gradient returns
        activations += tokens * row
        transients = max(logits, per_block) + tokens * row
    if layout.spans_pool:  # ZeRO-3: a unit's full parameters while it runs, and the next one prefetched
        largest_unit = max(sum(p.numel() for p in u.parameters()) for u in module.shard_units())
        transients += 2 * largest_unit * prec.param_bytes
    return RankPlan(
        stage=stage,
        layout=s.parallelism,
        degree=s.degree,
        num_actors=s.num_actors,
        precision=prec.name,
        activation_checkpointing=s.activation_checkpointing,
        **model_state_bytes(layout, prec, shapes, 0, ft, stage_adamw(cfg, stage)),
        activations=round(activations),
        transients=round(transients),
    )


def stage_adamw(cfg: Any, stage: str) -> Any:
    """The AdamW implementation `training.optimizer` gives `stage`'s ranks: CUDA's where they take GPUs."""
    from dhp.models.optimizer import adamw_of

    return adamw_of(cfg.training.optimizer, "cuda" if getattr(cfg, stage).num_gpus_per_actor > 0 else "cpu")


def device_memory(cfg: Any, gpu_memory_gib: float | None = None) -> tuple[int | None, str]:
    """(bytes of one device, where that number came from); (None, why) when there is nothing to compare."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), f"--gpu-memory {gpu_memory_gib:g} GiB"
    if cfg.training.gpu_memory_gib is not None:
        return int(cfg.training.gpu_memory_gib * GIB), f"training.gpu_memory_gib={cfg.training.gpu_memory_gib:g}"
    if max(cfg.vision.num_gpus_per_actor, cfg.text.num_gpus_per_actor) == 0:
        return None, "CPU actors: not compared (host memory is shared by every actor and the data pipeline)"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return torch.cuda.get_device_properties(0).total_memory, f"this machine's {name}"
    return None, "no GPU here to read its memory: pass --gpu-memory GiB (or set training.gpu_memory_gib)"


def meta_build(model_config: Any, stage: str, _cache: dict = {}) -> tuple[torch.nn.Module, dict]:  # noqa: B006
    """The meta build and its shapes, once per model config (a layout search asks hundreds of times)."""
    key = (id(model_config), stage)
    if key not in _cache:
        module = meta_stage(model_config, stage)
        _cache[key] = (model_config, module, full_shapes(model_config, stage, module))  # holds the id's owner
    return _cache[key][1], _cache[key][2]


def stage_shapes(model_config: Any, stage: str, lora: Any = None, _cache: dict = {}) -> dict:  # noqa: B006
    """`meta_build`'s full shapes, and the LoRA factors' (`text.lora`, None: none). Their order does not
    matter to the plan: ZeRO-1's partition sorts each group by size."""
    shapes = meta_build(model_config, stage)[1]
    if lora is None or stage != "text":
        return shapes
    key = (id(shapes), lora.rank, lora.targets)
    if key not in _cache:
        _cache[key] = (shapes, {**shapes, **factor_shapes(shapes, lora)})  # holds `shapes`, so its id stays its own
    return _cache[key][1]


def plan(
    cfg: Any, model_config: Any, gpu_memory_gib: float | None = None, vision_patches: int | None = None
) -> dict[str, Any]:
    """Both pools' rank plans, the per-GPU total (both pools' ranks under shared placement of fractional
    GPUs), the device it is compared with, and whether it fits."""
    ranks = {
        stage: stage_plan(cfg, model_config, stage, vision_patches if stage == "vision" else None)
        for stage in ("vision", "text")
    }
    shared = cfg.pipeline.shared and all(0 < getattr(cfg, s).num_gpus_per_actor < 1 for s in ("vision", "text"))
    per_device = (
        ranks["vision"].total + ranks["text"].total if shared else max(ranks["vision"].total, ranks["text"].total)
    )
    device, source = device_memory(cfg, gpu_memory_gib)
    fits = None if device is None else per_device <= MARGIN * device
    return {
        "ranks": ranks,
        "shared": shared,
        "per_device": per_device,
        "device": device,
        "device_source": source,
        "fits": fits,
    }


def _can_double(cfg: Any, model_config: Any, stage: str) -> bool:
    """Whether the stage's layout allows twice its degree on this model (the layout says, not its name)."""
    from dhp.models.parallel.layouts import layout_class, make_layout

    s = getattr(cfg, stage)
    degree = 2 * s.degree
    try:
        if layout_class(stage, s.parallelism).check_degree(stage, degree):
            return False
        make_layout(stage, s.parallelism, degree, s.num_actors * 2, model_config).check_shape(model_config)
    except ValueError:
        return False
    return True


def advice(cfg: Any, result: dict[str, Any], model_config: Any) -> list[str]:
    """What would make an over-budget plan fit, largest lever first."""
    out = []
    for stage, r in result["ranks"].items():
        if not ActivationCheckpointing.of(getattr(cfg, stage)).recomputes_all and r.activations > r.total / 4:
            out.append(f"{stage}.activation_checkpointing=full (activations are {r.activations / GIB:.1f} GiB)")
    from dhp.models.precision import PRECISIONS, precision_of

    current = precision_of(cfg.model.precision)
    cheapest = min(PRECISIONS.values(), key=lambda p: p.bytes_per_param)
    if current.bytes_per_param > cheapest.bytes_per_param:
        out.append(
            f"model.precision={cheapest.name} ({cheapest.bytes_per_param} instead of "
            f"{current.bytes_per_param} bytes per parameter)"
        )
    for stage in ("text", "vision"):
        if _can_double(cfg, model_config, stage):
            s = getattr(cfg, stage)
            out.append(f"{stage}.degree={2 * s.degree} with {stage}.num_actors={2 * s.num_actors} (more GPUs)")
    out += _fine_tuning_advice(cfg, result, model_config)
    out.append(f"a smaller data.microbatch_tokens than {cfg.data.microbatch_tokens} (or data.max_pixels)")
    if result["shared"]:
        out.append("pipeline.placement=disjoint with whole GPUs per pool")
    return out


def _fine_tuning_advice(cfg: Any, result: dict[str, Any], model_config: Any) -> list[str]:
    """Training less (models/fine_tuning.py), with what the plan says it would take per device: LoRA on the
    language model (no gradients or AdamW state for its base), the vision merger only. Only choices this layout
    can run (`check_layout`)."""
    import copy

    from dhp.errors import ConfigError
    from dhp.models.parallel.checks import check_layout  # the layouts' own checks, which live with the pools

    out = []
    gpu = None if result["device"] is None else result["device"] / GIB
    for stage, choice in (("text", "lora"), ("vision", "merger")):
        if not FineTuning(cfg).trains_all(stage):
            continue
        other = copy.deepcopy(cfg)
        getattr(other, stage).train = choice
        try:
            check_layout(other, model_config)
        except (ConfigError, ValueError):
            continue
        less = plan(other, model_config, gpu)["per_device"]
        if less < result["per_device"]:
            out.append(
                f"{stage}.train={choice} (fine-tuning: {less / GIB:.1f} GiB per device instead of "
                f"{result['per_device'] / GIB:.1f})"
            )
    return out


def table(result: dict[str, Any]) -> str:
    cols = ("params", "grads", "optimizer", "optimizer_step_temp", "activations", "transients")
    lines = [
        "| pool | layout | precision | checkpointing | params | grads | AdamW | step temp | activations "
        "| transients | total / rank |",
        "|---|---|---|---|" + "---:|" * 7,
    ]
    for stage, r in result["ranks"].items():
        lines.append(
            f"| {stage} | {r.layout} {r.degree} x {r.num_actors // r.degree} | {r.precision} | "
            f"{r.activation_checkpointing} | "
            + " | ".join(f"{getattr(r, c) / GIB:.2f}" for c in cols)
            + f" | {r.total / GIB:.2f} |"
        )
    per = result["per_device"] / GIB
    how = "vision + text ranks sharing one GPU" if result["shared"] else "the larger rank"
    if result["device"] is None:
        verdict = f"per device: {per:.2f} GiB ({how}); {result['device_source']}"
    else:
        dev = result["device"] / GIB
        word = "fits" if result["fits"] else "DOES NOT FIT"
        verdict = (
            f"per device: {per:.2f} GiB ({how}) of {dev:.0f} GiB ({result['device_source']}; "
            f"{MARGIN:.0%} usable): {word}"
        )
    return "\n".join(lines) + f"\n\nGiB. {verdict}"
