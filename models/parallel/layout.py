"""What a stage layout is: the one interface every parallelism implements, and the pool coordinates it reads.

A *layout* says how one stage (vision or text) of the model is spread over its pool of `num_actors` ranks:
`degree` consecutive ranks form a model-parallel group (one data-parallel *replica*), and there are
`dp = num_actors // degree` replicas. Everything the rest of dhp needs to know about a parallelism is
answered by its layout object, so a new mode is one subclass in one file plus its parity test:

  config time (driver, no process groups)
    `check_degree(stage, degree)`   classmethod: why this degree cannot run (None if it can)
    `check_shape(model_config)`     ValueError naming the valid degrees when the model cannot be split
    `lockstep`                      every replica must run every call (its collectives span replicas)
    `spans_pool`                    one copy of the model is spread over the whole pool
    `loader_shards`                 > 0: the loader cuts each vision micro-batch into this many rank parts
    `state_ranks(replica)`          the pool ranks whose local states make one full copy
  boundary (driver: which calls each rank gets, whose output crosses to the other pool; stages/boundary.py)
    `rank_inputs(inputs)`           the per-rank vision inputs of a replica from the loader's parts
    `crossing(outputs)`             which ranks' outputs cross the boundary
    `rank_grads(grads)`             the per-rank gradients of those outputs on the way back
  worker time (inside the pool's process groups, `PoolRanks`)
    `apply(model, ranks)`           parallelize the stage's module in place (torchtitan's `parallelize`);
                                    workers apply it to a `meta` model (models/weights/materialize.py)
    `materialize(model, device)`    allocate what this rank holds after `apply` (values: loaded or replayed)
    `slicer(rank, full_shapes)`     name -> index of this rank's part of a full tensor (None: whole); the
                                    same answer serves checkpoint loading, materialisation and export
    `assign_loaded`                 None, or how loaded parts are copied into parameters (not plain tensors)
    `grad_sync_group(ranks)`        the group gradients are summed over before the step (SKIP_SYNC: none)
    `optimizer_shard_group(ranks)`  the group AdamW state is sharded over ZeRO-1 style (default: the data-
                                    parallel replicas; NOT_SHARDED: none)
    `reports_grad_norm(ranks, p)`   whether this rank counts parameter p's gradient in the global norm
    `vision_forward(...)`           the vision encoder's forward on this rank's inputs
    `gather(local_states)`          full tensors from the `state_ranks`' local states (export, checkpoints)
  time (the step-time model, models/planning/time_model.py)
    `work_shards`                   ranks one replica's matrix work is split over (SP, TP: degree)
    `width_shards`                  ranks a matmul's width is split over (TP: degree): narrower matmuls
    `vit_collective`, `vit_collectives(s)`  the ViT's activation collective and how many run each way
  bytes (`dhp bench layouts` and the memory plan)
    `state_numel(full_shapes, rank)` elements of parameters this rank holds; `optimizer_fraction`
    `vit_comm_bytes / vit_grad_sync_bytes / vit_activation_bytes`  the ViT formulas (docs/layouts.md)

`models/parallel/layouts.py` maps a layout name to its class; nothing else compares layout names.
See docs/architecture.md for the walk-through and the example to copy.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

SKIP_SYNC = "skip"  # grad_sync_group: the layout sums gradients itself (FSDP's reduce-scatter)
NOT_SHARDED = False  # optimizer_shard_group: a plain, replicated optimizer
PIXELS = 1176  # values per ViT patch (3 x 2 x 14 x 14)


class PoolRanks(NamedTuple):
    """A rank's coordinates in its pool (made by `stages/actor_group.py` once the groups exist).

    `model_group`: the `degree` ranks of its replica; `dp_group`: the ranks at the same model-parallel
    position in every replica; None as a group means the pool's whole (default) group.
    """

    rank: int
    world_size: int
    degree: int
    replica: int
    model_rank: int
    model_group: Any
    dp_group: Any
    device: torch.device


def pool_ranks(rank: int, world_size: int, degree: int, device: torch.device) -> PoolRanks:
    """A rank's coordinates and groups, once the pool's default process group exists: model-parallel groups
    of `degree` consecutive ranks (one per data-parallel replica) and data-parallel groups (the same position
    across replicas). Every rank creates every group in the same order, as `new_group` requires."""
    import torch.distributed as dist

    dp = world_size // degree
    replica, model_rank = divmod(rank, degree)
    model_group = dp_group = None
    for r in range(dp):
        group = dist.new_group(list(range(r * degree, (r + 1) * degree)))
        if r == replica:
            model_group = group
    for m in range(degree):
        group = dist.new_group([m + r * degree for r in range(dp)])
        if m == model_rank:
            dp_group = group
    return PoolRanks(rank, world_size, degree, replica, model_rank, model_group, dp_group, device)


class VitShape(NamedTuple):
    """The ViT dimensions the byte formulas need: depth, full-attention blocks, hidden, heads, MLP, out; and what
    differs between families: values per patch, a gated MLP (three Linears) or a plain one (two), LayerNorm
    (weight and bias; keeps mean and rstd) or RMSNorm, learned position-embedding rows (0: none) and DeepStack
    mergers. The defaults are Qwen2.5-VL's."""

    depth: int
    full: int
    d: int
    h: int
    i: int
    o: int
    pixels: int = PIXELS
    gated: bool = True
    layer_norm: bool = False
    pos_embed: int = 0
    deepstack: int = 0

    @classmethod
    def of(cls, vc: Any) -> VitShape:
        """The shape of a vision config (its family says which blocks attend over whole images, which MLP and
        norm its blocks have, which mergers it has), or of a dict of Qwen2.5-VL vision config values (the
        benchmarks' shapes)."""
        if isinstance(vc, dict):
            dims = (vc[k] for k in ("hidden_size", "num_heads", "intermediate_size", "out_hidden_size"))
            return cls(vc["depth"], len(vc["fullatt_block_indexes"]), *dims)
        from dhp.models.family import family_of

        family = family_of(vc)
        dims = (getattr(vc, k) for k in ("hidden_size", "num_heads", "intermediate_size", "out_hidden_size"))
        return cls(
            vc.depth,
            len(family.full_attention_blocks(vc)),
            *dims,
            pixels=vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
            gated=family.vision_mlp_linears == 3,
            layer_norm=family.vision_layer_norm,
            pos_embed=family.vision_position_embeddings(vc),
            deepstack=len(family.deepstack_indexes(vc)),
        )

    @property
    def windowed(self) -> bool:
        """Some blocks attend inside windows: the merged tokens run in window order (an index and its inverse)."""
        return self.full < self.depth

    @property
    def mergers(self) -> int:
        """The merger and the DeepStack mergers (one shape)."""
        return 1 + self.deepstack

    def param_rows(self) -> list[tuple[int, int]]:
        """(dim-0 rows, elements per row) of every ViT parameter: patch embed, position embedding, blocks, mergers."""
        d, i, o = self.d, self.i, self.o
        norm = [(d, 1)] * (2 if self.layer_norm else 1)  # weight (and bias)
        attn = [(3 * d, d), (3 * d, 1), (d, d), (d, 1)]
        mlp = [(i, d), (i, 1)] * (2 if self.gated else 1) + [(d, i), (d, 1)]
        linears = [(4 * d, 4 * d), (4 * d, 1), (o, 4 * d), (o, 1)]
        merger = norm + linears  # its norm before the 2 x 2 merge
        # a DeepStack merger's norm runs after the merge, over 4D
        deepstack = [(4 * d, 1)] * (2 if self.layer_norm else 1) + linears
        embed = [(d, self.pixels)] + [(d, 1)] * self.layer_norm + [(self.pos_embed, d)] * bool(self.pos_embed)
        return [*embed, *(norm + norm + attn + mlp) * self.depth, *merger, *deepstack * self.deepstack]

    def params(self, pad_to: int = 1) -> int:
        """Parameter count; with pad_to=N, each padded to a multiple of N rows, as FSDP2 shards them."""
        return sum(-(-rows // pad_to) * pad_to * per_row for rows, per_row in self.param_rows())

    def replicated_params(self) -> int:
        """Replicated under ViT tensor parallelism: patch embed, position embedding, norms, row-parallel biases,
        the mergers' norms and output biases."""
        n = 2 if self.layer_norm else 1
        embed = self.pixels * self.d + self.layer_norm * self.d + self.pos_embed * self.d
        blocks = self.depth * (2 * n * self.d + 2 * self.d)
        return embed + blocks + n * self.d + self.o + self.deepstack * (n * 4 * self.d + self.o)

    def activation_elements(self, recomputed: int = 0) -> tuple[float, float]:
        """(replicated, shardable) saved-for-backward elements per patch, counted from transformers' modules;
        `recomputed` blocks (activation checkpointing) keep only their input, [P, D]. Integer indices are
        `index_bytes`."""
        hd, d = self.d // self.h, self.d
        # RMSNorm keeps x, rsqrt, x * rsqrt; LayerNorm x, mean, rstd; the output is saved by the next Linear
        norm = 2 * d + 2 if self.layer_norm else 3 * d + 1
        # q_rot, k_rot, the qkv output (v is a view of it), attention out, proj input; lse. As transformers' loop
        # keeps them; dhp's grouped attention keeps up to 2 D less (tests/test_qwen3_vl_plan.py): an upper bound
        attn = 7 * d + self.h
        mlp = 4 * self.i if self.gated else 2 * self.i  # gate, act(gate), up, act * up; or fc1 out, act(fc1 out)
        merger_mlp = 2 * d  # GELU input and output, [P/4, 4D] each, per merger
        # a DeepStack merger's norm takes a block's output (kept anyway) after the merge: its output, mean, rstd
        deepstack = self.deepstack * (d + (2 if self.layer_norm else 1) / 4)
        position = 4 if self.pos_embed else 0  # the 4 bilinear weights of each patch's position embedding
        kept = self.depth - recomputed
        # pixels, cos/sin, the norms, the merger's norm
        full = self.pixels + position + 2 * hd + kept * 2 * norm + norm + recomputed * d + deepstack
        return full, kept * (attn + mlp) + self.mergers * merger_mlp

    def index_bytes(self, patches: float, shards: int = 1, window_indexes: int = 2) -> float:
        """Bytes of int64 indices kept for `patches` patches (a rank's `1 / shards` of them): the window index
        and its inverse ([P / 4] each, `window_indexes` of them kept) and each patch's 4 position-embedding rows."""
        windows = window_indexes * patches / 4 * 8 if self.windowed else 0.0
        return windows + (patches / shards * 4 * 8 if self.pos_embed else 0.0)

    def merger_activation_elements(self) -> float:
        """Saved elements per patch when only the mergers train: each merger's norm input, its Linears' inputs
        and the GELU's input and output, D per patch each."""
        return self.mergers * 4 * self.d


class Layout:
    """The base is the plain data-parallel behaviour; each parallelism overrides what it changes."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""  # how a table names it: DP, SP, TP, ZeRO-3
    stages: ClassVar[tuple[str, ...]] = ()  # the stages it can lay out
    lockstep: ClassVar[bool] = False
    spans_pool: ClassVar[bool] = False
    assign_loaded: ClassVar[Any] = None
    takes_lora: ClassVar[bool] = True  # LoRA factors (models/lora.py) can be added after `apply`

    def __init__(self, stage: str, degree: int = 1, num_actors: int = 1, model_config: Any = None):
        self.stage, self.degree, self.num_actors, self.model_config = stage, degree, num_actors, model_config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stage}, degree={self.degree}, num_actors={self.num_actors})"

    @property
    def dp(self) -> int:
        return self.num_actors // self.degree

    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the model's state: the model-parallel group, or the pool."""
        return self.num_actors if self.spans_pool else self.degree

    @classmethod
    def of_size(cls, stage: str, n: int, model_config: Any = None) -> Layout:
        """This layout over n ranks holding one copy (one replica; for `spans_pool`, n replicas)."""
        return cls(stage, 1 if cls.spans_pool else n, n, model_config)

    # --- config time ------------------------------------------------------------------------------------

    @classmethod
    def check_degree(cls, stage: str, degree: int) -> str | None:
        return None

    def check_shape(self, model_config: Any) -> None:
        """Raise ValueError when this model cannot be laid out at this degree."""

    @property
    def loader_shards(self) -> int:
        return 0

    def state_ranks(self, replica: int = 0) -> list[int]:
        if self.spans_pool:
            return list(range(self.num_actors))
        return list(range(replica * self.degree, (replica + 1) * self.degree))

    # --- boundary (driver side) -------------------------------------------------------------------------

    def rank_inputs(self, inputs: list | None) -> list:
        """Per-rank inputs of one replica's vision call; `inputs` None is a padding micro-batch, which
        only a lockstep layout acts on (every rank encodes a placeholder)."""
        if inputs is None:
            return [None] * self.degree if self.lockstep else []
        return list(inputs)

    def crossing(self, outputs: list) -> list:
        return outputs

    def rank_grads(self, grads: list) -> list:
        """grads[j]: d loss / d crossing output j; none at all only for a padding micro-batch."""
        if not grads and self.lockstep:
            return [None] * self.degree
        return grads

    # --- worker time -----------------------------------------------------------------------------------

    def apply(self, model: nn.Module, ranks: PoolRanks) -> None:
        """Parallelize `model` (identical on every rank) in place; build the optimizer afterwards."""

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose forward `vision.compile` / `text.compile` compiles (models/compilation.py): the
        blocks, where the layout calls each block as a whole."""
        return model.blocks()

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Allocate the laid-out meta parameters (models/weights/materialize.py); values come after (load or init)."""
        from dhp.models.weights.materialize import materialize_params

        materialize_params(model, device)

    def slicer(self, rank: int, full_shapes: dict[str, torch.Size]):
        """name -> index of pool rank `rank`'s part of the full tensor (None: whole), or None if unsharded."""
        return None

    def grad_sync_group(self, ranks: PoolRanks) -> Any:
        return ranks.dp_group

    def optimizer_shard_group(self, ranks: PoolRanks) -> Any:
        """ZeRO-1 over the data-parallel replicas: after the gradient sync they hold the same gradients of
        the same tensors, so each keeps the AdamW moments of its share and broadcasts what it stepped."""
        return ranks.dp_group if ranks.world_size // ranks.degree > 1 else NOT_SHARDED

    def reports_grad_norm(self, ranks: PoolRanks, param: nn.Parameter) -> bool:
        """Replicas hold identical gradients after the sync: replica 0 reports. Inside it a sharded
        parameter (`_dhp_sharded`) counts on every rank, a replicated one on model-parallel rank 0."""
        return ranks.replica == 0 and (getattr(param, "_dhp_sharded", False) or ranks.model_rank == 0)

    def unsynced_replicated(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters replicated over a replica's ranks that dhp never all-reduces there (identical grads)."""
        return []

    def vision_forward(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, ranks: PoolRanks):
        """This rank's merged tokens of its inputs (`model`: the stage's `VisionModel`); all of them unless
        the layout shards the sequence."""
        return model(pixels, grid.to(pixels.device))

    def gather(self, local_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full tensors from the local states of `state_ranks`, in rank order; replicated: the first."""
        return local_states[0]

    # --- time ------------------------------------------------------------------------------------------

    vit_collective: ClassVar[str] = "all_reduce"

    @property
    def work_shards(self) -> int:
        return 1

    @property
    def width_shards(self) -> int:
        return 1

    def vit_collectives(self, s: VitShape) -> int:
        """Activation collectives of one ViT forward on one rank (as many run in the backward)."""
        return 0

    # --- bytes -----------------------------------------------------------------------------------------

    def state_numel(self, full_shapes: dict[str, torch.Size], rank: int = 0) -> int:
        """Elements of `full_shapes` pool rank `rank` holds, from the slicer alone: no allocation."""
        return sum(self.held_numels(full_shapes, rank).values())

    def held_numels(self, full_shapes: dict[str, torch.Size], rank: int = 0) -> dict[str, int]:
        """`state_numel` per tensor."""
        slicer = self.slicer(rank, full_shapes)
        return {name: _index_numel(shape, slicer(name) if slicer else None) for name, shape in full_shapes.items()}

    @property
    def optimizer_fraction(self) -> float:
        """Share of its parameters' optimizer state a rank keeps (ZeRO-1 shards it over a group)."""
        return 1.0 / self.dp

    def vit_comm_bytes(self, s: VitShape, patches: int, b: int) -> float:
        """Activation-collective bytes one rank sends per micro-batch (forward + backward)."""
        return 0.0

    def vit_grad_sync_bytes(self, s: VitShape, b: int) -> float:
        """Gradient/parameter synchronisation bytes per rank (per step; `spans_pool`: per micro-batch)."""
        return 0.0

    def vit_activation_bytes(self, s: VitShape, patches: int, b: int, recomputed: int = 0) -> float:
        """Saved-for-backward bytes per rank at the end of the forward (`recomputed` blocks checkpointed);
        the integer indices as `VitShape.index_bytes` counts them."""
        full, sharded = s.activation_elements(recomputed)
        return (full + sharded) * patches * b + s.index_bytes(patches)

    def merger_activation_bytes(self, s: VitShape, patches: int, b: int) -> float:
        """Saved-for-backward bytes per rank when only the mergers train (`vision.train=merger`): nothing in
        the blocks needs a gradient, so only each merger's norm input (its weight's gradient), first Linear's
        input and the GELU's input and output are kept, D per patch each."""
        return s.merger_activation_elements() * patches * b


def _index_numel(shape: torch.Size, idx) -> int:
    if idx is None:
        return math.prod(shape)
    parts = idx if isinstance(idx, list) else [idx]
    total = 0
    for part in parts:
        dims = [len(range(*part[d].indices(n))) if d < len(part) else n for d, n in enumerate(shape)]
        total += math.prod(dims)
    return total
