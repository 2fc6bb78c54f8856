"""Communication and activation memory of the vision-encoder layouts: `sequence`, `tensor`, `zero3`, `none`.

What is reported, per rank, for one micro-batch of P patches (one image) on a layout of degree N:
  comm_bytes_per_rank       bytes moved by ACTIVATION collectives, forward + backward.
  grad_sync_bytes_per_rank  bytes moved by gradient/parameter synchronisation per optimizer step (zero3: per
                            micro-batch, as FSDP2 gathers and reduce-scatters in every forward/backward;
                            `grad_sync_unit` says which).
  activation_bytes_per_rank bytes autograd keeps for backward (parameters excluded).
and, per layout and degree, the longest sequence whose activations fit `--budget-gib` per rank.

Byte convention ("bytes sent per rank", ring algorithms): all-to-all = the rows a rank sends to the
OTHER ranks; all-gather of chunk c = (N-1) * c; reduce-scatter to chunk c = (N-1) * c; all-reduce of x =
2 * (N-1)/N * x; broadcast = the bytes a rank receives (0 on the source), so ZeRO-1's parameter broadcast
averages (N-1)/N * params per rank. Activations and their collectives are in `--dtype-bytes` (2: bf16
autocast); gradient/parameter sync is always fp32 (GRAD_BYTES): dhp keeps fp32 master parameters, so its
gradients, ZeRO-1 broadcasts and FSDP2 gathers (no mixed-precision policy) are fp32.

Layouts:
  sequence  window-aware Ulysses SP (`models/parallel/sequence_parallel.py`): all-to-all #1 (q/k/v, 3*S_r*D) and
            #2 (S_r*D) in each full-attention block, forward and backward, then the all-gather of the
            merged shards (its backward has no collective). Optimizer: ZeRO-1 as torch's
            ZeroRedundancyOptimizer does it = all-reduce of every ViT gradient + broadcast of each
            rank's parameter share = 3 * (N-1)/N * params.
  tensor    dhp's Megatron TP ViT (`models/parallel/vision_tensor_parallel.py`): all-reduces forward 2 per block of
            [P, D] + 1 of [P/4, O] (merger), backward 1 of [P/4, 4D] + 2 per block of [P, D]; the row-
            parallel biases are added after the reduce, replicated. Activations: the norms (x, rsqrt,
            x*rsqrt, output), cos/sin, pixels, the merger's ln_q stay full; q_rot, k_rot, the qkv output (v is
            a view of it, so all of its [P, 3D/N] stays), log-sum-exp, attention out, proj input, the 4 MLP
            tensors and the merger MLP are / N. Grad sync, by convention: an all-reduce of the replicated
            parameters (norms, row-parallel biases, patch embed, ln_q) = 2 * (N-1)/N * those. dhp itself
            skips it (their gradients are bit-identical on every TP rank; it syncs over data-parallel
            replicas only). Degree N must divide heads (16), MLP (3420) and 4D (`check_vision_tp_degree`):
            the real shape splits 1, 2 or 4 ways, NOT 8 (3420 % 8 = 4): those rows carry `feasible: false`,
            a `note`, the formula as if the MLP split evenly, and no longest-fitting sequence.
  zero3     data parallel with FSDP2 (`models/parallel/zero3.py`): every block, the merger and the root reshard after
            forward, so each unit's parameters are all-gathered in forward and again in backward and its
            gradients reduce-scattered: 3 * (N-1)/N * params, each parameter padded to a multiple of N rows
            (FSDP2's dim-0 shards). No activation collective; each rank keeps the full-sequence
            activations of its own micro-batch.
  none      one rank, no collective; the full-sequence activations.

How: FORMULA rows for the real Qwen2.5-VL ViT (32 blocks, full attention in 7/15/23/31, D 1280, 16 heads,
I 3420, out 3584 = the 7B merger) at 1k-64k patches, degrees 2/4/8 (norm internals approximated at
`--dtype-bytes` too). MEASURED rows from a real run of a CPU-sized encoder with the same block structure
(MEASURED_VISION: 16 heads, D 256, I 684 = the real I/D ratio, depth 8 with full attention in block 7 = the
real 1-in-8 ratio, out 512), fp32: `none` in this process; `sequence`, `tensor` and `zero3` on gloo groups
of 2 and 4 spawned ranks (`layout_counts.py`: collectives counted at the torch.distributed function level,
saved tensors by saved_tensors_hooks). Degree 8 is not measured: 8 ranks on this 2-core machine, and 684 % 8
= 4 rules out tensor there too. The formula is then evaluated for the measured shape and must be within
+-15% of every count, else the script exits 1. Qwen3-VL's tiny ViT (`qwen3_vl_tiny`: 4 blocks of full attention,
the learned position embedding, 2 DeepStack mergers whose features widen the merged output threefold) is measured
the same way, `none` in this process and `sequence` and `tensor` on the spawned ranks (rows with `shape`
qwen3_vl_tiny), against the formula of its own shape. `--plot` (default: the --json path with .png) draws comm and
activations of the real shape and the formula/measured ratios.
Usage: dhp bench layouts [--json PATH] [--quick] [--budget-gib 40]
       python -m dhp.scripts.bench.layouts [--json PATH] [--plot PNG] [--quick] [--budget-gib 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from typing import Any

import torch

from dhp.models.parallel.layout import Layout, VitShape
from dhp.models.parallel.layouts import layout_class
from dhp.scripts.layout_counts import MEASURED, MEASURED_VISION, REAL_VISION, VISION_COMMON, measure, measure_none

FORMULA_SEQ = [1024, 4096, 16384, 65536]
DEGREES = [2, 4, 8]
TOL = 0.15
GRAD_BYTES = 4  # fp32 master parameters: gradients, ZeRO-1 broadcasts, FSDP2 gathers / reduce-scatters
KEYS = ("comm_bytes_per_rank", "grad_sync_bytes_per_rank", "activation_bytes_per_rank")
# Qwen3-VL's tiny shape, measured too (full attention in every block, the learned position embedding, the DeepStack
# mergers and their wider output): the layouts it runs in the measured set
QWEN3 = "qwen3_vl_tiny"
QWEN3_LAYOUTS = ("sequence", "tensor")


Shape = VitShape  # the ViT dimensions the formulas read (models/parallel/layout.py)


def vision_layout(layout: str, n: int) -> Layout:
    """The vision layout `layout` over n ranks holding one copy: the formulas below are its own methods."""
    return layout_class("vision", layout).of_size("vision", n)


def infeasible(vision: dict, layout: str, n: int) -> str | None:
    """Why `layout` cannot run at degree n on `vision` (dhp's own checks), or None."""
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(**vision, **VISION_COMMON))
    try:
        vision_layout(layout, n).check_shape(config)
    except ValueError as e:
        return str(e)
    return None


