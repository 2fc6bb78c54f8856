"""What a device can do, as the step-time model (models/planning/time_model.py) reads it: a *profile*.

Two sources, one shape:
- measured: `dhp bench ops --json PATH` times matmul, attention, collectives, copies and Ray calls on the
  machine it runs on (scripts/bench/ops.py defines every field). Its efficiency factors are 1: the rates
  are what this machine did.
- datasheet: `--gpu NAME` below. Peak bf16 dense rate, memory, HBM, NVLink/PCIe and inter-node bandwidth
  from the vendors' datasheets, and *efficiency factors* (achieved / datasheet) fitted on the two rows the
  reference published (scripts/fit_time_model.py; docs/time_model.md says how). Every fitted GPU shares
  the H100 fit: there is no published row for the others.

Bandwidths are per rank and per direction, in GB/s (1e9 B), as the layouts count bytes: the bytes one
rank sends (`vit_comm_bytes`). NVLink 4 is 900 GB/s bidirectional, so 450 per direction.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Profile:
    name: str
    kind: str  # "gpu" | "cpu"
    devices_per_node: int  # GPUs of a node; for a CPU profile, cores (one one-thread actor each)
    memory_gib: float  # one device's memory (CPU: the host's, shared)
    matmul_tflops: float  # large matmul, compute dtype (GPU: bf16)
    attention_tflops: float  # full attention (flash / SDPA), forward
    window_attention_tflops: float  # 64-token windows, batched
    memory_gbps: float  # device memory bandwidth (the optimizer step is bound by it)
    intra_gbps: float  # collective bus bandwidth per rank inside a node
    inter_gbps: float  # ... across nodes (per GPU: the node's NICs / its GPUs)
    h2d_gbps: float  # host <-> device, per direction
    object_store_gbps: float  # a tensor through Ray's object store (put + get)
    op_latency_s: float  # one kernel launch / op dispatch
    collective_latency_s: float  # one small collective
    call_latency_s: float  # one Ray actor call round trip
    matmul_by_size: list[list[float]] = field(default_factory=list)  # [[n, tflops]]: small matmuls run slower
    all_to_all_gbps: float | None = None  # when measured apart from intra_gbps
    # Attention beyond one rate (measured by `dhp bench ops`; the datasheet defaults are the plain model the
    # fitted efficiencies were fitted with): the rates' head_dim and the rate by head_dim, a causal kernel's
    # rate counting half the score work (None: attention_tflops, a kernel that skips the masked half), and
    # the backward's cost in forwards.
    attention_head_dim: int = 128
    attention_by_head_dim: list[list[float]] = field(default_factory=list)
    causal_attention_tflops: float | None = None
    attention_backward_ratio: float = 2.0
    optimizer_s_per_param: float | None = None  # one AdamW step, measured; None: bound by memory_gbps
    # Elementwise work (norms, activations, rotary, residuals) is bound by memory, not FLOPs. A measured
    # profile counts it: every activation the memory plan counts is written in the forward, read in the
    # backward, its gradient written and read (4 passes), and every backward accumulates a gradient into
    # `.grad`. A datasheet profile leaves it to the fitted efficiency factors (0), as they were fitted.
    memory_passes: int = 0
    # [[tensor bytes, seconds]] of one collective on 2 ranks (measured); empty: latency + bytes / bandwidth
    all_reduce_by_size: list[list[float]] = field(default_factory=list)
    all_gather_by_size: list[list[float]] = field(default_factory=list)
    all_to_all_by_size: list[list[float]] = field(default_factory=list)
    all_gather_gbps: float | None = None
    # What sharding costs beyond its bytes (measured on gloo, scripts/bench/ops_sharded.py); None: the bytes'
    # model (collectives by size, overlapped with compute on a GPU)
    zero3_unit_s: list[float] | None = None  # [forward, backward] seconds per FSDP2 unit per call
    zero3_s_per_byte: list[float] | None = None  # [forward, backward] seconds per byte of a unit's parameters
    zero3_optimizer_s_per_tensor: float = 0.0  # AdamW on DTensors, beyond plain AdamW, per parameter tensor
    zero1_step_s_per_tensor: float = 0.0  # ZeroRedundancyOptimizer's broadcasts, per parameter tensor
    efficiency: dict[str, float] = field(default_factory=lambda: {"matmul": 1.0, "attention": 1.0, "comm": 1.0})
    source: str = ""

    def rate(self, kind: str) -> float:
        """Achieved FLOP/s of `matmul`, `attention` or `window_attention`, efficiency applied."""
        peak = {
            "matmul": self.matmul_tflops,
            "attention": self.attention_tflops,
            "window_attention": self.window_attention_tflops,
        }[kind]
        eff = self.efficiency.get("attention" if "attention" in kind else "matmul", 1.0)
        return peak * eff * 1e12

    def attention_rate(self, kind: str, head_dim: int) -> float:
        """`rate(kind)` of `attention`, `window_attention` or `causal_attention` (FLOP/s of the work a causal
        kernel needs) at `head_dim`, scaled by the measured head_dim curve (log-linear, clamped)."""
        base = kind if kind != "causal_attention" else "attention"
        rate = self.rate(base)
        if kind == "causal_attention" and self.causal_attention_tflops:
            rate *= self.causal_attention_tflops / self.attention_tflops
        pts = sorted(self.attention_by_head_dim)
        if len(pts) < 2:
            return rate
        return rate * _loglinear(pts, head_dim) / _loglinear(pts, self.attention_head_dim)

    def matmul_rate(self, n: float) -> float:
        """FLOP/s of a matmul whose smallest dimension is `n`: the measured curve, linear in log n between
        its points, clamped at its ends; the large-matmul rate without a curve."""

        pts = sorted(self.matmul_by_size)
        if not pts or n >= pts[-1][0]:
            return self.rate("matmul")
        if n <= pts[0][0]:
            return pts[0][1] * 1e12 * self.efficiency.get("matmul", 1.0) * min(1.0, n / pts[0][0])
        return _loglinear(pts, n) * 1e12 * self.efficiency.get("matmul", 1.0)

    def optimizer_s(self, params: float, bytes_per_param: float) -> float:
        """Seconds of one AdamW step over `params` parameters: measured per parameter, else memory bound."""
        if self.optimizer_s_per_param:
            return params * self.optimizer_s_per_param
        return params * bytes_per_param / (self.memory_gbps * 1e9)

    def collective_s(self, collective: str, tensor_bytes: float, ranks: int, nodes: int = 1) -> float:
        """Seconds of one `collective` (all_reduce, all_gather: its output, all_to_all) of a `tensor_bytes`
        tensor on `ranks` ranks: the measured curve (log-log between its points, linear in bytes past its
        end, for 2 ranks: scaled by (n-1)/n / (1/2) for n) inside a node, else latency + bytes / bandwidth."""
        import math

        share = (ranks - 1) / ranks
        pts = sorted(getattr(self, f"{collective}_by_size"))
        if tensor_bytes <= 0 or ranks < 2:
            return 0.0
        if not pts or nodes > 1:
            sent = (2 if collective == "all_reduce" else 1) * share * tensor_bytes
            return self.collective_latency_s + sent / self.comm_rate(collective, nodes)
        if tensor_bytes >= pts[-1][0]:
            seconds = pts[-1][1] * tensor_bytes / pts[-1][0]
        else:  # log seconds, linear in log bytes, clamped below the first point
            seconds = math.exp(_loglinear([[b, math.log(t)] for b, t in pts], tensor_bytes))
        return seconds * share / 0.5

    def comm_rate(self, collective: str, nodes: int = 1) -> float:
        """Bytes/s one rank sends in `collective` (all_reduce, all_gather, all_to_all), efficiency applied;
        a group spanning nodes runs at the inter-node rate."""
        bw = (
            self.inter_gbps
            if nodes > 1
            else {"all_to_all": self.all_to_all_gbps, "all_gather": self.all_gather_gbps}.get(collective)
            or self.intra_gbps
        )
        return bw * 1e9 * self.efficiency.get("comm", 1.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _loglinear(pts: list[list[float]], x: float) -> float:
    """y at x on a curve of [x, y] points, linear in log x between them, clamped at its ends."""
    import math

    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (y1 - y0)
    return pts[-1][1]


# Datasheet numbers (NVIDIA H100/H200/A100/L40S datasheets; NVLink per direction; inter-node: 8 x 400 Gb/s
# InfiniBand per 8 GPUs for H100/H200, 8 x 200 Gb/s for A100, 4 x 100 Gb/s Ethernet for an L40S node).
# Attention peaks are the matmul peak (flash attention runs on the same tensor cores); windows of 64
# tokens are small tiles: a quarter of it. Kernel launch ~6 us; a Ray actor call ~1 ms.
_GPU_COMMON = dict(
    kind="gpu",
    devices_per_node=8,
    op_latency_s=6e-6,
    collective_latency_s=25e-6,
    call_latency_s=1e-3,
    object_store_gbps=5.0,
)
DATASHEETS: dict[str, dict[str, Any]] = {
    "h100-sxm": dict(
        _GPU_COMMON,
        memory_gib=80,
        matmul_tflops=989.0,
        attention_tflops=989.0,
        window_attention_tflops=247.0,
        memory_gbps=3350,
        intra_gbps=450,
        inter_gbps=50,
        h2d_gbps=55,
    ),
    "h200": dict(
        _GPU_COMMON,
        memory_gib=141,
        matmul_tflops=989.0,
        attention_tflops=989.0,
        window_attention_tflops=247.0,
        memory_gbps=4800,
        intra_gbps=450,
        inter_gbps=50,
        h2d_gbps=55,
    ),
    "a100-80gb": dict(
        _GPU_COMMON,
        memory_gib=80,
        matmul_tflops=312.0,
        attention_tflops=312.0,
        window_attention_tflops=78.0,
        memory_gbps=2039,
        intra_gbps=300,
        inter_gbps=25,
        h2d_gbps=25,
    ),
    "l40s": dict(
        _GPU_COMMON,
        memory_gib=48,
        matmul_tflops=362.0,
        attention_tflops=362.0,
        window_attention_tflops=90.0,
        memory_gbps=864,
        intra_gbps=25,
        inter_gbps=6.25,
        h2d_gbps=25,
    ),
}

# Ray's `accelerator_type:NAME` resource (ray.util.accelerators names) -> the datasheet above that describes it.
# Ray calls an H100 PCIe "H100" too, and an A100 of either memory size "A100" ("A100-80G" is a label a node gets
# only from `ray start --resources`): such a cluster names its profile itself (`plan.hardware`, e.g. a
# `dhp bench ops` JSON measured on it).
RAY_ACCELERATORS = {"H100": "h100-sxm", "H200": "h200", "A100-80G": "a100-80gb", "L40S": "l40s"}

FITTED = Path(__file__).resolve().parents[2] / "docs" / "results" / "time_model_fit.json"


def fitted_efficiency() -> dict[str, float]:
    """The efficiency factors fitted on the reference's rows (docs/results/time_model_fit.json), else 1."""
    if FITTED.exists():
        return json.loads(FITTED.read_text())["efficiency"]
    return {"matmul": 1.0, "attention": 1.0, "comm": 1.0, "call_s": 0.0}


