"""The single controller's parts: build the pools and loaders, run one step, evaluate, export.

Everything here schedules: it holds object references and scalars, never a tensor payload. Pixels go
loader -> vision pool, tokens loader -> text pool, embeddings vision -> text, gradients text -> vision.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from dhp.dataflow.balance import text_cost
from dhp.dataflow.loader import GlobalBatch, loader_actor
from dhp.dataflow.positions import files_key, reshard
from dhp.dataflow.preprocess import PreprocessSettings
from dhp.dataflow.sources import record_format
from dhp.dataflow.storage import resolve as resolve_storage
from dhp.dataflow.video import VideoSettings
from dhp.models.architectures import architecture_config
from dhp.models.family import load_config as load_model_config
from dhp.models.fine_tuning import FineTuning
from dhp.models.parallel.checks import check_layout, replicas
from dhp.models.parallel.layouts import stage_layout
from dhp.models.parallel.routing import balance_text, route
from dhp.models.parallel.schedule import TEXT_FORWARD_BACKWARD, VISION_FORWARD
from dhp.models.planning.flops import step_flops
from dhp.models.weights.export import export_hf, write_meta
from dhp.stages.actor_group import CallLedger
from dhp.stages.checkpoint_files import commit, staging_dir
from dhp.stages.config import Config, save_config
from dhp.stages.fault_injection import misrouted
from dhp.stages.placement import LOADER_CPUS, check_resources, describe, place_pools
from dhp.stages.pools import TextPool, VisionPool
from dhp.stages.resume_checks import check_positions, check_resumable
from dhp.stages.stage_worker import clip_coefficient
from dhp.stages.step_ledger import StepInvariantError
from dhp.stages.text_worker import TextWorker
from dhp.stages.trace import STEP_TAIL, busy_fractions, with_ray_transfers, write_chrome_trace
from dhp.stages.vision_worker import VisionWorker
from dhp.stages.watchdog import StepClock, StepHung, wait_for_data, wait_or_hang

SAVE_DEADLINE = 10  # a checkpoint write may take this many step deadlines


def model_config_of(cfg: Config) -> Any:
    """The model's config: the checkpoint's (`model.path`, any family's) or the named shape's (`model.name`)."""
    if cfg.model.path:
        return load_model_config(cfg.model.path, cfg.model.attn_implementation)
    return architecture_config(cfg.model.name, cfg.model.attn_implementation)


def actor_kind(cfg: Config) -> tuple:
    """What fixes a trainer's actors apart from their number (a trainer of another config with actors of the same
    kind, and enough of them, can take them over: `Trainer.reuse`): per pool the per-actor resources and threads,
    the placement mode, and whether the boundary uses Ray Direct Transport (an actor option). Not the degree: a
    reused pool regroups."""
    stages = tuple(
        (s.num_cpus_per_actor, s.num_gpus_per_actor, s.torch_threads, tuple(sorted(s.resources.items())))
        for s in (cfg.vision, cfg.text)
    )
    return stages, cfg.pipeline.placement_mode.name, cfg.pipeline.transport.direct


def pool_shape(cfg: Config) -> tuple:
    """The pools' actors, (vision, text), and their kind (`actor_kind`): a trainer of the same shape is reused
    with no process started and no world formed again."""
    return (cfg.vision.num_actors, cfg.text.num_actors), actor_kind(cfg)


def preprocess_settings(cfg: Config, image_root: str, train_paths: list[str]) -> PreprocessSettings:
    """What the preprocessing of `cfg`'s data needs (dataflow/preprocess.py), built in the driver."""
    d = cfg.data
    return PreprocessSettings(
        image_root=image_root,
        min_pixels=d.min_pixels,
        max_pixels=d.max_pixels,
        max_seq_len=d.max_seq_len,
        tokenizer_path=cfg.model.tokenizer_dir,
        storage=resolve_storage(d.storage),  # credentials read here, in the driver, then carried to workers
        records=record_format(d, train_paths),  # JSONL or WebDataset shards (dataflow/sources.py)
        video=VideoSettings(**dataclasses.asdict(d.video)),  # frame sampling and size (dataflow/video.py)
    )


