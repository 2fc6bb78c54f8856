"""Pipelined vs serial micro-batch order: step time against each pool's own work (`dhp bench pipeline`).

One vision actor and one text actor, `disjoint` placement, one Ray CPU and one torch thread each: on a
2-core machine each pool then owns a core, and one actor per pool is the cleanest overlap measurement
(no collectives, no replicas). Three scenarios set the per-micro-batch costs through the model shape:
`balanced` (Tv ~ Tt), `vision_heavy` (Tv ~ 3 Tt) and `text_heavy` (Tt ~ 3 Tv).

Per scenario, one Trainer runs the same global batch (M one-sample micro-batches, really preprocessed
from the synthetic set) first in the serial order (pipeline.max_in_flight=1), then pipelined (the default, 3).
  vision_s / text_s   each pool alone: the summed durations of its traced calls (forward, backward,
                      forward_backward, grad_norm, optimizer_step) in a step, the smaller of the serial and the
                      pipelined step's (both are in the row). Serial is not always the faster: there the
                      two actors take turns and may share a core's caches; pipelined they contend for
                      the CPU. The smaller one is the least disturbed, and it makes ratio_to_max >= 1.
  *_step_s            median train_step time (accumulate + grad norm + optimizer) after warm-up.
  ratio_to_max        pipelined_step_s / max(vision_s, text_s); fill and drain cost about 1/M of it.
  predicted_step_s    schedule.simulate with the serial step's per-call costs, plus its tail (the time
                      after the last forward/backward: grad norm, optimizer steps, round trips).
  driver_overhead_ms  median time the driver spends submitting, per micro-batch.
Goals (flags in the JSON, never asserted): ratio_to_max <= 1.15, speedup >= 1.3 when balanced,
driver_overhead_ms <= 2. A fourth row, `vision_bound_scaling`, compares the same actors split Dv = Dt and
Dv > Dt (fan-in) on a vision-bound model (scripts/bench/pool_scaling.py). Chrome traces of one serial and
one pipelined step per scenario, a text timeline of them and a PNG of the same timelines (`plot_timelines`)
are written next to the JSON.

`--mix long-tail` measures instead the step against the balanced bound on a long-tailed image mix, with the
micro-batches grouped by tokens (`data.balance` off) and by predicted cost (on): scripts/bench/long_tail.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dhp.stages.config import PipelineConfig
from dhp.stages.trace import STEP_TAIL

GOAL_RATIO, GOAL_SPEEDUP, GOAL_OVERHEAD_MS = 1.15, 1.3, 2.0
MODES = (("serial", 1), ("pipelined", PipelineConfig().max_in_flight))  # (name, max_in_flight): the default
SCENARIOS = ("balanced", "vision_heavy", "text_heavy")
PANELS: list[tuple[str, list[dict], tuple[float, float]]] = []  # one measured step per scenario and mode
PAD_ID = 151643  # <|endoftext|>, as the loader pads
# M=16 makes fill + drain ~1/M of a step; the unit puts a light pool at ~30 ms per micro-batch, far above
# the ~1 ms a Ray call costs. Quick (the test): 3 micro-batches, small models, depth capped, < 60 s.
# `calibrate`: the two depths timed; far apart, since a text layer costs ~5 ms against a ~100 ms floor.
FULL = dict(
    microbatches=16,
    steps=5,
    warmup=2,
    unit_s=0.03,
    cap=48,
    calibrate=(1, 9),
    vision_hidden=128,
    vision_inter=512,
    text_inter=1024,
    mix_samples=32,  # --mix long-tail: the global batch, the shard's 32 photos (scripts/bench/long_tail.py)
    mix_scale=0.25,
    mix_depth=8,
    mix_layers=1,
)
QUICK = dict(
    microbatches=3,
    steps=2,
    warmup=1,
    unit_s=0.005,
    cap=4,
    calibrate=(1, 3),
    vision_hidden=64,
    vision_inter=128,
    text_inter=176,
    mix_samples=8,
    mix_scale=0.125,
    mix_depth=2,
    mix_layers=1,
)


def model_config(preset: dict, depth: int, layers: int):
    """`tiny` with the vision depth/width and text layers/MLP width set. Tied word embeddings: the
    optimizer step over the 152 k-row embedding and lm_head is per-step work no order can hide."""
    from transformers import Qwen2_5_VLConfig

    from dhp.models.architectures import ARCHITECTURES, architecture_config

    tiny, base = ARCHITECTURES["tiny"], architecture_config("tiny")
    vision = dict(
        tiny["vision"],
        depth=depth,
        hidden_size=preset["vision_hidden"],
        intermediate_size=preset["vision_inter"],
        fullatt_block_indexes=list(range(1, depth, 2)),
        out_hidden_size=tiny["text"]["hidden_size"],
    )
    text = dict(
        tiny["text"], num_hidden_layers=layers, intermediate_size=preset["text_inter"], tie_word_embeddings=True
    )
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config = Qwen2_5_VLConfig(
        vision_config=vision, text_config=text, tie_word_embeddings=True, **{k: getattr(base, k) for k in ids}
    )
    config._attn_implementation = "sdpa"
    return config


def load_samples(n: int, root: Path) -> list[dict]:
    """n preprocessed samples: one 224x224 image, one round each, so every micro-batch costs the same."""
    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.dataflow.synth import write_synthetic_dataset
    from dhp.models.architectures import architecture_config

    s = write_synthetic_dataset(
        root / "synth", n, eval_num=0, min_size=224, max_size=224, multi_image_fraction=0.0, multi_turn_fraction=0.0
    )
    pre = Preprocessor(PreprocessSettings(str(s.out_dir), 56 * 56, 224 * 224, 1024), architecture_config("tiny"))
    lines = s.train_path.read_text().splitlines()
    return [decode_sample(pre({"source": "bench", "record": line})["sample"]) for line in lines]


def global_batch(samples: list[dict]):
    """One GlobalBatch, one sample per micro-batch, put in the object store once (as tests/test_parity.py)."""
    import ray

    from dhp.dataflow.loader import GlobalBatch, MicroBatch, split_for_ranks
    from dhp.dataflow.packing import meta_of, text_inputs, vision_inputs

    mbs = []
    for s in samples:
        vision, text = vision_inputs([s]), text_inputs([s], pad_id=PAD_ID)
        parts = split_for_ranks(vision, text, 0, None)  # no sequence parallelism: one part
        mbs.append(MicroBatch([ray.put(p) for p in parts], ray.put(text), meta_of(vision, text)))
    return GlobalBatch(mbs, epoch=0)


def _fwd_bwd_seconds(stage: str, preset: dict, n: int, v: dict, t: dict, reps: int) -> float:
    """Median seconds of one forward + backward of the stage at depth (layers) n, after one warm-up call."""
    from dhp.models.qwen2_5_vl import TextModel, VisionModel

    torch.manual_seed(0)
    mc = model_config(preset, n, 1) if stage == "vision" else model_config(preset, 1, n)
    model = VisionModel(mc) if stage == "vision" else TextModel(mc)
    rows = int((t["input_ids"] == mc.image_token_id).sum())
    embeds = torch.randn(rows, mc.text_config.hidden_size, requires_grad=True)
    times = []
    for _ in range(reps + 1):  # the first call pays allocator and first-dispatch costs: dropped
        start = time.perf_counter()
        if stage == "vision":
            model(v["pixel_values"], v["image_grid_thw"]).sum().backward()
        else:
            model(t["input_ids"], embeds, t["position_ids"], t["attention_mask"], t["labels"]).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def calibrate(sample: dict, preset: dict, reps: int) -> dict[str, tuple[float, float]]:
    """Per-micro-batch fwd+bwd seconds = a + b * depth for each stage, from two depths timed in-process.

    Two points, because neither cost goes through zero: the text stage's 152 k-vocabulary embedding
    gradient and lm_head, the vision patch embedding and merger are paid at any depth. One thread, as
    the actors run."""
    from dhp.dataflow.packing import text_inputs, vision_inputs

    v, t = vision_inputs([sample]), text_inputs([sample], pad_id=PAD_ID)
    lo, hi = preset["calibrate"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fits = {}
    try:
        for stage in ("vision", "text"):
            t_lo, t_hi = (_fwd_bwd_seconds(stage, preset, n, v, t, reps) for n in (lo, hi))
            slope = max((t_hi - t_lo) / (hi - lo), 1e-4)  # noise must not make depth free
            fits[stage] = (max(t_lo - slope * lo, 0.0), slope)
    finally:
        torch.set_num_threads(threads)
    return fits


def depth_for(target: float, fit: tuple[float, float], cap: int) -> int:
    return int(min(cap, max(1, round((target - fit[0]) / fit[1]))))


def plan(fits: dict, unit: float, cap: int) -> dict[str, tuple[int, int, float]]:
    """scenario -> (vision depth, text layers, intended Tv/Tt). The light unit stays above half the text
    stage's floor (fit intercept), so that a 3x heavier text stage is reachable by adding layers."""
    cost = {s: (lambda n, f=fits[s]: f[0] + f[1] * n) for s in fits}
    unit = max(unit, cost["text"](1) / 2)
    layers = depth_for(2 * unit, fits["text"], cap)
    balanced = (depth_for(cost["text"](layers), fits["vision"], cap), layers, 1.0)
    layers = depth_for(unit, fits["text"], cap)
    vision_heavy = (depth_for(3 * cost["text"](layers), fits["vision"], cap), layers, 3.0)
    depth = depth_for(unit, fits["vision"], cap)
    text_heavy = (depth, depth_for(3 * cost["vision"](depth), fits["text"], cap), 1 / 3)
    return dict(zip(SCENARIOS, (balanced, vision_heavy, text_heavy)))


