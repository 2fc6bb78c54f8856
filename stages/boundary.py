"""The boundary between the vision pool and the text pool: layouts, the forward transform, its adjoint.

Vision output layout (per data-parallel replica): `k` shards, one per vision rank of the replica (k = the
sequence-parallel degree; 1 without SP, and 1 under vision tensor parallelism, where every TP rank ends
with the same full merged sequence: rank 0's crosses, and its gradient is sent back to every TP rank,
since the row-parallel merger's adjoint needs the full output gradient on each). Shard j is a tensor
[n_j, D] of merged vision tokens (D = text hidden size) in the dtype the merger computed it in (fp32; bf16
under autocast or pure bf16: the text stage casts it to its embeddings' dtype, and its gradient comes back
in the same dtype, the rounding the vision stage would apply anyway); concatenated in rank order they are
the replica's merged tokens in *window order*.

Text input layout: the full merged sequence [N, D], N = sum_j n_j = number of `<|image_pad|>` tokens of
the micro-batch, in *raster order* (image after image, row-major inside an image), replicated on every
tensor-parallel rank of the replica (M:N: each of the M text ranks receives all k shards).

Forward (`assemble`, on each text rank): full[merged_index] = cat(shards), where `merged_index[i]` is the
raster position of the i-th window-ordered token (None = identity: no SP, shards already raster order).

Backward (the exact adjoint, on text rank 0 of the replica only): d_cat = d_full[merged_index], split
back into the k shard gradients, shard j going to the vision rank that produced shard j. The TP ranks
hold identical d_full (the text layout replicates its input), so one rank's is taken — not a sum.

Preconditions: shards arrive in vision-rank order; `merged_index` is a permutation of range(N) computed
by the loader from the same plan that cut the pixels; D matches the text hidden size.
"""

from __future__ import annotations

import torch


def assemble(shards: list[torch.Tensor], merged_index: torch.Tensor | None) -> torch.Tensor:
    """Differentiable: k window-ordered shards [n_j, D] -> [N, D] in raster order."""
    flat = torch.cat(shards) if len(shards) > 1 else shards[0]
    if merged_index is None:
        return flat
    return flat.new_empty(flat.shape).index_copy(0, merged_index.to(flat.device), flat)


def shard_gradients(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of each received shard (zeros where the loss did not reach it), for the vision ranks."""
    return [s.grad.cpu() if s.grad is not None else torch.zeros_like(s, device="cpu") for s in shards]
