"""Communication and activation memory of the vision-encoder layouts: `sequence`, `tensor`, `zero3`, `none`.

What is reported, per rank, for one micro-batch of P patches (one image) on a layout of degree N:
  comm_bytes_per_rank       bytes moved by ACTIVATION collectives, forward + backward.
  grad_sync_bytes_per_rank  bytes moved by gradient/parameter synchronisation per optimizer step.
  activation_bytes_per_rank bytes autograd keeps for backward (parameters excluded).
and, per layout and degree, the longest sequence whose activations fit `--budget-gib` per rank.

Byte convention ("bytes sent per rank", ring algorithms): all-to-all = the rows a rank sends to the
OTHER ranks; all-gather of chunk c = (N-1) * c; all-reduce of x = 2 * (N-1)/N * x; broadcast = the bytes
a rank receives (0 on the source), so ZeRO-1's parameter broadcast averages (N-1)/N * params per rank.

Layouts:
  sequence  window-aware Ulysses SP (`models/sequence_parallel.py`): all-to-all #1 (q/k/v, 3*S_r*D) and
            #2 (S_r*D) in each full-attention block, forward and backward, then the all-gather of the
            merged shards (its backward has no collective). Optimizer: ZeRO-1 as torch's
            ZeroRedundancyOptimizer does it = all-reduce of every ViT gradient + broadcast of each
            rank's parameter share.
  tensor    Megatron TP of every block (qkv/gate/up column-, proj/down row-parallel; merger mlp col/row):
            2 all-reduces of [P, D] per block forward, 2 backward; merger: [P/4, O] fwd, [P/4, 4D] bwd.
            dhp has no TP ViT: FORMULA ONLY. Activations: the norms (input, x*rsqrt, output), cos/sin,
            pixels, the merger's ln_q stay full; q/k/v, attention, MLP intermediates are / N. Grad sync:
            all-reduce of the replicated parameters (norm weights, row-parallel biases, patch embed, ln_q)
            -- the convention asked for; strictly Megatron without SP leaves them identical on all ranks.
  zero3     data parallel, params sharded: all-gather params in forward and again in backward, reduce-
            scatter of gradients = 3 * (N-1)/N * params; activations of the full sequence on every rank.
  none      one rank, no collective; the full-sequence activations.

How: FORMULA rows for the real Qwen2.5-VL ViT (32 blocks, full attention in 7/15/23/31, D 1280, 16 heads,
I 3420, out 3584 = the 7B merger) at 1k-64k patches, degrees 2/4/8, in `--dtype-bytes` (2: bf16, norm
internals approximated at 2 bytes too). MEASURED rows from a real run of a CPU-sized encoder with the same
block structure (MEASURED_VISION: 16 heads, D 256, I 684 = the real I/D ratio, depth 8 with full attention
in block 7 = the real 1-in-8 ratio), fp32: `none` in this process, `sequence` on gloo groups of 2 and 4
spawned ranks through `sp_vision_forward` + `gather_merged` + ZeroRedundancyOptimizer.step. Collectives are
counted by wrapping `sequence_parallel.all_to_all_single_autograd` (forward: bytes sent; backward: a hook on
its output counts the gradient the adjoint all-to-all sends) and `dist.all_gather/all_reduce/broadcast`;
saved tensors by `torch.autograd.graph.saved_tensors_hooks`, deduplicated by storage pointer. Measured
figures are the mean over ranks (shards are ragged). The formula is then evaluated for the measured shape
and must be within +-15% of every count, else the script exits 1.
Usage: dhp bench layouts [--json PATH] [--quick] [--budget-gib 40]   (or python -m dhp.scripts.bench_layouts)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import NamedTuple

import torch

REAL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
REAL_VISION["fullatt_block_indexes"] = [7, 15, 23, 31]
MEASURED_VISION = dict(REAL_VISION, depth=8, hidden_size=256, intermediate_size=684, out_hidden_size=512)
MEASURED_VISION["fullatt_block_indexes"] = [7]
_COMMON = dict(
    window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, hidden_act="silu"
)
PIXELS = 1176  # values per patch (3 x 2 x 14 x 14)
FORMULA_SEQ = [1024, 4096, 16384, 65536]
DEGREES = [2, 4, 8]
TOL = 0.15
KEYS = ("comm_bytes_per_rank", "grad_sync_bytes_per_rank", "activation_bytes_per_rank")


class Shape(NamedTuple("Shape", [(f, int) for f in ("depth", "full", "d", "h", "i", "o")])):
    @classmethod
    def of(cls, v: dict) -> Shape:
        dims = (v[k] for k in ("hidden_size", "num_heads", "intermediate_size", "out_hidden_size"))
        return cls(v["depth"], len(v["fullatt_block_indexes"]), *dims)

    def params(self) -> int:
        d, i = self.d, self.i
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (d * i + i) + (i * d + d)
        return PIXELS * d + self.depth * block + d + (4 * d) * (4 * d) + 4 * d + 4 * d * self.o + self.o

    def replicated_params(self) -> int:  # tensor layout: norms, row-parallel biases, patch embed, ln_q, merger bias
        return PIXELS * self.d + self.depth * 4 * self.d + self.d + self.o


def comm_formula(s: Shape, layout: str, n: int, p: int, b: int) -> float:
    if layout == "sequence":  # per full block: (3 + 1) * S_r * D * (N-1)/N, fwd and bwd; gather of S_r/4 rows
        return (s.full * 2 * 4 * (p / n) * s.d * (n - 1) / n + (n - 1) * (p / n / 4) * s.o) * b
    if layout == "tensor":
        ar = 2 * (n - 1) / n
        return ar * (s.depth * 4 * p * s.d + p / 4 * s.o + p * s.d) * b
    return 0.0


def grad_sync_formula(s: Shape, layout: str, n: int, b: int) -> float:
    if layout in ("sequence", "zero3"):  # ZeRO-1: 2(N-1)/N all-reduce + (N-1)/N broadcast; ZeRO-3: 2 AG + RS
        return 3 * (n - 1) / n * s.params() * b
    if layout == "tensor":
        return 2 * (n - 1) / n * s.replicated_params() * b
    return 0.0


def activation_formula(s: Shape, layout: str, n: int, p: int, b: int) -> float:
    """Saved-for-backward bytes per rank (elements counted from the transformers block, see the probe)."""
    hd, d = s.d // s.h, s.d
    norm = 3 * d + 1  # RMSNorm keeps x, rsqrt, x * rsqrt (and its output is saved by the next Linear)
    index = p / 4 * 8  # the int64 inverse window permutation, on every rank
    if layout in ("none", "zero3") or (layout == "sequence" and n == 1):
        per_tok = PIXELS + 2 * hd + s.depth * (13 * d + 4 * s.i + s.h + 2) + 6 * d + 1
        return per_tok * p * b + index
    if layout == "sequence":  # everything / N; a full block keeps the all-to-all output instead of q, k, qkv
        per_tok = PIXELS + 2 * hd + s.depth * (13 * d + 4 * s.i + s.h + 2) - s.full * 2 * d + 6 * d + 1
        return per_tok * p / n * b + index
    # tensor: norms (x2 per block), cos/sin, pixels, ln_q full; q_rot, k_rot, qkv, lse, attn out, proj in, MLP / N
    full = PIXELS + 2 * hd + s.depth * 2 * norm + norm
    shard = s.depth * (7 * d + s.h + 4 * s.i) + 2 * d
    return (full + shard / n) * p * b + index


def max_seq(s: Shape, layout: str, n: int, budget: float, b: int) -> int:
    per = activation_formula(s, layout, n, 1 << 20, b) / (1 << 20)
    return int(budget / per) // 64 * 64  # whole windows (8 x 8 patches)


def _row(layout: str, degree: int, seq_len: int, comm: float, grad: float, act: float, **extra) -> dict:
    return dict(layout=layout, degree=degree, seq_len=seq_len, **dict(zip(KEYS, (comm, grad, act))), **extra)


def formula_rows(s: Shape, seqs, degrees, b: int, budget: float) -> list[dict]:
    rows = []
    for p in seqs:
        for layout, degs in (("none", [1]), ("sequence", degrees), ("tensor", degrees), ("zero3", degrees)):
            for n in degs:
                comm, grad = comm_formula(s, layout, n, p, b), grad_sync_formula(s, layout, n, b)
                fit = max_seq(s, layout, n, budget, b)
                extra = dict(source="formula", shape="real", dtype_bytes=b, max_seq_len_at_budget=fit)
                rows.append(_row(layout, n, p, comm, grad, activation_formula(s, layout, n, p, b), **extra))
    return rows


# ----------------------------------------------------------------------------------------- measured
def _grid(p: int) -> torch.Tensor:
    h = 2 ** (int(math.log2(p)) // 2)
    if p % h or (p // h) % 8 or h % 8:
        raise ValueError(f"measured sequence lengths must be 64 * 4**k or 128 * 4**k patches, got {p}")
    return torch.tensor([[1, h, p // h]])


@contextlib.contextmanager
def saved_bytes(model):
    """Yields a dict whose "total" becomes the bytes of distinct storages autograd saved (parameters excluded)."""
    params, seen, result = {q.untyped_storage().data_ptr() for q in model.parameters()}, {}, {}

    def pack(t):
        st = getattr(t, "elem", t).untyped_storage()  # the all-to-all's AsyncCollectiveTensor wraps a tensor
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["total"] = sum(seen.values())


def _model():
    from transformers import Qwen2_5_VLConfig

    from dhp.models.qwen2_5_vl import VisionModel

    cfg = Qwen2_5_VLConfig(vision_config=dict(MEASURED_VISION, **_COMMON))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cfg, VisionModel(cfg).float().train()


def measure_none(p: int) -> dict:
    _, model = _model()
    pixels = torch.randn(p, PIXELS, generator=torch.Generator().manual_seed(p))
    with saved_bytes(model) as saved:
        out = model(pixels, _grid(p))
    out.sum().backward()
    return _row("none", 1, p, 0, 0, saved["total"])


def _worker(rank: int, world: int, port: int, seqs: list[int], out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dhp.models import sequence_parallel as sp_mod

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        cfg, model = _model()
        opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.SGD, lr=1e-3)
        acts, grads = [], []  # bytes of each activation / gradient-sync collective on this rank
        real_a2a, real_ag = sp_mod.all_to_all_single_autograd, dist.all_gather
        real_ar, real_bc = dist.all_reduce, dist.broadcast

        def a2a(t, out_sizes, in_sizes, group):
            row = math.prod(t.shape[1:]) * t.element_size()
            acts.append((sum(in_sizes) - in_sizes[rank]) * row)
            out = real_a2a(t, out_sizes, in_sizes, group)
            if out.requires_grad:  # the adjoint all-to-all sends this gradient with the splits swapped
                out.register_hook(lambda g: acts.append((sum(out_sizes) - out_sizes[rank]) * row))
            return out

        def all_gather(tensor_list, tensor, *a, **k):
            acts.append((world - 1) * tensor.numel() * tensor.element_size())
            return real_ag(tensor_list, tensor, *a, **k)

        def all_reduce(tensor, *a, **k):
            grads.append(2 * (world - 1) / world * tensor.numel() * tensor.element_size())
            return real_ar(tensor, *a, **k)

        def broadcast(tensor, src=None, *a, **k):
            grads.append(0 if src == rank else tensor.numel() * tensor.element_size())
            return real_bc(tensor, src, *a, **k)

        sp_mod.all_to_all_single_autograd, dist.all_gather = a2a, all_gather
        dist.all_reduce, dist.broadcast = all_reduce, broadcast
        results = []
        for p in seqs:
            grid, group = _grid(p), dist.group.WORLD
            plan = sp_mod.plan_shards(grid, world, cfg)
            pixels = torch.randn(p, PIXELS, generator=torch.Generator().manual_seed(p))
            model.zero_grad(set_to_none=True)
            acts.clear(), grads.clear()
            with saved_bytes(model) as saved:
                shard = sp_mod.sp_vision_forward(model.visual, plan.shard(pixels, rank), grid, plan, rank, group)
                out = sp_mod.gather_merged(shard, plan, rank, group)
            out.sum().backward()
            for q in model.parameters():  # ZeRO-1: the SP group's gradient sum, then each rank's share steps
                dist.all_reduce(q.grad)
            opt.step()
            results.append(dict(seq_len=p, comm=sum(acts), grad=sum(grads), act=saved["total"]))
        with open(os.path.join(out_dir, f"{world}_{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_sequence(world: int, seqs: list[int]) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, port, seqs, tmp), nprocs=world, start_method="spawn")
        per_rank = [json.load(open(os.path.join(tmp, f"{world}_{r}.json"))) for r in range(world)]
    rows = []
    for j, p in enumerate(seqs):
        vals = [per_rank[r][j] for r in range(world)]
        mean = {k: sum(v[k] for v in vals) / world for k in ("comm", "grad", "act")}
        peak = max(v["act"] for v in vals)
        rows.append(_row("sequence", world, p, mean["comm"], mean["grad"], mean["act"], activation_bytes_max_rank=peak))
    return rows


def check(rows: list[dict]) -> list[str]:
    """Attach the formula (measured shape, fp32) to each measured row; return the disagreements."""
    s, bad = Shape.of(MEASURED_VISION), []
    for r in rows:
        r.update(source="measured", shape="measured", dtype_bytes=4)
        n, p, lay = r["degree"], r["seq_len"], r["layout"]
        formulas = comm_formula(s, lay, n, p, 4), grad_sync_formula(s, lay, n, 4), activation_formula(s, lay, n, p, 4)
        for key, f in zip(KEYS, formulas):
            r[key.replace("_per_rank", "_formula")] = f
            ratio = f / r[key] if r[key] else (1.0 if f == 0 else math.inf)
            r[key.replace("_bytes_per_rank", "_ratio")] = round(ratio, 4)
            if abs(ratio - 1) > TOL:
                bad.append(f"{lay} N={n} P={p} {key}: formula/measured = {ratio:.3f}")
    return bad


def expectations(rows: list[dict], degree: int = 4) -> list[str]:
    """The design's two claims at `degree`, from the real-shape formula rows, one line per sequence length."""
    get = {(r["layout"], r["degree"], r["seq_len"]): r for r in rows if r["source"] == "formula"}
    lines = []
    for p in sorted({k[2] for k in get}):
        seq, ten, none = get[("sequence", degree, p)], get[("tensor", degree, p)], get[("none", 1, p)]
        comm = ten["comm_bytes_per_rank"] / seq["comm_bytes_per_rank"]
        act = seq["activation_bytes_per_rank"] / none["activation_bytes_per_rank"] * degree
        lines.append(
            f"degree {degree}, {p} patches: tensor/sequence comm = {comm:.1f}x (>= 10: {comm >= 10}); "
            f"sequence act * N / none = {act:.3f} (<= 1.15: {act <= 1.15})"
        )
    return lines


