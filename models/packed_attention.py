"""The text stage's attention on a packed micro-batch: causal inside each sample, never across samples.

A packed micro-batch is one sequence [1, T] of several samples back to back, with `cu_seqlens` [n + 1] (the first
row of each sample, then T). `varlen_kernel()` is the one place that decides how the decoder attends on it; the
text model asks it, nothing else chooses:

- `flash_attn`: flash-attn's varlen kernel, when the package is installed and CUDA is there. transformers'
  `flash_attention_2` already takes `cu_seq_lens_q/k` and `max_length_q/k` (`_flash_attention_forward`) and calls
  `flash_attn_varlen_func` with them, so dhp only hands those over.
- `torch_varlen`: where flash-attn is missing but CUDA is there, torch's own varlen flash attention
  (`models/torch_varlen.py`, public in torch 2.11 and 2.13): one call per layer over every sample, like
  flash-attn's. A call it cannot take (fp32 compute, an odd head size) goes to `sdpa_segments`.
- `sdpa_segments`: otherwise. transformers' `sdpa_attention_forward` with `is_causal` on each sample's rows, the
  samples of one length stacked along the batch (`window_attention.segment_groups`, as the vision encoder does for
  its windows), so a micro-batch costs one SDPA call per distinct sample length and sum(n_i^2), not T^2.

Why `sdpa_segments` is written here rather than taken from transformers' own packed path (position ids that restart
per sample, no attention mask: `masking_utils.find_packed_sequence_indices` then builds a block-diagonal mask):
that mask is a dense [T, T] boolean, and SDPA with it computes every one of the T^2 scores. On torch 2.13's CPU a
forward and backward of 8 samples, 4 096 tokens, 8 heads of 64 took 5.5 to 6.8 times as long with the mask as per
sample (`python -m dhp.models.packed_attention`), the same result to 8e-7. FlexAttention's block mask would skip
the empty blocks, but on the CPU torch 2.13 has no FlexAttention backward ("FlexAttention does not support
backward on CPU"), and on a GPU it needs `torch.compile` for each new packed length; torch's varlen API is
the GPU's exact path without either.

Both of dhp's attention functions are registered with transformers (`PACKED_SDPA`, `PACKED_TORCH_VARLEN`), their
mask function SDPA's, so an unpacked call (no `cu_seq_lens_q`: a ZeRO-3 padding micro-batch, say) is exactly `sdpa`.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from dhp.models import torch_varlen
from dhp.models.window_attention import segment_groups

# the attention implementation names transformers knows the two functions below by
PACKED_SDPA = "dhp_packed_sdpa"
PACKED_TORCH_VARLEN = "dhp_packed_torch_varlen"


def _check_packed(query: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """What both packed attention functions take: one row, no mask."""
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("a packed sequence is one row with no attention mask: its samples are its cu_seqlens")


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each segment of `cu_seq_lens_q`: q [1, h, T, hd], k/v [1, kv, T, hd] ->
    [1, T, h, hd] (what `sdpa_attention_forward` returns). Without `cu_seq_lens_q`, `sdpa_attention_forward`."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    _check_packed(query, attention_mask)
    return _attend_per_sample(module, query, key, value, dropout, scaling, cu_seq_lens_q), None


@torch.compiler.disable  # one call per sample length, chosen on the host: run as Python inside a compiled block
def _attend_per_sample(module, query, key, value, dropout, scaling, cu_seq_lens_q: torch.Tensor) -> torch.Tensor:
    heads, total, dim = query.shape[1:]
    plan = segment_groups(cu_seq_lens_q)
    if plan.total != total:
        raise ValueError(f"cu_seqlens covers {plan.total} tokens but the sequence has {total}")
    groups, inverse = plan.on(query.device)
    outs = []
    for length, count, rows in groups:
        # [1, heads, n * L, hd] -> [n, heads, L, hd]: the n samples of length L as a batch
        a, b, c = (t[0][:, rows].unflatten(1, (count, length)).transpose(0, 1) for t in (query, key, value))
        out, _ = sdpa_attention_forward(module, a, b, c, None, dropout, scaling, is_causal=True)
        outs.append(out.reshape(count * length, heads, dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out if inverse is None else out[inverse]).unsqueeze(0)


def packed_torch_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`packed_sdpa_forward`'s contract through torch's varlen flash attention: q [1, h, T, hd], k/v
    [1, kv, T, hd] -> [1, T, h, hd] in the compute dtype; `cu_seq_lens_q` int32 on q's device, `max_length_q` its
    longest sample. A call `torch_varlen.usable` refuses, or one with no `max_length_q`, is `packed_sdpa_forward`."""
    if cu_seq_lens_q is None or max_length_q is None or not torch_varlen.usable(query):
        return packed_sdpa_forward(
            module, query, key, value, attention_mask, dropout, scaling, cu_seq_lens_q=cu_seq_lens_q, **kwargs
        )
    _check_packed(query, attention_mask)
    if dropout:
        raise ValueError(f"torch's varlen attention has no dropout, but the decoder asks for {dropout}")
    # [1, heads, T, hd] -> [T, heads, hd]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return torch_varlen.attend(q, k, v, cu_seq_lens_q, max_length_q, causal=True, scale=scaling).unsqueeze(0), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
AttentionInterface.register(PACKED_TORCH_VARLEN, packed_torch_varlen_forward)
AttentionMaskInterface.register(PACKED_TORCH_VARLEN, sdpa_mask)


@dataclass(frozen=True)
class VarlenKernel:
    """How the decoder attends within each sample of a packed sequence (module docstring)."""

    name: str  # flash_attn | torch_varlen | sdpa_segments
    attn_implementation: str  # transformers' attention function the decoder layers call

    def text_config(self, text_config: Any) -> Any:
        """A copy of `text_config` whose layers attend with this kernel (the original is left as it was)."""
        config = copy.copy(text_config)
        config._attn_implementation = self.attn_implementation
        return config

    def model_kwargs(self, cu_seqlens: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """What the decoder's forward passes on to every attention call (transformers' `FlashAttentionKwargs`)."""
        if self.name == "sdpa_segments":  # the segments are read on the host, once per micro-batch (cached)
            return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.cache
def varlen_kernel() -> VarlenKernel:
    """The kernel of this process: flash-attn's varlen where flash-attn and CUDA are, else torch's varlen where a
    GPU it runs on is, else per-sample SDPA."""
    if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
        return VarlenKernel("flash_attn", "flash_attention_2")
    if torch_varlen.kernel() is not None:
        return VarlenKernel("torch_varlen", PACKED_TORCH_VARLEN)
    return VarlenKernel("sdpa_segments", PACKED_SDPA)


def _measure(lengths: list[int], heads: int = 8, dim: int = 64, repeats: int = 3) -> dict[str, float]:
    """Seconds of one forward + backward of causal attention over samples of `lengths` packed into one sequence:
    SDPA with the dense block-diagonal mask transformers' packed path builds, and per sample (this module); and
    the largest difference of their outputs."""
    import time
    import types

    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, dim, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (sample[:, None] == sample[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    runs = {
        "dense_mask_s": lambda: sdpa_attention_forward(module, q, k, v, mask[None, None])[0],
        "per_sample_s": lambda: packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu)[0],
    }
    out = {"max_difference": float((runs["dense_mask_s"]() - runs["per_sample_s"]()).detach().abs().max())}
    for name, run in runs.items():
        start = time.perf_counter()
        for _ in range(repeats):
            run().sum().backward()
        out[name] = round((time.perf_counter() - start) / repeats, 3)
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(_measure([300, 700, 250, 900, 500, 400, 600, 446]))