def trainer_for(cfg: Config, model_config: Any = None, previous: Trainer | None = None) -> Trainer:
    """A trainer of `cfg` at step 0: `previous` rebuilt for it when its pools have the same shape
    (`Trainer.reuse`, no process started), else a new one, `previous` shut down first (its resources freed).

    For callers that run several configs one after another on batches they build themselves (the benches)."""
    if previous is not None:
        if pool_shape(previous.cfg) == pool_shape(cfg):
            previous.reuse(cfg, model_config=model_config)
            return previous
        previous.shutdown()
    return Trainer(cfg, model_config=model_config)


class LastTrainer:
    """Where a caller that runs configs one after another gets its trainers (`take` / `give_back`, what
    `driver.train` and the tests' shared cache also answer): the last one given back is rebuilt for the next config
    when its pools have the same shape (`trainer_for`), else shut down; `close` shuts the kept one down."""

    def __init__(self) -> None:
        self.kept: Trainer | None = None

    def take(self, cfg: Config, model_config: Any = None) -> Trainer:
        previous, self.kept = self.kept, None
        return trainer_for(cfg, model_config, previous)

    def give_back(self, trainer: Trainer, ok: bool) -> None:
        """Keep `trainer` for the next config if it ended well (`ok`), else shut it down."""
        if ok:
            self.kept = trainer
        else:
            trainer.shutdown()

    def close(self) -> None:
        if self.kept is not None:
            self.kept.shutdown()
            self.kept = None


