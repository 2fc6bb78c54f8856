"""`dhp bench recovery`: what each kind of cluster fault costs a tiny run, and that none loses or repeats data.

Every run is a real `dhp train` subprocess (the default layout: vision SP2, text TP2, pipelined) that
checkpoints every `checkpoint_every` steps; once step `at` is in metrics.jsonl the fault is made:

  actor    SIGKILL vision rank 1's process (its pid is in the start-up placement lines)
  node     a 3-node cluster (scripts/local_cluster.py), the vision pool on one node and the text pool on
           another (`pipeline.placement=disjoint`, `vision/text.resources`): the text node is killed with all
           its processes and a replacement node joins
  hang     SIGSTOP vision rank 1: nothing fails, the step deadline (`training.step_timeout_s`) must notice
  preempt  SIGINT to the driver: it finishes the step, checkpoints and exits with status 75; a second
           `dhp train` of the same run (`training.resume=auto`) continues
  save     the checkpoint write of the next checkpoint step fails with ENOSPC on text rank 0
           (DHP_INJECT_FAULT, stages/fault_injection.py); the run continues, the next checkpoint is written

and read back from the run:

  detect_s     fault -> the driver's record of it (summary.json restarts[].detected_at; preempt: the signal's
               acknowledgement line; save: the failure line)
  recover_s    fault -> the first step finished after it (metrics.jsonl wall `time`): pools rebuilt, checkpoint
               loaded, data stream repositioned, one step trained (preempt: includes starting the run again)
  steps_redone steps finished before the fault that were trained again (kill step - checkpoint step)
  losses_equal every step's loss equals the uninterrupted reference run's (bit for bit)
  samples_ok   every finished epoch trained each of its samples exactly once (samples.jsonl)

`--quick` (tests/test_faults.py) trains 8 steps with a checkpoint every 2 and the fault after step 3, without
the held-out evaluation: its stream's loader and preprocessing processes would start with every run and
rebuild, and no check reads the evaluation. `--jobs N` runs the reference and the kinds N at a time (the node
kind on the main thread, which starts the cluster): a run's waits (Ray's start, the hang kind's step deadline,
the node probe) then overlap another run's work, but on 2 cores the runs contend, so detect_s and recover_s
are comparable between runs of the bench only at the default of 1.

Usage: dhp bench recovery [--json PATH] [--quick] [--kinds actor,node,...] [--keep DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dhp.scripts.results import write_json
from dhp.stages.step_logs import read

KINDS = ("actor", "node", "hang", "preempt", "save")
SAMPLES = 16  # synthetic training records: with a global batch of 4, an epoch is 4 steps
HANG_TIMEOUT_S = 20
_SYNTH_LOCK = threading.Lock()


def synthetic_set(out: Path) -> tuple[Path, Path]:
    """(train, held-out) annotation files of the runs under `out`, written on first use (once, however many
    threads start runs)."""
    from dhp.dataflow.synth import write_synthetic_dataset

    with _SYNTH_LOCK:
        synth = write_synthetic_dataset(out / "synth", SAMPLES, seed=0, eval_num=4)
    return synth.train_path.resolve(), synth.val_path.resolve()


def start_run(
    out: Path,
    name: str,
    steps: int,
    checkpoint_every: int,
    *extra: str,
    env: dict[str, str] | None = None,
    evaluate: bool = True,
) -> Run:
    """`dhp train` on the synthetic set of `out`; `evaluate`: with the held-out split (a loader and its
    preprocessing processes more, evaluated once at the end)."""
    train, held_out = synthetic_set(out)
    cmd = [
        sys.executable,
        "-m",
        "dhp.stages.cli",
        "train",
        f"output.dir={out}/runs",
        f"output.name={name}",
        f"data.train={train}",
        f"data.eval={held_out if evaluate else ''}",
        f"training.steps={steps}",
        f"training.checkpoint_every={checkpoint_every}",
        "training.eval_every=0",
        "training.eval_batches=1",
        "training.global_batch_size=4",
        "training.warmup_steps=2",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return Run(proc, out / "runs" / name)


class Run:
    """A `dhp train` subprocess; its output lines are read (with their arrival times) by a thread."""

    started: list[Run] = []  # every run of this process, so none outlives a failed measurement

    def __init__(self, proc: subprocess.Popen, run_dir: Path):
        self.proc, self.dir = proc, run_dir
        Run.started.append(self)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str, timeout_s: float = 600) -> tuple[float, re.Match]:
        """(arrival time, match) of the first output line matching `pattern`, waiting for it."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for at, line in list(self.lines):
                if m := re.search(pattern, line):
                    return at, m
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"the run printed no line matching {pattern!r}:\n{self.output()[-3000:]}")

    def pid_of(self, stage: str, rank: int) -> int:
        return int(self.first(rf"{stage}\s+rank {rank}: .* pid (\d+)")[1].group(1))

    def wait_for_step(self, step: int, timeout_s: float = 600) -> None:
        deadline, metrics = time.time() + timeout_s, self.dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the run ended or stalled before step {step}:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float = 1200) -> int:
        code = self.proc.wait(timeout_s)
        self.reader.join(10)
        return code

    def steps_done(self) -> int:
        metrics = self.dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def records(self) -> list[dict[str, Any]]:
        return read(self.dir)


