"""`vision.compile` / `text.compile` (models/compilation.py): compiled blocks compute what the eager ones do, compile
where they should (the GPU's varlen path without a graph break in a decoder layer), and compile once for every packed
length (no recompilation per micro-batch).

On this CPU the GPU's varlen kernel is stood in for by a torch custom op of the same contract (per-segment SDPA
inside; the real `varlen_attn` is a custom op too), so that dynamo sees an opaque call as it will on a GPU.
`aot_eager` traces forward and backward as inductor would and runs the graphs op by op, in seconds; one slow test
runs inductor itself. Through the pools: tests/test_packing.py's compiled layouts."""

from __future__ import annotations

import copy
import typing

import pytest
import torch
import torch._dynamo

from dhp.models.architectures import architecture_config
from dhp.models.compilation import BACKENDS, BlockCompile, compiled
from dhp.models.packed_attention import PACKED_SDPA, PACKED_TORCH_VARLEN, varlen_kernel
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.stages.config import ConfigError, StageConfig, load_config
from dhp.stages.progress import Progress
from tests.conftest import rel_err
from tests.test_torch_varlen import in_the_kernels_place, reference_varlen_attn

LENGTHS = [[5, 1, 9, 4, 9], [7, 12, 3], [2, 2, 2, 30]]  # a new total and a new longest sample in each micro-batch
GRIDS = [[[1, 16, 20], [1, 8, 8]], [[2, 8, 12]], [[1, 12, 12], [1, 4, 8], [1, 8, 8]]]


@torch.library.custom_op("dhp_test::varlen_attn", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float, causal: bool
) -> torch.Tensor:
    window = (-1, 0) if causal else (-1, -1)
    return reference_varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=window).contiguous()


@_varlen_op.register_fake
def _(q, k, v, cu, longest, scale, causal):
    return torch.empty_like(q)


@torch.library.custom_op("dhp_test::varlen_attn_backward", mutates_args=())
def _varlen_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's backward per segment, written out (autograd is off inside a custom op): P = softmax(q k^T s),
    dv = P^T g, dS = P (g v^T - rowsum(g o)), dq = dS k s, dk = dS^T q s."""
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs, gs = (t[a:b].transpose(0, 1).float() for t in (q, k, v, grad))  # [h, n, d]
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        out = p @ vs
        ds = p * (gs @ vs.transpose(1, 2) - (gs * out).sum(-1, keepdim=True))
        for full, part in zip(grads, (ds @ ks * scale, ds.transpose(1, 2) @ qs * scale, p.transpose(1, 2) @ gs)):
            full[a:b] = part.transpose(0, 1)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


@_varlen_backward_op.register_fake
def _(grad, q, k, v, cu, longest, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    dq, dk, dv = _varlen_backward_op(grad, q, k, v, cu, ctx.longest, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


def _setup(ctx, inputs, output):
    q, k, v, cu, ctx.longest, ctx.scale, ctx.causal = inputs
    ctx.save_for_backward(q, k, v, cu)


_varlen_op.register_autograd(_varlen_backward, setup_context=_setup)


def varlen_op(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """`reference_varlen_attn` behind a custom op: what dynamo sees of torch's `varlen_attn` on a GPU."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _varlen_op(q, k, v, cu_q, max_q, scale, tuple(window_size) == (-1, 0))


@pytest.fixture
def stand_in_op(monkeypatch):
    with in_the_kernels_place(monkeypatch, varlen_op):
        yield