def datasheet(name: str, **overrides: Any) -> Profile:
    """A named GPU's profile with the fitted efficiency; `overrides` replace any field (e.g. intra_gbps)."""
    if name not in DATASHEETS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(DATASHEETS)} (or a `dhp bench ops` JSON path)")
    eff = fitted_efficiency()
    fields = dict(DATASHEETS[name], efficiency=eff, source="datasheet x fitted efficiency (docs/time_model.md)")
    return _with(Profile(name=name, **fields), overrides)


def measured(path: str | Path, **overrides: Any) -> Profile:
    """The profile `dhp bench ops --json PATH` wrote."""
    return from_measurement(json.loads(Path(path).read_text()), f"measured by dhp bench ops ({path})", **overrides)


def from_measurement(raw: dict[str, Any], source: str, **overrides: Any) -> Profile:
    """A `dhp bench ops` result (its JSON object) as a Profile."""
    h2d = raw.get("h2d_gbps") or raw["memory_gbps"] / 2
    fields = dict(
        name=raw["name"],
        kind=raw["kind"],
        devices_per_node=int(raw["devices_per_node"]),
        memory_gib=float(raw["memory_gib"]),
        matmul_tflops=raw["matmul_tflops"],
        attention_tflops=raw["attention_tflops"],
        window_attention_tflops=raw["window_attention_tflops"],
        memory_gbps=raw["memory_gbps"],
        intra_gbps=raw.get("all_reduce_gbps") or h2d,
        inter_gbps=raw.get("all_reduce_gbps") or h2d,
        h2d_gbps=h2d,
        object_store_gbps=raw.get("object_store_gbps") or h2d,
        op_latency_s=raw["op_latency_s"],
        collective_latency_s=raw.get("collective_latency_s") or 0.0,
        call_latency_s=raw.get("call_latency_s") or 0.0,
        matmul_by_size=raw.get("matmul_by_size", []),
        all_to_all_gbps=raw.get("all_to_all_gbps"),
        all_gather_gbps=raw.get("all_gather_gbps"),
        efficiency=dict(raw.get("efficiency") or {}),
        attention_head_dim=int(raw.get("attention_head_dim") or 128),
        attention_by_head_dim=raw.get("attention_by_head_dim", []),
        causal_attention_tflops=raw.get("causal_attention_tflops"),
        attention_backward_ratio=raw.get("attention_backward_ratio") or 2.0,
        optimizer_s_per_param=raw.get("optimizer_s_per_param"),
        memory_passes=int(raw.get("memory_passes", 4)),
        **{f"{k}_by_size": raw.get(f"{k}_by_size") or [] for k in ("all_reduce", "all_gather", "all_to_all")},
        zero3_unit_s=raw.get("zero3_unit_s"),
        zero3_s_per_byte=raw.get("zero3_s_per_byte"),
        zero3_optimizer_s_per_tensor=raw.get("zero3_optimizer_s_per_tensor") or 0.0,
        zero1_step_s_per_tensor=raw.get("zero1_step_s_per_tensor") or 0.0,
        source=source,
    )
    return _with(Profile(**fields), overrides)


def profile(name_or_path: str, **overrides: Any) -> Profile:
    """`--gpu`: a datasheet name, or the path of a `dhp bench ops` JSON."""
    if name_or_path in DATASHEETS:
        return datasheet(name_or_path, **overrides)
    if Path(name_or_path).exists():
        return measured(name_or_path, **overrides)
    raise ValueError(f"--gpu {name_or_path!r}: not a known GPU ({', '.join(DATASHEETS)}) nor a profile file")


def _with(p: Profile, overrides: dict[str, Any]) -> Profile:
    known = {f.name for f in dataclasses.fields(Profile)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown profile field(s) {bad}; known: {', '.join(sorted(known))}")
    return dataclasses.replace(p, **overrides)
