"""`dhp train`: the training loop of the single controller.

It reads like a single-process script; `Trainer` hides the pools and loaders. The next global batch is
requested before the current step runs, so preprocessing overlaps compute.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray

from dhp.dataflow.synth import write_synthetic_dataset
from dhp.errors import DataError
from dhp.stages import run_log
from dhp.stages.checkpoint_files import Newest, latest_valid, resume_from
from dhp.stages.config import Config, ConfigError, one_line, save_config
from dhp.stages.node_probe import lost_nodes
from dhp.stages.preemption import Preempted, Preemption
from dhp.stages.preflight import HEAD_ADDRESS, check_attention, check_reachable, preflight, ray_address
from dhp.stages.rebalance import Rebalanced, Rebalancer
from dhp.stages.step_ledger import StepInvariantError
from dhp.stages.step_logs import StepLogs
from dhp.stages.watchdog import DataStalled, StepClock, StepHung


def resolve_data(cfg: Config) -> tuple[list[str], list[str], str]:
    """(train files, eval files, image root); writes the synthetic set when `data.train` is empty."""
    d = cfg.data
    if not d.train:
        s = d.synthetic
        synth = write_synthetic_dataset(s.dir, s.num, seed=s.seed, eval_num=s.eval_num, video_fraction=s.video_fraction)
        # data.synthetic.eval_num=0: no held-out split (its empty file would evaluate to a loss of nothing)
        evals = [str(synth.val_path.resolve())] if s.eval_num else []
        return [str(synth.train_path.resolve())], evals, str(synth.out_dir.resolve())
    from dhp.dataflow.sources import expand_paths, record_format
    from dhp.dataflow.storage import filesystem_of_all, require_file, resolve

    storage = resolve(d.storage)
    train, evals = expand_paths(d.train, storage), expand_paths(d.eval, storage)  # lists, braces, globs
    for paths in (train, evals):
        if paths:
            filesystem_of_all(paths, storage)  # one Ray Data read per split: one kind of storage each
            if not record_format(d, paths).missing_ok:  # a missing shard is a counted skip; a missing
                # annotation file stops the run here, naming its key (local or s3://); so do training files
                # that are all empty (Ray Data would read no record and the stream would stop at its start)
                sizes = [require_file(p, storage) for p in paths]
                if paths is train and all(size == 0 for size in sizes):
                    raise DataError(f"data.train: every annotation file is empty ({', '.join(train)})")
    root = d.image_root or os.path.dirname(train[0])
    return train, evals, root if "://" in root else os.path.abspath(root)


def make_run_dir(cfg: Config) -> Path:
    name = cfg.output.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.output.dir) / name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output.dir={cfg.output.dir}: the run directory {run_dir} cannot be made ({e.strerror or e})"
        ) from None
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def init_ray(cfg: Config) -> None:
    """Connect to `ray.address` (or `RAY_ADDRESS`), else start a local Ray; a line says which and what it has."""
    if ray.is_initialized():
        return
    begun = time.monotonic()
    key, address = ray_address(cfg)
    if address:
        check_reachable(key, address)
        try:
            ray.init(address=address, log_to_driver=True)
        except ConnectionError as e:  # something answers there, but not a Ray head's GCS
            raise ConfigError(f"{key}={address}: {one_line(e)}; {HEAD_ADDRESS}") from None
    else:
        from dhp.stages.rendezvous import local_ray_on_loopback

        local_ray_on_loopback()  # a local run listens on 127.0.0.1 only
        # address="local": a Ray of its own, as `ray.address: null` promises; without it Ray joins the cluster a
        # `ray start` on this machine last recorded, and waits minutes on it when that head is gone.
        # Ray's notices at a local start (token auth is on, as dhp wants it; "Started a local Ray instance") are not
        # the user's business: the console keeps dhp's own lines and Ray's warnings about the run itself.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(
            address="local",
            num_cpus=cfg.ray.num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
    print(f"{ray_line(address)} in {time.monotonic() - begun:.1f} s", flush=True)


def ray_line(address: str | None) -> str:
    """`ray: connected to ADDRESS` or `ray: started a local Ray`, with its nodes, CPUs and GPUs."""
    have = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    what = f"connected to {address}" if address else "started a local Ray"
    return (
        f"ray: {what} ({nodes} node{'s' if nodes != 1 else ''}, {have.get('CPU', 0):g} CPUs, "
        f"{have.get('GPU', 0):g} GPUs)"
    )


class NewTrainers:
    """Where `train` gets each attempt's trainer: a new one, shut down after the attempt (what a run does).

    `take` has `Trainer`'s arguments; `give_back(trainer, ok)` ends the attempt (`ok`: it trained to the end).
    Another source may keep a trainer for a later run of the same pool shape (`Trainer.reuse`)."""

    def take(self, cfg: Config, *args: Any, **kwargs: Any) -> Any:
        from dhp.stages.trainer import Trainer

        return Trainer(cfg, *args, **kwargs)

    def give_back(self, trainer: Any, ok: bool) -> None:
        trainer.shutdown()  # every actor and placement group of this attempt: nothing orphaned


def train(cfg: Config, keep: list[str] | None = None, trainers: Any = None) -> dict[str, Any]:
    """Run `cfg` to completion; returns the run summary (also written to RUN_DIR/summary.json). `keep`: the layout
    keys the command line set, which `plan.layout=auto` keeps (stages/auto_layout.py). `trainers`: where each
    attempt's trainer comes from (`NewTrainers` by default)."""
    check_attention(cfg.model.attn_implementation)
    started_ray = not ray.is_initialized()
    if cfg.plan.searched:  # the layouts of the devices Ray reports: Ray starts before the layout's checks
        cfg = _choose_layout(cfg, keep or [], started_ray)
    preflight(cfg)  # before anything is written (and, unless auto, before Ray starts)
    train_paths, eval_paths, image_root = resolve_data(cfg)  # missing or empty files: before the run directory
    run_dir = make_run_dir(cfg)
    init_ray(cfg)
    faults: list[dict[str, Any]] = []
    clock = StepClock(cfg.training.step_timeout_s, cfg.training.step_timeout_min_s)  # learned across restarts
    preemption = Preemption(cfg.training.preempt_grace_s)
    way = None  # how the last fault failed (`_way`)
    moves: list[dict[str, Any]] = []  # pipeline.rebalance: each move (`Move.record`)
    trainers = trainers or NewTrainers()
    try:
        with preemption.installed():
            while True:  # one pass per attempt: a fault costs a rebuild and a resume, not the run
                trainer, ok = None, False
                try:
                    wait_s = cfg.training.rebuild_timeout_s if faults else 0.0
                    trainer = trainers.take(cfg, train_paths, eval_paths, image_root, clock=clock, wait_s=wait_s)
                    summary = _loop(cfg, trainer, run_dir, preemption, after_fault=bool(faults or moves))
                    ok = True
                    break
                except Rebalanced as r:  # checkpointed at a step boundary: resume it in the moved layout
                    print(r.move.line(), flush=True)
                    moves.append(r.move.record(r.step))
                    cfg, ok = r.config, True
                    save_config(cfg, run_dir / "config.yaml")
                except Preempted as p:
                    print(p, flush=True)  # the line a person or a scheduler looks for
                    _write_summary(
                        run_dir,
                        {
                            "run_dir": str(run_dir),
                            "preempted": {
                                "step": p.step,
                                "checkpoint": str(p.checkpoint) if p.checkpoint else None,
                                "signal": p.signal_name,
                            },
                            "restarts": faults,
                        },
                    )
                    raise
                except StepInvariantError as e:  # a gradient that went nowhere: a bug, not retried; one line
                    raise TrainingFailed(one_line(getattr(e, "cause", e))) from None  # (an actor's: Ray's wrapper)
                except Exception as e:  # noqa: BLE001 (sorted out below: only a fault of the cluster is retried)
                    kind = fault_kind(e, trainer)
                    if kind is None:
                        raise
                    step = trainer.step if trainer is not None else None
                    faults.append({"kind": kind, "step": step, "detected_at": time.time(), "error": _one_line(e)})
                    way, last_way = _way(kind, step, e), way
                    if way == last_way:  # a restart did not get past it: it would fail there again and again
                        raise TrainingFailed(_repeated(faults[-2], faults[-1], len(faults) - 1)) from None
                    if len(faults) > cfg.training.max_restarts:
                        raise TrainingFailed(
                            f"{kind} and training.max_restarts={cfg.training.max_restarts} restarts are used up; "
                            f"last error: {faults[-1]['error']}"
                        ) from None
                    print(
                        f"fault ({kind}): {faults[-1]['error']}; rebuilding both pools and resuming from the last "
                        f"checkpoint (restart {len(faults)}/{cfg.training.max_restarts})",
                        flush=True,
                    )
                finally:
                    if trainer is not None:
                        trainers.give_back(trainer, ok)
    finally:
        if started_ray:
            ray.shutdown()
    summary["restarts"], summary["rebalanced"] = faults, moves
    _write_summary(run_dir, summary)
    return summary