STEP_CALLS = (
    ("vision", "forward"),
    ("vision", "backward"),
    ("text", "forward_backward"),
    ("vision", "optimizer_step"),
    ("text", "optimizer_step"),
)


def step_numbers(metrics: dict, events: list[dict], wall: tuple[float, float]) -> dict:
    """One step's numbers from train_step's metrics and its rank-0 trace events."""
    events = [e for e in events if e["rank"] == 0]  # one actor per pool here
    out = {f"{s}_s": sum(e["end"] - e["start"] for e in events if e["stage"] == s) for s in ("vision", "text")}
    for stage, name in STEP_CALLS:  # mean seconds per call
        ds = [e["end"] - e["start"] for e in events if e["stage"] == stage and e["name"] == name]
        out[f"{stage}_{name}"] = sum(ds) / max(1, len(ds))
    # After the last forward/backward: grad norms, both optimizer steps, the round trips.
    out["tail_s"] = wall[1] - max(e["end"] for e in events if e["name"] not in STEP_TAIL)
    keys = ("step_time_s", "loss", "driver_ms_per_microbatch", "vision_busy", "text_busy", "bubble")
    return out | {k: metrics[k] for k in keys}


def run_mode(trainer, batch, k: int, warmup: int, steps: int) -> tuple[dict, list[dict], tuple[float, float]]:
    """Median numbers of `steps` steps after `warmup`, plus the last step's events (for the trace)."""
    trainer.cfg.pipeline.max_in_flight = k  # read at every accumulate
    rows = []
    for i in range(warmup + steps):
        trainer.events = []  # filled by train_step's drain (pipeline.trace=True): this step's calls only
        start = time.time()
        metrics = trainer.train_step([batch])
        wall = (start, time.time())
        if i >= warmup:
            rows.append(step_numbers(metrics, trainer.events, wall))
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}, trainer.events, wall