def comm_formula(s: Shape, layout: str, n: int, p: int, b: int) -> float:
    return vision_layout(layout, n).vit_comm_bytes(s, p, b)


def grad_sync_formula(s: Shape, layout: str, n: int, b: int) -> float:
    return vision_layout(layout, n).vit_grad_sync_bytes(s, b)


def activation_formula(s: Shape, layout: str, n: int, p: int, b: int) -> float:
    """Saved-for-backward bytes per rank: elements per patch counted from the transformers modules."""
    return vision_layout(layout, n).vit_activation_bytes(s, p, b)


def max_seq(s: Shape, layout: str, n: int, budget: float, b: int) -> int:
    per = activation_formula(s, layout, n, 1 << 20, b) / (1 << 20)
    return int(budget / per) // 64 * 64  # whole windows (8 x 8 patches)


def _row(layout: str, degree: int, seq_len: int, comm: float, grad: float, act: float, **extra) -> dict:
    unit = "micro-batch" if layout_class("vision", layout).spans_pool else "step"  # FSDP2 syncs in every fwd/bwd
    values = dict(zip(KEYS, (comm, grad, act)))
    return dict(layout=layout, degree=degree, seq_len=seq_len, **values, grad_sync_unit=unit, **extra)


def formula_rows(s: Shape, seqs, degrees, b: int, budget: float) -> list[dict]:
    rows = []
    for p in seqs:
        for layout, degs in (("none", [1]), ("sequence", degrees), ("tensor", degrees), ("zero3", degrees)):
            for n in degs:
                why = infeasible(REAL_VISION, layout, n)
                comm, grad = comm_formula(s, layout, n, p, b), grad_sync_formula(s, layout, n, GRAD_BYTES)
                fit = None if why else max_seq(s, layout, n, budget, b)
                extra = dict(source="formula", shape="real", dtype_bytes=b, grad_dtype_bytes=GRAD_BYTES)
                extra.update(feasible=why is None, max_seq_len_at_budget=fit, **({"note": why} if why else {}))
                rows.append(_row(layout, n, p, comm, grad, activation_formula(s, layout, n, p, b), **extra))
    return rows