def table(rows: list[dict]) -> str:
    lines = [
        f"{'source':8} {'layout':8} {'N':>2} {'seq':>6} {'comm MiB':>10}{'grad MiB':>10}{'act MiB':>10}  f/m ratios"
    ]
    for r in rows:
        ratio = ""
        if r["source"] == "measured":
            ratio = " ".join(str(r[k]) for k in ("comm_ratio", "grad_sync_ratio", "activation_ratio"))
        lines.append(
            f"{r['source']:8} {r['layout']:8} {r['degree']:>2} {r['seq_len']:>6} "
            + "".join(f"{r[k] / 2**20:10.1f}" for k in KEYS)
            + f"  {ratio}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhp bench layouts", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="measure 1k patches at degree 2 only (< 60 s)")
    p.add_argument("--budget-gib", type=float, default=40.0, help="per-rank activation budget (default 40)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element of the real-shape rows (2: bf16)")
    return p.parse_args(argv)


def main(args=None) -> int:
    if args is None or isinstance(args, list):
        args = parse_args(args)
    budget, b = args.budget_gib * 2**30, args.dtype_bytes
    seqs, worlds = ([1024], [2]) if args.quick else ([1024, 4096], [2, 4])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 intra-op threads on a shared 2-core machine made backward ~25x slower
    try:
        measured = [measure_none(p) for p in seqs]
    finally:
        torch.set_num_threads(threads)
    for w in worlds:
        measured += measure_sequence(w, seqs)
    bad = check(measured)
    real = Shape.of(REAL_VISION)
    rows = measured + formula_rows(real, FORMULA_SEQ, DEGREES, b, budget)
    fits = {f"{r['layout']}@{r['degree']}": r["max_seq_len_at_budget"] for r in rows if r["source"] == "formula"}
    print(table(rows))
    print(f"\nlongest sequence (patches) fitting {budget / 2**30:g} GiB of activations per rank: {fits}")
    print("\n".join(expectations(rows)))
    for line in bad:
        print(f"FORMULA MISMATCH (> {TOL:.0%}): {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
