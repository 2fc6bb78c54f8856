"""Megatron-style tensor parallelism for the text stage, applied to transformers' modules from outside.

`apply_tensor_parallel(model, group)` rewrites a `TextModel` in place (torchtitan style: slice parameters,
add forward hooks, swap `embed_tokens` for a vocab-parallel twin, rebind `loss_sum`); the transformers
code is untouched. `tp` = group size, `r` = rank in the group, H = hidden, I = intermediate, V = vocab,
N = labelled tokens. Every activation between blocks (the residual stream [B, L, H]) is replicated.

Plan, per decoder layer (copy = identity forward / all-reduce backward; reduce = all-reduce forward /
identity backward):

    x [B,L,H] repl -> input_layernorm -> copy -> q/k/v_proj (column: rows of W and b sharded by head)
      -> q [B, heads/tp, L, d], k/v [B, kv_local, L, d] -> sdpa (`view(..., -1, d)` picks up the local
      head counts) -> [B,L,heads/tp*d] -> o_proj (row: columns of W sharded) -> partial sums -> reduce
    x [B,L,H] repl -> post_attention_layernorm -> copy -> gate/up_proj (column) [B,L,I/tp]
      -> act * up -> down_proj (row) -> reduce
    ids [B,L] -> embed_tokens (vocab-parallel: rank r holds rows [r*V/tp, (r+1)*V/tp), other ids give
      zero rows) -> reduce -> [B,L,H] repl -> masked_scatter of vision_embeds (replicated)
    final norm -> hidden[keep] [N,H] -> copy -> lm_head (column over vocab) -> logits [N, V/tp]
      -> vocab-parallel cross-entropy -> summed loss (replicated scalar)

Collectives. Forward: 1 all-reduce of [B,L,H] after the embedding, 2 per layer (after o_proj and
down_proj), 2 in the cross-entropy (max of [N]; sum-exp and target logit stacked into one [2,N]).
Backward: 2 all-reduces of [B,L,H] per layer (the copies in front of q/k/v and gate/up), 1 of [N,H] (the
copy in front of lm_head), plus the KV-replica sums below; the cross-entropy backward is local. Without
the copy in front of lm_head the final norm, every layer, the embedding and `vision_embeds` would get
only this rank's vocab share of their gradient. With it, norm weights and `vision_embeds` get the full
gradient, bit-identical on every rank (one all-reduce result), so replicated weights stay replicated.
The sequence of collectives depends only on shapes that all TP ranks share (they see the same sample).

Per-head norms (Qwen3's q_norm / k_norm, the family's `text_head_norms`): one [head_dim] weight applied to
every head, replicated on each rank, whose gradient on a rank covers only that rank's heads, so
`sum_partial_grads` sums it over the TP group once per step, as it does replicated KV heads.

KV heads. tp must divide num_attention_heads, intermediate_size and vocab_size (no vocab padding: every
released Qwen2.5-VL vocabulary divides by 8; a ValueError names the valid degrees). If tp divides
num_key_value_heads, each rank holds kv_heads/tp of them. If instead num_key_value_heads divides tp, KV
heads are replicated: rank r holds the single KV head its q heads use, r // (tp/kv_heads); its k/v
weight gradients cover only its own q heads, so `sum_partial_grads` sums them over the ranks holding the
same head once per step (one all-reduce of a [kv_heads, ...] buffer per k/v parameter).

Why hand-written autograd Functions rather than DTensor (`parallelize_module`, `loss_parallel`), chosen
from the documented API, not measured: `loss_parallel` must also wrap the backward call (a trainer
change), DTensor has no placement for KV heads replicated over groups of ranks, a tied embedding/lm_head
would need re-tying by hand, and plain local tensors keep optimizer, checkpoint slicing and the vision
boundary ordinary. Parity is exact up to fp32 summation order (see tests/test_tensor_parallel.py).

Checkpoints: `tp_slice(name, rank, tp, config)` gives the index of rank r's slice of a full tensor
(`safe_open(...).get_slice(name)[idx]` reads only that), `shard_state_dict_for_rank` applies it to a
full state dict and `gather_full_state_dict` reassembles full tensors from every rank's local dict
(models/parallel/tensor_parts.py does the indexing).
"""

