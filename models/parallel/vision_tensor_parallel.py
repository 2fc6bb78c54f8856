"""Megatron-style tensor parallelism for the Qwen2.5-VL vision encoder (`vision.parallelism: tensor`).

`apply_vision_tensor_parallel(model, group)` rewrites a `VisionModel` in place from outside: parameters
are sliced, `attn.num_heads` is set to the local head count, copies go in as forward pre-hooks and the
row-parallel Linears get a forward that all-reduces before adding their bias. transformers' code runs
unchanged. `tp` = group size, `r` = rank in the group, S = patches in the micro-batch (sum of t*h*w),
D = hidden, H = heads of d = D/H, I = intermediate, O = out_hidden, M = 4 patches per merge unit.

Plan, per vision block (copy = identity forward / all-reduce backward; reduce = all-reduce forward /
identity backward); the residual stream x [S, D] is replicated on every TP rank:

    x -> norm1 -> copy -> attn.qkv (column: rank r keeps heads [r*H/tp, (r+1)*H/tp) of each of q, k, v,
      so its rows stay laid out [3, H/tp, d] and `reshape(S, 3, num_heads, -1)` works with num_heads =
      H/tp) -> rotary (per head) -> attention -> [S, H/tp*d] -> attn.proj (row: columns of W) -> reduce
      -> + proj.bias
    x -> norm2 -> copy -> mlp.gate_proj/up_proj (column, [S, I/tp]) -> act * up -> mlp.down_proj (row)
      -> reduce -> + down_proj.bias
    merger: ln_q (replicated) -> view [S/M, M*D] -> copy -> mlp.0 (column, [S/M, M*D/tp]) -> GELU -> mlp.2
      (row) -> reduce -> + mlp.2.bias -> [S/M, O] replicated

Row-parallel biases are added once, after the reduce (`_row_parallel_forward`), not on rank 0 only: the
bias stays an ordinary replicated parameter whose gradient (the column sums of the replicated output
gradient) is the full gradient, bit-identical on every rank, so the optimizer keeps the copies equal.
patch_embed, the norms and ln_q are replicated; the copies make their gradients identical on every rank
(each copy's backward is one all-reduce result, and everything between copies is replicated math).

Collectives, in the same order on every rank (all TP ranks see the same micro-batch; none for an empty
grid), each an all-reduce (sum) in the dtype of the tensor at that point (4 bytes/element in fp32):
  forward: 2 per block of [S, D] (after attn.proj, then after mlp.down_proj) + 1 of [S/M, O] (after
    merger.mlp.2): 2*depth*S*D + S/M*O elements, e.g. fp32 7B encoder: (64*S*1280 + S/4*3584)*4 bytes;
  backward, in reverse: 1 of [S/M, M*D] (the copy in front of merger.mlp.0), then 2 per block of [S, D]
    (the copies in front of mlp and attn, last block first): (2*depth + 1)*S*D elements. The row-parallel
    biases need none. tests/test_vision_tensor_parallel.py checks this list, shapes and order.
  With gradient checkpointing on the blocks, the recomputation repeats the 2 forward all-reduces per block.
Precondition: the gradient reaching the output is the same on every TP rank (a replicated loss, or the text
stage's gradient sent to each of them), as the replicated parameters' gradients are computed locally.

Checkpoints: `vision_tp_slice(name, r, tp, config)` indexes rank r's part of a full tensor. Rank r's rows
of the fused qkv are three separate ranges, and safetensors' `get_slice(...)[idx]` takes slices only, so
for qkv it returns a *list* of three slice tuples whose parts are concatenated along dim 0; every other
sharded tensor gets one slice tuple. `read_part(source, idx)` reads either form from a tensor or a
safetensors slice; `shard_vision_state_dict_for_rank` / `gather_full_vision_state_dict` apply it.
Requires tp to divide H, I and M*D (`check_vision_tp_degree`).

Families (models/family/): which Linear is the fused qkv, column- or row-parallel and of which width is the
family's `vision_tp_role`; the Linear closing a block's MLP and the (column, row) pair of each merger are its
`vision_mlp_out` and `vision_merger_linears`. Qwen3-VL: a plain MLP (linear_fc1 column, linear_fc2 row), and
its DeepStack mergers split like the merger (their post-shuffle LayerNorm replicated, in front of the copy),
each closing with one more all-reduce of [S/M, O] forward and one of [S/M, M*D] backward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dhp.models.family import family_of
from dhp.models.parallel.layout import PoolRanks, VitShape
from dhp.models.parallel.tensor_parallel import TensorParallel, copy_hook, reduce_from_region
from dhp.models.parallel.tensor_parts import gather_sliced, read_part, shard_sliced
from dhp.models.qwen2_5_vl import VisionModel

Index = tuple[slice, ...] | list[tuple[slice, ...]]


def _vision_config(config):
    return getattr(config, "vision_config", config)


def _merger_width(c) -> int:
    return c.hidden_size * c.spatial_merge_size**2


def _valid(tp: int, c) -> bool:
    return c.num_heads % tp == 0 and c.intermediate_size % tp == 0 and _merger_width(c) % tp == 0


def check_vision_tp_degree(tp: int, vision_config) -> None:
    """Raise ValueError (naming the degrees that would work) unless the encoder can be split tp ways."""
    c = _vision_config(vision_config)
    if tp < 1 or not _valid(tp, c):
        ok = [d for d in range(1, c.num_heads + 1) if _valid(d, c)]
        raise ValueError(
            f"vision tensor parallel degree {tp} does not split heads={c.num_heads}, "
            f"intermediate={c.intermediate_size}, merger width={_merger_width(c)}; valid degrees: {ok}"
        )


def vision_tp_slice(name: str, rank: int, tp: int, vision_config) -> Index | None:
    """Index of `rank`'s part of the full tensor `name` (`VisionModel` names); None if it is replicated.

    A list (fused qkv only) means: read each slice tuple and concatenate along dim 0 (`read_part`).
    """
    c = _vision_config(vision_config)
    check_vision_tp_degree(tp, c)
    role = family_of(c).vision_tp_role(name)  # the family's plan: which Linear is split how
    if role is None:
        return None
    kind, of, bias = role
    full = {"hidden": c.hidden_size, "mlp": c.intermediate_size, "merger": _merger_width(c)}[of]
    width = full // tp
    if kind == "qkv":
        rows = [slice(k * full + rank * width, k * full + (rank + 1) * width) for k in range(3)]
        return [(s,) if bias else (s, slice(None)) for s in rows]
    if kind == "column":
        rows = slice(rank * width, (rank + 1) * width)
        return (rows,) if bias else (rows, slice(None))
    return slice(None), slice(rank * width, (rank + 1) * width)


def shard_vision_state_dict_for_rank(
    full_state: dict[str, torch.Tensor], rank: int, tp: int, vision_config
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s local state dict (copies of its parts; replicated tensors as they are)."""
    return shard_sliced(full_state, lambda name: vision_tp_slice(name, rank, tp, vision_config))


