"""Input pipeline throughput and memory, and how long training waits for data (`dhp bench data`).

On the synthetic captioning set (real PNGs, the real tokenizer and image processor):
  baseline_samples_per_s   one process, a plain loop doing the same decode / smart_resize / patchify /
                           chat template / mRoPE (`Preprocessor.process` per record).
  ray_data_samples_per_s   dhp's Ray Data pipeline (`loader.build_dataset`: read, split records, a pool of
                           `workers` Preprocessor actors), local files; `ray_data_s3_samples_per_s` the same
                           files from s3:// on a real S3 HTTP endpoint (moto's server, 127.0.0.1). Steady
                           state: the records of the `repeat`x stream beyond the 1x one, over the extra time
                           (start-up cancels), after one untimed stream that warms the processes (`steady`).
  ray_data_startup_s       seconds from a stream's start to its first row in a running session (what each
                           epoch, resume and evaluation pass costs; goal <= 5 s); `ray_data_cold_start_s` the
                           same for the session's first stream (fresh processes import and build).
  *_vision_tokens_per_s    the same in merged vision tokens (what the text stage receives).
  memory                   the stream re-run over `repeat`x more records with the object store capped at
                           `object_store_mb`: peak memory (PSS of the Ray processes and this one) stays
                           flat while the bytes streamed grow past the object store many times over.
  webdataset               the same images as img2dataset would shard them (`{key}.png`, `{key}.txt`): one
                           shard, then `repeat` shards, through the WebDataset reader (dataflow/webdataset.py):
                           steady samples/s and the same peak-memory check as `memory`.
  data_wait_fraction       a real tiny `dhp train` run: time the driver waited for the next global batch /
                           (wait + step time), over the steps after the first (goal <= 5 %);
                           `first_step_data_wait_s` the first step's wait (the streams start while the pools
                           build, `BatchLoader.start`, so it is the start-up a user would see).
Writes one JSON row and prints a short table. Timings are this machine's (2 cores): pipeline workers and the
baseline share them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dhp.scripts.results import write_json

GOAL_WAIT = 0.05
GOAL_STARTUP_S = 5.0
FULL = dict(samples=192, repeat=4, workers=2, object_store_mb=80, train_steps=30)
QUICK = dict(samples=12, repeat=2, workers=1, object_store_mb=80, train_steps=4)


class PeakMemory:
    """Peak summed PSS (proportional set size: shared pages split between their users, so the object store's
    shared memory is counted once) of this process and its descendants, sampled every `period_s`."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peak, self._stop = period_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(os.getpid()))
            self._stop.wait(self.period_s)


