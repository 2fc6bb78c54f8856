"""`dhp bench pipeline`'s pool-scaling scenario: a vision-bound run, the same actors split two ways.

A vision-heavy model (Tv ~ 3 Tt per micro-batch, the `vision_heavy` shape) on `actors` stage actors:
  even     Dv = Dt = actors / 2 (what dhp allowed before fan-in: vision replica i fed text replica i)
  fan_in   Dv = actors - 1 vision replicas feeding Dt = 1 text replica (models/parallel/routing.py)
Same samples, same global batch, pipelined (max_in_flight 3). Per layout:
  step_s            median measured train_step time on this machine
  predicted_step_s  routing.simulate_calls of that layout's submission list with the uncontended per-
                    micro-batch costs calibrated in-process (`bench_pipeline.calibrate`: Tv, Tt; Tv split
                    into forward and backward as the run's trace splits it), plus the run's measured tail
                    (grad norm, optimizer): the step with one core per actor. The traced per-call costs
                    themselves are not used: with more actors than cores they carry the contention.
The speedup is `even / fan_in` of each. On a machine with fewer cores than actors (this 2-core one with
4 actors), every layout is CPU-bound at total work / cores, so the measured speedup is ~1 there by
construction; the predicted one is what dedicated devices would see (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import statistics
import time

ACTORS = 4


def _layouts(actors: int) -> dict[str, tuple[int, int]]:
    return {"even": (actors // 2, actors // 2), "fan_in": (actors - 1, 1)}


def _batches(samples: list[dict], text_replicas: int):
    """The samples as one-sample micro-batches, split evenly over the text replicas (in order)."""
    from dhp.scripts.bench.pipeline import global_batch

    per = len(samples) // text_replicas
    return [global_batch(samples[t * per : (t + 1) * per]) for t in range(text_replicas)]


def _vision_call_costs(events: list[dict]) -> dict[str, float]:
    """Median seconds of the vision forward and backward calls in one step's trace (every rank)."""
    return {
        name: statistics.median(e["end"] - e["start"] for e in events if e["stage"] == "vision" and e["name"] == name)
        for name in ("forward", "backward")
    }


def run_layout(
    name: str, dv: int, dt: int, samples: list[dict], model_config, preset: dict, costs: tuple[float, float]
) -> dict:
    """One layout's measured and predicted step; `costs`: calibrated (Tv, Tt) seconds per micro-batch."""
    from dhp.models.parallel.routing import route, simulate_calls
    from dhp.stages.config import load_config
    from dhp.stages.trace import STEP_TAIL
    from dhp.stages.trainer import Trainer

    pools = [
        f"{s}.{kv}"
        for s in ("vision", "text")
        for kv in ("parallelism=none", "degree=1", "num_cpus_per_actor=0.5", "torch_threads=1")
    ]
    cfg = load_config(
        "tiny",
        [
            *pools,
            f"vision.num_actors={dv}",
            f"text.num_actors={dt}",
            "pipeline.placement=disjoint",
            "pipeline.trace=true",
            f"training.global_batch_size={len(samples)}",
            "training.steps=100000",
            "training.warmup_steps=0",
            "training.lr=1e-6",
        ],
    )
    batches = _batches(samples, dt)
    trainer = Trainer(cfg, model_config=model_config)
    steps, predicted = [], []
    try:
        for i in range(preset["warmup"] + preset["steps"]):
            trainer.events = []
            metrics = trainer.train_step(batches)
            end = time.time()
            if i < preset["warmup"]:
                continue
            traced = _vision_call_costs(trainer.events)
            forward = costs[0] * traced["forward"] / (traced["forward"] + traced["backward"])
            tail = end - max(e["end"] for e in trainer.events if e["name"] not in STEP_TAIL)
            calls = route(
                [[mb.meta.patches for mb in b.microbatches] for b in batches],
                dv,
                False,
                False,
                cfg.pipeline.max_in_flight,
            )
            predicted.append(simulate_calls(calls, forward, costs[1], costs[0] - forward)[0] + tail)
            steps.append(metrics["step_time_s"])
            loss = metrics["loss"]
    finally:
        trainer.shutdown()
    return {
        "layout": name,
        "vision_replicas": dv,
        "text_replicas": dt,
        "step_s": statistics.median(steps),
        "predicted_step_s": statistics.median(predicted),
        "loss": loss,
    }


def run(samples: list[dict], model_config, preset: dict, costs: tuple[float, float], actors: int = ACTORS) -> dict:
    """The scenario's row: both layouts and the speedups (measured, predicted)."""
    layouts = {
        name: run_layout(name, dv, dt, samples, model_config, preset, costs)
        for name, (dv, dt) in _layouts(actors).items()
    }
    even, fan = layouts["even"], layouts["fan_in"]
    return {
        "scenario": "vision_bound_scaling",
        "actors": actors,
        "cpus": os.cpu_count(),
        "microbatches": len(samples),
        "tv_s": round(costs[0], 4),
        "tt_s": round(costs[1], 4),
        "layouts": list(layouts.values()),
        "speedup": round(even["step_s"] / fan["step_s"], 4),
        "predicted_speedup": round(even["predicted_step_s"] / fan["predicted_step_s"], 4),
    }


def samples_needed(microbatches: int, actors: int = ACTORS) -> int:
    """Micro-batches divisible by both layouts' text replica counts."""
    per = actors // 2
    return -(-microbatches // per) * per


def table(row: dict) -> str:
    lines = [
        f"vision_bound_scaling: {row['actors']} actors on {row['cpus']} CPUs, {row['microbatches']} "
        f"micro-batches, calibrated Tv {row['tv_s'] * 1e3:.0f} ms, Tt {row['tt_s'] * 1e3:.0f} ms",
        f"{'layout':8}{'Dv':>4}{'Dt':>4}{'step_s':>9}{'pred_s':>9}",
    ]
    for r in row["layouts"]:
        lines.append(
            f"{r['layout']:8}{r['vision_replicas']:4d}{r['text_replicas']:4d}{r['step_s']:9.3f}"
            f"{r['predicted_step_s']:9.3f}"
        )
    lines.append(
        f"speedup fan_in over even: measured {row['speedup']:.2f}, predicted (one core per actor) "
        f"{row['predicted_speedup']:.2f}"
    )
    return "\n".join(lines)
