"""What every stage worker shares: model construction, the optimizer, clipping, weight export.

Model states are kept in the precision `model.precision` names (models/precision.py: fp32 master weights,
gradients and moments, with bf16 autocast on GPU when `model.dtype: bfloat16`; or pure bf16). AdamW +
warmup/cosine come from torch and transformers. Gradient clipping is by the global norm over *both* stages:
each worker reports its squared norm, the driver adds them and hands every worker the same clip coefficient.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from dhp.models.activation_checkpointing import ActivationCheckpointing
from dhp.models.compilation import BlockCompile, compile_stats
from dhp.models.fine_tuning import FineTuning, group_lrs
from dhp.models.optimizer import adamw_of, device_type_of, warmup_cosine_schedule
from dhp.models.parallel.layout import NOT_SHARDED, SKIP_SYNC
from dhp.models.parallel.layouts import make_layout, stage_layout
from dhp.models.parallel.tensor_parallel import sum_partial_grads
from dhp.models.parallel.zero3 import local_tensor
from dhp.models.precision import precision_of
from dhp.models.stage_build import build_stage
from dhp.models.weights.hf_checkpoint import save_shard
from dhp.models.weights.random_init import random_init
from dhp.models.weights.reshard import MOMENT_SEP, SavedRanks, index_of
from dhp.stages.actor_group import DistributedWorker
from dhp.stages.checkpoint_files import file_entry
from dhp.stages.config import Config
from dhp.stages.fault_injection import save_fault
from dhp.stages.step_ledger import StepLedger
from dhp.stages.trace import EventRecorder


def build_optimizer(module: nn.Module, cfg: Config, zero_group: Any = NOT_SHARDED):
    """AdamW over `module`'s trainable parameters, one group per module and decay choice with its own LR and
    weight decay (models/fine_tuning.py), + linear warmup + cosine decay to `min_lr_ratio` of each group's LR;
    one scheduler step per optimizer step. `training.optimizer` picks torch's implementation for the parameters'
    device (models/optimizer.py).

    `zero_group` (a process group, None = the default group; NOT_SHARDED = off) shards the AdamW state ZeRO-1
    style: each rank keeps the moments of its share of the parameters, steps those, and broadcasts them.
    Every rank must hold the full, already-summed gradients when `step()` runs.
    """
    t = cfg.training
    groups = FineTuning(cfg).param_groups(module)
    implementation = adamw_of(t.optimizer, device_type_of(groups))
    optimizer = implementation.build(groups, zero_group, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    scheduler = warmup_cosine_schedule(optimizer, t.warmup_steps, t.steps, t.min_lr_ratio)
    return optimizer, scheduler


def clipped_step(optimizer: torch.optim.Optimizer, params: Any, clip_coef: float) -> None:
    """One optimizer step as dhp takes it: gradients scaled by the global clip coefficient (when it clips), the
    step, gradients freed (what `dhp bench ops` times, too)."""
    if clip_coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(clip_coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


SYNC_BUCKET_BYTES = 64 << 20


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype whose bytes add up to at most `limit` (a larger one alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if not out or size + n > limit or out[-1][0].dtype != t.dtype:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """As `torch.nn.utils.clip_grad_norm_`: scale by max_norm / (norm + 1e-6), never up."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def recorded(name: str):
    """Time a worker method on the actor's timeline (trace.py); the micro-batch id is its first argument.
    On a GPU the call ends when its kernels have: a backward returns with them still queued, and the
    timeline (and the bubble) would otherwise charge them to whichever call synchronizes next."""

    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            mb = args[0] if args and isinstance(args[0], int) and name != "optimizer_step" else -1
            with self.recorder.record(name, mb):
                out = method(self, *args, **kwargs)
                self.synchronize()
                return out

        return timed

    return wrap