from __future__ import annotations

import functools
import re
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dhp.models.family import family_of
from dhp.models.parallel.layout import Layout, PoolRanks
from dhp.models.parallel.tensor_parts import gather_sliced, shard_sliced
from dhp.models.qwen2_5_vl import IGNORE_INDEX, TextModel

_COLUMN = re.compile(r"\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = ("language_model.embed_tokens.weight", "lm_head.weight")
_LORA = re.compile(r"^(.*)\.lora_(A|B)\.weight$")  # LoRA factors (models/lora.py): split where their base is


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward. In front of every sharded reader."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward. Closes a row-parallel or vocab-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`_CopyToRegion` for other modules (the vision encoder's TP): identity forward, gradient all-reduced."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`_ReduceFromRegion` for other modules: all-reduced forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits sharded over the vocabulary [N, V/tp]; never gathers them."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -onehot)
        return grad_logits * grad.unsqueeze(-1), None, None, None


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` over the vocabulary rows [vocab_start, vocab_start + weight.shape[0]); output reduced."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, padding_idx: int | None, group):
        super().__init__()
        self.weight = weight  # the same Parameter object: keeps a tied lm_head tied
        self.vocab_start = vocab_start
        local_pad = None if padding_idx is None else padding_idx - vocab_start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        return _ReduceFromRegion.apply(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


def _text_config(config):
    return getattr(config, "text_config", config)


def _valid(tp: int, c) -> bool:
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    return (
        heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and c.intermediate_size % tp == 0 and c.vocab_size % tp == 0
    )


def check_tp_degree(tp: int, config) -> None:
    """Raise ValueError (naming the degrees that would work) unless this model can be split tp ways."""
    c = _text_config(config)
    if tp < 1 or not _valid(tp, c):
        ok = [d for d in range(1, c.num_attention_heads + 1) if _valid(d, c)]
        raise ValueError(
            f"tensor parallel degree {tp} does not split heads={c.num_attention_heads}, "
            f"kv_heads={c.num_key_value_heads}, intermediate={c.intermediate_size}, vocab={c.vocab_size}; "
            f"valid degrees: {ok}"
        )


def _kv_heads(rank: int, tp: int, c) -> tuple[int, int]:
    """(first KV head, count) held by `rank`; count 1 and shared by tp/kv ranks when KV is replicated."""
    kv = c.num_key_value_heads
    if kv % tp == 0:
        return rank * (kv // tp), kv // tp
    return rank // (tp // kv), 1


def tp_slice(name: str, rank: int, tp: int, config) -> tuple[slice, ...] | None:
    """Index of `rank`'s part of the full tensor `name` (TextModel names); None if it is replicated. A LoRA
    factor follows its base: B takes a column-parallel base's rows, A a row-parallel base's columns."""
    lora = _LORA.match(name)
    if lora:
        base = tp_slice(f"{lora.group(1)}.weight", rank, tp, config)
        if base is None:
            return None
        split = base[0] if lora.group(2) == "B" else base[1]
        if split == slice(None):
            return None
        return (split, slice(None)) if lora.group(2) == "B" else (slice(None), split)
    c = _text_config(config)
    check_tp_degree(tp, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen3: its own
    q_cols = c.num_attention_heads // tp * head_dim
    inter = c.intermediate_size // tp
    if name in _VOCAB:
        vocab = c.vocab_size // tp
        return slice(rank * vocab, (rank + 1) * vocab), slice(None)
    m = _COLUMN.search(name)
    if m:
        if m.group(2) in ("k", "v"):
            first, count = _kv_heads(rank, tp, c)
            rows = slice(first * head_dim, (first + count) * head_dim)
        elif m.group(2) == "q":
            rows = slice(rank * q_cols, (rank + 1) * q_cols)
        else:
            rows = slice(rank * inter, (rank + 1) * inter)
        return (rows,) if m.group(4) == "bias" else (rows, slice(None))
    m = _ROW.search(name)
    if m:
        width = q_cols if "o_proj" in m.group(1) else inter
        return slice(None), slice(rank * width, (rank + 1) * width)
    return None


def shard_state_dict_for_rank(
    full_state: dict[str, torch.Tensor], rank: int, tp: int, config
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s local state dict (copies of its slices; replicated tensors as they are)."""
    return shard_sliced(full_state, lambda name: tp_slice(name, rank, tp, config))


def gather_full_state_dict(shards: list[dict[str, torch.Tensor]], config) -> dict[str, torch.Tensor]:
    """Inverse of `shard_state_dict_for_rank`: full tensors from every rank's local state dict, in rank order."""
    return gather_sliced(shards, lambda name, rank: tp_slice(name, rank, len(shards), config))


def copy_hook(group, module, args, kwargs):
    """Forward pre-hook (with kwargs): `copy_to_region` on a module's input (positional or `hidden_states=`)."""
    if args:
        return (_CopyToRegion.apply(args[0], group), *args[1:]), kwargs
    kwargs["hidden_states"] = _CopyToRegion.apply(kwargs["hidden_states"], group)
    return args, kwargs


def _reduce_hook(group, module, args, output):
    return _ReduceFromRegion.apply(output, group)


def sum_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum each accumulated gradient that covers only part of what it should over the ranks holding the same
    tensor (`_dhp_partial`: its slot among the distinct tensors, their count, the TP group): replicated KV heads
    (each rank's k/v gradient covers its own q heads) and LoRA factors held whole by several ranks
    (models/lora.py). Once per step, before the data-parallel sync (`StageWorker.sync_grads`; the sum is linear,
    so summing the accumulation equals summing each micro-batch, with one all-reduce instead of one per
    micro-batch). Not in an autograd hook: the TP rank that sends the embedding gradient back runs a larger
    graph than the others (stages/text_worker.py), so hooks could fire in another order than theirs and
    mismatch the collectives; here every rank walks the same parameters in the same order."""
    for p in params:
        if not hasattr(p, "_dhp_partial"):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(sum_over_holders(p.grad, *p._dhp_partial))


def sum_over_holders(grad: torch.Tensor, slot: int, slots: int, group) -> torch.Tensor:
    """The sum of `grad` over the ranks of `group` holding the same part as this one: each rank writes its part
    into its `slot` of `slots` (one per distinct part) and the whole buffer is all-reduced, so every rank calls
    the same collective whatever it holds (replicated KV heads; LoRA factors held whole, models/lora.py)."""
    buf = grad.new_zeros(slots, *grad.shape)
    buf[slot] = grad
    dist.all_reduce(buf, group=group)
    return buf[slot]


def _vocab_parallel_loss_sum(self: TextModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`TextModel.loss_sum` on vocab-sharded logits: same shift, same labelled positions, summed loss."""
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    keep = shift_labels != IGNORE_INDEX
    logits = self.lm_head(hidden[keep]).float()  # the pre-hook puts the copy in front of lm_head
    vocab_start = self.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, shift_labels[keep], vocab_start, self.tp_group).sum()


def apply_tensor_parallel(model: TextModel, group: dist.ProcessGroup) -> None:
    """Shard `model` (full, identical on every rank of `group`) in place for tensor parallelism over `group`.

    Build the optimizer afterwards (parameters are re-sliced in place). Each parameter gets `_dhp_sharded`
    (the flag `StageWorker.grad_sq_norm` reads): True on sharded ones, and for replicated KV heads only on
    the first rank holding each head, so that summing the flagged squared norms over the group (plus the
    unflagged ones of rank 0) counts every gradient element of the full model exactly once.
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    lm = model.language_model
    c = lm.config
    check_tp_degree(tp, c)
    if any(layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None for layer in lm.layers):
        raise ValueError("row-parallel layers with a bias are not supported")
    kv_first, kv_local = _kv_heads(rank, tp, c)
    kv_replicated = c.num_key_value_heads < tp
    head_norms = family_of(c).text_head_norms  # one weight applied to every head: each rank sees only its heads
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head.weight is the embedding: sliced once
            idx = tp_slice(name, rank, tp, c)
            if idx is not None:
                param.data = param.data[idx].clone()
            kv = kv_replicated and re.search(r"\.(k|v)_proj\.", name) is not None
            param._dhp_sharded = idx is not None and (not kv or rank % (tp // c.num_key_value_heads) == 0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape

    copy = functools.partial(copy_hook, group)
    reduce = functools.partial(_reduce_hook, group)
    for layer in lm.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads = c.num_attention_heads // tp
        attn.num_key_value_heads = kv_local
        attn.num_key_value_groups = attn.num_heads // kv_local
        attn.register_forward_pre_hook(copy, with_kwargs=True)
        mlp.register_forward_pre_hook(copy, with_kwargs=True)
        attn.o_proj.register_forward_hook(reduce)
        mlp.down_proj.register_forward_hook(reduce)
        if kv_replicated:  # each rank's k/v gradient covers only its own q heads: summed over the head's holders
            for p in (*attn.k_proj.parameters(), *attn.v_proj.parameters()):
                p._dhp_partial = (kv_first, c.num_key_value_heads, group)  # once per step: sum_partial_grads
        for norm in head_norms:  # replicated, but its gradient is this rank's heads' share: summed over all ranks
            for p in getattr(attn, norm).parameters():
                p._dhp_partial = (0, 1, group)
    old = lm.embed_tokens
    lm.embed_tokens = VocabParallelEmbedding(old.weight, rank * (c.vocab_size // tp), old.padding_idx, group)
    model.lm_head.register_forward_pre_hook(copy, with_kwargs=True)
    model.tp_group, model.tp_rank, model.tp_size = group, rank, tp
    model.loss_sum = types.MethodType(_vocab_parallel_loss_sum, model)


class TensorParallel(Layout):
    """`tensor` (text): Megatron TP inside each replica (the plan in the module docstring).

    Every rank of a replica gets the same micro-batch and the same vision embeddings, and ends with the
    same loss and the same gradient of those embeddings, so rank 0's cross back. Sharded parameters hold
    a slice (`part`); the others are replicated with bit-identical gradients (no sync inside the replica).
    """

    name = "tensor"
    label = "TP"
    stages = ("text",)

    def check_shape(self, model_config) -> None:
        check_tp_degree(self.degree, model_config)

    @property
    def work_shards(self) -> int:
        return self.degree

    @property
    def width_shards(self) -> int:
        return self.degree

    def part(self, name: str, model_rank: int):
        """Index of model-parallel rank `model_rank`'s part of the full tensor `name`; None if replicated."""
        return tp_slice(name, model_rank, self.degree, self.model_config)

    def slicer(self, rank: int, full_shapes: dict[str, torch.Size]):
        return functools.partial(self.part, model_rank=rank % self.degree)

    def apply(self, model: nn.Module, ranks: PoolRanks) -> None:
        apply_tensor_parallel(model, ranks.model_group)

    def gather(self, local_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return gather_sliced(local_states, self.part)

    def unsynced_replicated(self, model: nn.Module) -> list[nn.Parameter]:
        """Replicated parameters: their gradients are identical on every rank of the replica, so dhp never
        all-reduces them (`dhp bench layouts` counts that all-reduce by convention)."""
        return [p for p in model.parameters() if not p._dhp_sharded]