def _choose_layout(cfg: Config, keep: list[str], started_ray: bool) -> Config:
    """`plan.layout=auto`: the config of the best layout of the cluster, its ranking printed; a Ray started
    here is shut down again when no layout is chosen."""
    from dhp.stages.auto_layout import choose_layout

    init_ray(cfg)
    try:
        cfg, lines = choose_layout(cfg, ray.cluster_resources(), keep)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    print("\n".join(lines), flush=True)
    return cfg


def _write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


class TrainingFailed(RuntimeError):
    """The run cannot continue (restarts used up, or a step whose forwards and backwards do not match); the message
    says why, for a one-line CLI error."""


def _way(kind: str, step: int | None, error: Exception) -> tuple:
    """How a fault failed, to tell a repeat: its kind, the step the trainer was at and, for a hang, the ranks named
    and their calls (a restarted rank has another pid, so that is not part of it)."""
    return kind, step, tuple(sorted(error.ranks)) if isinstance(error, StepHung) else ()


def _repeated(first: dict[str, Any], again: dict[str, Any], restarts: int) -> str:
    """The one line that stops a run whose step failed the same way after a restart."""
    where = f"step {first['step']}" if first["step"] is not None else "the start-up"

    def at(fault: dict[str, Any]) -> str:
        return time.strftime("%H:%M:%S", time.localtime(fault["detected_at"]))

    return (
        f"{where} failed the same way after restart {restarts}, so it would again: {first['kind']} both times, "
        f"at {at(first)} ({first['error']}) and at {at(again)} ({again['error']}); stopping instead of "
        f"restarting up to training.max_restarts times"
    )


