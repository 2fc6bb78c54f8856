"""What a user sees while training: the start-up summary, the progress bar or log lines, per-step
throughput and MFU, and TensorBoard scalars. The driver's loop calls these; none of them touches a tensor.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import ray
from tqdm import tqdm

from dhp.models.planning.flops import actor_peak, mfu, model_flops
from dhp.models.precision import precision_of
from dhp.stages.config import Config


@dataclass
class Peak:
    flops: float  # FLOP/s of all stage actors together: the MFU denominator per second
    description: str


def peak_of(cfg: Config, trainer: Any) -> Peak:
    """Sum over both pools of actors x per-actor peak.

    Per-actor peak: `output.peak_tflops` if set; else asked of one actor of each pool (datasheet figure
    of its GPU times `num_gpus_per_actor`, so actors sharing a GPU share its peak; or a matmul measured
    on its CPU threads).
    """
    per_stage = {}
    for stage, pool in trainer.pools():
        if cfg.output.peak_tflops is not None:
            per_stage[stage] = {"tflops": cfg.output.peak_tflops, "device": "output.peak_tflops", "gpu": False}
        else:
            dtype = precision_of(cfg.model.precision).compute_dtype(cfg.model.dtype)
            per_stage[stage] = ray.get(pool.actors[0].__ray_call__.remote(actor_peak, dtype))
            per_stage[stage]["device"] += f", {per_stage[stage]['source']}"
    measured = [p for p in per_stage.values() if "measured" in p.get("source", "")]
    for p in measured:  # the same device measured twice: the better window is the nearer one to its peak
        p["tflops"] = max(q["tflops"] for q in measured if q["device"] == p["device"])
    total, parts = 0.0, []
    for stage, info in per_stage.items():
        s = getattr(cfg, stage)
        per = info["tflops"] * (s.num_gpus_per_actor if info["gpu"] else 1.0)
        total += per * 1e12 * s.num_actors
        parts.append(f"{stage} {s.num_actors} x {per:.4g} TFLOP/s ({info['device']})")
    return Peak(total, "peak for MFU: " + "; ".join(parts))


def startup_summary(cfg: Config, run_dir: Path, first: int, peak: Peak) -> str:
    """Three lines: the run, the layout of the two pools, and the MFU denominator."""
    t, m = cfg.training, cfg.model
    stages = []
    for stage in ("vision", "text"):
        s = getattr(cfg, stage)
        actors = f"{s.num_actors} actor{'s' * (s.num_actors != 1)}"
        stages.append(
            f"{stage} {s.parallelism} x{s.degree} ({actors}, dp {s.num_actors // s.degree}, "
            f"{s.num_cpus_per_actor:g} CPU {s.num_gpus_per_actor:g} GPU each)"
        )
    return "\n".join(
        [
            f"run {run_dir}: steps {first}-{t.steps}, global batch {t.global_batch_size}, model "
            f"{m.path or m.name} ({m.dtype})",
            f"layout: {', '.join(stages)}; pipeline max_in_flight {cfg.pipeline.max_in_flight}, "
            f"placement {cfg.pipeline.placement}",
            peak.description,
        ]
    )


def throughput(batches: list[Any], model_config: Any, step_time_s: float, peak_flops: float) -> dict[str, Any]:
    """Per-step token counts, achieved model TFLOP/s and MFU from the micro-batches' metadata."""
    metas = [mb.meta for b in batches for mb in b.microbatches]
    flops = model_flops(model_config, metas)
    return {
        "vision_tokens": sum(m.patches for m in metas),  # patches through the vision encoder
        "text_tokens": sum(m.tokens for m in metas),  # unpadded decoder tokens, image placeholders included
        # padding / all decoder token slots of the step (0 with data.packing: nothing is padded)
        "padding_share": _sig(1 - sum(m.tokens for m in metas) / max(1, sum(m.padded_tokens for m in metas))),
        "model_tflops_per_s": _sig(flops / step_time_s / 1e12),
        "mfu": _sig(mfu(flops, step_time_s, peak_flops)),
    }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def eta_s(remaining: int, done: int, elapsed_s: float) -> float | None:
    """Seconds left at the mean pace of `done` steps that took `elapsed_s`; None before any step."""
    return remaining * elapsed_s / done if done > 0 else None


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """tqdm on a terminal; elsewhere (a Ray Job's log, a pipe) one line every `every` steps, plus the first
    and last step of the run. The ETA is paced on the steps of this process only: after a resume the steps
    restored from the checkpoint took no time here, and the first step here carries start-up costs."""

    def __init__(
        self, total: int, done: int = 0, every: int = 10, interactive: bool | None = None, file: TextIO | None = None
    ):
        self.total, self.done, self.every = total, done, max(1, every)
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.file = file
        self.bar = tqdm(
            total=total,
            initial=done,
            desc="train",
            unit="step",
            disable=not self.interactive,
            file=file,
            dynamic_ncols=True,
        )
        self.mark: tuple[float, int] | None = None  # (time, step) after this process's first step
        self.start = time.perf_counter()
        self.eval_loss: float | None = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def eta(self, step: int) -> float | None:
        now = time.perf_counter()
        if self.mark is None or step == self.mark[1]:  # one step so far: its pace is all there is
            return eta_s(self.total - step, step - self.done, now - self.start)
        return eta_s(self.total - step, step - self.mark[1], now - self.mark[0])

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.mark is None:
            self.mark = (time.perf_counter(), step)
        if record.get("eval_loss") is not None:
            self.eval_loss = record["eval_loss"]
        self.bar.update(1)
        post = dict(
            loss=f"{record['loss']:.3f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            mfu=f"{record['mfu']:.2%}",
            busy_vt=f"{record['vision_busy']:.2f}/{record['text_busy']:.2f}",
            bubble=f"{record['bubble']:.2f}",
        )
        if self.eval_loss is not None:
            post["eval"] = f"{self.eval_loss:.3f}"
        self.bar.set_postfix(post)
        if not self.interactive and (step % self.every == 0 or step == self.total or step == self.mark[1]):
            print(self.line(record), file=self.file or sys.stdout, flush=True)

    def line(self, record: dict[str, Any]) -> str:
        step = record["step"]
        text = (
            f"step {step}/{self.total} loss {record['loss']:.4f} tok/s {record['tokens_per_s']:.0f} "
            f"mfu {record['mfu']:.2%} busy vision/text {record['vision_busy']:.2f}/{record['text_busy']:.2f} "
            f"bubble {record['bubble']:.2f} eta {fmt_duration(self.eta(step))}"
        )
        if record.get("eval_loss") is not None:
            text += f" eval_loss {record['eval_loss']:.4f}"
        return text


# metrics.jsonl field -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "model_tflops_per_s": "throughput/model_tflops_per_s",
    "mfu": "throughput/mfu",
    "vision_busy": "pipeline/vision_busy",
    "text_busy": "pipeline/text_busy",
    "bubble": "pipeline/bubble",
    "eval_loss": "eval/loss",
}


class TensorBoard:
    """Scalars of each step under RUN_DIR/tensorboard; a no-op when `log_dir` is None.

    `first_step` is passed as `purge_step`: TensorBoard then hides whatever an earlier process of this run
    wrote from that step on, as metrics.jsonl drops those lines, so a resumed run shows each step once.
    """

    def __init__(self, log_dir: Path | None, first_step: int):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir), purge_step=first_step)

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.writer is not None:
            self.writer.close()

    def log(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, tag in TAGS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], record["step"])
        for module, lr in record.get("lrs", {}).items():  # each trained module's LR (models/fine_tuning.py)
            self.writer.add_scalar(f"train/lr/{module}", lr, record["step"])
        self.writer.flush()