def tree_pss(root: int) -> int:
    """Bytes of PSS summed over `root` and its descendants (Linux /proc)."""
    from dhp.scripts.local_head import process_tree

    total = 0
    for pid in process_tree(root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _settings(root: str, storage: Any = None, records: Any = None):
    from dhp.dataflow.preprocess import PreprocessSettings

    return PreprocessSettings(
        image_root=root, min_pixels=3136, max_pixels=50176, max_seq_len=1024, storage=storage, records=records
    )


def _model_config():
    from dhp.models.architectures import architecture_config

    return architecture_config("tiny")


def baseline(train: Path, root: str) -> dict[str, float]:
    """The plain single-process loop over the same records."""
    from dhp.dataflow.preprocess import Preprocessor, SkipSample

    pre = Preprocessor(_settings(root), _model_config())
    lines = [line for line in train.read_text().splitlines() if line.strip()]
    start, n, vision = time.perf_counter(), 0, 0
    for line in lines:
        try:
            sample = pre.process(line)
        except SkipSample:
            continue
        n += 1
        vision += int(sample["image_grid_thw"].prod(-1).sum()) // pre.merge_unit
    elapsed = time.perf_counter() - start
    return {"samples_per_s": n / elapsed, "vision_tokens_per_s": vision / elapsed, "samples": n}


def ray_data(paths: list[str], root: str, workers: int, storage: Any = None, records: Any = None) -> dict[str, float]:
    """dhp's pipeline streamed to the end: seconds from the start (actor start-up included), rows, bytes."""
    from dhp.dataflow.loader import build_dataset
    from dhp.dataflow.preprocess import decode_sample

    start = time.perf_counter()
    ds = build_dataset(
        paths, _settings(root, storage, records), _model_config(), workers=workers, num_cpus=0.5, seed=None
    )
    n, vision, streamed, first = 0, 0, 0, None
    for row in ds.iter_rows():
        first = first or time.perf_counter() - start
        if row["error"]:
            continue
        n += 1
        streamed += len(row["sample"])
        vision += int(decode_sample(row["sample"])["image_grid_thw"].prod(-1).sum()) // 4
    return {
        "seconds": time.perf_counter() - start,
        "first_row_s": first,
        "samples": n,
        "vision_tokens": vision,
        "streamed_bytes": streamed,
    }


def steady(stream: Any, short: Any, long: Any) -> dict[str, Any]:
    """Steady throughput and start-up of `stream(paths)`: `short` once to warm this configuration's processes
    (its first-row latency is the cold start: fresh worker processes importing and building the preprocessor),
    then `short` and `long` again. Throughput counts the records the long stream has beyond the short one over
    the extra time, so the start-up both pay cancels (a one-file stream arrives in a few large blocks: timing
    from its first row would leave most of the work out); the start-up is the warm short run's first row: what
    a stream costs in a running trainer (each epoch, resume, evaluation)."""
    cold = stream(short)
    runs = [stream(short), stream(long)]
    dt, extra = max(runs[1]["seconds"] - runs[0]["seconds"], 1e-9), runs[1]["samples"] - runs[0]["samples"]
    vision = runs[1]["vision_tokens"] - runs[0]["vision_tokens"]
    return {
        "samples_per_s": extra / dt,
        "vision_tokens_per_s": vision / dt,
        "startup_s": runs[0]["first_row_s"],
        "cold_start_s": cold["first_row_s"],
        "runs": runs,
    }


def repeated(train: Path, times: int, out: Path) -> Path:
    """The annotation file `times` over (same images): a longer stream of the same work."""
    text = train.read_text()
    out.write_text(text * times)
    return out


def shards_of(train: Path, root: Path, copies: int, out: Path) -> list[Path]:
    """The set as img2dataset would write it: a tar of `{key}.png` + `{key}.txt` (the record's reply), and
    `copies` - 1 more copies of it: a longer stream of the same work."""
    import io
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    first = out / "00000.tar"
    with tarfile.open(first, "w") as tar:
        for i, line in enumerate(line for line in train.read_text().splitlines() if line.strip()):
            record = json.loads(line)
            caption = next(t["value"] for t in record["conversations"] if t["from"] == "gpt").encode()
            image = record["image"] if isinstance(record["image"], str) else record["image"][0]
            for name, data in ((f"{i:06d}.png", (root / image).read_bytes()), (f"{i:06d}.txt", caption)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    paths = [first]
    for k in range(1, copies):
        paths.append(out / f"{k:05d}.tar")
        paths[-1].write_bytes(first.read_bytes())
    return paths


def upload(local_dir: Path, endpoint: str, bucket: str) -> Any:
    """The synthetic set into s3://bucket/synth (boto3, installed with moto); returns the resolved storage."""
    import boto3

    from dhp.dataflow.storage import resolve
    from dhp.stages.config import StorageConfig

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"synth/{path.relative_to(local_dir).as_posix()}")
    return resolve(StorageConfig(endpoint_url=endpoint, region="us-east-1", addressing_style="path"))


def upload_file(path: Path, endpoint: str, bucket: str, key: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").upload_file(str(path), bucket, key)


def training_wait(data_dir: Path, out_dir: Path, steps: int) -> dict[str, float]:
    """A real tiny `dhp train` (the default layout): the fraction of step time spent waiting for data."""
    from dhp.stages.config import load_config
    from dhp.stages.driver import train
    from dhp.stages.step_logs import read

    cfg = load_config(
        "tiny",
        [
            f"training.steps={steps}",
            "training.eval_every=0",
            "training.eval_batches=1",
            f"data.synthetic.dir={data_dir}",
            f"output.dir={out_dir}",
            "output.name=run",
            "output.save_final_checkpoint=false",
            "output.tensorboard=false",
        ],
    )
    train(cfg)
    rows = read(out_dir / "run")
    first, rows = rows[0]["data_wait_s"], rows[1:]
    wait = sum(r["data_wait_s"] for r in rows)
    busy = sum(r["step_time_s"] for r in rows)
    return {
        "data_wait_fraction": wait / max(wait + busy, 1e-9),
        "train_steps_measured": len(rows),
        "first_step_data_wait_s": first,
        "median_step_s": statistics.median(r["step_time_s"] for r in rows) if rows else 0.0,
    }


def run(sizes: dict[str, Any], work: Path) -> dict[str, Any]:
    import ray
    from moto.server import ThreadedMotoServer

    from dhp.dataflow.synth import write_synthetic_dataset
    from dhp.stages.rendezvous import local_ray_on_loopback

    synth = write_synthetic_dataset(work / "synth", sizes["samples"], seed=0, eval_num=0)
    train, root = synth.train_path, str(synth.out_dir)
    row: dict[str, Any] = {"samples": sizes["samples"], "workers": sizes["workers"]}
    base = baseline(train, root)
    row.update(baseline_samples_per_s=base["samples_per_s"], baseline_vision_tokens_per_s=base["vision_tokens_per_s"])

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    for key, value in saved.items():  # moto accepts any keys; resolve() reads them (restored at the end)
        os.environ[key] = value or "bench"
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server would log every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    own_ray = not ray.is_initialized()  # a caller's Ray (the tests' session) is reused and left running
    if own_ray:
        local_ray_on_loopback()
        ray.init(
            address="local",
            num_cpus=2,
            object_store_memory=sizes["object_store_mb"] << 20,
            include_dashboard=False,
            log_to_driver=False,
        )
    store_mb = ray.cluster_resources().get("object_store_memory", 0) / 2**20
    try:
        host, port = server.get_host_and_port()
        storage = upload(synth.out_dir, f"http://{host}:{port}", "bench")
        big = repeated(train, sizes["repeat"], work / "repeated.jsonl")
        upload_file(big, f"http://{host}:{port}", "bench", "synth/repeated.jsonl")
        from dhp.dataflow.sources import WebDataset

        def measured(paths: list[Path], **kw: Any) -> dict[str, Any]:  # one stream, with its peak memory
            with PeakMemory() as peak:
                out = ray_data([str(p) for p in paths], root, sizes["workers"], **kw)
            return out | {"peak_pss_mb": peak.peak / 2**20, "streamed_mb": out["streamed_bytes"] / 2**20}

        def memory_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:  # peak memory against stream length
            return [
                {"records": r["samples"], "streamed_mb": r["streamed_mb"], "peak_pss_mb": r["peak_pss_mb"]}
                for r in runs
            ]

        local = steady(measured, [train], [big])
        shards = shards_of(train, synth.out_dir, sizes["repeat"], work / "shards")
        wds_format = WebDataset("<image>\nDescribe this image.", "txt")
        wds = steady(lambda paths: measured(paths, records=wds_format), shards[:1], shards)
        memory, wds_memory = memory_of(local["runs"]), memory_of(wds["runs"])
        row.update(
            webdataset_samples_per_s=wds["samples_per_s"],
            webdataset_startup_s=wds["startup_s"],
            webdataset_memory=wds_memory,
            webdataset_peak_growth=wds_memory[-1]["peak_pss_mb"] / max(wds_memory[0]["peak_pss_mb"], 1e-9),
        )
        s3 = steady(
            lambda paths: ray_data(
                [f"s3://bench/synth/{p.name}" for p in paths], "s3://bench/synth", sizes["workers"], storage
            ),
            [train],
            [big],
        )
        row.update(
            ray_data_samples_per_s=local["samples_per_s"],
            ray_data_vision_tokens_per_s=local["vision_tokens_per_s"],
            ray_data_startup_s=local["startup_s"],
            ray_data_cold_start_s=local["cold_start_s"],
            ray_data_s3_samples_per_s=s3["samples_per_s"],
            ray_data_s3_vision_tokens_per_s=s3["vision_tokens_per_s"],
            object_store_mb=round(store_mb),
            memory=memory,
            streamed_over_object_store=memory[-1]["streamed_mb"] / max(store_mb, 1e-9),
            peak_growth=memory[-1]["peak_pss_mb"] / max(memory[0]["peak_pss_mb"], 1e-9),
        )
    finally:
        if own_ray:
            ray.shutdown()
        server.stop()
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    row.update(training_wait(work / "synth", work / "runs", sizes["train_steps"]))
    row["speedup_over_baseline"] = row["ray_data_samples_per_s"] / row["baseline_samples_per_s"]
    row["goal"] = {
        "data_wait_fraction": row["data_wait_fraction"] <= GOAL_WAIT,
        "ray_data_startup_s": row["ray_data_startup_s"] <= GOAL_STARTUP_S,
        "first_step_data_wait_s": row["first_step_data_wait_s"] <= GOAL_STARTUP_S,
    }
    return row


def table(row: dict[str, Any]) -> str:
    lines = [
        f"{'pipeline':28}{'samples/s':>10}{'vision tok/s':>14}",
        f"{'plain loop (1 process)':28}{row['baseline_samples_per_s']:10.1f}"
        f"{row['baseline_vision_tokens_per_s']:14.0f}",
        f"{'Ray Data, local files':28}{row['ray_data_samples_per_s']:10.1f}{row['ray_data_vision_tokens_per_s']:14.0f}",
        f"{'Ray Data, s3:// (moto)':28}{row['ray_data_s3_samples_per_s']:10.1f}"
        f"{row['ray_data_s3_vision_tokens_per_s']:14.0f}",
        f"{'Ray Data, WebDataset shards':28}{row['webdataset_samples_per_s']:10.1f}",
        "",
    ]
    for kind, key in (("records", "memory"), ("shard samples", "webdataset_memory")):
        for m in row[key]:
            lines.append(
                f"streamed {m['records']:5d} {kind} = {m['streamed_mb']:7.1f} MiB through a "
                f"{row['object_store_mb']} MiB object store: peak PSS {m['peak_pss_mb']:7.1f} MiB"
            )
    lines.append(
        f"a stream's first row after {row['ray_data_startup_s']:.2f} s (the session's first stream: "
        f"{row['ray_data_cold_start_s']:.2f} s; goal <= {GOAL_STARTUP_S:g} s); training's first step "
        f"waited {row['first_step_data_wait_s']:.2f} s for data"
    )
    lines.append(
        f"training waited for data {row['data_wait_fraction']:.1%} of step time "
        f"(goal <= {GOAL_WAIT:.0%}) over {row['train_steps_measured']} steps"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        p = argparse.ArgumentParser(prog="bench_data")
        p.add_argument("--json", default=None)
        p.add_argument("--quick", action="store_true")
        args = p.parse_args()
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="dhp-bench-data-") as tmp:
        row = run(sizes, Path(tmp))
    print(table(row))
    if args.json:
        write_json(args.json, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="Ray Data preprocessing vs a plain loop (local and s3://); data wait")
    p.add_argument("--json", default=None, help="write the row here")
    p.add_argument("--quick", action="store_true", help="a tiny set (for tests)")