class Trainer:
    def __init__(
        self,
        cfg: Config,
        train_paths: list[str] | None = None,
        eval_paths: list[str] | None = None,
        image_root: str = "",
        model_config: Any = None,
        clock: StepClock | None = None,
        wait_s: float = 0.0,
        spares: tuple[int, int] = (0, 0),
    ):
        """`model_config` replaces the one `cfg.model` describes (benchmarks that vary the shape). `clock` gives
        each step its deadline (stages/watchdog.py; kept by the driver across restarts); `wait_s`: how long to
        wait for the cluster to offer the pools' resources (a rebuild after a fault). `spares`: (vision, text)
        actors started and placed beyond the pools' `num_actors`, idle until a `reuse` for larger pools takes them
        in (a cache of trainers whose configs differ in pool size: the tests')."""
        self._configure(cfg, model_config, clock)
        check_resources(cfg, wait_s)
        self.ledger = CallLedger()  # which call each stage rank is in (for the hang report)
        # The streams start while the pools build: Ray Data's start-up and the preprocessing processes' imports
        # (~5 s on 2 cores, `dhp bench data`) would otherwise be the first step's wait for data. The pools'
        # placement groups are reserved first all the same (their rendezvous needs every rank placed at once),
        # and `check_resources` left CPU for the data work beside them.
        self.loaders, self.eval_loader = [], None
        self.placement = self.vision = self.text = None  # built below; a failed build kills what it started
        try:
            self.placement = place_pools(cfg, spares=spares)
            opened = time.monotonic()
            started = self._open_streams(train_paths, eval_paths, image_root)
            self.vision = self._pool("vision", VisionPool, VisionWorker, spares[0])
            self.text = self._pool("text", TextPool, TextWorker, spares[1])
            # A stream that cannot start (no usable sample, a bad tokenizer) fails here, at start; one that hangs too.
            self.fetch(started, "the data streams' start", self._all_loaders())
            if started:
                streams = f"{len(started)} streams read their" if len(started) > 1 else "1 stream read its"
                waited = time.monotonic() - opened
                print(f"data: {streams} first rows {waited:.1f} s after the pools' build began", flush=True)
            self.where = {stage: ray.get([a.where.remote() for a in pool.actors]) for stage, pool in self.pools()}
        except BaseException:
            self.shutdown()
            raise
        print(describe(self.placement, self.where), flush=True)
        self.events: list[dict] = []  # every stage call so far, when `pipeline.trace` is on
        self.step = 0
        self._backwards: list[ray.ObjectRef] = []  # the vision backwards since the last optimizer step
        self._eval_batches: list[GlobalBatch] | None = None

    def _configure(self, cfg: Config, model_config: Any, clock: StepClock | None) -> None:
        """What a trainer of `cfg` decides before any actor is asked: the model's config, the layout checks, what
        trains, the step deadlines of this attempt and the text replicas."""
        self.cfg = cfg
        self.model_config = model_config or model_config_of(cfg)
        check_layout(cfg, self.model_config)
        self.fine_tuning = FineTuning(cfg)  # what trains (checked by check_layout)
        self.clock = clock or StepClock(cfg.training.step_timeout_s, cfg.training.step_timeout_min_s)
        self.clock.new_attempt()
        self.dp = replicas(cfg, "text")  # one sample stream per text replica (routing.py)

    def _open_streams(
        self, train_paths: list[str] | None, eval_paths: list[str] | None, image_root: str
    ) -> list[ray.ObjectRef]:
        """Start `self.cfg`'s data streams (one loader per text replica, one for evaluation); returns the refs of
        their start calls, for `fetch`."""
        cfg, d = self.cfg, self.cfg.data
        records = record_format(d, train_paths or [])
        self.train_files = (len(train_paths or []), files_key(train_paths or [], records.deals))  # what data positions
        # count in: a checkpoint's must be the same
        settings = preprocess_settings(cfg, image_root, train_paths or [])
        loader_cls = loader_actor(LOADER_CPUS)
        common = dict(
            settings=settings,
            model_config=self.model_config,
            global_batch_size=cfg.training.global_batch_size // self.dp,  # per replica
            microbatch_tokens=d.microbatch_tokens,
            workers=d.preprocess_workers,
            num_cpus=d.preprocess_num_cpus,
            vision_sp=stage_layout(cfg, "vision", self.model_config).loader_shards,
            packing=d.packing,  # one sequence per micro-batch (dataflow/packing.py); the text workers build for it
            balance=d.balance,  # micro-batches even in predicted cost (dataflow/balance.py)
        )
        self.loaders = [  # one disjoint sample stream per data-parallel replica
            loader_cls.remote(train_paths, seed=d.shuffle_seed, replica=r, num_replicas=self.dp, **common)
            for r in range(self.dp if train_paths else 0)
        ]
        # Evaluation runs on one replica per pool: its batches are whole global batches, the same in any layout.
        evals = common | {
            "global_batch_size": cfg.training.global_batch_size,
            "settings": dataclasses.replace(settings, records=record_format(d, eval_paths or [])),
        }
        self.eval_loader = loader_cls.remote(eval_paths, seed=None, repeat=False, **evals) if eval_paths else None
        return [loader.start.remote() for loader in self._all_loaders()]

    def _pool(self, stage: str, pool_cls: type, worker_cls: type, spares: int):
        s, transport = getattr(self.cfg, stage), self.cfg.pipeline.transport
        begun = time.monotonic()
        pool = pool_cls(
            stage,
            worker_cls,
            s.num_actors,
            init_args=(self.cfg, self.model_config),
            num_cpus=s.num_cpus_per_actor,
            num_gpus=s.num_gpus_per_actor,
            torch_threads=s.torch_threads,
            degree=s.degree,
            placement=getattr(self.placement, stage),
            ledger=self.ledger,
            tensor_transport=transport.direct,
            spares=spares,
        )
        pool.layout = stage_layout(self.cfg, stage, self.model_config)
        pool.transport = transport
        pool.trains = self.fine_tuning.trains(stage)
        extra = f" and {spares} spares" if spares else ""
        built_s = time.monotonic() - begun
        print(f"{stage} pool: {s.num_actors} ranks{extra} started and built in {built_s:.1f} s", flush=True)
        return pool

    def reuse(
        self,
        cfg: Config,
        train_paths: list[str] | None = None,
        eval_paths: list[str] | None = None,
        image_root: str = "",
        model_config: Any = None,
        clock: StepClock | None = None,
        wait_s: float = 0.0,
    ) -> None:
        """Become a new trainer of `cfg` (step 0) on the actors and process groups this one already has; the
        arguments are the constructor's, new data streams replace the old ones.

        Starting a pool costs a process per rank and its torch and transformers imports (about 9 CPU-s each on
        2 cores); a run of another config on actors of the same kind (`actor_kind`: resources, placement) needs
        none of that, only each rank's model and optimizer built again, and its groups, for another degree or
        another number of actors (`ActorGroup.resize`: the first of the actors started, the others idle as
        spares). `wait_s` has nothing to wait for (the pools' resources are held). Raises ValueError when the
        actors are of another kind or too few (`fits`)."""
        if not self.fits(cfg):
            raise ValueError(
                f"pools of {pool_shape(cfg)} do not fit on {pool_shape(self.cfg)} "
                f"(capacity: vision {self.vision.capacity}, text {self.text.capacity})"
            )
        self.close_streams()
        self._configure(cfg, model_config, clock)
        self.ledger.clear()
        for stage, pool in self.pools():
            pool.resize(getattr(cfg, stage).num_actors, getattr(cfg, stage).degree)
        started = self._open_streams(train_paths, eval_paths, image_root)
        # every rank of both pools at once: a layout's build (and a regroup) runs collectives within its pool
        rebuilt = [a.reconfigure.remote(cfg, self.model_config) for _, pool in self.pools() for a in pool.actors]
        ray.get(rebuilt)
        self.where = {stage: ray.get([a.where.remote() for a in pool.actors]) for stage, pool in self.pools()}
        for stage, pool in self.pools():
            pool.layout = stage_layout(cfg, stage, self.model_config)
            pool.transport = cfg.pipeline.transport
            pool.trains = self.fine_tuning.trains(stage)
        self.fetch(started, "the data streams' start", self._all_loaders())
        self.events, self.step, self._backwards, self._eval_batches = [], 0, [], None

    def fits(self, cfg: Config) -> bool:
        """Whether `reuse(cfg)` can take these pools: actors of the same kind (`actor_kind`) and enough of them."""
        return actor_kind(cfg) == actor_kind(self.cfg) and all(
            getattr(cfg, stage).num_actors <= pool.capacity for stage, pool in self.pools()
        )

    def pools(self) -> list[tuple[str, VisionPool | TextPool]]:
        return [("vision", self.vision), ("text", self.text)]

    def next_batch(self) -> list[ray.ObjectRef]:
        """Refs of the next global batch: one part per data-parallel replica (`fetch` waits for them)."""
        return [loader.next_batch.remote() for loader in self.loaders]

    def fetch(self, refs: list[ray.ObjectRef], what: str, loaders: list[Any] | None = None) -> list[Any]:
        """What `loaders` (default: the training streams) were asked for, e.g. the global batch `next_batch` asked
        for, while they keep reading (`data.timeout_s`, else `DataStalled`)."""
        return wait_for_data(refs, self.loaders if loaders is None else loaders, self.cfg.data.timeout_s, what)

    def _all_loaders(self) -> list[Any]:
        return [*self.loaders, *([self.eval_loader] if self.eval_loader is not None else [])]

    def accumulate(self, batches: list[GlobalBatch]) -> float:
        """Forward + backward of every micro-batch of every text replica; gradients accumulate in the actors.

        `batches[t]` is text replica t's loader's part of the global batch; `routing.balance_text` deals its
        micro-batches to the text replicas by padded tokens (`data.balance`: tokens and patches, `text_cost`).
        Which vision replica encodes each micro-batch and the order of every call come from `routing.route`
        (balanced by patches, vision forwards up to `pipeline.max_in_flight` ahead per vision replica, lockstep
        pools padded). Only references move through here. Returns the global batch's mean loss.
        """
        loss_scale = 1.0 / max(1, sum(b.label_tokens for b in batches))  # mean over all label tokens
        mbs = [list(b.microbatches) for b in batches]
        # A lockstep (ZeRO-3) text pool runs every replica's i-th micro-batch together: per-replica totals do
        # not set its step, so its micro-batches stay where the loaders put them.
        if not self.text.layout.lockstep:
            costs = [[text_cost(mb.meta, self.cfg.data.balance) for mb in m] for m in mbs]
            mbs = [[mbs[t][i] for t, i in keys] for keys in balance_text(costs)]
        calls = route(
            [[mb.meta.patches for mb in m] for m in mbs],
            self.vision.dp,
            self.vision.layout.lockstep,
            self.text.layout.lockstep,
            self.cfg.pipeline.max_in_flight,
        )
        calls = misrouted(calls, self.vision.dp)  # as routed, unless a test plants a fault (fault_injection.py)
        ids = {key: n for n, key in enumerate((t, i) for t, m in enumerate(mbs) for i in range(len(m)))}
        shards, grads, losses = {}, {}, []  # refs in flight: key -> vision output shards / their gradients
        submit_start = time.perf_counter()
        for call in calls:
            for replica, key in call.members:
                mb = mbs[key[0]][key[1]] if key else None  # None: a lockstep pool's padding
                mb_id = ids[key] if key else -1 - call.slot
                if call.kind == VISION_FORWARD:
                    out = self.vision.forward(replica, mb_id, mb and mb.vision)
                    if key:
                        shards[key] = out
                elif call.kind == TEXT_FORWARD_BACKWARD:
                    loss, g = self.text.forward_backward(
                        replica,
                        mb_id,
                        mb and mb.text,
                        shards.pop(key) if key else [],
                        loss_scale,
                        want_grads=self.vision.trains,
                    )
                    losses.append(loss)
                    if key and self.vision.trains:
                        grads[key] = g
                elif self.vision.trains:  # a frozen vision pool kept no graph: nothing to send back
                    self._backwards += self.vision.backward(replica, mb_id, grads.pop(key) if key else [])
        # Driver-side cost of scheduling (everything above is non-blocking submission), per micro-batch.
        self.submit_s_per_microbatch = (time.perf_counter() - submit_start) / max(1, len(ids))
        return sum(self._get([loss for loss in losses if loss is not None], f"step {self.step}"))

    def _get(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        """`ray.get` within the current deadline; a rank that stopped answering raises `StepHung` (watchdog.py)."""
        return wait_or_hang(refs, self.clock, what, self.pools(), self.where, self.ledger)

    def optimizer_step(self) -> tuple[float, dict[str, float]]:
        """Sum gradients over replicas, clip by the global norm over the pools that train, step.
        -> (norm, the LR each trained module used: models/fine_tuning.py).

        First every rank of both pools says whether each micro-batch it forwarded in the global batch had its one
        backward (stages/step_ledger.py); if not, `StepInvariantError` names what is missing and no rank sums or
        steps (the driver fetches the answers before any rank enters a collective: none waits on another)."""
        what = f"step {self.step} (optimizer)"
        self._check_ledgers(what)
        trained = [pool for _, pool in self.pools() if pool.trains]
        for pool in trained:
            pool.sync_grads()  # ordered before grad_sq_norm on each actor
        grad_norm = math.sqrt(sum(self._get([ref for pool in trained for ref in pool.grad_sq_norm()], what)))
        coef = clip_coefficient(grad_norm, self.cfg.training.max_grad_norm)
        lrs: dict[str, float] = {}
        for per_rank in self._get([ref for pool in trained for ref in pool.optimizer_step(coef)], what):
            lrs.update(per_rank)
        return grad_norm, lrs

    def _check_ledgers(self, what: str) -> None:
        """Every rank's step ledger (stages/step_ledger.py) closed; `StepInvariantError` with all their lines if
        any is broken. Each rank answers after its backwards, so these are done too: one that failed for another
        reason raises here instead of passing unseen."""
        backwards, self._backwards = self._backwards, []
        ledgers = [ref for _, pool in self.pools() for ref in pool.close_global_batch()]
        broken = [line for lines in self._get(ledgers, what) for line in lines]
        if broken:
            for ref in backwards:  # read the failed ones (their lines are above), or Ray prints each as unhandled
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError:
                    pass
            raise StepInvariantError(
                f"step {self.step}: not every forward of the global batch had its one backward, "
                f"so no optimizer step: {'; '.join(broken)}"
            )
        self._get(backwards, what)

    def train_step(self, batches: list[GlobalBatch]) -> dict[str, Any]:
        self.step += 1
        self.ledger.clear()  # the last step's calls all finished (its optimizer step waited on every rank)
        self.clock.start(work=step_flops(self.model_config, [mb.meta for b in batches for mb in b.microbatches]))
        start, wall_start = time.perf_counter(), time.time()
        loss = self.accumulate(batches)
        grad_norm, lrs = self.optimizer_step()
        elapsed = time.perf_counter() - start
        pipeline = self._pipeline_stats(wall_start)
        self.clock.stop(elapsed)
        self.ledger.clear()  # drop the step's references (the optimizer step waited on every rank)
        tokens = sum(b.tokens for b in batches)
        skipped: dict[str, int] = {}
        for b in batches:
            for reason, n in b.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        return {
            "loss": loss,
            "lr": lrs.get("text", next(iter(lrs.values()))),  # the language model's, if it trains
            "lrs": lrs,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "label_tokens": sum(b.label_tokens for b in batches),
            "microbatches": sum(len(b.microbatches) for b in batches),
            "samples": sum(mb.meta.samples for b in batches for mb in b.microbatches),
            "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "epoch": batches[0].epoch,
            "skipped": skipped,
            "driver_ms_per_microbatch": round(self.submit_s_per_microbatch * 1e3, 4),
            **pipeline,
        }

    def _pipeline_stats(self, wall_start: float) -> dict[str, float]:
        """Busy fractions of the pools and the bubble over this step's forward/backward phase (trace.py).

        The window runs from the first submission to the last forward/backward call's end; the grad norm
        and optimizer step (a barrier of both pools) are left out. Every actor's events are drained, so none pile up.
        """
        events = [
            e
            for evs in self._get(
                [a.drain_events.remote(self.step + 1) for _, pool in self.pools() for a in pool.actors],
                f"step {self.step} (events)",
            )
            for e in evs
        ]
        if self.cfg.pipeline.trace:
            self.events += events
        compute = [e for e in events if e["name"] not in STEP_TAIL]
        end = max((e["end"] for e in compute), default=wall_start)
        return {k: round(v, 4) for k, v in busy_fractions(compute, wall_start, end).items()}

    def traced_events(self, wait_s: float = 5.0) -> list[dict]:
        """Every stage call so far (`pipeline.trace`) with Ray's transfers attached (trace.with_ray_transfers)."""
        return with_ray_transfers(self.events, ray.timeline, wait_s)

    def write_trace(self, path: Path) -> None:
        write_chrome_trace(self.traced_events(), path)

    def evaluate(self) -> float | None:
        """Mean loss per label token over the first `training.eval_batches` held-out global batches."""
        if self.eval_loader is None:
            return None
        if self._eval_batches is None:  # the same held-out batches every time, fetched once
            self._eval_batches = []
            for _ in range(self.cfg.training.eval_batches):
                (batch,) = self.fetch([self.eval_loader.next_batch.remote()], "an evaluation batch", [self.eval_loader])
                if batch is None:
                    break
                self._eval_batches.append(batch)
            if not self._eval_batches:
                print("evaluation: the held-out data has no usable record; no eval_loss is reported", flush=True)
        if not self._eval_batches:
            return None
        # On replica 0 of each pool: evaluation is small and needs no gradient sync. A lockstep pool (ZeRO-3's
        # per-block all-gathers span it) runs every micro-batch on all its replicas and replica 0's is taken.
        vision = range(self.vision.dp) if self.vision.layout.lockstep else range(1)
        text = range(self.text.dp) if self.text.layout.lockstep else range(1)
        sums, count = [], 0
        self.clock.start(scale=max(1, len(self._eval_batches)))
        for batch in self._eval_batches:
            for mb in batch.microbatches:
                shards = [self.vision.forward_eval(v, mb.vision) for v in vision][0]
                sums.append([self.text.forward_eval(t, mb.text, shards) for t in text][0])
                count += mb.meta.label_tokens
        loss = sum(self._get(sums, f"evaluation after step {self.step}")) / max(1, count)
        self.clock.stop()
        return loss

    def save_weights(self, out_dir: Path) -> None:
        """An HF checkpoint dir in `output.max_shard_size` shards, streamed: the ranks of one model copy write
        their own tensors (no gathering onto an actor), then the driver reassembles and writes one full
        tensor at a time (models/weights/export.py) and removes the rank files."""
        staging = out_dir.parent / f".{out_dir.name}.ranks"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            ray.get([a.save_local.remote(str(staging)) for _, pool in self.pools() for a in pool.state_ranks(0)])
            write_meta(staging, self.layout(), self.step, self.model_config, lora=self._lora_meta())
            export_hf(staging, out_dir, self.cfg.output.max_shard_size)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _partial_stages(self) -> list[str]:
        """The stages of which only a part trains: their checkpoints hold that part (models/fine_tuning.py)."""
        return [stage for stage, _ in self.pools() if self.fine_tuning.partial(stage)]

    def _base(self) -> dict[str, Any]:
        """Where the frozen rest of a partial checkpoint comes from: `model.path`, else the seeded init."""
        m = self.cfg.model
        return {"path": m.path, "init_seed": m.init_seed, "random_init": m.random_init}

    def _lora_meta(self) -> dict[str, Any] | None:
        lora = self.fine_tuning.lora
        return dataclasses.asdict(lora) if lora is not None else None

    def layout(self) -> dict[str, dict[str, Any]]:
        return {
            stage: {"parallelism": s.parallelism, "degree": s.degree, "num_actors": s.num_actors}
            for stage, s in (("vision", self.cfg.vision), ("text", self.cfg.text))
        }

    def save_checkpoint(self, root: Path, batches: list[GlobalBatch]) -> Path:
        """RUN_DIR/checkpoints/step_N after the step that trained `batches`: every rank writes its own
        tensors, optimizer share, scheduler and RNG (no gathering); the driver adds the data position of
        each replica and the config; each rank hashes its own files, in parallel; written atomically and
        verified on load (checkpoint_files.py)."""
        tmp = staging_dir(root, self.step)
        writes: list[ray.ObjectRef] = []
        try:
            partial = self._partial_stages()
            hashed: dict[str, Any] = {}
            writes = [a.save_state.remote(str(tmp)) for _, pool in self.pools() for a in pool.actors]
            # A deadline of SAVE_DEADLINE step deadlines: a write's time grows with the model, not the step, but a
            # rank that stops mid-write must not hang the run.
            self.clock.start(scale=SAVE_DEADLINE)
            for entries in self._get(writes, f"checkpoint of step {self.step}"):
                hashed |= entries
            self.clock.stop()
            write_meta(
                tmp,
                self.layout(),
                self.step,
                self.model_config,
                lora=self._lora_meta(),
                partial=partial,
                base=self._base() if partial else None,
            )
            (tmp / "trainer_state.json").write_text(
                json.dumps({"step": self.step, "loaders": [b.state for b in batches]})
            )
            save_config(self.cfg, tmp / "config.yaml")
            return commit(tmp, self.cfg.training.keep_last, hashed)
        except BaseException as e:  # a full disk, a refused write, a rank gone: the older checkpoints stay intact
            if writes and not isinstance(e, StepHung):  # the other ranks finish writing before the cleanup
                ray.wait(writes, num_returns=len(writes), timeout=self.clock.timeout_s() * SAVE_DEADLINE)
            self.clock.stop()
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def restore_checkpoint(self, ckpt: Path) -> int:
        """Load a checkpoint of this model written by any layout; returns its step. The data streams
        continue after it. Another layout (degree, replicas, pool sizes, parallelism) is resharded on
        load: each rank reads from the writers' files only the parts of its own weights and AdamW moments
        (StageWorker.load_state, models/weights/reshard.py), and the data position is carried over to this run's
        number of streams (`positions.reshard`)."""
        meta = check_resumable(ckpt, self.model_config, self._base(), self._partial_stages())
        saved, now = meta["layout"], self.layout()
        if saved != now:
            what = "{parallelism} degree {degree} x {num_actors} actors".format
            print(
                "resume: resharding "
                + ", ".join(
                    f"{stage} {what(**saved[stage])} -> {what(**now[stage])}"
                    for stage in now
                    if saved[stage] != now[stage]
                ),
                flush=True,
            )
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if self.loaders:
            check_positions(ckpt, state["loaders"], self.train_files)
        positions = reshard(state["loaders"], len(self.loaders))
        ray.get([loader.restore.remote(s) for loader, s in zip(self.loaders, positions)])
        # Reading is like a checkpoint write (its time grows with the model): the same deadline, so a rank that
        # stops mid-read is named rather than waited on forever.
        self.clock.start(scale=SAVE_DEADLINE)
        self._get(
            [a.load_state.remote(str(ckpt), saved[stage]) for stage, pool in self.pools() for a in pool.actors],
            f"restore from {ckpt}",
        )
        self.clock.stop()
        self.step = state["step"]
        return self.step

    def skip_report(self) -> dict[str, Any]:
        reports = ray.get([loader.skip_report.remote() for loader in self.loaders])
        counts: dict[str, int] = {}
        for rep in reports:
            for reason, n in rep["counts"].items():
                counts[reason] = counts.get(reason, 0) + n
        return {
            "counts": counts,
            "examples": [e for rep in reports for e in rep["examples"]],
            "good": sum(rep["good"] for rep in reports),
        }

    def close_streams(self) -> None:
        """Stop the data streams (their loaders and preprocessing); the pools stay."""
        for loader in self._all_loaders():
            ray.kill(loader, no_restart=True)
        self.loaders, self.eval_loader = [], None

    def shutdown(self) -> None:
        """Kill every actor this trainer started (pools, loaders) and free its placement groups."""
        for pool in (self.vision, self.text):
            if pool is not None:  # None: start-up failed before this pool was built
                pool.shutdown()
        self.close_streams()
        self.ledger.clear()
        if self.placement is not None:
            self.placement.remove()