class StageWorker(DistributedWorker):
    """A stage's model on one actor. Subclasses build `self.model` and define forward/backward; everything
    that depends on the stage's parallelism is asked of `self.layout` (models/parallel/layout.py)."""

    stage = ""  # "vision" | "text"

    def __init__(self, cfg: Config, model_config: Any, rank: int, world_size: int, torch_threads: int = 1):
        super().__init__(rank, world_size, torch_threads)
        self.cfg, self.model_config = cfg, model_config
        self.stage_cfg = getattr(cfg, self.stage)
        # one backward for every forward of a global batch (stages/step_ledger.py)
        self.step_ledger = StepLedger(self.stage, rank // self.stage_cfg.degree, rank)

    def setup(self) -> None:
        """Build this rank's part of the stage (models/stage_build.py: on `meta`, laid out, only its own tensors
        allocated and filled from its checkpoint slices or its part of the seeded init), then the optimizer
        over what this rank holds. Peak host memory: this rank's tensors + one full tensor.

        Runs after the process groups exist, since the parallel layouts need them.
        """
        self.recorder = EventRecorder(self.stage, self.rank, ray.get_runtime_context().get_worker_id())
        self.layout = stage_layout(self.cfg, self.stage, self.model_config)
        self.precision = precision_of(self.cfg.model.precision)
        self.transport = self.cfg.pipeline.transport  # how boundary tensors leave and arrive (stages/boundary.py)
        self.fine_tuning = FineTuning(self.cfg)
        self.trains = self.fine_tuning.trains(self.stage)
        self.model, self.full_shapes = build_stage(
            lambda: self.build_model(self.model_config),
            self.layout,
            self.ranks,
            self.precision,
            seed=self.cfg.model.init_seed,
            path=self.cfg.model.path,
            freeze=self.fine_tuning.freeze,
            init=random_init(self.cfg.model.random_init),
        )
        self.adapt()
        self.activation_checkpointing = ActivationCheckpointing.of(self.stage_cfg)
        self.activation_checkpointing.apply(self.model.blocks())
        self.block_compile = BlockCompile.of(self.stage_cfg)
        self.compiled_units = self.block_compile.apply(self.layout.compile_units(self.model))
        self.progress.watch(self.model.blocks())  # the heartbeat's progress (stages/progress.py)
        self.optimizer = self.scheduler = None  # a frozen stage: no optimizer state at all
        if self.trains:
            self.optimizer, self.scheduler = build_optimizer(
                self.model, self.cfg, zero_group=self.layout.optimizer_shard_group(self.ranks)
            )
        self._synced = False  # gradients summed over data-parallel replicas for this step?
        self._measured: list[dict[str, int]] | None = None  # measure_activations' records while it is on

    def reconfigure(self, cfg: Config, model_config: Any) -> None:
        """Drop this rank's model and optimizer and build `cfg`'s in their place, on the process groups this
        actor already joined (`Trainer.reuse`): a new run from step 0, as a new actor would start it. The
        build seeds torch's generator (models/stage_build.py), so nothing of the previous run's draws carries
        over."""
        self._measuring_changed(False)
        self.model = self.optimizer = self.scheduler = None
        self.cfg, self.model_config = cfg, model_config
        self.stage_cfg = getattr(cfg, self.stage)
        if self.stage_cfg.degree != self.ranks.degree:
            self.regroup(self.stage_cfg.degree)
        self.step_ledger = StepLedger(self.stage, self.rank // self.stage_cfg.degree, self.rank)
        self.setup()

    def leave(self, world_size: int) -> None:
        """`DistributedWorker.leave`, dropping the model and optimizer built on the groups that go."""
        self.model = self.optimizer = self.scheduler = None
        super().leave(world_size)

    def compiled(self) -> dict[str, Any]:
        """This rank's `compile` setting, how many units it compiled and what torch compiled so far
        (models/compilation.py `compile_stats`)."""
        return {"backend": self.block_compile.backend, "units": self.compiled_units, **compile_stats()}

    def build_model(self, model_config: Any) -> nn.Module:
        raise NotImplementedError

    def adapt(self) -> None:
        """Hook point: add trainable adapters to the built, laid-out model (before the optimizer exists)."""

    def autocast(self):
        return self.precision.autocast(self.device, self.cfg.model.dtype)

    @property
    def local_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer over this rank's share: under ZeRO-1 the wrapper's inner one (its partition only);
        None for a stage that trains nothing."""
        return getattr(self.optimizer, "optim", self.optimizer)

    def _moments(self) -> list[torch.Tensor]:
        """This rank's AdamW state tensors (not the 0-dim step counters)."""
        if self.local_optimizer is None:
            return []
        return [v for st in self.local_optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's parameters, gradients (those present) and AdamW states (its ZeRO-1 share):
        what the memory plan predicts (models/planning/memory_plan.py)."""

        def nbytes(tensors) -> int:  # not by storage: FSDP2's gradients are views of one reduce-scatter buffer
            return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)

        params = list(self.model.parameters())  # a tied parameter once
        return {
            "params": nbytes(params),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": nbytes(self._moments()),
        }

    def measure_activations(self, on: bool = True) -> list[dict[str, int]]:
        """Start (on) or stop recording, per training forward, the bytes it keeps for backward (saved-tensor
        hooks, models/planning/saved_tensors.py) with the size of its input (`patches` / `tokens`): what the memory
        plan predicts as activations. Returns the records so far and clears them."""
        done, self._measured = self._measured or [], [] if on else None
        self._measuring_changed(on)
        return done

    def _measuring_changed(self, on: bool) -> None:
        """Hook point for a stage that measures from module hooks rather than around its own call."""

    def state_dtypes(self) -> dict[str, Any]:
        """Dtypes of this rank's parameters and optimizer states, and how many parameters' states it holds."""
        return {
            "params": {n: str(p.dtype) for n, p in self.model.named_parameters()},
            "optimizer": sorted({str(v.dtype) for v in self._moments()}),
            "params_with_state": len(self.local_optimizer.state) if self.local_optimizer else 0,
            "params_total": sum(1 for _ in self.model.parameters()),
        }

    def sync_grads(self) -> None:
        """Sum gradients over the layout's `grad_sync_group` (data-parallel replicas; the whole pool under
        SP), in buckets of at most `SYNC_BUCKET_BYTES`: a tensor at least that large is all-reduced in place,
        smaller ones are packed together (one flat buffer per bucket, never one of the whole model: that
        was +16 GB per text rank at 32B). Buckets depend only on the parameters' shapes: the same on every
        rank of the group.

        A parameter that got no gradient on this rank (e.g. a replica whose micro-batches held no image)
        contributes zeros, so every rank all-reduces the same buffers (docs/design.md, invariant 2: no data-dependent
        collectives).
        """
        import torch.distributed as dist

        if self._synced:
            return  # idempotent: a second sync in the same step would double the gradients
        self._synced = True
        params = [p for p in self.model.parameters() if p.requires_grad]
        sum_partial_grads(params)  # replicated KV heads, LoRA factors held whole by several TP ranks
        group = self.layout.grad_sync_group(self.ranks)
        if group is SKIP_SYNC:
            return  # e.g. ZeRO-3: FSDP already reduce-scattered (summed) every micro-batch's gradients
        if (self.world_size if group is None else dist.get_world_size(group)) == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params], SYNC_BUCKET_BYTES):
            self.progress.move("gradient sync")  # (the bucket before this one completed)
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.all_reduce(bucket[0], group=group)
                continue
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            for grad, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                grad.copy_(synced)

    @recorded("grad_norm")
    def grad_sq_norm(self) -> float:
        """This rank's share of the pool's squared gradient norm (call after `sync_grads`).

        Which rank counts which parameter is the layout's answer (`reports_grad_norm`): replica 0 only, a
        sharded parameter on every rank of it, a replicated one on model-parallel rank 0; under ZeRO-3 all.
        The norm is torch's fused multi-tensor one (fp32 accumulation, as `clip_grad_norm_`): a float64
        copy of every gradient cost ~100 ms per step on the 152k-row embedding and lm_head.
        """
        grads = [
            local_tensor(p.grad).detach()
            for p in self.model.parameters()
            if p.grad is not None and self.layout.reports_grad_norm(self.ranks, p)
        ]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).double() ** 2)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def moving(self) -> Iterator[None]:
        """Count the body as the boundary's device <-> host copies (trace.py). The device's queued work is
        waited for first, so that a copy is not charged with the compute before it."""
        self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.recorder.add_copy(time.perf_counter() - start)

    def drain_events(self, next_step: int) -> list[dict[str, Any]]:
        """The calls recorded since the last drain (trace.StageEvent dicts); later ones count as `next_step`."""
        events = self.recorder.drain()
        self.recorder.step = next_step
        return events

    def close_global_batch(self) -> list[str]:
        """Asked of every rank of both pools before each optimizer step (stages/trainer.py): this global batch's
        forwards left without their backward and backwards that found no forward on this rank, one line each
        (none: every forward had its one backward; stages/step_ledger.py). The next global batch starts clean."""
        return self.step_ledger.close()

    @recorded("optimizer_step")
    def optimizer_step(self, clip_coef: float) -> dict[str, float]:
        """Scale gradients by the global clip coefficient, step, zero; returns the LR each module used."""
        lrs = group_lrs(self.optimizer)
        self._synced = False
        clipped_step(self.optimizer, self.model.parameters(), clip_coef)
        self.scheduler.step()
        return lrs

    def local_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's parameters (or gradients) under module names, CPU copies: shards under TP / ZeRO-3."""
        if grads:
            named = ((n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None)
        else:
            named = self.model.state_dict().items()
        return {n: local_tensor(t).detach().cpu().clone() for n, t in named}

    def full_state(self, local_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full tensors from the `local_state`s of the ranks that hold one copy of the model, in rank order
        (one replica's model-parallel ranks; the whole pool under ZeRO-3). Replicated: rank 0's."""
        return self.layout.gather(local_states)

    def full_state_of(self, *other_ranks: dict[str, torch.Tensor], grads: bool = False) -> dict[str, torch.Tensor]:
        """`full_state` with this rank's own local state first (the others arrive as object refs)."""
        return self.full_state([self.local_state(grads), *other_ranks])

    def save_local(self, out_dir: str, trained_only: bool = False) -> str:
        """This rank's local tensors as `{stage}-rank{rank:05d}.safetensors` in a dhp checkpoint dir; with
        `trained_only`, only those that train (the frozen rest is the base's: models/fine_tuning.py)."""
        name = f"{self.stage}-rank{self.rank:05d}.safetensors"
        state = self.local_state()
        if trained_only:
            state = {n: t for n, t in state.items() if self.fine_tuning.trainable(n)}
        save_shard(state, Path(out_dir), name)
        return name

    def save_state(self, ckpt_dir: str) -> dict[str, dict[str, int | str]]:
        """Everything this rank needs to continue exactly: its tensors (only those that train when some of
        the stage is frozen), its optimizer moments (its ZeRO-1 share) by parameter name, LR scheduler and RNG
        states. Read back with safetensors and
        `torch.load(weights_only=True)`: no pickled code. Returns the manifest entries of the files it
        wrote (hashed here: every rank in parallel).

        Moments are stored like the weights, under `{name}::{key}` with the parameter's local part (a TP
        slice, ZeRO-3 rows), not by the optimizer's local parameter index: that index means nothing in
        another layout, a name plus the layout's slicer does (`load_state` reshards by it)."""
        tensors = self.save_local(ckpt_dir, trained_only=self.fine_tuning.partial(self.stage))
        save_fault(self.stage, self.rank, Path(ckpt_dir))  # off unless a test asks (fault_injection.py)
        moments = f"{self.stage}-rank{self.rank:05d}-moments.safetensors"
        save_shard(self._named_moments(), Path(ckpt_dir), moments)
        state = {
            "scheduler": self.scheduler.state_dict() if self.scheduler else {},
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else torch.empty(0),
        }
        state_file = f"{self.stage}-rank{self.rank:05d}-state.pt"
        torch.save(state, Path(ckpt_dir) / state_file)
        return {name: file_entry(Path(ckpt_dir) / name) for name in (tensors, moments, state_file)}

    def _optimizer_params(self) -> list[tuple[str, nn.Parameter]]:
        """(module name, parameter) of each parameter the local optimizer steps, in its own index order (a
        parameter object is the same in the model and the optimizer: DTensors under ZeRO-3 included)."""
        if self.local_optimizer is None:
            return []
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [(names[id(p)], p) for group in self.local_optimizer.param_groups for p in group["params"]]

    def _named_moments(self) -> dict[str, torch.Tensor]:
        """This rank's AdamW state as `{name}::{key}` -> local CPU tensor (0-dim for `step`)."""
        out = {}
        for name, p in self._optimizer_params():
            for key, value in self.local_optimizer.state.get(p, {}).items():
                value = local_tensor(value) if torch.is_tensor(value) else torch.tensor(value)
                out[f"{name}{MOMENT_SEP}{key}"] = value.detach().cpu().contiguous()
        return out

    def load_state(self, ckpt_dir: str, saved_layout: dict[str, Any] | None = None) -> None:
        """Inverse of `save_state`, into a freshly built rank of this layout or another one.

        `saved_layout` ({parallelism, degree, num_actors} of this stage in the checkpoint; None: this
        rank's own) gives the slicers of the ranks that wrote it. For each of its own tensors and moments
        this rank reads, from the ranks holding them, only the intersections with its own part
        (models/weights/reshard.py): no full tensor is gathered; in the same layout that is an exact copy of its own
        files. Scheduler and RNG come from the writer of the same rank (rank 0's when that layout had fewer).
        """
        ckpt = Path(ckpt_dir)
        saved = (
            self.layout
            if saved_layout is None
            else make_layout(
                self.stage,
                saved_layout["parallelism"],
                saved_layout["degree"],
                saved_layout["num_actors"],
                self.model_config,
            )
        )
        own = self.layout.slicer(self.rank, self.full_shapes)
        with SavedRanks(ckpt, self.stage, saved, self.full_shapes) as files:
            partial = self.fine_tuning.partial(self.stage)  # then the frozen tensors are the base's, loaded at build
            with torch.no_grad():
                for name, t in self.model.state_dict().items():
                    if not partial or self.fine_tuning.trainable(name):
                        files.fill_weight(local_tensor(t), name, index_of(own, name))
            moments = {
                i: {key: files.read_moment(name, key, index_of(own, name)) for key in files.moment_keys(name)}
                for i, (name, _) in enumerate(self._optimizer_params())
            }
        writer = self.rank if self.rank < saved.num_actors else 0
        state = torch.load(ckpt / f"{self.stage}-rank{writer:05d}-state.pt", weights_only=True)
        if self.trains:
            optim_state = {
                "state": {i: st for i, st in moments.items() if st},
                "param_groups": self.local_optimizer.state_dict()["param_groups"],
            }
            self.local_optimizer.load_state_dict(_like_params(optim_state, self.local_optimizer))
            self.scheduler.load_state_dict(state["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr  # a ZeRO wrapper keeps its own groups, which it copies into its partition's
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and state["cuda_rng"].numel():
            torch.cuda.set_rng_state(state["cuda_rng"])


def _like_params(optim_state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Local moments (plain tensors, as stored) wrapped back into DTensors laid out like their parameters
    (ZeRO-3), keyed by the optimizer's local parameter index; others unchanged."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for k, st in optim_state["state"].items():
        p = params[int(k)]
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import DTensor

            st = {
                n: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if v.ndim
                else v  # moments are read onto the CPU; a DTensor's local part lives on its mesh's device
                for n, v in st.items()
            }
        out[k] = st
    return {**optim_state, "state": out}