def timeline(events: list[dict], wall: tuple[float, float], width: int = 100) -> list[str]:
    """Two text rows (vision, text): F/B forward/backward, T text forward_backward, n grad norm, o optimizer,
    . idle."""
    marks = {"forward": "F", "backward": "B", "forward_backward": "T", "grad_norm": "n", "optimizer_step": "o"}
    span = wall[1] - wall[0]
    lines = []
    for stage in ("vision", "text"):
        row = ["."] * width
        for e in (e for e in events if e["stage"] == stage and e["rank"] == 0):
            lo, hi = (int((t - wall[0]) / max(span, 1e-9) * width) for t in (e["start"], e["end"]))
            for j in range(max(0, lo), min(width, max(hi, lo + 1))):
                row[j] = marks.get(e["name"], "?")
        lines.append(f"{stage:6s} |{''.join(row)}|")
    return lines


def plot_timelines(panels: list[tuple[str, list[dict], tuple[float, float]]], path: Path) -> None:
    """One panel per (title, events, wall window): rank 0 of each pool as bars, colour by call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "forward": "tab:blue",
        "backward": "tab:cyan",
        "forward_backward": "tab:orange",
        "optimizer_step": "tab:gray",
    }
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.3 * len(panels)), squeeze=False)
    for ax, (title, events, (t0, t1)) in zip(axes[:, 0], panels):
        for y, stage in enumerate(("text", "vision")):
            for name, colour in colours.items():
                bars = [
                    (e["start"] - t0, e["end"] - e["start"])
                    for e in events
                    if e["stage"] == stage and e["rank"] == 0 and e["name"] == name
                ]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colour, label=name if y == 1 or stage == "text" else None)
        ax.set_yticks([0, 1], ["text", "vision"])
        ax.set_xlim(0, t1 - t0)
        ax.set_title(title, fontsize=9, loc="left")
    handles = {h.get_label(): h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles.values(), handles.keys(), loc="upper right", ncol=4, fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scenario(
    name: str, plan_row: tuple, preset: dict, batch, out: Path | None, trainers: Any
) -> tuple[dict, list[str]]:
    """(the scenario's row, its timeline text), on a trainer from `trainers` (stages/trainer.py `LastTrainer`:
    every scenario has one actor per pool, so the last scenario's trainer is rebuilt for this one's model)."""
    from dhp.models.parallel.schedule import pipeline_schedule, simulate
    from dhp.stages.config import load_config
    from dhp.stages.trace import write_chrome_trace

    (depth, layers, intended), m = plan_row, len(batch.microbatches)
    pools = [
        f"{s}.{kv}"
        for s in ("vision", "text")
        for kv in ("parallelism=none", "num_actors=1", "degree=1", "num_cpus_per_actor=1", "torch_threads=1")
    ]
    cfg = load_config(
        "tiny",
        [
            *pools,
            "pipeline.placement=disjoint",
            "pipeline.trace=true",
            f"training.global_batch_size={m}",
            "training.steps=100000",
            "training.warmup_steps=0",
            "training.lr=1e-6",
        ],
    )  # the model barely moves: every step costs the same
    trainer = trainers.take(cfg, model_config=model_config(preset, depth, layers))
    res, texts = {}, [f"{name}: vision depth {depth}, text layers {layers}"]
    try:
        for mode, k in MODES:
            res[mode], events, wall = run_mode(trainer, batch, k, preset["warmup"], preset["steps"])
            texts += [f" {mode} (max_in_flight={k}), {wall[1] - wall[0]:.3f} s:", *timeline(events, wall)]
            PANELS.append((f"{name}, {mode} (max_in_flight={k}): {wall[1] - wall[0]:.2f} s", events, wall))
            if out is not None:
                write_chrome_trace(events, out.with_name(f"{out.stem}.{name}.{mode}.trace.json"))
    except BaseException:
        trainers.give_back(trainer, ok=False)
        raise
    trainers.give_back(trainer, ok=True)
    s, p = res["serial"], res["pipelined"]
    tv, tt = s["vision_forward"] + s["vision_backward"], s["text_forward_backward"]
    alone = {k: min(s[k], p[k]) for k in ("vision_s", "text_s")}  # each pool's own work (module docstring)
    bound = max(alone.values())

    def predicted(k: int) -> float:  # the order's best case with serial-mode call costs, plus the serial tail
        return simulate(pipeline_schedule(m, k), s["vision_forward"], tt, s["vision_backward"]).makespan + s["tail_s"]

    row = dict(
        scenario=name,
        microbatches=m,
        vision_depth=depth,
        text_layers=layers,
        intended_tv_over_tt=intended,
        tv_over_tt=tv / tt,
        vision_ms_per_mb=tv * 1e3,
        text_ms_per_mb=tt * 1e3,
        **alone,
        serial_step_s=s["step_time_s"],
        pipelined_step_s=p["step_time_s"],
        predicted_step_s=predicted(2),
        predicted_serial_step_s=predicted(1),
        ratio_to_max=p["step_time_s"] / bound,
        serial_ratio=s["step_time_s"] / bound,
        speedup=s["step_time_s"] / p["step_time_s"],
        driver_overhead_ms=p["driver_ms_per_microbatch"],
        driver_overhead_ms_serial=s["driver_ms_per_microbatch"],
        serial_vision_s=s["vision_s"],
        serial_text_s=s["text_s"],
        pipelined_vision_s=p["vision_s"],
        pipelined_text_s=p["text_s"],
        serial_tail_s=s["tail_s"],
        pipelined_tail_s=p["tail_s"],
        serial_loss=s["loss"],
        pipelined_loss=p["loss"],
        **{f"{mode}_{k}": res[mode][k] for mode, _ in MODES for k in ("vision_busy", "text_busy", "bubble")},
    )
    row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    row["goal"] = dict(
        ratio_to_max=row["ratio_to_max"] <= GOAL_RATIO,
        speedup=row["speedup"] >= GOAL_SPEEDUP if name == "balanced" else None,
        driver_overhead=row["driver_overhead_ms"] <= GOAL_OVERHEAD_MS,
    )
    return row, texts


def table(rows: list[dict]) -> str:
    head = (
        f"{'scenario':13}{'Tv/Tt':>6}{'vision_s':>9}{'text_s':>8}{'serial':>8}{'pipe':>8}{'pred':>8}"
        f"{'pipe/max':>9}{'ser/max':>8}{'speedup':>8}{'drv ms':>7}  goals"
    )
    lines = [head]
    for r in rows:
        goals = " ".join(f"{k}={'-' if v is None else 'ok' if v else 'MISS'}" for k, v in r["goal"].items())
        lines.append(
            f"{r['scenario']:13}{r['tv_over_tt']:6.2f}{r['vision_s']:9.3f}{r['text_s']:8.3f}"
            f"{r['serial_step_s']:8.3f}{r['pipelined_step_s']:8.3f}{r['predicted_step_s']:8.3f}"
            f"{r['ratio_to_max']:9.3f}{r['serial_ratio']:8.3f}{r['speedup']:8.3f}"
            f"{r['driver_overhead_ms']:7.2f}  {goals}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhp bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here (traces and timelines beside it)")
    p.add_argument("--quick", action="store_true", help="3 micro-batches, 2 steps, small models (< 60 s)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 5, quick 2)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 12, quick 3)")
    p.add_argument(
        "--scenario",
        action="append",
        choices=[*SCENARIOS, "vision_bound_scaling"],
        default=None,
        help="run only this scenario (repeatable; default: all four)",
    )
    add_mix_arguments(p)
    return p.parse_args(argv)


def add_mix_arguments(p: Any) -> None:
    p.add_argument(
        "--mix",
        choices=["long-tail"],
        default=None,
        help="instead of the scenarios: balance off vs on on a long-tailed image mix (scripts/bench/long_tail.py)",
    )
    p.add_argument("--scale", type=float, default=None, help="--mix: photo side scale (default 0.25, quick 0.125)")
    p.add_argument("--packed", action="store_true", help="--mix: the text packed (data.packing), not padded")


def main(args=None) -> int:
    PANELS.clear()
    if args is None or isinstance(args, list):
        args = parse_args(args)
    preset = dict(QUICK if args.quick else FULL)
    for key in ("microbatches", "steps"):
        preset[key] = preset[key] if getattr(args, key) is None else getattr(args, key)
    if preset["microbatches"] < 1 or preset["steps"] < 1:
        from dhp.stages.config import ConfigError

        raise ConfigError(f"--microbatches and --steps must be >= 1 (got {args.microbatches}, {args.steps})")
    out = Path(args.json) if args.json else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)  # the traces are written there as the scenarios finish
    if getattr(args, "mix", None):
        return main_mix(args, preset, out)
    import ray

    from dhp.stages.rendezvous import local_ray_on_loopback
    from dhp.stages.trainer import LastTrainer

    own_ray = not ray.is_initialized()  # a caller's Ray (the tests' session fixture) is reused, left running
    rows, texts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        from dhp.scripts.bench import pool_scaling as scaling

        samples = load_samples(scaling.samples_needed(preset["microbatches"]), Path(tmp))
        fits = calibrate(samples[0], preset, reps=1 if args.quick else 3)
        print(
            "calibration, seconds per micro-batch = a + b * depth: "
            + ", ".join(f"{s} a={a * 1e3:.1f} ms b={b * 1e3:.2f} ms" for s, (a, b) in fits.items()),
            flush=True,
        )
        if own_ray:
            # 4 logical CPUs on 2 cores: the trainer's resource check also reserves CPU for data loaders,
            # which are not started here (the batch is built in this process); the pools take 1 CPU each
            # (the scaling scenario: 4 actors of 0.5).
            local_ray_on_loopback()
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            batch = global_batch(samples[: preset["microbatches"]])
            chosen = args.scenario or [*SCENARIOS, "vision_bound_scaling"]
            trainers = LastTrainer()
            try:
                for name in (n for n in SCENARIOS if n in chosen):
                    row, text = run_scenario(
                        name, plan(fits, preset["unit_s"], preset["cap"])[name], preset, batch, out, trainers
                    )
                    rows.append(row)
                    texts += text
                    # The actors' costs differ from the in-process calibration (by ~10-30% here): rescale each
                    # stage's fit by measured / predicted, so the later scenarios land nearer their ratio.
                    for stage, n in (("vision", row["vision_depth"]), ("text", row["text_layers"])):
                        a, b = fits[stage]
                        c = row[f"{stage}_ms_per_mb"] / 1e3 / (a + b * n)
                        fits[stage] = (a * c, b * c)
            finally:  # the scaling scenario needs the CPUs it held
                trainers.close()
            if "vision_bound_scaling" in chosen:
                depth, layers, _ = plan(fits, preset["unit_s"], preset["cap"])["vision_heavy"]
                costs = (fits["vision"][0] + fits["vision"][1] * depth, fits["text"][0] + fits["text"][1] * layers)
                rows.append(scaling.run(samples, model_config(preset, depth, layers), preset, costs))
                texts.append(scaling.table(rows[-1]))
        finally:
            if own_ray:
                ray.shutdown()
    pipelined = [r for r in rows if r["scenario"] in SCENARIOS]
    if pipelined:
        print(table(pipelined))
    if len(pipelined) < len(rows):
        print(scaling.table(rows[-1]))
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
        out.with_name(f"{out.stem}.timelines.txt").write_text("\n".join(texts) + "\n")
        if PANELS:
            plot_timelines(PANELS, out.with_name(f"{out.stem}.timelines.png"))
        print(f"rows: {out}; Chrome traces and text timelines beside it ({out.stem}.*)")
    return 0


def main_mix(args: Any, preset: dict, out: Path | None) -> int:
    """`--mix long-tail`: its rows (balance off, then on) as a table and, with --json, the JSON."""
    import ray

    from dhp.scripts.bench import long_tail
    from dhp.stages.rendezvous import local_ray_on_loopback

    scale = preset["mix_scale"] if args.scale is None else args.scale
    if not 0 < scale <= 1:
        from dhp.stages.config import ConfigError

        raise ConfigError(f"--scale must be in (0, 1] (got {scale})")
    own_ray = not ray.is_initialized()
    if own_ray:  # as `main`: 4 logical CPUs; the pools take 2 (two vision replicas of 0.5, text 1)
        local_ray_on_loopback()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = long_tail.run(preset, preset["steps"], scale, args.packed)
    finally:
        if own_ray:
            ray.shutdown()
    print(long_tail.table(rows))
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
        print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pipeline", help="pipelined vs serial micro-batch order: step time, bubble, overhead")
    p.add_argument("--json", default=None, help="write the rows here (traces beside it)")
    p.add_argument("--quick", action="store_true", help="a tiny measured set (for tests)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 5)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 12)")
    p.add_argument(
        "--scenario",
        action="append",
        default=None,
        choices=["balanced", "vision_heavy", "text_heavy", "vision_bound_scaling"],
        help="run only this scenario (repeatable; default: all four)",
    )
    add_mix_arguments(p)