def _one_line(e: Exception) -> str:
    """`Type: message` on one line; for an error raised in an actor, the actor's own exception (not Ray's wrapper
    with its traceback)."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    e = cause if isinstance(cause, BaseException) else e
    return f"{type(e).__name__}: {one_line(e)[:300]}"


def fault_kind(error: Exception, trainer) -> str | None:
    """What of the cluster failed, if `error` came from that (a bug is not retried): "a rank hung", "the data
    pipeline stalled", "a node died" or "a stage actor died"; None otherwise.

    A dead actor's own calls raise RayActorError; calls that depended on its outputs, or that waited in a
    collective with it, fail with other errors. So: look for an actor that Ray reports dead, and for a node of
    the pools that no longer answers.
    """
    if isinstance(error, StepHung):
        return "a rank hung"
    if isinstance(error, DataStalled):
        return "the data pipeline stalled"
    if trainer is None or not isinstance(error, ray.exceptions.RayError):
        return None
    if _lost_node(trainer, probe=False):
        return "a node died"
    if isinstance(error, ray.exceptions.RayActorError):  # an actor died: was its node lost with it?
        return "a node died" if _lost_node(trainer) else "a stage actor died"
    actors = [a for _, pool in trainer.pools() for a in pool.actors] + trainer.loaders
    # Each actor on its own: a dead one answers RayActorError at once; one that is merely slow to answer (a loaded
    # machine, a call still running) is alive, unless its node is gone. A hung rank is the step deadline's.
    probes = [a.__ray_ready__.remote() for a in actors]
    answered, late = ray.wait(probes, num_returns=len(probes), timeout=ACTOR_PROBE_S)
    dead = any(_died(ref) for ref in answered)
    if (dead or late) and _lost_node(trainer):
        return "a node died"
    return "a stage actor died" if dead else None


ACTOR_PROBE_S = 10.0  # how long `fault_kind` waits for every actor's answer before it asks about their nodes


def _died(probe: ray.ObjectRef) -> bool:
    try:
        ray.get(probe)
    except ray.exceptions.RayActorError:
        return True
    return False


NODE_PROBE_S = 10.0  # how long a node that held ranks has to run a task before it counts as lost


def _lost_node(trainer, probe: bool = True) -> bool:
    """Has a node that holds one of the pools' ranks left the cluster? Ray's node table says so only seconds
    after the node's actors fail, so with `probe` each node is also asked (stages/node_probe.py)."""
    used = {w["node_id"] for ranks in trainer.where.values() for w in ranks}
    return bool(lost_nodes(used, NODE_PROBE_S if probe else None))


