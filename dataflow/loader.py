"""Ray Data ingestion: annotation files -> preprocessed samples -> micro-batches held in the object store.

Reading and preprocessing run in Ray Data (one row per file this stream reads -> its records -> map with a
`Preprocessor` built once per worker process, `data.preprocess_workers` tasks at a time); the files are
JSONL annotation files or WebDataset shards (`dataflow/sources.py` decides, `dataflow/webdataset.py` splits a shard),
and which of them a stream reads, and from where, is `dataflow/positions.py`'s. A
`BatchLoader` actor drives the stream, packs each global batch into token-budget micro-batches and
`ray.put`s the vision part and the text part separately, so the driver receives only object references
and scalar metadata (docs/design.md, invariant 3): the vision pool is handed the vision refs, the text pool
the text refs.

Nothing materializes a dataset: `iter_rows` streams, so memory is Ray Data's pipeline buffers plus the
one global batch being packed here, whatever the dataset's size. The one unit held whole is an
annotation file or a shard (its records are shuffled together), so very large annotation sets are best split
into several files (`data.train` takes a comma-separated list).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.data._internal.logical.interfaces import LogicalPlan

from dhp.dataflow.balance import micro_batches
from dhp.dataflow.packing import MicroBatchMeta, meta_of, microbatch_inputs
from dhp.dataflow.positions import MAX_SKIP_EXAMPLES, Read, files_key, reads, resumed
from dhp.dataflow.preprocess import PreprocessSettings, decode_sample, preprocess_row
from dhp.dataflow.sources import Jsonl, split_batch
from dhp.dataflow.storage import filesystem_of_all, scheme_of
from dhp.errors import DataError

ROWS_PER_TASK = 16  # records per preprocessing task (small_blocks): 4 and 64 measured slower here
SPLIT_CPUS = 0.05  # Ray CPU asked by the file -> records split (and the cutting fused into it): mostly I/O


@dataclass
class MicroBatch:
    vision: list[ray.ObjectRef]  # per vision rank of the replica: dict pixel_values [P_j, 1176], image_grid_thw
    # dict: input_ids/labels/attention_mask [B, L], position_ids [3, B, L]; packed: [1, T] and cu_seqlens, no mask
    text: ray.ObjectRef
    meta: MicroBatchMeta


@dataclass
class GlobalBatch:
    microbatches: list[MicroBatch]
    epoch: int
    skipped: dict[str, int] = field(default_factory=dict)  # new skips (by reason) since the last batch
    state: dict[str, Any] = field(default_factory=dict)  # the loader's `state()` right after this batch
    quarantined: list[dict[str, str]] = field(default_factory=list)  # the skipped records: source, error, detail
    ids: list[tuple[int, str]] = field(default_factory=list)  # (epoch, source) of each sample trained, in order

    @property
    def label_tokens(self) -> int:
        return sum(m.meta.label_tokens for m in self.microbatches)

    @property
    def tokens(self) -> int:
        return sum(m.meta.tokens for m in self.microbatches)


def split_for_ranks(
    vision: dict[str, torch.Tensor], text: dict[str, torch.Tensor], sp: int, model_config: Any
) -> list[dict[str, torch.Tensor]]:
    """The vision inputs of each vision rank of a replica (one part without sequence parallelism).

    Under sequence parallelism rank r gets only its window-ordered patches (`ShardPlan.shard`) plus the
    grid sizes; the text side gets `merged_index`, the raster position of each window-ordered merged
    token, which is how it reassembles the ranks' shards (stages/boundary.py). Padded or packed text alike:
    both hold the images' merged tokens in the order of `vision`'s images (dataflow/packing.py), and the
    ShardPlan attends per image (each image its own windows and full-attention segment), however many the
    micro-batch holds.
    """
    if sp <= 0:
        return [vision]
    from dhp.models.parallel.shard_plan import plan_shards

    grid = vision["image_grid_thw"]
    if grid.numel() == 0:  # text-only: every rank gets the same empty input and skips the encoder
        return [vision] * sp
    plan = plan_shards(grid, sp, model_config)
    text["merged_index"] = plan.window_index.long()
    return [{"pixel_values": plan.shard(vision["pixel_values"], r), "image_grid_thw": grid} for r in range(sp)]


def small_blocks(ds: ray.data.Dataset, rows: int) -> ray.data.Dataset:
    """Cut `ds`'s blocks into blocks of about `rows` rows, streaming and order kept (Ray Data's streaming
    repartition), fused into the split before it.

    Why: a file's records leave the split as one block, and a block is one preprocessing task, so one annotation
    file would be preprocessed by one worker however many `data.preprocess_workers` there are, and its first
    sample would wait for the whole file. Why not plain `ds.repartition(target_num_rows_per_block=rows)`: its
    tasks ask Ray for a whole CPU (the API takes no resources), which a trainer whose stage actors hold the CPUs
    never has -- the stream waits forever. So the same logical operator is built with the split's small CPU
    request, which also lets Ray Data fuse the two (equal resources, MapBatches -> StreamingRepartition).
    """
    cut = ds.repartition(target_num_rows_per_block=rows)
    op = dataclasses.replace(cut._logical_plan.dag, ray_remote_args={"num_cpus": SPLIT_CPUS})
    return ray.data.Dataset._from_parent(cut, LogicalPlan(op, cut.context))


def build_dataset(
    paths: list[str],
    settings: PreprocessSettings,
    model_config: Any,
    workers: int,
    num_cpus: float,
    seed: int | None,
    reads: list[Read] | None = None,
) -> ray.data.Dataset:
    """The preprocessed rows of `reads` (`positions.Read`s of the epoch whose shuffle `seed` is; None: every file,
    whole), in order."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # same seed -> same batches, across runs and resumes
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # per-epoch execution plans are noise here
    # ... and so is its notice, once per loader process, that the progress bars are off (they are, on purpose).
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # Ray Data's memory advice ("uses 229 MiB per worker ... consider setting memory=") concerns memory requests,
    # which dhp does not schedule by: preprocessing is sized by CPU share (data.preprocess_num_cpus) and its wait is
    # measured by dhp itself (metrics' data_wait_s). On a console the advice only interleaves blocks with dhp's lines.
    detectors = getattr(ctx, "issue_detectors_config", None)
    if detectors is not None:
        detectors.detectors = [d for d in detectors.detectors if d.__name__ != "HighMemoryIssueDetector"]
    # Small CPU requests: Ray Data's default of one CPU per task would wait forever on a small machine
    # whose CPUs are held by the stage actors.
    # Local files and s3:// objects alike: one pyarrow filesystem, which Ray pickles to the read tasks
    # together with the driver-resolved endpoint, retry policy and credentials (storage.py).
    fs, fs_paths = filesystem_of_all(paths, settings.storage)
    records = settings.records or Jsonl()  # JSONL files or WebDataset shards (dataflow/sources.py)
    order = records.order(len(fs_paths), seed)
    reads = [Read(k) for k in range(len(fs_paths))] if reads is None else reads
    ds = ray.data.from_items([r.item(fs_paths[order[r.part]]) for r in reads])
    split_args = {
        "seed": seed,
        "prefix": f"{scheme_of(paths[0])}://" if scheme_of(paths[0]) else "",
        **records.split_kwargs(fs),
    }
    ds = ds.map_batches(
        split_batch, batch_size=1, fn_kwargs={"split": records.split, **split_args}, num_cpus=SPLIT_CPUS
    )
    ds = small_blocks(ds, ROWS_PER_TASK)
    # A task-based map whose preprocessor is built once per worker process (`preprocess_row`): an actor pool
    # would be rebuilt, imports and tokenizer included, for every epoch's dataset.
    return ds.map(
        preprocess_row,
        fn_kwargs={"settings": settings, "model_config": model_config},
        num_cpus=num_cpus,
        compute=ray.data.TaskPoolStrategy(size=workers),
    )


