"""`dhp bench boundary`: what moving a micro-batch's embeddings and their gradient between the pools costs.

Two Ray actors play the pools' parts in a step's boundary chain, as the trainer submits it:

    vision.send()  ->  text.receive(shard) returns the shard's gradient  ->  vision.receive(gradient)

for a shard of `rows` merged tokens x the text hidden size (7B: 3 584) in bf16, the dtype a GPU run moves.
Per format, the median seconds of that chain over `--reps` minus the same chain with an empty shard (Ray's
call latency, not the boundary's), i.e. the time per micro-batch spent storing, fetching and copying the two
tensors on the host:
  tensor   what the pools sent before the wire format: the torch tensor itself (torch's pickling inside Ray's)
  wire     `stages/boundary.py`'s WireTensor: the bytes as a numpy array (one copy into the object store,
           none out of it) and the receiver's own copy (`from_wire`)
Default rows: 256, 1 024 and 4 096 tokens, the 7B's merged tokens for images of 1 k, 4 k and 16 k patches.
The device<->host copies of a GPU run are not in it (`dhp bench one-gpu` measures the whole boundary there).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dhp.scripts.results import report

ROWS = (256, 1024, 4096)
DIM = 3584  # the 7B's text hidden size
FORMATS = ("tensor", "wire")  # the first is the baseline the others' speedup is over


def _codec(fmt: str) -> tuple[Any, Any]:
    """(what the sender hands Ray, what the receiver makes of it) in format `fmt`. The tensor as it is: a stage
    received it with `.to(device)`, no copy on a CPU. Imported when called: the CLI builds its parser from
    this module and must not pay for torch."""
    from dhp.stages.boundary import from_wire, to_wire

    return {"tensor": (lambda t: t, lambda x: x), "wire": (to_wire, from_wire)}[fmt]


class _Pool:
    """One side of the boundary: sends its shard (or gradient) in a format, receives the other side's."""

    def __init__(self, rows: int, dim: int):
        import torch

        self.shard = {n: torch.randn(n, dim).to(torch.bfloat16) for n in (0, rows)}

    def send(self, fmt: str, rows: int) -> Any:
        return _codec(fmt)[0](self.shard[rows])

    def receive(self, fmt: str, rows: int, x: Any) -> Any:
        """What a stage does on receipt, then what it sends back."""
        got = _codec(fmt)[1](x)
        assert got.shape[0] == rows
        return self.send(fmt, rows)


def _chain(ray: Any, vision: Any, text: Any, fmt: str, rows: int) -> float:
    start = time.perf_counter()
    ray.get(vision.receive.remote(fmt, rows, text.receive.remote(fmt, rows, vision.send.remote(fmt, rows))))
    return time.perf_counter() - start


def run(rows: tuple[int, ...] = ROWS, dim: int = DIM, reps: int = 20) -> dict[str, Any]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = []
    try:
        for n in rows:
            vision, text = (ray.remote(num_cpus=0.25)(_Pool).remote(n, dim) for _ in range(2))
            try:
                for fmt in FORMATS:
                    for _ in range(2):  # warm-up: the actors' imports, the store's first pages
                        _chain(ray, vision, text, fmt, n)
                    empty = statistics.median(_chain(ray, vision, text, fmt, 0) for _ in range(reps))
                    full = statistics.median(_chain(ray, vision, text, fmt, n) for _ in range(reps))
                    moved = 2 * n * dim * 2  # the shard and its gradient, bf16
                    seconds = max(full - empty, 1e-9)
                    out.append(
                        {
                            "rows": n,
                            "dim": dim,
                            "format": fmt,
                            "bytes_per_microbatch": moved,
                            "chain_s": full,
                            "empty_chain_s": empty,
                            "boundary_s": seconds,
                            "gb_per_s": moved / seconds / 1e9,
                        }
                    )
            finally:
                for a in (vision, text):
                    ray.kill(a)
    finally:
        if started:
            ray.shutdown()
    base = {r["rows"]: r["boundary_s"] for r in out if r["format"] == FORMATS[0]}
    for r in out:
        if r["format"] != FORMATS[0]:
            r["speedup"] = base[r["rows"]] / r["boundary_s"]
    return {"timings": "CPU timings (this machine), host side only", "dtype": "bfloat16", "reps": reps, "rows": out}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"boundary per micro-batch (shard + gradient, {result['dtype']}), median of {result['reps']}, "
        f"{result['timings']}",
        "",
        "| tokens x dim | MB moved | format | ms | GB/s | speedup |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        speedup = f"{r['speedup']:.1f}x" if "speedup" in r else ""
        lines.append(
            f"| {r['rows']} x {r['dim']} | {r['bytes_per_microbatch'] / 1e6:.1f} | {r['format']} | "
            f"{r['boundary_s'] * 1e3:.1f} | {r['gb_per_s']:.2f} | {speedup} |"
        )
    return "\n".join(lines)


def main(args: Any) -> int:
    result = run((16, 64), 64, reps=3) if args.quick else run(reps=args.reps)
    return report(args.json, result, table)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("boundary", help="moving embeddings and gradients between the pools: tensor vs wire format")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="16 and 64 tokens x 64, 3 repetitions (for the tests)")
    p.add_argument("--reps", type=int, default=20, help="chains per format and size (median; default 20)")
