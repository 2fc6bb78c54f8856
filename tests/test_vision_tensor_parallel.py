"""Tensor-parallel vision encoder == the unsharded VisionModel: output, every gradient (gathered to full), the
parameters after three AdamW steps and the global grad norm, on gloo groups of 2 and 4 ranks, with eager and
sdpa attention; plus the collectives the module docstring promises and a mutant the checks must catch.
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

from dhp.models.architectures import architecture_config
from dhp.models.parallel.vision_tensor_parallel import (
    apply_vision_tensor_parallel,
    check_vision_tp_degree,
    gather_full_vision_state_dict,
    read_part,
    shard_vision_state_dict_for_rank,
    vision_tp_slice,
)
from dhp.models.qwen2_5_vl import VisionModel
from tests.conftest import free_port, perturbed_reference, rel_err

STEPS = 3
GRID = [[1, 8, 12], [1, 4, 4]]  # two images of different sizes; the first spans two attention windows
ATTN = ("eager", "sdpa")


def make_batch(config):
    v = config.vision_config
    g = torch.Generator().manual_seed(3)
    patches = sum(t * h * w for t, h, w in GRID)
    pixels = torch.randn(patches, v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
    # Scaled so gradients are ~1e-2..1e-4: Adam's step is lr * g / (|g| + eps), so an fp32 summation-order
    # difference dg on an element with |g| ~ eps moves it by ~lr * dg / eps. At unit scale (patch_embed
    # gradients ~0.4, dg ~3e-8) one element with g = -7.0e-7 vs -7.3e-7 ended 1.0e-5 apart after 3 steps
    # at tp 2 (4.9e-5 at tp 4); here dg is ~100x smaller.
    weights = torch.randn(patches // v.spatial_merge_size**2, v.out_hidden_size, generator=g) * 1e-2
    return pixels, torch.tensor(GRID), weights


def forward_backward(model, batch):
    pixels, grid, weights = batch
    out = model(pixels, grid)
    (out * weights).sum().backward()
    return out.detach()


@contextmanager
def record_all_reduces(log: list):
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        log.append((tuple(tensor.shape), tensor.dtype))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = real


def run_case(group, attn: str) -> dict:
    rank = dist.get_rank(group)
    config = architecture_config("tiny", attn)
    ref = perturbed_reference(VisionModel, config)
    tp = copy.deepcopy(ref)
    apply_vision_tensor_parallel(tp, group)
    batch = make_batch(config)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-3, eps=1e-6)
    res = {}
    for step in range(STEPS):
        out_ref = forward_backward(ref, batch)
        if step == 0:
            fwd, bwd = [], []
            pixels, grid, weights = batch
            with record_all_reduces(fwd):
                out_tp = tp(pixels, grid)
            with record_all_reduces(bwd):
                (out_tp * weights).sum().backward()
            res["collectives"] = (fwd, bwd)
            res["output"] = rel_err(out_tp.detach(), out_ref)
            res["local_grads"] = {n: p.grad.clone() for n, p in tp.named_parameters()}
            res["ref_grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
            res["sharded"] = {n: p._dhp_sharded for n, p in tp.named_parameters()}
            # the global grad norm as StageWorker.grad_sq_norm assembles it from `_dhp_sharded`
            sq = sum(p.grad.double().pow(2).sum() for p in tp.parameters() if p._dhp_sharded or rank == 0)
            dist.all_reduce(sq, group=group)
            res["grad_sq_norm"] = (float(sq), float(sum(p.grad.double().pow(2).sum() for p in ref.parameters())))
        else:
            forward_backward(tp, batch)
        for opt in (opt_ref, opt_tp):
            opt.step()
            opt.zero_grad()
    res["local_params"] = {n: p.detach().clone() for n, p in tp.named_parameters()}
    res["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # Mutant: without the copy in front of attn the forward is unchanged, but the residual stream below each
    # block gets only this rank's heads' share of the attention gradient.
    for block in tp.visual.blocks:
        block.attn._forward_pre_hooks.clear()
    forward_backward(ref, batch)
    forward_backward(tp, batch)
    res["mutant"] = {
        name: rel_err(tp.get_parameter(name).grad, ref.get_parameter(name).grad)
        for name in ("visual.patch_embed.proj.weight", "visual.blocks.0.norm1.weight")
    }
    return res


def _worker(rank: int, port: int, out: str) -> None:
    """Four ranks, one spawn (process start-up is most of the cost): tp 4 on all, tp 2 on {0,1} and {2,3}."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    try:
        pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank creates every group
        res = {}
        for tp, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
            res[tp] = {attn: run_case(group, attn) for attn in ATTN}
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vision_tp")
    # forkserver: torch and transformers are imported once, by the server, not by each of 4 spawned ranks
    # (~5 s of CPU each on 2 cores). If a server already runs without the preload, ranks import for themselves.
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=4, start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("world", [2, 4])
def test_vision_tensor_parallel_matches_unsharded(world, tp_results):
    v = architecture_config("tiny").vision_config
    patches = sum(t * h * w for t, h, w in GRID)
    merged = patches // v.spatial_merge_size**2
    for attn, first in itertools.product(ATTN, range(0, 4, world)):
        runs = [res[world][attn] for res in tp_results[first : first + world]]
        ref_grads, ref_params = runs[0]["ref_grads"], runs[0]["ref_params"]
        grads = gather_full_vision_state_dict([r["local_grads"] for r in runs], v)
        params = gather_full_vision_state_dict([r["local_params"] for r in runs], v)
        assert grads.keys() == ref_grads.keys() == params.keys()
        errs = {n: rel_err(grads[n], ref_grads[n]) for n in grads}
        assert not {n: e for n, e in errs.items() if not e <= 1e-5}, (attn, errs)
        diffs = {n: float((params[n] - ref_params[n]).abs().max()) for n in params}
        assert not {n: d for n, d in diffs.items() if not d <= 1e-5}, (attn, diffs)
        for rank, res in enumerate(runs):
            assert res["output"] <= 1e-5, (attn, rank, res["output"])
            tp_sq, ref_sq = res["grad_sq_norm"]
            assert abs(tp_sq - ref_sq) <= 1e-6 * ref_sq, (attn, rank, tp_sq, ref_sq)
            # exactly the collectives of the module docstring
            fwd, bwd = res["collectives"]
            f32 = torch.float32
            assert fwd == [((patches, v.hidden_size), f32)] * 2 * v.depth + [((merged, v.out_hidden_size), f32)]
            assert bwd == [((merged, 4 * v.hidden_size), f32)] + [((patches, v.hidden_size), f32)] * 2 * v.depth
            shard = res["local_grads"]
            assert shard["visual.blocks.0.attn.qkv.weight"].shape == (3 * v.hidden_size // world, v.hidden_size)
            assert shard["visual.blocks.2.mlp.down_proj.weight"].shape == (v.hidden_size, v.intermediate_size // world)
            assert shard["visual.merger.mlp.2.weight"].shape == (v.out_hidden_size, 4 * v.hidden_size // world)
            assert res["sharded"]["visual.merger.mlp.0.bias"] and not res["sharded"]["visual.blocks.1.attn.proj.bias"]
            # the mutant: patch_embed's gradient is mostly the residual path (measured rel err ~2e-2, still
            # 1000x the tolerance above); block 0's norm1 sees only 1/tp of its attention gradient
            mutant = res["mutant"]
            assert mutant["visual.patch_embed.proj.weight"] > 2e-3, (attn, rank, mutant)
            assert mutant["visual.blocks.0.norm1.weight"] > 0.3, (attn, rank, mutant)
        # replicated parameters (patch_embed, norms, row-parallel biases) get bit-identical gradients
        for name, sharded in runs[0]["sharded"].items():
            if not sharded:
                for res in runs[1:]:
                    assert torch.equal(res["local_grads"][name], runs[0]["local_grads"][name]), (attn, name)


def test_vision_tp_degree_validation():
    tiny = architecture_config("tiny").vision_config  # 4 heads, intermediate 128, merger width 256
    for tp in (1, 2, 4):
        check_vision_tp_degree(tp, tiny)
    for tp in (0, 3, 8):
        with pytest.raises(ValueError, match=r"valid degrees: \[1, 2, 4\]"):
            check_vision_tp_degree(tp, tiny)
    # the released encoder: 16 heads, but intermediate 3420 is not a multiple of 8
    with pytest.raises(ValueError, match=r"intermediate=3420.*valid degrees: \[1, 2, 4\]"):
        check_vision_tp_degree(8, architecture_config("qwen2_5_vl_7b"))


@pytest.mark.parametrize("tp", [2, 4])
def test_vision_shard_and_gather_round_trip(tp, tmp_path):
    config = architecture_config("tiny")
    v = config.vision_config
    torch.manual_seed(0)
    full = {n: p.detach().clone() for n, p in VisionModel(config).state_dict().items()}
    shards = [shard_vision_state_dict_for_rank(full, r, tp, v) for r in range(tp)]
    back = gather_full_vision_state_dict(shards, v)
    assert back.keys() == full.keys()
    for n in full:
        assert torch.equal(back[n], full[n]), n
    # rank r's qkv rows are head group r of q, of k and of v
    qkv = full["visual.blocks.0.attn.qkv.bias"].view(3, v.num_heads, -1)
    for r in range(tp):
        own = qkv[:, r * v.num_heads // tp : (r + 1) * v.num_heads // tp].reshape(-1)
        assert torch.equal(shards[r]["visual.blocks.0.attn.qkv.bias"], own)
    # the same indexes read only a rank's part through safetensors' get_slice, qkv included
    names = [
        "visual.blocks.1.attn.qkv.weight",
        "visual.blocks.1.attn.qkv.bias",
        "visual.blocks.1.attn.proj.weight",
        "visual.blocks.1.mlp.up_proj.bias",
        "visual.merger.mlp.0.weight",
    ]
    save_file({n: full[n].contiguous() for n in names}, str(tmp_path / "v.safetensors"))
    with safe_open(str(tmp_path / "v.safetensors"), framework="pt") as f:
        for r in range(tp):
            for n in names:
                assert torch.equal(read_part(f.get_slice(n), vision_tp_slice(n, r, tp, v)), shards[r][n]), (n, r)
    assert vision_tp_slice("visual.blocks.0.norm1.weight", 1, tp, v) is None