def gather_full_vision_state_dict(shards: list[dict[str, torch.Tensor]], vision_config) -> dict[str, torch.Tensor]:
    """Inverse of `shard_vision_state_dict_for_rank`: full tensors from every rank's local dict, in rank order."""
    return gather_sliced(shards, lambda name, rank: vision_tp_slice(name, rank, len(shards), vision_config))


def _row_parallel_forward(self: nn.Linear, group, x: torch.Tensor) -> torch.Tensor:
    # The bias joins after the reduce: added before it, it would be summed tp times. `.to`: under autocast
    # F.linear's output is bf16 and the reference's addmm adds a bf16 bias, so the stream keeps its dtype.
    out = reduce_from_region(F.linear(x, self.weight), group)
    return out if self.bias is None else out + self.bias.to(out.dtype)


def apply_vision_tensor_parallel(model: VisionModel, group: dist.ProcessGroup) -> None:
    """Shard `model` (full, identical on every rank of `group`) in place for tensor parallelism over `group`.

    Build the optimizer afterwards (parameters are re-sliced in place). `_dhp_sharded` (read by
    `StageWorker.grad_sq_norm`) is True exactly on the sliced parameters; the replicated ones, row-parallel
    biases included, are False and counted on rank 0 only, so summing the flagged squared norms over the
    group plus the unflagged ones of rank 0 counts every gradient element of the full model exactly once.
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    visual = model.visual
    c = visual.config
    check_vision_tp_degree(tp, c)
    with torch.no_grad():
        for name, param in model.named_parameters():
            idx = vision_tp_slice(name, rank, tp, c)
            if idx is not None:
                param.data = read_part(param.data, idx).clone()
            param._dhp_sharded = idx is not None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape

    copy = functools.partial(copy_hook, group)
    family = family_of(c)
    mergers = family.vision_merger_linears(visual)  # (column Linear, row Linear) of each merger
    row_parallel = [out for _, out in mergers]
    for block in visual.blocks:
        block.attn.num_heads = c.num_heads // tp  # head_dim and scaling stay those of the full model
        block.mlp.intermediate_size = c.intermediate_size // tp
        block.attn.register_forward_pre_hook(copy, with_kwargs=True)
        block.mlp.register_forward_pre_hook(copy, with_kwargs=True)
        row_parallel += [block.attn.proj, family.vision_mlp_out(block.mlp)]
    for column, _ in mergers:
        column.register_forward_pre_hook(copy, with_kwargs=True)
    for linear in row_parallel:
        linear.forward = functools.partial(_row_parallel_forward, linear, group)
    model.tp_group, model.tp_rank, model.tp_size = group, rank, tp


class VisionTensorParallel(TensorParallel):
    """`tensor` (vision): the uniform-TP baseline. Every TP rank encodes the same pixels and ends with the
    same full merged sequence, so one output (rank 0's) crosses the boundary and the others only join the
    all-reduces; on the way back the replicated output's gradient goes to every rank (row-parallel adjoint).
    """

    stages = ("vision",)

    def check_shape(self, model_config) -> None:
        check_vision_tp_degree(self.degree, model_config.vision_config)

    def vit_collectives(self, s: VitShape) -> int:
        return 2 * s.depth if self.degree > 1 else 0  # after attention's proj and the MLP's down, per block

    def part(self, name: str, model_rank: int) -> Index | None:
        return vision_tp_slice(name, model_rank, self.degree, self.model_config)

    def apply(self, model: nn.Module, ranks: PoolRanks) -> None:
        apply_vision_tensor_parallel(model, ranks.model_group)

    def rank_inputs(self, inputs: list | None) -> list:
        return [] if inputs is None else list(inputs[:1]) * self.degree

    def crossing(self, outputs: list) -> list:
        return outputs[:1]

    def rank_grads(self, grads: list) -> list:
        return list(grads) * self.degree if grads else grads

    def vit_comm_bytes(self, s: VitShape, patches: int, b: int) -> float:
        """All-reduces: forward 2 per block [P, D] + each merger's [P/4, O]; backward each merger's [P/4, 4D] + 2
        per block."""
        n, p, m = self.degree, patches, s.mergers
        forward, backward = 2 * s.depth * p * s.d + m * p / 4 * s.o, m * p / 4 * 4 * s.d + 2 * s.depth * p * s.d
        return 2 * (n - 1) / n * (forward + backward) * b

    def vit_grad_sync_bytes(self, s: VitShape, b: int) -> float:
        """By convention, an all-reduce of the replicated parameters (which dhp skips: identical gradients)."""
        return 2 * (self.degree - 1) / self.degree * s.replicated_params() * b

    def merger_activation_bytes(self, s: VitShape, patches: int, b: int) -> float:
        """Per merger: its norm's input and its first Linear's input replicated; the GELU's input and output
        split."""
        return s.mergers * (2 + 2 / self.degree) * s.d * patches * b

    def vit_activation_bytes(self, s: VitShape, patches: int, b: int, recomputed: int = 0) -> float:
        """The per-block attention and MLP activations / N; pixels, rotary, norms, block inputs replicated."""
        if self.degree == 1:
            return super().vit_activation_bytes(s, patches, b, recomputed)
        full, sharded = s.activation_elements(recomputed)
        return (full + sharded / self.degree) * patches * b + s.index_bytes(patches)
