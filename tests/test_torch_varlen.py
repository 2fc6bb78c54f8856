"""torch's varlen flash attention (models/torch_varlen.py) as the packed text attention and the ViT's segment
attention on a GPU without flash-attn.

The kernel runs on CUDA only. On CPU, `reference_varlen_attn` stands in for it: the same call contract as torch
2.11's `varlen_attn` (q/k/v [T, h, hd] with as many key/value heads as query heads, one dtype, int32 cu_seqlens,
`window_size` (-1, 0) causal or (-1, -1) whole segment), computed per segment with SDPA. What dhp adds around the
kernel (layouts, head repetition, the autocast dtype, the fallbacks) is checked through it against dhp's exact
per-segment paths, to fp32 round-off, for the decoder and the ViT with every gradient. On a GPU the real kernel is
checked against the reference in bf16, forward and backward, so the stand-in is held to what it stands for.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from dhp.models import packed_attention, torch_varlen
from dhp.models.architectures import architecture_config
from dhp.models.packed_attention import (
    PACKED_SDPA,
    PACKED_TORCH_VARLEN,
    VarlenKernel,
    packed_sdpa_forward,
    packed_torch_varlen_forward,
    varlen_kernel,
)
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from tests.conftest import rel_err

LENGTHS = [5, 1, 9, 4, 9]  # two samples of one length, not adjacent; a one-token sample


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's `varlen_attn` contract, per segment through SDPA (fp32 inside, the inputs' dtype out)."""
    assert q.shape[1] == k.shape[1] == v.shape[1], "torch 2.11's varlen_attn takes no grouped key/value heads"
    assert q.dtype == k.dtype == v.dtype and cu_q.dtype == torch.int32 and cu_q is cu_k
    assert tuple(window_size) in ((-1, 0), (-1, -1))
    bounds = cu_q.tolist()
    assert (
        bounds[0] == 0 and bounds[-1] == q.shape[0] and max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    )
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=window_size == (-1, 0), scale=scale)
        outs.append(out.transpose(0, 1).to(q.dtype))
    return torch.cat(outs)


@contextlib.contextmanager
def in_the_kernels_place(monkeypatch, kernel):
    """`kernel` in place of torch's varlen kernel, and every call counted usable (on CPU it never is); the
    process's kernel choice is made again inside and after."""
    monkeypatch.setattr(torch_varlen, "kernel", lambda: kernel)
    monkeypatch.setattr(torch_varlen, "usable", lambda q: True)
    varlen_kernel.cache_clear()
    try:
        yield
    finally:
        varlen_kernel.cache_clear()


@pytest.fixture
def stand_in(monkeypatch):
    """The reference in the kernel's place."""
    with in_the_kernels_place(monkeypatch, reference_varlen_attn):
        yield


def _cu(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def _qkv(kv_heads: int = 2, heads: int = 4, dim: int = 16) -> tuple[torch.Tensor, ...]:
    """q [1, heads, T, dim], k/v [1, kv_heads, T, dim] over `LENGTHS`, fp32 leaves, the same draws every call."""
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    return tuple(torch.randn(1, h, total, dim, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads))


MODULE = type("M", (), {"num_key_value_groups": 2, "is_causal": True})()


def test_this_machine_has_no_kernel_and_every_call_falls_back():
    assert torch_varlen.kernel() is None and varlen_kernel().name == "sdpa_segments"
    q, k, v = _qkv()
    assert not torch_varlen.usable(q[0])
    cu = _cu(LENGTHS)
    ours = packed_torch_varlen_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))[0]
    assert torch.equal(ours, packed_sdpa_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu)[0])
    with pytest.raises(RuntimeError, match="CUDA GPU of compute capability 8.0"):
        torch_varlen.attend(q[0], k[0], v[0], cu, max(LENGTHS), causal=True)


def test_usable_asks_for_a_half_compute_dtype_and_a_flash_head_size():
    on_cpu = torch.zeros(3, 2, 64)
    assert not torch_varlen.usable(on_cpu)
    assert torch_varlen.compute_dtype(on_cpu) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_varlen.compute_dtype(on_cpu) == torch.bfloat16


