"""torch's own variable-length flash attention, for packed sequences on a GPU without flash-attn installed.

`torch.nn.attention.varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=, window_size=)` is public in
torch 2.11 (the GPU machine's image) and 2.13 (this project's CPU pin): one flash-attention call over all the
segments of a packed sequence, q/k/v [T, h, hd], `cu` int32 on the GPU. It runs on CUDA only, in bf16 or fp16.
So where flash-attn is missing, dhp's packed text attention and its ViT's segment attention make one call per
layer with it instead of one SDPA call per distinct segment length.

What differs between the two torch releases, and how `attend` stays within both:
- 2.13 takes `enable_gqa`; 2.11 does not. Key/value heads are repeated to the query heads here (what
  transformers' `repeat_kv` does: key/value head j serves query heads j*g .. j*g + g - 1), in both.
- Causality is `window_size=(-1, 0)` in both; `(-1, -1)` attends to the whole segment.

The op is not in autocast's lists: under bf16 autocast the rotary embedding leaves q/k in fp32 while v is bf16,
so all three are cast to the autocast dtype here, as autocast casts them for SDPA.

`usable(q)` says whether a call can take this path; where it cannot (CPU, fp32 compute, an odd head size), the
callers keep their exact per-segment SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HALF = (torch.bfloat16, torch.float16)


# `kernel()`'s answer once looked up: a list, not functools.cache, because compiled blocks (models/compilation.py)
# trace the call, and dynamo traces through a cache wrapper, warning that it ignores it
_FOUND: list[Callable | None] = []


def kernel() -> Callable | None:
    """torch's `varlen_attn` where this torch has it and a GPU of compute capability 8.0 or newer is visible
    (flash attention's floor), else None."""
    if not _FOUND:
        _FOUND.append(_look_up())
    return _FOUND[0]


def _look_up() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None
    return varlen_attn


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the attention runs in: autocast's where autocast is on for q's device, else q's own."""
    device = q.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype


def usable(q: torch.Tensor) -> bool:
    """Whether `attend` can take q [T, h, hd]: on CUDA, computing in bf16/fp16, hd a multiple of 8 up to 256."""
    head_dim = q.shape[-1]
    return q.is_cuda and compute_dtype(q) in HALF and head_dim % 8 == 0 and head_dim <= 256


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float | None = None,
    varlen_attn: Callable | None = None,
) -> torch.Tensor:
    """Attention inside each segment [cu[j], cu[j+1]) of a packed sequence: q [T, h, hd], k/v [T, kv, hd]
    (h a multiple of kv) -> [T, h, hd] in the compute dtype. `cu_seqlens` [n + 1] int32 on q's device, from 0 to
    T; `max_seqlen` its longest segment. `varlen_attn` defaults to `kernel()`."""
    run = varlen_attn or kernel()
    if run is None:
        raise RuntimeError("torch's varlen_attn needs a CUDA GPU of compute capability 8.0 or newer")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    if kv_heads != heads:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    dtype = compute_dtype(q)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    window = (-1, 0) if causal else (-1, -1)
    return run(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=window)