class BatchLoader:
    """Ray actor owning one stream of global batches: one per text replica (models/parallel/routing.py). Made by
    `loader_actor`: its `probe` thread answers `position` while the stream's own calls run one at a time."""

    def __init__(
        self,
        paths: list[str],
        settings: PreprocessSettings,
        model_config: Any,
        global_batch_size: int,
        microbatch_tokens: int,
        workers: int = 1,
        num_cpus: float = 0.25,
        seed: int | None = 0,
        pad_id: int = 151643,
        repeat: bool = True,
        replica: int = 0,
        num_replicas: int = 1,
        vision_sp: int = 0,
        packing: bool = False,
        balance: bool = False,
    ):
        self.args = (paths, settings, model_config, workers, num_cpus)
        self.records = settings.records or Jsonl()
        self.stream = (replica, num_replicas)  # this stream of how many: what it reads (dataflow/positions.py)
        self.vision_sp = vision_sp  # > 0: sequence-parallel vision, each rank gets only its own patches
        self.global_batch_size = global_batch_size
        self.budget = microbatch_tokens
        self.packing = packing  # one sequence per micro-batch, its samples back to back (dataflow/packing.py)
        self.balance = balance  # micro-batches even in predicted cost, not only within the budget (dataflow/balance.py)
        self.seed, self.pad_id, self.repeat = seed, pad_id, repeat
        self.epoch, self.rows, self.exhausted = 0, None, False
        # The data position (dataflow/positions.py): in the epoch's part (file) `part`, `taken` of this stream's
        # rows of it consumed; `plans`: epoch -> the parts read before a resume into another number of streams.
        self.part, self.taken, self.plans = -1, 0, {}
        self.cursor = 0  # rows (good or skipped) consumed in this epoch, and the last one's source (file:line,
        self.source = ""  # shard:key): the position, for people
        self.ahead: dict[str, Any] | None = None  # the row `start` read, not yet handed out
        self.skipped: Counter[str] = Counter()
        self.skip_examples: list[dict[str, str]] = []
        self.good = 0
        # The batch being assembled (`next_batch`): records taken for it so far, its skips by reason, the last one
        # skipped. Read from the probe thread (`position`), so the driver can say why a batch is late: one tuple,
        # replaced whole after each record, so that the probe never sees a count without its skips.
        self.batch_reads: tuple[int, dict[str, int], dict[str, str] | None] = (0, {}, None)
        self.files = files_key(paths or [], self.records.deals)  # what the position counts in (a checkpoint's check)
        self._dry_streak()

    def state(self) -> dict[str, Any]:
        """Position and counters, JSON-able: what a checkpoint stores to continue this stream exactly, in this or
        another number of streams (`positions.reshard`)."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "source": self.source,
            "good": self.good,
            "skipped": dict(self.skipped),
            "skip_examples": list(self.skip_examples),
            "parts": len(self.args[0]),
            "deals": self.records.deals,
            "files": self.files,
            "part": self.part,
            "taken": self.taken,
            "plans": {str(e): p for e, p in self.plans.items() if e >= self.epoch},
        }

    @ray.method(concurrency_group="probe")
    def position(self) -> dict[str, Any]:
        """Where this stream stands, answered from its own thread while a batch is awaited (the driver's stall
        check and its warning on a stream that reads but skips): `where`, for people; `read`, the records taken
        for the batch being assembled; `skipped`, how many of them were skipped, by reason; `example`, the last."""
        last = f", last record {self.source}" if self.source else ", no record read yet"
        read, skipped, example = self.batch_reads
        return {
            "where": f"epoch {self.epoch}, {self.cursor} records into it{last}",
            "read": read,
            "skipped": skipped,
            "example": example,
        }

    def start(self) -> None:
        """Start the stream and wait for its first row: Ray Data's start-up and the preprocessing processes'
        imports (seconds, `dhp bench data`) then overlap whatever the caller does meanwhile (the trainer builds
        its pools). A `restore` afterwards drops this stream and starts the restored one."""
        if self.ahead is None and not self.exhausted:
            self.ahead = self._next_row()

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after the batch whose `state()` this is: the parts behind its position are not read again,
        and of the one it is in only the rows after it (`positions.resumed`)."""
        self.epoch, self.cursor, self.source = state["epoch"], state["cursor"], state["source"]
        self.part, self.taken = state["part"], state["taken"]
        self.plans = {int(e): p for e, p in state["plans"].items()}
        self.rows, self.ahead, self.exhausted = None, None, False
        self.good, self.skipped = state["good"], Counter(state["skipped"])
        self.skip_examples = list(state["skip_examples"])
        self._dry_streak()

    def _dry_streak(self) -> None:
        """Forget what was read without a usable sample (a start or a restore: this process's own count)."""
        self.seen_good, self.epoch_good = False, 0
        self.dry: dict[int, float] = {}  # file -> how much of it read (whole: 1, a stride of N: 1/N), no usable sample
        self.epoch_reads: dict[int, float] = {}
        self.epoch_whole = False  # this epoch's reads are this stream's whole share (not resumed into)

    def _epoch_rows(self) -> Any:
        """This stream's rows of the epoch, from its position on."""
        seed = None if self.seed is None else self.seed + self.epoch
        paths = self.args[0]
        self.epoch_whole = self.epoch not in self.plans and self.part < 0
        mine = resumed(
            reads(len(paths), self.plans.get(self.epoch), *self.stream, self.records.deals), self.part, self.taken
        )
        order = self.records.order(len(paths), seed)
        self.epoch_reads = {order[r.part]: 1 / r.step for r in mine if r.first == 0}  # read from their start
        return iter(build_dataset(*self.args, seed=seed, reads=mine).iter_rows() if mine else ())

    def _end_epoch(self) -> None:
        self.rows, self.cursor, self.part, self.taken = None, 0, -1, 0
        self.plans.pop(self.epoch, None)
        if self.epoch_good:
            self.dry = {}
        else:
            for f, share in self.epoch_reads.items():
                self.dry[f] = self.dry.get(f, 0.0) + share
        self.epoch_good = 0
        if not self.repeat:
            self.exhausted = True
        elif self._barren():
            read = f"skipped: {dict(self.skipped)}" if self.skipped else "no record was read: the files are empty"
            raise DataError(
                f"no usable sample in {self.args[0]} for data stream {self.stream[0]} of {self.stream[1]}; {read}"
            )
        else:
            self.epoch += 1

    def _barren(self) -> bool:
        """Whether this stream will never find a usable sample: it has found none since it started (or was
        restored), and its epochs without one have read every file whole (a stride of N counting 1/N of it), or
        the files come in one fixed order (no seed) and it read its whole share of an epoch without one (every
        later epoch is the same). A stream dealt only bad shards in one epoch goes on: another epoch deals
        others."""
        if self.seen_good:
            return False
        everything = len(self.dry) == len(self.args[0]) and min(self.dry.values()) >= 1 - 1e-9
        return everything or (self.seed is None and self.epoch_whole)

    def _next_row(self) -> dict[str, Any] | None:
        if self.ahead is not None:
            row, self.ahead = self.ahead, None
            return row
        while not self.exhausted:
            if self.rows is None:
                self.rows = self._epoch_rows()
            try:
                row = next(self.rows)
            except StopIteration:
                self._end_epoch()
                continue
            self.cursor += 1
            self.source = row["source"]
            if int(row["part"]) != self.part:
                self.part, self.taken = int(row["part"]), 0
            self.taken += 1
            return row
        return None

    def next_batch(self) -> GlobalBatch | None:
        """The next global batch, or None when a non-repeating stream is exhausted."""
        before = Counter(self.skipped)
        samples, bad, ids = [], [], []
        read, skips = 0, Counter()
        self.batch_reads = (0, {}, None)
        while len(samples) < self.global_batch_size:
            row = self._next_row()
            if row is None:
                break
            read += 1
            if row["error"]:
                self.skipped[row["error"]] += 1
                skips[row["error"]] += 1
                bad.append({k: row[k] for k in ("source", "error", "detail")})
                self.batch_reads = (read, dict(skips), bad[-1])
                if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
                    self.skip_examples.append(bad[-1])
                continue
            self.batch_reads = (read, self.batch_reads[1], self.batch_reads[2])
            self.good += 1
            self.epoch_good += 1
            self.seen_good = True
            samples.append(decode_sample(row["sample"]))
            ids.append((self.epoch, row["source"]))
        if not samples:
            return None
        microbatches = []
        lengths = [s["input_ids"].shape[0] for s in samples]
        patches = [s["pixel_values"].shape[0] for s in samples]
        for group in micro_batches(lengths, patches, self.budget, self.packing, self.balance):
            vision, text = microbatch_inputs([samples[i] for i in group], self.pad_id, self.packing)
            meta = meta_of(vision, text)
            parts = split_for_ranks(vision, text, self.vision_sp, self.args[2])
            microbatches.append(MicroBatch([ray.put(p) for p in parts], ray.put(text), meta))
        return GlobalBatch(microbatches, self.epoch, dict(self.skipped - before), self.state(), bad, ids)

    def skip_report(self) -> dict[str, Any]:
        return {"counts": dict(self.skipped), "examples": list(self.skip_examples), "good": self.good}


def loader_actor(num_cpus: float = 0.1) -> Any:
    """`BatchLoader` as a Ray actor class (`.remote(...)` starts one), with its `probe` thread."""
    return ray.remote(num_cpus=num_cpus, concurrency_groups={"probe": 1})(BatchLoader)