def _loop(cfg: Config, trainer, run_dir: Path, preemption: Preemption, after_fault: bool = False) -> dict[str, Any]:
    t, start = cfg.training, time.perf_counter()
    # After a fault, this run's own newest checkpoint, whatever `training.resume` said at the start.
    resumed = (Newest() if after_fault else resume_from(t.resume)).point(run_dir)
    first = trainer.restore_checkpoint(resumed) + 1 if resumed is not None else 1
    if resumed is not None:
        print(f"resumed from {resumed} (step {first - 1})", flush=True)
    if preemption.requested:  # during start-up: nothing trained since `resumed`
        raise Preempted(first - 1, resumed, preemption.signal_name)
    peak = run_log.peak_of(cfg, trainer)  # before the first step: a CPU peak measured during one reads low
    if not after_fault:
        print(run_log.startup_summary(cfg, run_dir, first, peak), flush=True)
    saves, rebalancer = _Checkpoints(trainer, run_dir / "checkpoints", t), Rebalancer(cfg, trainer.model_config)
    pending, eval_loss = trainer.next_batch(), None
    with ExitStack() as stack:
        logs = stack.enter_context(StepLogs(run_dir, first))
        bar = stack.enter_context(run_log.Progress(t.steps, first - 1, every=t.log_every * 10))
        tb = stack.enter_context(
            run_log.TensorBoard(run_dir / "tensorboard" if cfg.output.tensorboard else None, first)
        )
        for step in range(first, t.steps + 1):
            waited = time.perf_counter()  # the stages idle while the driver waits for the next global batch
            batches = trainer.fetch(pending, f"the global batch of step {step}")
            pending = trainer.next_batch() if step < t.steps else None
            waited = time.perf_counter() - waited
            logs.skipped(step, batches)
            stats = trainer.train_step(batches)
            throughput = run_log.throughput(batches, trainer.model_config, stats["step_time_s"], peak.flops)
            record = {"step": step, **stats, **throughput, "data_wait_s": round(waited, 4), "time": time.time()}
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                record["eval_loss"] = eval_loss = trainer.evaluate()
            logs.trained(step, batches, record)
            tb.log(record)
            saved = saves.due(step, batches, stats["step_time_s"])
            bar.update(record)
            if step < t.steps:  # (after the last step the run simply finishes)
                _move_or_stop(rebalancer.after_step(record), preemption, saves, step, batches, saved)
    if cfg.output.save_final_checkpoint:
        trainer.save_weights(run_dir / "checkpoint")  # Hugging Face format; first: the weights matter more
    if cfg.pipeline.trace:
        trainer.write_trace(run_dir / "trace.json")
    summary = {
        "run_dir": str(run_dir),
        "steps": t.steps,
        "resumed_from": str(resumed) if resumed else None,
        "first_loss": logs.losses[0] if logs.losses else None,
        "final_loss": sum(logs.losses[-5:]) / len(logs.losses[-5:]) if logs.losses else None,
        "eval_loss": eval_loss,
        "wall_s": time.perf_counter() - start,
        "skipped": trainer.skip_report(),
    }
    _write_summary(run_dir, summary)
    return summary