def test_kernel_choice_between_flash_attn_torch_and_segments(monkeypatch, stand_in):
    assert varlen_kernel() == VarlenKernel("torch_varlen", PACKED_TORCH_VARLEN)
    config = architecture_config("tiny").text_config
    assert varlen_kernel().text_config(config)._attn_implementation == PACKED_TORCH_VARLEN
    kwargs = varlen_kernel().model_kwargs(torch.tensor([0, 3, 8, 9]), torch.device("cpu"))
    assert kwargs["max_length_q"] == 5 and kwargs["cu_seq_lens_q"].dtype == torch.int32  # the kernel's arguments
    monkeypatch.setattr(packed_attention.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    varlen_kernel.cache_clear()
    assert varlen_kernel().name == "flash_attn"  # flash-attn first where it is installed
    monkeypatch.setattr(torch_varlen, "kernel", lambda: None)
    monkeypatch.setattr(packed_attention.importlib.util, "find_spec", lambda name: None)
    varlen_kernel.cache_clear()
    assert varlen_kernel() == VarlenKernel("sdpa_segments", PACKED_SDPA)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_decoder_attention_through_the_kernel_equals_segments(stand_in, kv_heads):
    """Layouts in and out, grouped key/value heads repeated as transformers' repeat_kv does, scale, causality:
    forward and the gradients of q, k and v equal the per-sample SDPA path."""
    module = type("M", (), {"num_key_value_groups": 4 // kv_heads, "is_causal": True})()
    cu = _cu(LENGTHS)
    runs = []
    for forward in (packed_torch_varlen_forward, packed_sdpa_forward):
        q, k, v = _qkv(kv_heads=kv_heads)
        out = forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))[0]
        assert out.shape == (1, sum(LENGTHS), 4, 16)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        runs.append([out, q.grad, k.grad, v.grad])
    for ours, theirs in zip(*runs):
        assert rel_err(ours, theirs) < 1e-6


def test_packed_decoder_attention_refuses_what_the_kernel_cannot_do(stand_in):
    q, k, v = _qkv()
    cu = _cu(LENGTHS)
    with pytest.raises(ValueError, match="no dropout"):
        packed_torch_varlen_forward(MODULE, q, k, v, None, 0.1, cu_seq_lens_q=cu, max_length_q=9)
    with pytest.raises(ValueError, match="no attention mask"):
        packed_torch_varlen_forward(MODULE, q, k, v, torch.ones(1, 1, 28, 28), cu_seq_lens_q=cu, max_length_q=9)
    with pytest.raises(ValueError, match="do not share 3 key/value heads"):
        torch_varlen.attend(q[0].transpose(0, 1), *(torch.zeros(28, 3, 16),) * 2, cu, 9, causal=True)


def test_kernel_gets_the_autocast_dtype(stand_in):
    """Under bf16 autocast q/k leave the rotary embedding in fp32 while v is bf16: the kernel gets all three in
    bf16 and returns bf16, as SDPA does under autocast."""
    seen = []

    def kernel(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen_attn(q, k, v, *args, **kwargs)

    q, k, v = (t[0].transpose(0, 1) for t in _qkv(kv_heads=4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch_varlen.attend(q, k, v.bfloat16(), _cu(LENGTHS), 9, causal=False, varlen_attn=kernel)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16


def _text_step(model, cu):
    torch.manual_seed(3)
    total = int(cu[-1])
    ids = torch.randint(0, 1000, (1, total))
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).expand(3, 1, total)
    labels = ids.clone()
    model.zero_grad(set_to_none=True)
    loss = model(ids, torch.zeros(0, model.lm_head.in_features), positions, None, labels, cu)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_text_model_through_the_kernel_equals_segments(stand_in):
    """dhp's decoder on a packed sequence: the loss and every gradient are those of the per-sample SDPA path."""
    config = architecture_config("tiny")
    torch.manual_seed(0)
    through_kernel = TextModel(config, packed=True).train()
    assert through_kernel.language_model.config._attn_implementation == PACKED_TORCH_VARLEN
    segments = copy.deepcopy(through_kernel)
    segments.language_model.config._attn_implementation = PACKED_SDPA
    cu = _cu(LENGTHS)
    loss, grads = _text_step(through_kernel, cu)
    ref_loss, ref_grads = _text_step(segments, cu)
    assert abs(float(loss - ref_loss)) < 1e-6
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) < 1e-5, name


def test_vision_segments_through_the_kernel_equal_grouped_sdpa(stand_in, monkeypatch):
    """The ViT's windows and whole images in one kernel call per block: output and every gradient as the
    one-call-per-length path, and the kernel called once per block."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return reference_varlen_attn(*args, **kwargs)

    grid = torch.tensor([[1, 16, 20], [1, 8, 8], [2, 8, 12]])
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g)
    model = VisionModel(architecture_config("tiny")).train()
    weights = torch.randn(int(grid.prod(-1).sum()) // 4, model.visual.config.out_hidden_size, generator=g)
    runs = []
    for through_kernel in (True, False):
        monkeypatch.setattr(torch_varlen, "kernel", (lambda: counting) if through_kernel else (lambda: None))
        model.zero_grad(set_to_none=True)
        out = model.visual(pixels, grid_thw=grid).pooler_output
        (out * weights).sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(calls) == len(model.visual.blocks) and set(calls) == {int(grid.prod(-1).sum())}
    (out, grads), (ref_out, ref_grads) = runs
    assert rel_err(out, ref_out) < 1e-5
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) < 1e-5, name


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_a_gpu_equals_the_reference(causal, kv_heads, dim):
    """The real kernel in bf16 (the ViT's head size 80, the decoders' 64 and 128, grouped key/value heads) against
    the stand-in the CPU tests use: output and the gradients of q, k and v."""
    assert torch_varlen.kernel() is not None, "a GPU of compute capability 8.0 or newer runs torch's varlen_attn"
    lengths = [300, 0, 1, 517, 64, 300]  # an empty segment, as a padded window row gives
    cu = _cu(lengths, "cuda")
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g).cuda().bfloat16() for h in (8, kv_heads, kv_heads))
    runs = []
    for kernel in (None, reference_varlen_attn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch_varlen.attend(*leaves, cu, max(lengths), causal=causal, scale=dim**-0.5, varlen_attn=kernel)
        out.float().square().sum().backward()
        runs.append([out.float(), *(t.grad.float() for t in leaves)])
    for ours, ref in zip(*runs):
        assert rel_err(ours, ref) < 2e-2
