"""Counted (not computed) bytes for `bench_layouts.py`: a real run of a CPU-sized vision encoder per layout.

`measure_none(P)` runs the plain encoder in this process; `measure(world, seqs, layouts)` spawns `world`
gloo ranks that each build a fresh encoder per (layout, P) and run one micro-batch forward + backward and
the layout's gradient/parameter synchronisation:
  sequence  `sp_vision_forward` + `gather_merged`, then ZeRO-1: all-reduce of every gradient over the group
            and ZeroRedundancyOptimizer.step (the broadcast of each rank's parameter share).
  tensor    `apply_vision_tensor_parallel` over the group, the model's own forward; then, by the benchmark's
            convention, an all-reduce of the gradients of the replicated parameters (`_dhp_sharded` False).
  zero3     `apply_zero3` over `stages/vision_worker.py`'s units (every block, the merger, then the root);
            each rank encodes its own image (data parallel), FSDP2 gathers / reduce-scatters by itself.
Collectives are counted at the torch.distributed function level, in bytes sent per rank (the convention of
bench_layouts.py): `dist.all_reduce` / `all_gather` / `broadcast` go to the activation count while the
micro-batch's forward + backward runs and to the sync count afterwards; `all_to_all_single_autograd` is
always activation (its backward by a hook on its output); FSDP2's `dist.all_gather_single` /
`reduce_scatter_single` (torch 2.13 calls these, also on gloo) are always parameter/gradient sync.
Saved tensors: `models/planning/saved_tensors.py` (`saved_tensors_hooks`, deduplicated by storage, minus the
storages of the parameters as they are at that moment, FSDP2's all-gathered ones included). Figures are
means over the ranks.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import timedelta

import torch

from dhp.models.planning.saved_tensors import SavedBytes

REAL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
REAL_VISION["fullatt_block_indexes"] = [7, 15, 23, 31]
MEASURED_VISION = dict(REAL_VISION, depth=8, hidden_size=256, intermediate_size=684, out_hidden_size=512)
MEASURED_VISION["fullatt_block_indexes"] = [7]
VISION_COMMON = dict(
    window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, hidden_act="silu"
)
LAYOUTS = ("sequence", "tensor", "zero3")
MEASURED = "measured"  # the model `build_model` makes by default


def grid_of(p: int) -> torch.Tensor:
    h = 2 ** (int(math.log2(p)) // 2)
    if p % h or (p // h) % 8 or h % 8:
        raise ValueError(f"measured sequence lengths must be 64 * 4**k or 128 * 4**k patches, got {p}")
    return torch.tensor([[1, h, p // h]])


def build_model(model: str = MEASURED):
    """(config, vision stage) of `model`: MEASURED (the CPU-sized Qwen2.5-VL encoder above) or a named shape
    (`qwen3_vl_tiny`: full attention in every block, the position embedding, two DeepStack mergers)."""
    if model == MEASURED:
        from transformers import Qwen2_5_VLConfig

        cfg = Qwen2_5_VLConfig(vision_config=dict(MEASURED_VISION, **VISION_COMMON))
        cfg._attn_implementation = "sdpa"
    else:
        from dhp.models.architectures import architecture_config

        cfg = architecture_config(model)
    from dhp.models.family import family_of

    torch.manual_seed(0)
    return cfg, family_of(cfg).vision_model(cfg).float().train()


def _pixels(cfg, p: int, seed: int = 0) -> torch.Tensor:
    vc = cfg.vision_config
    values = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2  # 1176 for Qwen2.5-VL's 14 px patches
    return torch.randn(p, values, generator=torch.Generator().manual_seed(p + 1000 * seed))


def measure_none(p: int, model: str = MEASURED) -> dict:
    cfg, vit = build_model(model)
    with SavedBytes(vit) as saved:
        out = vit(_pixels(cfg, p), grid_of(p))
    out.sum().backward()
    return dict(layout="none", degree=1, seq_len=p, comm=0, grad=0, act=saved.total, model=model)


class Counter:
    """Wraps the torch.distributed entry points the layouts use; bytes sent by this rank, by phase."""

    _ALWAYS_GRAD = ("all_gather_single", "reduce_scatter_single")  # FSDP2's parameter gathers / gradient scatters
    _BY_PHASE = ("all_reduce", "all_gather", "broadcast")

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        from dhp.models.parallel import sequence_parallel as sp

        self.rank, self.world, self.comm, self.grad, self.phase = rank, world, 0.0, 0.0, "comm"

        def nbytes(t):
            return t.numel() * t.element_size()

        real_a2a = sp.all_to_all_single_autograd
        real = {k: getattr(dist, k) for k in self._ALWAYS_GRAD + self._BY_PHASE}
        rank_sends = {  # bytes this rank sends, by collective (ring algorithms)
            "all_reduce": lambda tensor, *a, **k: 2 * (world - 1) / world * nbytes(tensor),
            "all_gather": lambda tensor_list, tensor, *a, **k: (world - 1) * nbytes(tensor),
            "broadcast": lambda tensor, src=None, *a, **k: 0 if src == rank else nbytes(tensor),
            "all_gather_single": lambda output_tensor, input_tensor, *a, **k: (world - 1) * nbytes(input_tensor),
            "reduce_scatter_single": lambda output, input, *a, **k: (world - 1) * nbytes(output),
        }

        def wrap(name):
            def counted(*a, **k):
                self.add(rank_sends[name](*a, **k), "grad" if name in self._ALWAYS_GRAD else self.phase)
                return real[name](*a, **k)

            return counted

        def a2a(t, out_sizes, in_sizes, group):
            row = math.prod(t.shape[1:]) * t.element_size()
            self.add((sum(in_sizes) - in_sizes[rank]) * row, "comm")
            out = real_a2a(t, out_sizes, in_sizes, group)
            if out.requires_grad:  # the adjoint all-to-all sends this gradient with the splits swapped
                out.register_hook(lambda g: self.add((sum(out_sizes) - out_sizes[rank]) * row, "comm"))
            return out

        for name in real:
            setattr(dist, name, wrap(name))
        sp.all_to_all_single_autograd = a2a

    def add(self, n: float, phase: str) -> None:
        setattr(self, phase, getattr(self, phase) + n)

    def reset(self) -> None:
        self.comm, self.grad, self.phase = 0.0, 0.0, "comm"


def _run(name: str, counter: Counter, p: int, model_name: str = MEASURED) -> dict:
    """One micro-batch of `p` patches under layout `name` on this rank: bytes sent and saved.

    The layout object does what it does in a vision worker (apply, forward, gradient sync group, ZeRO-1
    group); the one addition is the benchmark's convention for tensor parallelism: the gradients of the
    replicated parameters, which dhp never all-reduces (they are identical), are all-reduced and counted.
    """
    import torch.distributed as dist

    from dhp.models.parallel import sequence_parallel as sp
    from dhp.models.parallel.layout import NOT_SHARDED, SKIP_SYNC, PoolRanks
    from dhp.models.parallel.layouts import layout_class

    rank, world, group = counter.rank, counter.world, dist.group.WORLD
    cfg, model = build_model(model_name)
    layout = layout_class("vision", name).of_size("vision", world, cfg)
    singles = [dist.new_group([r]) for r in range(world)]  # the size-1 group of whichever dimension is 1
    whole = layout.degree == world
    ranks = PoolRanks(
        rank,
        world,
        layout.degree,
        rank // layout.degree,
        rank % layout.degree,
        group if whole else singles[rank],
        singles[rank] if whole else group,
        torch.device("cpu"),
    )
    grid = grid_of(p)
    layout.apply(model, ranks)
    zero_group = layout.optimizer_shard_group(ranks)
    opt = None
    if zero_group is not NOT_SHARDED:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=torch.optim.SGD, lr=1e-3, process_group=zero_group
        )
    # Data parallel layouts: each rank its own image; model-parallel ones: every rank the same micro-batch.
    pixels = _pixels(cfg, p, seed=rank + 1 if layout.dp == world and world > 1 else 0)
    plan = sp.plan_shards(grid, layout.loader_shards, cfg) if layout.loader_shards else None

    def forward():
        if plan is None:
            return layout.vision_forward(model, pixels, grid, ranks)
        shard = layout.vision_forward(model, plan.shard(pixels, rank), grid, ranks)
        return sp.gather_merged(shard, plan, rank, group)  # the boundary's gather, counted as activation comm

    counter.reset()
    with SavedBytes(model) as saved:
        out = forward()
    out.sum().backward()
    counter.phase = "grad"
    sync = layout.grad_sync_group(ranks)
    if sync is not SKIP_SYNC and dist.get_world_size(sync) > 1:
        for q in model.parameters():
            dist.all_reduce(q.grad, group=sync)
    for q in layout.unsynced_replicated(model):  # the convention (see the docstring)
        dist.all_reduce(q.grad)
    if opt is not None:  # ZeRO-1: each rank's share steps and is broadcast
        opt.step()
    return dict(comm=counter.comm, grad=counter.grad, act=saved.total)


def _worker(rank: int, world: int, seqs: list[int], layouts: list, out_dir: str) -> None:
    import torch.distributed as dist

    from dhp.stages.rendezvous import pin_collectives_to_loopback

    torch.set_num_threads(1)
    pin_collectives_to_loopback()  # one machine: a file store and loopback sockets, nothing else listens
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        counter = Counter(rank, world)
        results = [
            dict(layout=lay, seq_len=p, model=model, **_run(lay, counter, p, model))
            for model, lay in layouts
            for p in seqs
        ]
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure(
    world: int, seqs: list[int], layouts=LAYOUTS, models: dict[str, tuple[str, ...]] | None = None
) -> list[dict]:
    """Rows (model, layout, degree, seq_len, comm, grad, act, act_max) averaged over `world` spawned gloo ranks:
    `layouts` of the MEASURED encoder, and of each other model in `models` the layouts given there."""
    layouts = [(MEASURED, lay) for lay in layouts] + [(m, lay) for m, lays in (models or {}).items() for lay in lays]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, seqs, list(layouts), tmp), nprocs=world, start_method="spawn")
        per_rank = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    rows = []
    for j, first in enumerate(per_rank[0]):
        vals = [per_rank[r][j] for r in range(world)]
        mean = {k: sum(v[k] for v in vals) / world for k in ("comm", "grad", "act")}
        rows.append(dict(layout=first["layout"], degree=world, seq_len=first["seq_len"], model=first["model"], **mean))
        rows[-1]["act_max"] = max(v["act"] for v in vals)
    return rows
