"""`dhp train`: the training loop of the single controller.

It reads like a single-process script; `Trainer` hides the pools and loaders. The next global batch is
requested before the current step runs, so preprocessing overlaps compute.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ray

from dhp.dataflow.synth import write_synthetic_dataset
from dhp.stages import run_log
from dhp.stages.checkpoint_files import latest_valid, verify
from dhp.stages.config import Config, ConfigError, one_line, save_config


def resolve_data(cfg: Config) -> tuple[list[str], list[str], str]:
    """(train files, eval files, image root); writes the synthetic set when `data.train` is empty."""
    d = cfg.data
    if not d.train:
        s = d.synthetic
        synth = write_synthetic_dataset(s.dir, s.num, seed=s.seed, eval_num=s.eval_num)
        return [str(synth.train_path.resolve())], [str(synth.val_path.resolve())], str(synth.out_dir.resolve())
    from dhp.dataflow.sources import expand_paths, record_format
    from dhp.dataflow.storage import filesystem_of_all, require_file, resolve

    storage = resolve(d.storage)
    train, evals = expand_paths(d.train, storage), expand_paths(d.eval, storage)  # lists, braces, globs
    for paths in (train, evals):
        if paths:
            filesystem_of_all(paths, storage)  # one Ray Data read per split: one kind of storage each
            if not record_format(d, paths).missing_ok:  # a missing shard is a counted skip; a missing
                for p in paths:  # annotation file stops the run here, naming its key (local or s3://)
                    require_file(p, storage)
    root = d.image_root or os.path.dirname(train[0])
    return train, evals, root if "://" in root else os.path.abspath(root)


def make_run_dir(cfg: Config) -> Path:
    name = cfg.output.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.output.dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def init_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        from dhp.stages.rendezvous import local_ray_on_loopback

        local_ray_on_loopback()  # a local run listens on 127.0.0.1 only
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=True)


def check_attention(implementation: str) -> None:
    """The asked-for attention kernel must be importable here, before Ray starts (else every actor would fail
    its setup with an ImportError minutes later)."""
    import importlib.util

    if implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed: "
            "install it (pip install flash-attn --no-build-isolation, CUDA only) or use "
            "model.attn_implementation=sdpa (PyTorch's SDPA, with a flash kernel on CUDA)"
        )


def check_memory(cfg: Config, model_config: Any) -> None:
    """Refuse a layout the memory plan (models/memory_plan.py) says will not fit its GPUs, with the plan's table
    and what would fit; `training.skip_memory_check=true` starts anyway."""
    from dhp.models.memory_plan import advice, plan, table

    result = plan(cfg, model_config)
    if result["fits"] is False and not cfg.training.skip_memory_check:
        tips = "; ".join(advice(cfg, result, model_config))
        raise ConfigError(
            f"this layout does not fit its GPUs (dhp plan):\n{table(result)}\nwhat would fit: {tips}; or "
            f"training.skip_memory_check=true to start anyway"
        )


def train(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to completion; returns the run summary (also written to RUN_DIR/summary.json)."""
    from dhp.stages.pools import check_layout
    from dhp.stages.trainer import Trainer, model_config_of  # heavy imports: after config errors are out

    check_attention(cfg.model.attn_implementation)
    check_layout(cfg, model_config_of(cfg))  # before Ray starts or anything is written
    check_memory(cfg, model_config_of(cfg))
    run_dir = make_run_dir(cfg)
    train_paths, eval_paths, image_root = resolve_data(cfg)
    started_ray = not ray.is_initialized()
    init_ray(cfg)
    faults: list[dict[str, Any]] = []
    try:
        while True:  # one pass per attempt: a dead stage actor costs a rebuild and a resume, not the run
            trainer = None
            try:
                trainer = Trainer(cfg, train_paths, eval_paths, image_root)
                summary = _loop(cfg, trainer, run_dir, after_fault=bool(faults))
                break
            except Exception as e:  # noqa: BLE001 (sorted out below: only a lost actor is retried)
                if trainer is None or not _lost_an_actor(e, trainer):
                    raise
                faults.append({"detected_at": time.time(), "error": _one_line(e)})
                if len(faults) > cfg.training.max_restarts:
                    raise TrainingFailed(
                        f"a stage actor died and training.max_restarts={cfg.training.max_restarts} restarts are "
                        f"used up; last error: {faults[-1]['error']}"
                    ) from None
                print(f"fault: {faults[-1]['error']}; rebuilding both pools and resuming from the last checkpoint "
                      f"(restart {len(faults)}/{cfg.training.max_restarts})", flush=True)
            finally:
                if trainer is not None:
                    trainer.shutdown()  # every actor and placement group of this attempt: nothing orphaned
    finally:
        if started_ray:
            ray.shutdown()
    summary["restarts"] = faults
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class TrainingFailed(RuntimeError):
    """The run cannot continue (restarts used up); the message says why, for a one-line CLI error."""


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {one_line(e)[:300]}"