def kill_vision_actor_after_step(run: Run, step: int) -> float:
    """SIGKILL vision rank 1 once `step` steps are in metrics.jsonl; returns the kill's wall time."""
    pid = run.pid_of("vision", 1)
    run.wait_for_step(step)
    os.kill(pid, signal.SIGKILL)
    return time.time()


@dataclass
class Fault:
    run: Run  # the run that finished the training
    at: float  # wall time of the fault
    done: int  # steps finished when it struck
    detected: float | None = None  # when the run acknowledged it, if read from its output
    runs: list[Run] = field(default_factory=list)  # every run involved (their output is kept with --keep)
    nodes: list[str] = field(default_factory=list)  # node ids of a multi-node cluster


def trained_ids(run_dir: Path) -> dict[int, Counter]:
    """epoch -> how many times each sample id was trained, over every stream (samples.jsonl)."""
    out: dict[int, Counter] = {}
    for record in read(run_dir, "samples"):
        for epoch, source in record["ids"]:
            out.setdefault(epoch, Counter())[source] += 1
    return out


def epochs_exact(run_dir: Path, train_file: Path, steps: int, per_step: int) -> bool:
    """Each finished epoch trained every record of the training file once, nothing else."""
    good = {f"{train_file.resolve()}:{i + 1}" for i in range(len(train_file.read_text().splitlines()))}
    ids = trained_ids(run_dir)
    finished = steps * per_step // len(good)
    return finished >= 1 and all(set(ids.get(e, {})) == good and set(ids[e].values()) == {1} for e in range(finished))


