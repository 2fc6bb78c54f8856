"""Window-aware Ulysses SP of the vision encoder == the unsharded VisionModel (output and every gradient).

Distributed cases run on gloo groups of 2 and 4 spawned ranks; the reference (same weights, fp32) runs
in the test process. Each rank gets its own pixel rows only (the others are NaN in the tensor it slices),
some ranks hold no patch at all, and every rank must make the same collectives. The same ranks then check
Qwen3-VL's encoder (no windows: the all-to-all in every block; learned position embeddings; the DeepStack
mergers' rows beside the merged ones).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.vision_utils import get_vision_window_index

from dhp.models.architectures import architecture_config
from dhp.models.family import family_of
from dhp.models.parallel import sequence_parallel as sp_mod
from dhp.models.parallel.sequence_parallel import gather_merged, sp_vision_forward
from dhp.models.parallel.shard_plan import check_sp_degree, plan_shards
from dhp.models.qwen2_5_vl import VisionModel
from tests.conftest import free_port, perturbed_reference, rel_err

MAIN = [[1, 16, 20], [1, 8, 8], [1, 4, 6]]  # the last image is one window: smaller than sp x window
CASES = {
    "main": MAIN,
    "one_small_image": [[1, 4, 6]],  # one window: every rank but one is empty
    "two_small_images": [[1, 4, 6], [1, 4, 4]],  # sp=4: ranks 0 and 2 are empty
    "video_frames": [[2, 8, 12]],  # two frames: full attention is per frame
}
EMPTY_RANKS = {("one_small_image", 2), ("one_small_image", 4), ("two_small_images", 4)}  # (case, world)
# Qwen3-VL: no windows, so cuts fall at any merge unit; an image of one merge unit leaves sp - 1 ranks empty
QWEN3_CASES = {"main": MAIN, "one_unit": [[1, 2, 2]], "video_frames": [[2, 8, 12]]}
QWEN3_EMPTY_RANKS = {("one_unit", 2), ("one_unit", 4)}
MODELS = {"tiny": (CASES, EMPTY_RANKS), "qwen3_vl_tiny": (QWEN3_CASES, QWEN3_EMPTY_RANKS)}
OUT_TOL, GRAD_TOL = 1e-6, 1e-5  # fp32; both measured below 1e-6 here


def reference_case(model: VisionModel, grid: list[list[int]], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grid)
    vc = model.visual.config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2  # 1176 for 14 px patches
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), width, generator=g)
    model.zero_grad(set_to_none=True)
    out = model(pixels, grid_thw)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(grid=grid_thw, pixels=pixels, weights=weights, out=out.detach(), grads=grads)


def _worker(rank: int, world: int, port: int, models: dict, done_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        for model_name, (state, cases) in models.items():
            _check_cases(rank, world, model_name, state, cases)
            (Path(done_dir) / f"rank{rank}.{model_name}.ok").write_text(",".join(cases))  # all checked on this rank
    finally:
        dist.destroy_process_group()


def _check_cases(rank: int, world: int, model_name: str, state: dict, cases: dict) -> None:
    config = architecture_config(model_name)
    family = family_of(config)
    empty_ranks = MODELS[model_name][1]
    model = family.vision_model(config).float().train()
    model.load_state_dict(state)
    group = dist.group.WORLD
    calls = []
    real_a2a = sp_mod.all_to_all_single_autograd

    def counting_a2a(tensor, out_sizes, in_sizes, grp):
        calls.append((tuple(out_sizes), tuple(in_sizes)))
        return real_a2a(tensor, out_sizes, in_sizes, grp)

    sp_mod.all_to_all_single_autograd = counting_a2a
    try:
        for name, case in cases.items():
            calls.clear()
            plan = plan_shards(case["grid"], world, config)
            if (name, world) in empty_ranks:
                assert 0 in plan.lengths, (name, plan.lengths)
            poisoned = torch.full_like(case["pixels"], float("nan"))  # other ranks' rows must never be read
            poisoned[plan.patch_index[rank]] = case["pixels"][plan.patch_index[rank]]
            shard = plan.shard(poisoned, rank)
            model.zero_grad(set_to_none=True)
            merged = sp_vision_forward(model.visual, shard, case["grid"], plan, rank, group)
            start = sum(plan.lengths[:rank]) // 4  # the shard is its slice of the window-ordered output
            expected = case["out"][plan.window_index][start : start + plan.lengths[rank] // 4]
            assert rel_err(merged, expected) <= OUT_TOL, (name, rank, rel_err(merged, expected))
            out = gather_merged(merged, plan, rank, group)
            assert rel_err(out, case["out"]) <= OUT_TOL, (name, rank, rel_err(out, case["out"]))
            (out * case["weights"]).sum().backward()

            # docs/design.md, invariant 2: the same all-to-alls on every rank, empty or not (2 per full-attention block)
            everyone = [None] * world
            dist.all_gather_object(everyone, len(calls), group=group)
            assert everyone == [2 * len(family.full_attention_blocks(config.vision_config))] * world, (name, everyone)
            for pname, p in model.named_parameters():
                assert p.grad is not None, (name, rank, pname)  # an empty rank still has (zero) grads to reduce
                total = p.grad.clone()
                dist.all_reduce(total, group=group)
                err = rel_err(total, case["grads"][pname])
                assert err <= GRAD_TOL, (name, rank, pname, err)
    finally:
        sp_mod.all_to_all_single_autograd = real_a2a


@pytest.fixture(scope="module")
def reference():
    config = architecture_config("tiny")
    model = perturbed_reference(VisionModel, config)
    cases = {name: reference_case(model, grid, seed) for seed, (name, grid) in enumerate(CASES.items())}
    return config, model, cases


@pytest.fixture(scope="module")
def qwen3_reference():
    config = architecture_config("qwen3_vl_tiny")
    model = perturbed_reference(family_of(config).vision_model, config)
    cases = {name: reference_case(model, grid, seed) for seed, (name, grid) in enumerate(QWEN3_CASES.items())}
    return config, model, cases


@pytest.mark.parametrize("world", [2, 4])
def test_sp_forward_backward_match_unsharded(reference, qwen3_reference, world, tmp_path):
    models = {
        name: ({k: v.detach().clone() for k, v in model.state_dict().items()}, cases)
        for name, (_, model, cases) in (("tiny", reference), ("qwen3_vl_tiny", qwen3_reference))
    }
    # The ranks assert; a failing rank makes start_processes raise. Each rank also reports completion.
    mp.start_processes(_worker, args=(world, free_port(), models, str(tmp_path)), nprocs=world, start_method="spawn")
    for rank in range(world):
        for name, (_, cases) in models.items():
            assert (tmp_path / f"rank{rank}.{name}.ok").read_text() == ",".join(cases)


def test_sp1_is_the_plain_forward(reference):
    config, model, cases = reference
    case = cases["main"]
    plan = plan_shards(case["grid"], 1, config)
    model.zero_grad(set_to_none=True)
    out = gather_merged(
        sp_vision_forward(model.visual, case["pixels"][plan.patch_index[0]], case["grid"], plan, 0, None), plan, 0, None
    )
    assert rel_err(out, case["out"]) <= 1e-6
    (out * case["weights"]).sum().backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad, case["grads"][name]) <= 1e-6, name


@pytest.mark.parametrize("grid", list(CASES.values()) + [[[1, 32, 32], [1, 6, 10]], [[1, 12, 4], [3, 8, 8]]])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_plan_cuts_at_window_boundaries_and_balances(grid, sp):
    config = architecture_config("tiny")
    vc = config.vision_config
    grid_thw = torch.tensor(grid)
    plan = plan_shards(grid_thw, sp, config)
    window_index, cu_windows = get_vision_window_index(grid_thw, vc.spatial_merge_size, vc.window_size, vc.patch_size)
    order = (window_index[:, None] * 4 + torch.arange(4)).reshape(-1)
    num_patches = int(grid_thw.prod(-1).sum())
    edges = cu_windows.tolist()
    biggest = max(b - a for a, b in zip(edges[:-1], edges[1:]))

    # every patch owned exactly once, rank order == transformers' window order
    owned = torch.cat(plan.patch_index)
    assert torch.equal(owned, order)
    assert torch.equal(owned.sort().values, torch.arange(num_patches))
    assert list(plan.lengths) == [len(i) for i in plan.patch_index] and sum(plan.lengths) == num_patches
    # cuts only at window boundaries; the local windows are exactly the global windows of the range
    assert set(plan.bounds) <= set(edges)
    for r in range(sp):
        a, b = plan.bounds[r], plan.bounds[r + 1]
        inside = [e - a for e in edges if a <= e <= b]
        assert plan.cu_window_seqlens[r].tolist() == (inside if b > a else [0])
        assert abs(plan.lengths[r] - num_patches / sp) <= biggest  # balanced within one window
    # per-image per-rank lengths add up both ways
    assert plan.image_lengths.sum(0).tolist() == list(plan.lengths)
    assert plan.image_lengths.sum(1).tolist() == grid_thw.prod(-1).tolist()
    assert torch.equal(plan.cu_seqlens.long().diff(), grid_thw[:, 1:].prod(-1).repeat_interleave(grid_thw[:, 0]))


def test_plan_leaves_ranks_without_a_small_image():
    plan = plan_shards(torch.tensor(MAIN), 4, architecture_config("tiny"))
    assert (plan.image_lengths[2] > 0).sum() == 1  # one window, one rank
    assert (plan.image_lengths[0] == 0).sum() >= 1
    assert min(plan_shards(torch.tensor([[1, 4, 6]]), 2, architecture_config("tiny")).lengths) == 0


def test_sp_must_divide_heads():
    config = architecture_config("tiny")  # 4 vision heads
    with pytest.raises(ValueError, match="1, 2, 4"):
        plan_shards(torch.tensor(MAIN), 3, config)
    with pytest.raises(ValueError, match="1, 2, 3, 6, 9, 18"):
        check_sp_degree(18, 4)
    plan = dataclasses.replace(plan_shards(torch.tensor(MAIN), 2, config), sp=3)
    model = VisionModel(config)
    with pytest.raises(ValueError, match="1, 2, 4"):
        sp_vision_forward(model.visual, torch.zeros(plan.lengths[0], 1176), torch.tensor(MAIN), plan, 0, None)