@pytest.fixture
def dynamo():
    """A clean slate of compiled code and counters for each test."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _text_step(model: TextModel, lengths: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    device = model.lm_head.weight.device
    ids = torch.randint(0, 1000, (1, total), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(3, 1, total).to(device)
    model.zero_grad(set_to_none=True)
    loss = model(
        ids, torch.zeros(0, model.lm_head.in_features, device=device), positions, None, ids.clone(), _cu(lengths)
    )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _vision_step(model: VisionModel, grids: list[list[int]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    grid = torch.tensor(grids)
    g = torch.Generator().manual_seed(int(grid.sum()))
    device = next(model.parameters()).device
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=g).to(device)
    model.zero_grad(set_to_none=True)
    out = model(pixels, grid)
    (out * torch.randn(out.shape, generator=g).to(device)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(run, ref) -> None:
    (out, grads), (ref_out, ref_grads) = run, ref
    assert rel_err(out, ref_out) < 1e-6
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 1e-5, name


def _eager_and_compiled(model: torch.nn.Module, backend: str = "aot_eager"):
    eager = copy.deepcopy(model)
    assert BlockCompile(backend).apply(model.blocks()) == len(model.blocks())
    return eager, model


def test_the_setting_is_one_object_with_three_choices():
    assert BACKENDS == ("none", "inductor", "aot_eager")
    assert typing.get_args(typing.get_type_hints(StageConfig)["compile"]) == BACKENDS
    assert load_config("tiny").text.compile == "none" and not BlockCompile.of(load_config("tiny").vision).on
    assert BlockCompile.of(load_config("tiny", ["text.compile=inductor"]).text).backend == "inductor"
    assert load_config("tiny", ["text.compile=inductor", "text.compile=none"]).text.compile == "none"
    with pytest.raises(ConfigError, match="text.compile.*expects one of"):
        load_config("tiny", ["text.compile=yes"])
    with pytest.raises(ValueError, match="compile='yes': choose one of none, inductor, aot_eager"):
        BlockCompile("yes")
    model = TextModel(architecture_config("tiny"), packed=True)
    assert BlockCompile("none").apply(model.blocks()) == 0 and not any(map(compiled, model.blocks()))


def test_names_state_and_hooks_stay_those_of_the_eager_model():
    """Only `forward` changes: the state dict's names, and the heartbeat's hooks sit on each compiled block (outside
    its compiled code) instead of on the modules inside it."""
    model = TextModel(architecture_config("tiny"), packed=True)
    names = list(model.state_dict())
    inner = len(Progress().watch(model.blocks()))
    # a forward a layout replaces (vision TP's row-parallel Linears) is not a compiled one
    mlp = model.blocks()[0].mlp
    mlp.down_proj.forward = mlp.down_proj.forward
    assert not compiled(mlp.down_proj)
    BlockCompile("aot_eager").apply(model.blocks())
    assert list(model.state_dict()) == names and all(map(compiled, model.blocks()))
    assert len(Progress().watch(model.blocks())) == 2 * len(model.blocks()) < inner


def test_decoder_on_the_varlen_path_is_one_graph_for_every_length(stand_in_op, dynamo):
    """The GPU's path: each decoder layer compiles without a graph break, all layers share the graph, and micro-batches
    of new lengths reuse it; loss and every gradient as the eager layers'."""
    torch.manual_seed(0)
    eager, model = _eager_and_compiled(TextModel(architecture_config("tiny"), packed=True).train())
    assert model.language_model.config._attn_implementation == PACKED_TORCH_VARLEN
    for lengths in LENGTHS:
        _assert_same(_text_step(model, lengths), _text_step(eager, lengths))
    assert dict(dynamo["graph_break"]) == {}
    assert dynamo["stats"]["unique_graphs"] == 1


def test_vit_on_the_varlen_path_compiles_once_around_the_host_read(stand_in_op, dynamo):
    """The ViT's blocks on the GPU's path: the longest window or image is read on the host (the one break), the
    rest compiles once for images of every size; output and every gradient as the eager blocks'."""
    torch.manual_seed(0)
    eager, model = _eager_and_compiled(VisionModel(architecture_config("tiny")).train())
    for grids in GRIDS[:1]:
        _assert_same(_vision_step(model, grids), _vision_step(eager, grids))
    graphs = dynamo["stats"]["unique_graphs"]
    for grids in GRIDS[1:]:
        _assert_same(_vision_step(model, grids), _vision_step(eager, grids))
    assert dynamo["stats"]["unique_graphs"] == graphs
    _only_disabled_functions_break(dynamo)


def test_cpu_path_compiles_around_the_per_length_loops(dynamo):
    """Without a varlen kernel (this CPU): the per-sample and per-window SDPA loops run as Python between two graphs
    of each block, which compile once for micro-batches of every length; parity with the eager blocks."""
    torch.manual_seed(0)
    config = architecture_config("tiny")
    text_eager, text = _eager_and_compiled(TextModel(config, packed=True).train())
    vision_eager, vision = _eager_and_compiled(VisionModel(config).train())
    assert text.language_model.config._attn_implementation == PACKED_SDPA
    _assert_same(_text_step(text, LENGTHS[0]), _text_step(text_eager, LENGTHS[0]))
    _assert_same(_vision_step(vision, GRIDS[0]), _vision_step(vision_eager, GRIDS[0]))
    graphs = dynamo["stats"]["unique_graphs"]
    _assert_same(_text_step(text, LENGTHS[1]), _text_step(text_eager, LENGTHS[1]))
    _assert_same(_vision_step(vision, GRIDS[1]), _vision_step(vision_eager, GRIDS[1]))
    assert dynamo["stats"]["unique_graphs"] == graphs
    _only_disabled_functions_break(dynamo)


def _only_disabled_functions_break(counters) -> None:
    """Every graph break is at a function dhp marked `torch.compiler.disable` (its host work), none elsewhere."""
    reasons = list(counters["graph_break"])
    assert reasons and all("torch.compiler.disable" in reason for reason in reasons), reasons