def _fault(kind: str, out: Path, steps: int, every: int, at: int, evaluate: bool) -> Fault:
    if kind == "actor":
        run = start_run(out, kind, steps, every, evaluate=evaluate)
        killed = kill_vision_actor_after_step(run, at)
        return Fault(run, killed, run.steps_done(), runs=[run])
    if kind == "hang":
        run = start_run(out, kind, steps, every, f"training.step_timeout_s={HANG_TIMEOUT_S}", evaluate=evaluate)
        pid = run.pid_of("vision", 1)
        run.wait_for_step(at)
        os.kill(pid, signal.SIGSTOP)
        return Fault(run, time.time(), run.steps_done(), runs=[run])
    if kind == "preempt":
        first = start_run(out, kind, steps, every, evaluate=evaluate)
        first.wait_for_step(at)
        os.kill(first.proc.pid, signal.SIGINT)
        sent, done = time.time(), first.steps_done()
        detected = first.first(r"SIGINT received")[0]
        if first.finish() != 75:
            raise RuntimeError(f"a preempted run must exit with status 75:\n{first.output()[-3000:]}")
        second = start_run(out, kind, steps, every, evaluate=evaluate)
        return Fault(second, sent, done, detected, [first, second])
    if kind == "save":
        # The first checkpoint step after `at`; text rank 0 fails it with ENOSPC once.
        fail = (at // every + 1) * every
        run = start_run(out, kind, steps, every, env={"DHP_INJECT_FAULT": f"enospc@text:0:{fail}"}, evaluate=evaluate)
        at_line, _ = run.first(rf"checkpoint of step {fail} failed")
        return Fault(run, at_line, fail, at_line, [run])
    if kind == "node":
        return _node_fault(out, steps, every, at, evaluate)
    raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")


def _node_fault(out: Path, steps: int, every: int, at: int, evaluate: bool) -> Fault:
    from dhp.scripts.local_cluster import LocalCluster

    cluster = LocalCluster(head_cpus=2)
    try:
        nodes = [cluster.add("vision", 1, {"vision_node": 2}), cluster.add("text", 1, {"text_node": 2})]
        run = start_run(
            out,
            "node",
            steps,
            every,
            f"ray.address={cluster.address}",
            "pipeline.placement=disjoint",
            "vision.resources={vision_node: 1}",
            "text.resources={text_node: 1}",
            evaluate=evaluate,
        )
        run.wait_for_step(at)
        cluster.kill("text")
        fault = Fault(run, time.time(), run.steps_done(), runs=[run], nodes=nodes)
        nodes.append(cluster.add("text-replacement", 1, {"text_node": 2}))
        run.finish()  # before the cluster goes
        return fault
    finally:
        cluster.shutdown()


def faulted(kind: str, out: Path, steps: int, every: int, at: int, evaluate: bool) -> Fault:
    """The fault of `kind` made in a run that then trained to its end."""
    fault = _fault(kind, out, steps, every, at, evaluate)
    if fault.run.finish() != 0:
        raise RuntimeError(f"the {kind} run failed:\n{fault.run.output()[-3000:]}")
    return fault


def uninterrupted(out: Path, steps: int, every: int, evaluate: bool) -> list[float]:
    """Every step's loss of the reference run, which no fault touches."""
    ref = start_run(out, "reference", steps, every, evaluate=evaluate)
    if ref.finish() != 0:
        raise RuntimeError(f"the reference run failed:\n{ref.output()[-3000:]}")
    return [r["loss"] for r in ref.records()]


def measure(kind: str, fault: Fault, out: Path, steps: int, every: int, at: int, reference: list[float]) -> dict:
    """The row of one fault kind, read back from its finished run."""
    run, fault_at, detected = fault.run, fault.at, fault.detected
    summary = json.loads((run.dir / "summary.json").read_text())
    records = run.records()
    if detected is None:
        detected = summary["restarts"][0]["detected_at"]
    resumed = int(re.search(r"step_(\d+)", summary["resumed_from"] or "step_0").group(1))
    if summary["resumed_from"]:  # the first step the rebuilt (or restarted) run trained
        after = next(r["time"] for r in records if r["step"] == resumed + 1)
    else:  # it never stopped training (a failed save)
        after = min((r["time"] for r in records if r["time"] > detected), default=float("nan"))
    losses = [r["loss"] for r in records]
    return {
        "kind": kind,
        "detect_s": round(detected - fault_at, 3),
        "recover_s": round(after - fault_at, 3),
        "steps_redone": max(0, fault.done - resumed) if summary["resumed_from"] else 0,
        "fault_after_step": at,
        "resumed_from_step": resumed,
        "restarts": [{k: v for k, v in r.items() if k != "detected_at"} for r in summary["restarts"]],
        "steps_in_order": [r["step"] for r in records] == list(range(1, steps + 1)),
        "losses_equal": losses == reference,
        "max_loss_diff": max((abs(a - b) for a, b in zip(losses, reference)), default=0.0),
        "samples_ok": epochs_exact(run.dir, out / "synth" / "train.jsonl", steps, 4),
        "step_time_s": round(sorted(r["step_time_s"] for r in records)[len(records) // 2], 3),
        "checkpoint_every": every,
        "steps": steps,
        "nodes": fault.nodes,
        "run_dir": str(run.dir),
        "output": [r.output()[-20000:] for r in fault.runs],
    }


def run_jobs(jobs: dict[str, Callable[[], Any]], workers: int, on_main: set[str]) -> dict[str, Any]:
    """Each job's result, `workers` jobs at a time, taken in the order given as threads free up; those named in
    `on_main` only by the calling thread. After a failure no job starts, and the first failure is raised once
    the running ones have ended."""
    todo, results, errors, lock = list(jobs), {}, [], threading.Lock()

    def take(main: bool) -> str | None:
        with lock:
            name = next((n for n in todo if main or n not in on_main), None)
            if errors or name is None:
                return None
            todo.remove(name)
            return name

    def work(main: bool) -> None:
        while (name := take(main)) is not None:
            try:
                results[name] = jobs[name]()
            except Exception as e:  # raised on the calling thread
                errors.append(e)

    threads = [threading.Thread(target=work, args=(False,), daemon=True) for _ in range(workers - 1)]
    for t in threads:
        t.start()
    work(True)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def job_order(kinds: list[str], jobs: int) -> list[str]:
    """One at a time: the reference first, so that a broken run fails before any fault is made. Several: the node
    kind first (the main thread's, which starts its cluster), the others longest first (the hang waits out its
    deadline)."""
    if jobs == 1:
        return ["reference", *kinds]
    longest = sorted(kinds, key=("node", "hang", "preempt", "actor", "save").index)
    return [*longest[:2], "reference", *longest[2:]]


def main(args: argparse.Namespace) -> int:
    steps, every, at = (8, 2, 3) if args.quick else (12, 4, 7)
    evaluate = not args.quick
    kinds = [k.strip() for k in (args.kinds or ",".join(KINDS)).split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or args.jobs < 1:
        bad = f"unknown fault kind {unknown[0]!r}; kinds: {', '.join(KINDS)}" if unknown else "--jobs must be >= 1"
        print(f"dhp: error: {bad}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        synthetic_set(out)  # before the runs start, however many at a time

        def job(name: str) -> Callable[[], Any]:
            if name == "reference":
                return lambda: uninterrupted(out, steps, every, evaluate)
            return lambda: faulted(name, out, steps, every, at, evaluate)

        try:
            done = run_jobs({n: job(n) for n in job_order(kinds, args.jobs)}, args.jobs, on_main={"node"})
        finally:
            for run in Run.started:
                if run.proc.poll() is None:
                    run.proc.kill()  # its local Ray goes with it (Ray's reaper)
        rows = [measure(kind, done[kind], out, steps, every, at, done["reference"]) for kind in kinds]
    print(
        f"{'fault':8s} {'detect_s':>9} {'recover_s':>10} {'steps_redone':>12} {'losses_equal':>12} {'samples_ok':>10}"
    )
    for r in rows:
        print(
            f"{r['kind']:8s} {r['detect_s']:>9.2f} {r['recover_s']:>10.2f} {r['steps_redone']:>12d} "
            f"{str(r['losses_equal']):>12} {str(r['samples_ok']):>10}"
        )
    if args.json:
        write_json(args.json, [{k: v for k, v in r.items() if k != "output" or args.keep} for r in rows])
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kinds", default=None)
    parser.add_argument("--keep", default=None)
    parser.add_argument("--jobs", type=int, default=1)
    sys.exit(main(parser.parse_args()))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("recovery", help="faults mid-run (actor, node, hang, preempt, save): recovery")
    p.add_argument("--json", default=None, help="write the row here")
    p.add_argument("--quick", action="store_true", help="8 steps, no evaluation (for tests)")
    p.add_argument("--kinds", default=None, help="comma-separated: actor,node,hang,preempt,save (default: all)")
    p.add_argument("--keep", default=None, help="write the runs here and keep them (default: a temp dir)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1: timings comparable)")