def _move_or_stop(
    moved: tuple | None, preemption: Preemption, saves: _Checkpoints, step: int, batches: list, saved: Path | None
) -> None:
    """After a step that is not the last: a rebalancer's move (`moved`) or a preemption leaves the loop with the
    step's checkpoint (`saved`, else written now)."""
    ckpt = saves.now(batches, saved) if moved else None
    if ckpt:  # (a failed write: no move, the run continues in this layout)
        raise Rebalanced(moved[0], step, ckpt, moved[1])
    if preemption.requested:
        ckpt = saves.now(batches, saved) or latest_valid(saves.root)[0]  # a failed write: the newest intact one
        raise Preempted(step, ckpt, preemption.signal_name)


class _Checkpoints:
    """The run's checkpoints under `root`: at `training.checkpoint_every` and the last step (`due`), or when a move
    or a preemption needs one now (`now`); the attempt's first write is timed against `training.preempt_grace_s`."""

    def __init__(self, trainer, root: Path, t: Any):
        self.trainer, self.root, self.t = trainer, root, t
        self.grace_checked = False

    def due(self, step: int, batches: list, step_s: float) -> Path | None:
        """`step`'s checkpoint if one is due (None if not, or if its write failed)."""
        if not (step == self.t.steps or (self.t.checkpoint_every and step % self.t.checkpoint_every == 0)):
            return None
        save_start = time.perf_counter()
        saved = _save(self.trainer, self.root, batches, self.t)
        if not self.grace_checked:
            self.grace_checked = True
            _check_grace(step_s, time.perf_counter() - save_start, self.t.preempt_grace_s)
        return saved

    def now(self, batches: list, saved: Path | None) -> Path | None:
        """The step's checkpoint: `saved` if it was written, else written now (None if that write failed)."""
        return saved or _save(self.trainer, self.root, batches, self.t)


def _save(trainer, root: Path, batches: list, t: Any) -> Path | None:
    """Write the step's checkpoint. A failed write (a full disk, a refused write) is reported in one line with
    the state of the newest checkpoint, then the run continues (retrying at the next interval) or stops, as
    `training.on_checkpoint_error` says; a rank that died mid-write is a fault (the caller rebuilds the pools
    and resumes from that newest checkpoint). Returns the checkpoint, None if the write failed."""
    try:
        return trainer.save_checkpoint(root, batches)
    except Exception as e:  # noqa: BLE001 (re-raised below unless it is a failed write the policy continues after)
        previous, _ = latest_valid(root)
        kept = f"{previous.name} is intact (verified)" if previous else "there is no earlier checkpoint"
        cluster_fault = fault_kind(e, trainer)
        then = (
            "resuming from it after the rebuild"
            if cluster_fault
            else "stopping (training.on_checkpoint_error=stop)"
            if t.stops_on_checkpoint_error
            else "training continues, the next checkpoint is tried at its interval"
        )
        print(f"checkpoint of step {trainer.step} failed ({_one_line(e)}); {kept}; {then}", flush=True)
        if cluster_fault:
            raise  # the caller rebuilds the pools and resumes from `previous`
        if t.stops_on_checkpoint_error:
            raise TrainingFailed(
                f"the checkpoint of step {trainer.step} could not be written ({_one_line(e)}) and "
                f"training.on_checkpoint_error=stop"
            ) from None
        return None


def _check_grace(step_s: float, save_s: float, grace_s: float) -> None:
    if step_s + save_s > grace_s:
        print(
            f"warning: a step ({step_s:.1f} s) plus a checkpoint write ({save_s:.1f} s) take longer than "
            f"training.preempt_grace_s={grace_s:g} s: a preemption may end the run before its checkpoint is "
            f"written",
            flush=True,
        )