def test_checkpointed_blocks_compile_and_recompute_the_compiled_forward(dynamo):
    """Activation checkpointing stays around the compiled forward: the blocks compile (torch would run a checkpoint
    traced with a side effect inside it eagerly, compiling nothing) and train like the eager blocks, every other one
    checkpointed (`every_n` 2: both kinds of block in one model)."""
    from dhp.models.activation_checkpointing import ActivationCheckpointing

    torch.manual_seed(0)
    config = architecture_config("tiny")
    halves = []
    for model in (TextModel(config, packed=True).train(), VisionModel(config).train()):
        assert 0 < ActivationCheckpointing("every_n", 2).apply(model.blocks()) < len(model.blocks())
        halves.append(_eager_and_compiled(model))
    (text_eager, text), (vision_eager, vision) = halves
    _assert_same(_text_step(text, LENGTHS[0]), _text_step(text_eager, LENGTHS[0]))
    _assert_same(_vision_step(vision, GRIDS[0]), _vision_step(vision_eager, GRIDS[0]))
    assert dynamo["stats"]["unique_graphs"] > 0
    _only_disabled_functions_break(dynamo)


@pytest.mark.slow
def test_inductor_compiles_the_decoder(dynamo):
    """inductor's generated kernels (C++ on this CPU) on packed text steps of two lengths: the eager results within
    the parity tolerances (its fused reductions sum in another order), one compilation for both."""
    torch.manual_seed(0)
    text_eager, text = _eager_and_compiled(TextModel(architecture_config("tiny"), packed=True).train(), "inductor")
    _assert_same(_text_step(text, LENGTHS[0]), _text_step(text_eager, LENGTHS[0]))
    graphs = dynamo["stats"]["unique_graphs"]
    _assert_same(_text_step(text, LENGTHS[1]), _text_step(text_eager, LENGTHS[1]))
    assert dynamo["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_on_a_gpu_with_the_real_kernel(dynamo):
    """On a GPU, through the varlen kernel this machine chooses, under bf16 autocast with fp32 weights (the
    presets' mixed precision): inductor's Triton kernels against the eager blocks (bf16 tolerances); with a varlen
    kernel, the decoder without a graph break; the ViT compiling around its one host read."""
    torch.manual_seed(0)
    config = architecture_config("tiny")

    def on_cuda(step, model, arg):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, grads = step(model, arg)
        return out.float(), {n: g.float() for n, g in grads.items()}

    def close(run, ref) -> None:
        (out, grads), (ref_out, ref_grads) = run, ref
        assert rel_err(out, ref_out) < 2e-2
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) < 5e-2, name

    text_eager, text = _eager_and_compiled(TextModel(config, packed=True).cuda().train(), "inductor")
    for lengths in LENGTHS:
        close(on_cuda(_text_step, text, lengths), on_cuda(_text_step, text_eager, lengths))
    if varlen_kernel().name != "sdpa_segments":
        assert dict(dynamo["graph_break"]) == {}
    vision_eager, vision = _eager_and_compiled(VisionModel(config).cuda().train(), "inductor")
    for grids in GRIDS:
        close(on_cuda(_vision_step, vision, grids), on_cuda(_vision_step, vision_eager, grids))
    _only_disabled_functions_break(dynamo)


@pytest.mark.slow
def test_a_compiled_run_trains_and_evaluates_as_the_eager_one(trainers, tmp_path):
    """`dhp train` end to end, twice on the same synthetic set (images and videos, packed): both pools compiled
    (`aot_eager`), then eager. Every step's loss and the eval loss (a forward without gradients, which the compiled
    blocks compile once more for) agree."""
    from dhp.stages import step_logs
    from dhp.stages.driver import train

    runs = {}
    for backend in ("aot_eager", "none"):
        cfg = load_config(
            "tiny",
            [
                *(f"vision.compile={backend}", f"text.compile={backend}", "data.packing=true"),
                *("training.steps=2", "training.global_batch_size=4", "training.eval_batches=1"),
                *(f"data.synthetic.dir={tmp_path / 'synth'}", "data.synthetic.num=8", "data.synthetic.eval_num=4"),
                *(f"output.dir={tmp_path}", f"output.name={backend}", "output.save_final_checkpoint=false"),
            ],
        )
        summary = train(cfg, trainers=trainers)
        runs[backend] = ([r["loss"] for r in step_logs.read(tmp_path / backend)], summary["eval_loss"])
    (losses, eval_loss), (eager_losses, eager_eval) = runs["aot_eager"], runs["none"]
    assert len(losses) == 2 and eval_loss is not None
    for loss, eager in zip([*losses, eval_loss], [*eager_losses, eager_eval]):
        assert abs(loss - eager) <= 1e-6 * abs(eager), (losses, eval_loss, eager_losses, eager_eval)
