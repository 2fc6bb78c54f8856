"""The layouts of N devices ranked by the time model's predicted step: `dhp plan --search` and
`dhp train plan.layout=auto` (stages/auto_layout.py) both ask `search`.

`prepare` fills in what a device count implies on a GPU profile: `num_gpus_per_actor` (shared placement: both
pools' actor b on GPU b, half a GPU each; disjoint: one each, the pools side by side), `model.dtype: bfloat16`,
the GPU's memory for the memory plan, and a micro-batch of at least one sample (`data.microbatch_tokens` >=
P/4 + T, or the longest sample of the mix). `predict` is one configuration's step and memory; `candidates`
every layout of the devices; `search` the ones that fit, fastest first.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from typing import Any

from dhp.errors import ConfigError
from dhp.models.activation_checkpointing import ActivationCheckpointing
from dhp.models.planning.hardware import Profile
from dhp.models.planning.time_model import Workload, step_time

GIB = 2**30


def prepare(cfg: Any, prof: Profile, gpus: int | None, w: Workload, longest: int | None = None) -> Any:
    """A copy of `cfg` as it would run on `gpus` devices of `prof` (module docstring); `longest`: the tokens
    of the longest sample a micro-batch must take (default `w`'s)."""
    cfg = copy.deepcopy(cfg)
    tokens = w.sample_tokens if longest is None else longest
    if cfg.data.microbatch_tokens < tokens:
        cfg.data.microbatch_tokens = tokens
    cfg.data.max_seq_len = min(cfg.data.max_seq_len, cfg.data.microbatch_tokens)
    cfg.data.max_seq_len = max(cfg.data.max_seq_len, tokens)
    if prof.kind != "gpu":
        return cfg
    nv, nt = cfg.vision.num_actors, cfg.text.num_actors
    shared = cfg.pipeline.shared
    need = max(nv, nt) if shared else nv + nt
    if gpus is not None and gpus != need:
        how = (
            f"shared placement puts vision actor b and text actor b on GPU b: max(vision.num_actors, "
            f"text.num_actors) = {need}"
            if shared
            else f"disjoint pools: vision.num_actors + text.num_actors = {need}"
        )
        raise ConfigError(
            f"--gpus {gpus} does not match the layout ({how}); set the pools' num_actors to fill "
            f"{gpus} GPUs or pass --gpus {need}"
        )
    per_gpu = 0.5 if shared and min(nv, nt) == max(nv, nt) else 1.0
    cfg.vision.num_gpus_per_actor = cfg.text.num_gpus_per_actor = per_gpu
    if shared and nv != nt:  # the larger pool's extra actors have a GPU to themselves
        cfg.vision.num_gpus_per_actor = cfg.text.num_gpus_per_actor = 0.5
    cfg.model.dtype = "bfloat16"
    cfg.training.gpu_memory_gib = prof.memory_gib
    return cfg


def predict(cfg: Any, mc: Any, prof: Profile, w: Workload, mix: list[dict] | None = None) -> dict[str, Any]:
    """`step_time` plus the memory plan of the same configuration: `fits`, GiB per device. With `mix` (a
    length profile's samples) the step of that mix (`length_mix.mixed_step_time`), memory at its largest
    micro-batch."""
    from dhp.models.planning.length_mix import mixed_step_time
    from dhp.models.planning.memory_plan import plan

    if mix is None:
        result = step_time(cfg, mc, prof, w)
        patches = result["largest_microbatch_patches"]
    else:
        result = mixed_step_time(cfg, mc, prof, mix)
        patches = result["memory_patches"]
    mem = plan(cfg, mc, prof.memory_gib if prof.kind == "gpu" else None, vision_patches=patches)
    return {
        **result,
        "fits": mem["fits"] is not False,
        "memory_per_device_gib": mem["per_device"] / GIB,
        "memory_source": mem["device_source"],
        "memory_patches": patches,
        "layout": describe(cfg),
    }


def describe(cfg: Any) -> str:
    from dhp.models.parallel.layouts import layout_class

    def pool(stage: str) -> str:
        s = getattr(cfg, stage)
        reps = s.num_actors // s.degree
        return f"{layout_class(stage, s.parallelism).label}{s.degree if s.degree > 1 else ''}" + (
            f" x{reps}" if reps > 1 else ""
        )

    ac = "/".join("AC" if ActivationCheckpointing.of(s).recomputes else "-" for s in (cfg.vision, cfg.text))
    return (
        f"vision {pool('vision')} | text {pool('text')} | {cfg.pipeline.placement} | "
        f"in flight {cfg.pipeline.max_in_flight} | ckpt {ac} | {cfg.model.precision}"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _stage_options(stage: str, n: int) -> list[tuple[str, int]]:
    """(parallelism, degree) of one pool of n ranks, for every layout of the stage: one with a model-parallel
    group (its `check_degree` takes 2) at every divisor of n above 1, the others (plain replicas, ZeRO-3 over the
    pool) at degree 1."""
    from dhp.models.parallel.layouts import available, layout_class

    out = []
    for kind in available(stage):
        if layout_class(stage, kind).check_degree(stage, 2) is None:
            out += [(kind, d) for d in _divisors(n) if d > 1]
        else:
            out.append((kind, 1))
    return out


def candidates(base: Any, gpus: int) -> list[Any]:
    """Every layout of `gpus` GPUs: per pool a parallelism and degree, the replicas filling the pool, shared
    (both pools on every GPU) or disjoint (the GPUs split); pipelining and micro-batch size come after."""
    out = []
    splits = [("shared", gpus, gpus)] + [("disjoint", v, gpus - v) for v in range(1, gpus)]
    for placement, nv, nt in splits:
        for (vk, vd), (tk, td) in itertools.product(_stage_options("vision", nv), _stage_options("text", nt)):
            cfg = copy.deepcopy(base)
            cfg.pipeline.placement = placement
            for s, kind, d, n in ((cfg.vision, vk, vd, nv), (cfg.text, tk, td, nt)):
                s.parallelism, s.degree, s.num_actors = kind, d, n
                s.activation_checkpointing = "none"
            out.append(cfg)
    return out


# The keys a search sets: the layout's pools (`candidates`), then its levers (`search`)
LAYOUT_KEYS = tuple(f"{s}.{k}" for s in ("vision", "text") for k in ("parallelism", "degree", "num_actors")) + (
    "pipeline.placement",
)
MEMORY_LEVERS = ("vision.activation_checkpointing", "text.activation_checkpointing", "model.precision")
SEARCHED_KEYS = (*LAYOUT_KEYS, "pipeline.max_in_flight", "data.microbatch_tokens", *MEMORY_LEVERS)
LEVERS = [
    (va, ta, precision)
    for precision in ("fp32", "bf16")
    for va, ta in (("none", "none"), ("full", "none"), ("none", "full"), ("full", "full"))
]


def value_at(cfg: Any, key: str) -> Any:
    """The value of a dotted key (`vision.parallelism`) in a config."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def search(
    base: Any,
    mc: Any,
    prof: Profile,
    gpus: int,
    w: Workload,
    mix: list[dict] | None = None,
    keep: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Ranked predictions of the layouts that fit: for each layout, micro-batch samples 1/2/4, in-flight
    1/2/4, and the first memory lever that makes it fit: fp32 master states before pure bf16 (a choice of
    numerics, not only of speed), and within each, no recomputation before checkpointing a pool. With `mix`
    (a length profile's samples) each is predicted on the mix and a micro-batch takes 1/2/4 median samples'
    tokens, at least the longest sample's. `keep`: keys of SEARCHED_KEYS whose value in `base` every layout
    has (only the layouts with those pools, that budget, in-flight count, recomputation or precision)."""
    from dhp.models.parallel.checks import check_layout
    from dhp.models.planning.length_mix import longest, summary

    sample_tokens = w.sample_tokens if mix is None else summary(mix, [])["tokens_per_sample"]["p50"]
    least = None if mix is None else longest(mix)
    keep = set(keep)
    budgets = [max(n * sample_tokens, least or 0) for n in (1, 2, 4)]
    if "data.microbatch_tokens" in keep:
        budgets = [base.data.microbatch_tokens]
    flights = [base.pipeline.max_in_flight] if "pipeline.max_in_flight" in keep else [1, 2, 4]
    levers = list(
        dict.fromkeys(tuple(value_at(base, k) if k in keep else v for k, v in zip(MEMORY_LEVERS, lv)) for lv in LEVERS)
    )
    fixed = [k for k in LAYOUT_KEYS if k in keep]

    rows = []
    for layout in candidates(base, gpus):
        if any(value_at(layout, k) != value_at(base, k) for k in fixed):
            continue
        for budget, in_flight in itertools.product(budgets, flights):
            cfg = copy.deepcopy(layout)
            cfg.data.microbatch_tokens = budget
            cfg.pipeline.max_in_flight = in_flight
            try:
                check_layout(cfg, mc)
                cfg = prepare(cfg, prof, gpus, w, least)
            except ConfigError:
                continue
            for va, ta, precision in levers:
                cfg.vision.activation_checkpointing, cfg.text.activation_checkpointing = va, ta
                cfg.model.precision = precision
                r = predict(cfg, mc, prof, w, mix)
                if r["fits"]:
                    rows.append({**r, "config": copy.deepcopy(cfg)})
                    break
    rows.sort(key=lambda r: -r["vision_tokens_per_s"])
    return rows


def search_table(rows: list[dict[str, Any]], top: int) -> str:
    samples = "samples / largest micro-batch" if rows and "mix" in rows[0] else "samples / micro-batch"
    lines = [
        f"| # | layout | {samples} | step s | vision tokens/s | GiB / GPU |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rows[:top], 1):
        lines.append(
            f"| {i} | {r['layout']} | {r['samples_per_microbatch']} | {r['step_s']:.3f} | "
            f"{r['vision_tokens_per_s']:.0f} | {r['memory_per_device_gib']:.1f} |"
        )
    return "\n".join(lines)