def _lost_an_actor(error: Exception, trainer) -> bool:
    """Was `error` caused by a stage or loader actor dying (as opposed to a bug, which is not retried)?

    A dead actor's own calls raise RayActorError; calls that depended on its outputs, or that waited in a
    collective with it, fail with other errors. So: look for an actor that no longer answers.
    """
    if isinstance(error, ray.exceptions.RayActorError):
        return True
    if not isinstance(error, ray.exceptions.RayError):
        return False
    actors = [a for _, pool in trainer.pools() for a in pool.actors] + trainer.loaders
    pings = [a.__ray_ready__.remote() for a in actors]
    try:
        ray.get(pings, timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def _resume_point(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to continue from: `training.resume` = auto (newest valid in this run), none, or a path."""
    resume = cfg.training.resume
    if resume == "none":
        return None
    if resume != "auto":
        problem = verify(Path(resume))
        if problem:
            raise FileNotFoundError(f"training.resume={resume}: not a usable checkpoint ({problem})")
        return Path(resume)
    ckpt, notes = latest_valid(run_dir / "checkpoints")
    for note in notes:
        print(f"resume: skipping {note}", flush=True)
    return ckpt


def _lines_before(path: Path, step: int) -> list[str]:
    """JSONL lines of `path` whose `step` is before `step` (what a resumed run keeps)."""
    if step <= 1 or not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step]


def _loop(cfg: Config, trainer, run_dir: Path, after_fault: bool = False) -> dict[str, Any]:
    t = cfg.training
    steps, history, eval_loss, first = t.steps, [], None, 1
    start = time.perf_counter()
    ckpt_root = run_dir / "checkpoints"
    # After a fault, this run's own newest checkpoint, whatever `training.resume` said at the start.
    resumed = latest_valid(ckpt_root)[0] if after_fault else _resume_point(cfg, run_dir)
    if resumed is not None:
        first = trainer.restore_checkpoint(resumed) + 1
        print(f"resumed from {resumed} (step {first - 1})", flush=True)
    peak = run_log.peak_of(cfg, trainer)  # before the first step: a CPU peak measured during one reads low
    if not after_fault:
        print(run_log.startup_summary(cfg, run_dir, first, peak), flush=True)
    metrics_path, quarantine_path = run_dir / "metrics.jsonl", run_dir / "quarantine.jsonl"
    kept, kept_quarantine = _lines_before(metrics_path, first), _lines_before(quarantine_path, first)
    history = [json.loads(line)["loss"] for line in kept]
    pending = trainer.next_batch()
    board = run_dir / "tensorboard" if cfg.output.tensorboard else None
    with open(metrics_path, "w") as metrics, open(quarantine_path, "w") as quarantine, \
            run_log.Progress(steps, first - 1, every=t.log_every * 10) as bar, run_log.TensorBoard(board, first) as tb:
        metrics.writelines(line + "\n" for line in kept)  # the steps before the resume point, as they were
        quarantine.writelines(line + "\n" for line in kept_quarantine)
        for step in range(first, steps + 1):
            waited = time.perf_counter()  # the stages idle while the driver waits for the next global batch
            batches, pending = ray.get(pending), (trainer.next_batch() if step < steps else None)
            waited = time.perf_counter() - waited
            for b in batches:  # every skipped record with its source location (file:line) and reason
                quarantine.writelines(json.dumps({"step": step, **q}) + "\n" for q in b.quarantined)
            quarantine.flush()
            stats = trainer.train_step(batches)
            record = {"step": step, **stats, **run_log.throughput(batches, trainer.model_config,
                                                                   stats["step_time_s"], peak.flops)}
            record.update(data_wait_s=round(waited, 4), time=time.time())
            if step == steps or (t.eval_every and step % t.eval_every == 0):
                record["eval_loss"] = eval_loss = trainer.evaluate()
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            tb.log(record)
            if step == steps or (t.checkpoint_every and step % t.checkpoint_every == 0):
                trainer.save_checkpoint(ckpt_root, batches)
            history.append(record["loss"])
            bar.update(record)
    if cfg.pipeline.trace:
        trainer.write_trace(run_dir / "trace.json")
    if cfg.output.save_final_checkpoint:
        trainer.save_weights(run_dir / "checkpoint")  # Hugging Face format
    summary = {
        "run_dir": str(run_dir),
        "steps": steps,
        "resumed_from": str(resumed) if resumed else None,
        "first_loss": history[0] if history else None,
        "final_loss": sum(history[-5:]) / len(history[-5:]) if history else None,
        "eval_loss": eval_loss,
        "wall_s": time.perf_counter() - start,
        "skipped": trainer.skip_report(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
