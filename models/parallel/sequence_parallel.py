"""Window-aware DeepSpeed-Ulysses sequence parallelism for the Qwen2.5-VL vision encoder.

The transformers modules of `Qwen2_5_VisionTransformerPretrainedModel` (patch_embed, rotary_pos_emb,
blocks, merger) are reused as they are; this file replaces only its forward orchestration and the
attention step of each block. Notation: P patches in the batch (rows of `pixel_values`, image processor
order), sp ranks in the SP group, rank r owns S_r patches, D = hidden, H heads of hd = D / H, M = 4
patches per merge unit, O = out_hidden.

Plan (`plan_shards`, models/parallel/shard_plan.py, from grid_thw alone, identical on every rank): the global
  window order of the patches cut into sp contiguous ranges at window boundaries; rank r owns S_r of them.

Forward (`sp_vision_forward`) on rank r, shapes per rank:
  pixel_shard [S_r, 1176]   rows plan.patch_index[r] of pixel_values (window order); nothing else read
  patch_embed -> x [S_r, D]; rotary cos/sin [S_r, hd] from the position ids of its own patches (local)
  window blocks: attention with plan.cu_window_seqlens[r] (no window straddles a cut): NO collective
  full blocks (fullatt_block_indexes), Ulysses:
    qkv + rotary locally [S_r, 3, H, hd] --all-to-all #1--> [P, 3, H/sp, hd]  (global window order,
    rank r keeps head group r); attention per image frame with plan.cu_seqlens; [P, H/sp, hd]
    --all-to-all #2--> [S_r, H, hd]; proj and MLP locally.
  merger on the shard -> [S_r / 4, O] in window order (a merge unit never straddles a window).
`gather_merged`: all-gather (padded to the largest shard) -> [P / 4, O] in global window order, then
  the inverse window permutation -> raster order, identical on every rank (= VisionModel.forward).

Collectives, in the same order on every rank whatever its data (docs/design.md, invariant 2): forward, per full block,
  all-to-all #1 then #2 (`all_to_all_single_autograd`, unequal splits; a rank with S_r = 0 sends and
  receives empty pieces but joins); then one all_gather in `gather_merged`. Backward, autograd runs
  the adjoint all-to-alls in reverse order (#2', #1' per full block, last block first); `gather_merged`'s
  backward has NO collective: every rank holds the same gradient of the full output (the loss is
  replicated), so a rank keeps the slice of its own shard (docs/design.md, "The boundary between the
  pools") -- summing would count it sp times. After backward each rank holds partial parameter gradients;
  their SUM over the SP group is
  the full-model gradient (each patch's path is differentiated on exactly one rank; attention of head
  group r on rank r). Every parameter gets a gradient (zeros on an empty rank), so a later gradient
  all-reduce cannot diverge either.

Preconditions: num_heads % sp == 0 (ValueError names the degrees that work); every SP rank computes the
same plan from the same grid_thw and calls the same functions; window sizes are whole merge units (true
for the Qwen2.5-VL windows); the gradient reaching `gather_merged`'s output is the same on every rank
(a replicated loss, or the text stage's gradient fanned out). sp == 1 needs no process group.

Families (models/family/): the plan and the forward ask the model's family which blocks attend over whole
images, and nothing else about the model. Qwen3-VL has no windows: every block is a full block (both
all-to-alls in each), the plan cuts its raster-ordered patches at the merge-unit edge nearest to r * P / sp
(window order is raster order, `merged_index` the identity), the learned position embeddings of a rank's own
patches are added after the patch embed, and each DeepStack block's own merger runs on the shard, its rows
appended to the merged rows ([S_r / 4, (1 + k) * O]: the boundary's row layout, stages/boundary.py).

Volume per full block per rank, forward: 3 * S_r * D * (sp-1)/sp sent
for q/k/v plus S_r * D * (sp-1)/sp back, i.e. ~4 * P * D / sp elements per rank and block; the same
again in backward, and only in len(fullatt_block_indexes) blocks (4 of 32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
from transformers.vision_utils import get_vision_position_ids

from dhp.models.activation_checkpointing import maybe_checkpoint
from dhp.models.family import family_of
from dhp.models.parallel.layout import NOT_SHARDED, Layout, PoolRanks, VitShape
from dhp.models.parallel.shard_plan import ShardPlan, check_sp_degree, plan_shards
from dhp.models.window_attention import segment_attention


class _Ulysses:
    """The two all-to-alls of a full-attention block: sequence-sharded <-> head-sharded."""

    def __init__(self, plan: ShardPlan, rank: int, group):
        self.sp, self.group, self.lengths = plan.sp, group, list(plan.lengths)
        self.mine = plan.lengths[rank]

    def seq_to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[S_r, 3, H, hd] -> [P, 3, H/sp, hd]: rank r keeps head group r of every rank's patches."""
        s, three, heads, hd = t.shape
        chunks = t.reshape(s, three, self.sp, heads // self.sp, hd).permute(2, 0, 1, 3, 4)
        chunks = chunks.reshape(self.sp * s, three * heads // self.sp * hd)
        out = all_to_all_single_autograd(chunks, self.lengths, [s] * self.sp, self.group)
        return out.reshape(sum(self.lengths), three, heads // self.sp, hd)

    def heads_to_seq(self, t: torch.Tensor) -> torch.Tensor:
        """[P, H/sp, hd] -> [S_r, H, hd]: every rank gets all heads of its own patches back."""
        _, local_heads, hd = t.shape
        out = all_to_all_single_autograd(t.reshape(t.shape[0], -1), [self.mine] * self.sp, self.lengths, self.group)
        out = out.reshape(self.sp, self.mine, local_heads, hd).permute(1, 0, 2, 3)
        return out.reshape(self.mine, self.sp * local_heads, hd)


def _attention(attn, x, rope, cu_seqlens, ulysses: _Ulysses | None) -> torch.Tensor:
    """`Qwen2_5_VLVisionAttention.forward` on a shard; the full-attention variant swaps sequence and heads."""
    s, heads = x.shape[0], attn.num_heads
    q, k, v = attn.qkv(x).reshape(s, 3, heads, attn.head_dim).unbind(1)
    q, k = apply_rotary_pos_emb_vision(q, k, *rope)  # local: rotary is per position
    if ulysses is not None:
        q, k, v = ulysses.seq_to_heads(torch.stack((q, k, v), dim=1)).unbind(1)
    out = segment_attention(attn, q, k, v, cu_seqlens)  # one call per window length, not per window
    if ulysses is not None:
        out = ulysses.heads_to_seq(out)
    return attn.proj(out.reshape(s, heads * attn.head_dim))


def sp_vision_forward(
    visual, pixel_shard: torch.Tensor, grid_thw: torch.Tensor, plan: ShardPlan, rank: int, group
) -> torch.Tensor:
    """Rank `rank`'s merged shard [S_r / 4, out_hidden] in window order. `visual`: the transformers ViT."""
    cfg = visual.config
    check_sp_degree(cfg.num_heads, plan.sp)
    if group is not None and dist.get_world_size(group) != plan.sp:
        raise ValueError(f"plan is for sp={plan.sp} but the group has {dist.get_world_size(group)} ranks")
    s = plan.lengths[rank]
    if pixel_shard.shape[0] != s:
        raise ValueError(f"rank {rank} owns {s} patches but got {pixel_shard.shape[0]} pixel rows")
    family = family_of(cfg)
    merger, deepstack = visual.merger, family.deepstack_indexes(cfg)
    if plan.num_patches == 0:  # same on every rank (same plan): nobody joins anything
        return pixel_shard.new_zeros(0, cfg.out_hidden_size * (1 + len(deepstack)))
    pe = visual.patch_embed
    pixel_shard = pixel_shard.to(pe.proj.weight.dtype)
    if s:
        x = pe(pixel_shard)
    else:  # patch_embed's view(-1, ...) is ambiguous on zero rows
        x = pe.proj(pixel_shard.view(0, pe.in_channels, pe.temporal_patch_size, pe.patch_size, pe.patch_size))
        x = x.view(0, pe.embed_dim)
    index = plan.patch_index[rank].to(x.device)
    x = family.add_position_embeds(visual, x, grid_thw.to(x.device), index)  # learned ones, where the family has
    positions = get_vision_position_ids(grid_thw.to(x.device), visual.spatial_merge_size)[index]
    rope = visual.rotary_pos_emb(x, positions)
    ulysses = _Ulysses(plan, rank, group) if plan.sp > 1 else None  # sp == 1: the plain forward, no group
    cu_windows, cu_full = plan.cu_window_seqlens[rank], plan.cu_seqlens
    all_to_all = set(family.full_attention_blocks(cfg))  # the blocks attending over whole images
    features = []  # DeepStack: this shard's rows of each deepstack block's own merger
    for i, blk in enumerate(visual.blocks):
        full = i in all_to_all

        def block(x: torch.Tensor, blk: nn.Module = blk, full: bool = full) -> torch.Tensor:
            x = x + _attention(blk.attn, blk.norm1(x), rope, cu_full if full else cu_windows, ulysses if full else None)
            return x + blk.mlp(blk.norm2(x))

        x = maybe_checkpoint(blk, block, x)  # recomputed (its all-to-alls too) in backward if chosen
        if i in deepstack:
            features.append(family.merge(family.deepstack_mergers(visual)[deepstack.index(i)], x))
    merged = family.merge(merger, x)
    return torch.cat([merged, *features], dim=-1) if features else merged


class _GatherShards(torch.autograd.Function):
    """Forward: all-gather variable-size shards (rank order). Backward: this rank's slice, no collective."""

    @staticmethod
    def forward(ctx, shard, sizes, rank, group):
        ctx.span = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
        padded = shard.new_zeros(max(sizes), *shard.shape[1:])
        padded[: shard.shape[0]] = shard
        buffers = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(buffers, padded.contiguous(), group=group)
        return torch.cat([b[:n] for b, n in zip(buffers, sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.span[0] : ctx.span[1]], None, None, None


def gather_merged(merged_shard: torch.Tensor, plan: ShardPlan, rank: int, group) -> torch.Tensor:
    """[S_r / 4, O] shards -> the full merged sequence [P / 4, O] in raster order on every rank."""
    sizes = [n // plan.merge_unit for n in plan.lengths]
    if merged_shard.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank} should hold {sizes[rank]} merged rows, got {merged_shard.shape[0]}")
    if plan.num_patches == 0:
        return merged_shard
    full = _GatherShards.apply(merged_shard, sizes, rank, group) if plan.sp > 1 else merged_shard
    return full[torch.argsort(plan.window_index).to(full.device)]


class SequenceParallel(Layout):
    """`sequence` (vision): window-aware Ulysses inside each replica + ZeRO-1 AdamW over the whole pool.

    The loader sends each rank only its own window-aligned patches (`loader_shards`), every rank's merged
    shard crosses the boundary (the text side reassembles them: stages/boundary.py), and each shard's
    gradient comes back to the rank that produced it. SP ranks see different patches, so their parameter
    gradients are partial sums over the sequence: they are summed over the whole pool (SP x DP) before
    the step, after which every rank holds the same full gradients and ZeRO-1 can shard the moments.
    """

    name = "sequence"
    label = "SP"
    stages = ("vision",)

    def check_shape(self, model_config: Any) -> None:
        check_sp_degree(model_config.vision_config.num_heads, self.degree)

    @property
    def loader_shards(self) -> int:
        return self.degree

    vit_collective = "all_to_all"

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        """`sp_vision_forward` calls a block's parts itself, around the attention's all-to-alls: its two norms and
        its MLP are what compiles (the attention's projections are single matrix products)."""
        return [part for block in model.blocks() for part in (block.norm1, block.norm2, block.mlp)]

    @property
    def work_shards(self) -> int:
        return self.degree

    def vit_collectives(self, s: VitShape) -> int:
        return 4 * s.full if self.degree > 1 else 0  # q, k, v in and the output back, per full-attention block

    def grad_sync_group(self, ranks: PoolRanks) -> Any:
        return None  # the whole pool

    def optimizer_shard_group(self, ranks: PoolRanks) -> Any:
        """ZeRO-1 over the whole pool: every rank holds the same summed gradients after the sync.

        torch's ZeroRedundancyOptimizer rather than DeepSpeed ZeRO-1, measured (DeepSpeed 0.19.8, CPU/gloo):
        both give exact parity, but DeepSpeed has no API for an externally computed clip coefficient (the
        global norm spans two pools; it needs its private `loss_scale`/`averaged_gradients`), its gradient
        flush must stay open across Ray calls (`coalesce_grad_reduction`), and it JIT-builds a comm op
        (~90 s on 2 cores) on every fresh machine. Costs: whole-parameter partitions, all-reduce + broadcast
        instead of reduce-scatter + all-gather.
        """
        return None if ranks.world_size > 1 else NOT_SHARDED

    @property
    def optimizer_fraction(self) -> float:
        return 1.0 / self.num_actors

    def vision_forward(self, model, pixels: torch.Tensor, grid: torch.Tensor, ranks: PoolRanks) -> torch.Tensor:
        """This rank's merged shard [S_r / 4, D] in window order. Every rank of the replica has the same
        grid, so the same plan and the same collectives (an empty batch: the plain forward, none)."""
        if grid.numel() == 0:
            return model(pixels, grid.to(pixels.device))
        plan = plan_shards(grid, self.degree, self.model_config)
        return sp_vision_forward(model.visual, pixels, grid, plan, ranks.model_rank, ranks.model_group)

    def vit_comm_bytes(self, s: VitShape, patches: int, b: int) -> float:
        """Per full block (3 + 1) * S_r * D * (N-1)/N, forward and backward; the gather of S_r / 4 rows, one output
        per merger wide (the merged embedding and each DeepStack feature)."""
        n, p = self.degree, patches
        return (s.full * 2 * 4 * (p / n) * s.d * (n - 1) / n + (n - 1) * (p / n / 4) * s.o * s.mergers) * b

    def vit_grad_sync_bytes(self, s: VitShape, b: int) -> float:
        """ZeRO-1: a 2(N-1)/N all-reduce of every gradient, then an (N-1)/N broadcast of every parameter."""
        return 3 * (self.degree - 1) / self.degree * s.params() * b

    def merger_activation_bytes(self, s: VitShape, patches: int, b: int) -> float:
        return super().merger_activation_bytes(s, patches, b) / self.degree  # each rank merges its own shard

    def vit_activation_bytes(self, s: VitShape, patches: int, b: int, recomputed: int = 0) -> float:
        """Everything / N; a full block keeps the all-to-all output instead of q, k, qkv; only the inverse
        window index is kept (unsharded), and the position-embedding rows of the rank's own patches. Recomputed
        blocks: their share of the full ones, by proportion."""
        n = self.degree
        if n == 1:
            return super().vit_activation_bytes(s, patches, b, recomputed)
        full, sharded = s.activation_elements(recomputed)
        full_kept = s.full * (s.depth - recomputed) / s.depth
        return (full + sharded - full_kept * 2 * s.d) * patches / n * b + s.index_bytes(patches, n, 1)