def measured_shape(model: str) -> Shape:
    """The formulas' shape of a measured model: the CPU-sized Qwen2.5-VL encoder, or a named shape's ViT."""
    if model == MEASURED:
        return Shape.of(MEASURED_VISION)
    from dhp.models.architectures import architecture_config

    return Shape.of(architecture_config(model).vision_config)


def check(rows: list[dict]) -> list[str]:
    """Attach the formula (measured shape, fp32) to each measured row; return the disagreements."""
    bad = []
    for r in rows:
        model = r.setdefault("model", MEASURED)
        s = measured_shape(model)
        shape = "measured" if model == MEASURED else model
        r.update(source="measured", shape=shape, dtype_bytes=4, grad_dtype_bytes=4, feasible=True)
        n, p, lay = r["degree"], r["seq_len"], r["layout"]
        formulas = comm_formula(s, lay, n, p, 4), grad_sync_formula(s, lay, n, 4), activation_formula(s, lay, n, p, 4)
        for key, f in zip(KEYS, formulas):
            r[key.replace("_per_rank", "_formula")] = f
            ratio = f / r[key] if r[key] else (1.0 if f == 0 else math.inf)
            r[key.replace("_bytes_per_rank", "_ratio")] = round(ratio, 4)
            if abs(ratio - 1) > TOL:
                bad.append(f"{r['shape']} {lay} N={n} P={p} {key}: formula/measured = {ratio:.3f}")
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
    head = f"{'source':8} {'shape':13} {'layout':8} {'N':>2} {'seq':>6} {'comm MiB':>10}{'grad MiB':>10}{'act MiB':>10}"
    lines = [head + "  f/m ratios"]
    for r in rows:
        ratio = "" if r["feasible"] else "INFEASIBLE (formula as if it split evenly)"
        if r["source"] == "measured":
            ratio = " ".join(str(r[k]) for k in ("comm_ratio", "grad_sync_ratio", "activation_ratio"))
        lines.append(
            f"{r['source']:8} {r['shape']:13} {r['layout']:8} {r['degree']:>2} {r['seq_len']:>6} "
            + "".join(f"{r[k] / 2**20:10.1f}" for k in KEYS)
            + f"  {ratio}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, budget: float) -> None:
    """Three panels: real-shape activation comm (sequence vs tensor, N = 2/4/8), real-shape activations at
    degree 4 against the budget, and the formula/measured ratio of every measured row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = [r for r in rows if r["source"] == "formula"]

    def line(ax, layout, n, key, **style):
        pts = sorted(
            (r["seq_len"], r[key] / 2**30, r["feasible"]) for r in real if (r["layout"], r["degree"]) == (layout, n)
        )
        ok = pts[0][2]
        same_as_none = layout_class("vision", layout).spans_pool  # data parallel: full-sequence activations
        label = f"{layout} N={n}" + ("" if ok else " (infeasible: 3420 % 8)") + (" (= none)" if same_as_none else "")
        style = {"ls": "-" if ok else ":", **style}
        ax.plot([x for x, *_ in pts], [y for _, y, _ in pts], label=label, **style)

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5))
    for layout, color in (("sequence", "tab:blue"), ("tensor", "tab:red")):
        for n, marker in zip(DEGREES, "os^"):
            line(a, layout, n, "comm_bytes_per_rank", color=color, marker=marker)
    a.set(title="activation-collective bytes per rank per micro-batch\n(real ViT shape, formula, fwd + bwd)")
    for layout, n, color, ls in (
        ("none", 1, "k", "-"),
        ("sequence", 4, "tab:blue", "-"),
        ("tensor", 4, "tab:red", "-"),
        ("zero3", 4, "tab:green", "--"),
    ):
        line(b, layout, n, "activation_bytes_per_rank", color=color, ls=ls, marker="s")
    b.axhline(budget / 2**30, color="gray", ls="--", label=f"budget {budget / 2**30:g} GiB")
    b.set(title="activation bytes kept for backward per rank\n(real ViT shape, formula, degree 4)")
    for ax in (a, b):
        ax.set(xscale="log", yscale="log", xlabel="patches per micro-batch", ylabel="GiB per rank")
        ax.set_xticks(FORMULA_SEQ, [f"{p // 1024}k" for p in FORMULA_SEQ])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    measured = [r for r in rows if r["source"] == "measured"]
    for k, (key, marker) in enumerate((("comm", "o"), ("grad_sync", "s"), ("activation", "^"))):
        pts = [(j, r[f"{key}_ratio"]) for j, r in enumerate(measured) if r[f"{key}_bytes_per_rank"]]
        c.plot([j + (k - 1) * 0.15 for j, _ in pts], [y for _, y in pts], marker, label=key, ls="none")
    c.axhspan(1 - TOL, 1 + TOL, color="green", alpha=0.1, label=f"+-{TOL:.0%}")
    labels = [f"{r['shape']} {r['layout']} N={r['degree']} {r['seq_len'] // 1024}k" for r in measured]
    c.set_xticks(range(len(measured)), labels, rotation=60, ha="right", fontsize=8)
    c.set(ylim=(0.8, 1.2), ylabel="formula / measured", title="formula vs counted (CPU-sized ViT, fp32, gloo)")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhp bench layouts", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="write the PNG here (default: the --json path with .png)")
    p.add_argument("--quick", action="store_true", help="measure 1k patches at degree 2 only (< 60 s)")
    p.add_argument("--budget-gib", type=float, default=40.0, help="per-rank activation budget (default 40)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element, real shape (2: bf16)")
    return p.parse_args(argv)


def main(args=None) -> int:
    if args is None or isinstance(args, list):
        args = parse_args(args)
    budget, b = args.budget_gib * 2**30, args.dtype_bytes
    seqs, worlds = ([1024], [2]) if args.quick else ([1024, 4096], [2, 4])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 intra-op threads on a shared 2-core machine made backward ~25x slower
    try:
        counted = [measure_none(p, model) for model in (MEASURED, QWEN3) for p in seqs]
    finally:
        torch.set_num_threads(threads)
    for w in worlds:
        counted += measure(w, seqs, models={QWEN3: QWEN3_LAYOUTS})
    measured = [
        _row(c["layout"], c["degree"], c["seq_len"], c["comm"], c["grad"], c["act"], model=c["model"])
        | ({"activation_bytes_max_rank": c["act_max"]} if "act_max" in c else {})
        for c in counted
    ]
    bad = check(measured)
    rows = measured + formula_rows(Shape.of(REAL_VISION), FORMULA_SEQ, DEGREES, b, budget)
    fits = {
        f"{r['layout']}@{r['degree']}": r["max_seq_len_at_budget"] or "infeasible"
        for r in rows
        if r["source"] == "formula"
    }
    print(table(rows))
    print(f"\nlongest sequence (patches) fitting {budget / 2**30:g} GiB of activations per rank: {fits}")
    print("\n".join(expectations(rows)))
    for line in bad:
        print(f"FORMULA MISMATCH (> {TOL:.0%}): {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    png = getattr(args, "plot", None) or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        plot(rows, png, budget)
        print(f"plot: {png}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())


def add_parser(sub: Any) -> None:
    p = sub.add_parser("layouts", help="vision-encoder layouts: comm and activation bytes per rank")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="a tiny measured set (for tests)")
    p.add_argument("--budget-gib", type=float, default=40.0, help="per-rank activation budget")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element, real-shape rows")
    p.add_argument("--plot", default=None, help="write the PNG here (default: the --json path with .png)")
