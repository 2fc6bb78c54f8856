"""One backward for every forward (stages/step_ledger.py): a gradient sent to a rank that never forwarded its
micro-batch raises at once, naming the micro-batch, the pool, the replica and the rank; a forward left without its
backward stops the step before the optimizer; the run ends in one line. In any fan of the pools (vision and text
replica counts differ): every gradient goes back to the replica that encoded its micro-batch."""

from __future__ import annotations

import functools
import itertools
import os
import random
import re

import pytest
import ray
import torch

from dhp.models.parallel.routing import check_fan, route
from dhp.models.parallel.schedule import VISION_BACKWARD, VISION_FORWARD
from dhp.stages import trainer as trainer_module
from dhp.stages.fault_injection import MISROUTE, misrouted
from dhp.stages.step_ledger import StepInvariantError, StepLedger

# One vision and one text actor without parallelism, half a logical CPU each (tests/test_parity.py's BASE).
ONE_EACH = [
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "text.parallelism=none",
    "text.num_actors=1",
    "text.degree=1",
    "vision.num_cpus_per_actor=0.5",
    "text.num_cpus_per_actor=0.5",
]


def test_ledger_owes_one_backward_per_forward():
    ledger = StepLedger("vision", replica=1, rank=3)
    where = "vision pool, replica 1, rank 3"
    ledger.forwarded(0, "graph of 0")
    ledger.forwarded(1)  # a text-only micro-batch: nothing to backward, but its backward is legal
    assert ledger.backward(1) is None and ledger.backward(0) == "graph of 0"
    with pytest.raises(
        StepInvariantError,
        match=rf"^{where}: a backward of micro-batch 0, which this rank already "
        r"backwarded in this global batch \(backwards owed: none\)$",
    ):
        ledger.backward(0)
    ledger.forwarded(2, "graph of 2")
    with pytest.raises(
        StepInvariantError,
        match=rf"^{where}: a backward of micro-batch 7, which this rank never "
        r"forwarded in this global batch \(backwards owed: \[2\]\)$",
    ):
        ledger.backward(7)
    with pytest.raises(StepInvariantError, match="micro-batch 2 forwarded a second time"):
        ledger.forwarded(2)
    problems = ledger.close()  # what it raised (the driver may never have fetched those calls), then what is owed
    assert len(problems) == 4 and all(p.startswith(where + ": ") and "\n" not in p for p in problems)
    assert problems[-1] == f"{where}: micro-batch 2 was forwarded and never backwarded"
    assert ledger.close() == []  # a clean ledger for the next global batch, whose ids start again
    ledger.forwarded(0, "again")
    assert ledger.backward(0) == "again" and ledger.close() == []


def test_ledger_of_gradients_kept_for_sending():
    """A text rank under a Ray Direct Transport boundary keeps a micro-batch's shard gradients until each is asked
    for (TextWorker.gradient): owed until the last one leaves."""
    ledger = StepLedger("text", replica=0, rank=0)
    ledger.forwarded(5)
    ledger.keep(5, {0: "g0", 1: "g1"})
    left = ledger.owe(5, "the gradient of shard 0 of")
    left.pop(0)
    assert ledger.close() == ["text pool, replica 0, rank 0: micro-batch 5 was forwarded and never backwarded"]
    with pytest.raises(
        StepInvariantError,
        match="^text pool, replica 0, rank 0: the gradient of shard 1 of "
        "micro-batch 5, which this rank never forwarded",
    ):
        ledger.owe(5, "the gradient of shard 1 of")


def _bare_vision_worker():
    """A vision worker of the tiny model on this process, set up by hand (no Ray, no process group)."""
    from dhp.models.architectures import architecture_config
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.precision import precision_of
    from dhp.models.qwen2_5_vl import VisionModel
    from dhp.stages.config import load_config
    from dhp.stages.trace import EventRecorder
    from dhp.stages.vision_worker import VisionWorker

    cfg = load_config("tiny", ONE_EACH)
    config = architecture_config("tiny")
    threads = torch.get_num_threads()  # the worker sets its own: keep this process's
    worker = VisionWorker(cfg, config, rank=0, world_size=1, torch_threads=threads)
    torch.manual_seed(0)
    worker.model, worker.layout, worker.ranks = VisionModel(config), stage_layout(cfg, "vision", config), None
    worker.precision, worker.transport = precision_of(cfg.model.precision), cfg.pipeline.transport
    worker.trains, worker._measured, worker.recorder = True, None, EventRecorder("vision", 0)
    return worker


def test_vision_worker_records_text_only_forwards_and_refuses_unknown_backwards():
    from dhp.stages.boundary import to_wire

    worker = _bare_vision_worker()
    grid = torch.tensor([[1, 2, 2]])  # one 28x28 image: 4 patches, 1 merged token
    image = {"pixel_values": torch.randn(4, worker._placeholder()["pixel_values"].shape[1]), "image_grid_thw": grid}
    text_only = {"pixel_values": image["pixel_values"][:0], "image_grid_thw": grid[:0]}
    assert tuple(worker.forward(0, image).shape) == (1, 64)
    grad = to_wire(torch.randn(1, 64))
    assert worker.forward(1, text_only).data.size == 0  # nothing to encode, nothing sent
    assert worker.backward(1, None) == 1  # legal: the text-only micro-batch was forwarded here
    with pytest.raises(
        StepInvariantError,
        match=r"^vision pool, replica 0, rank 0: a backward of micro-batch 2, "
        r"which this rank never forwarded .*owed: \[0\]",
    ):
        worker.backward(2, grad)
    assert all(p.grad is None for p in worker.model.parameters())  # the refused gradient went nowhere
    assert worker.close_global_batch() == [
        "vision pool, replica 0, rank 0: a backward of micro-batch 2, which this rank never forwarded in this global "
        "batch (backwards owed: [0])",
        "vision pool, replica 0, rank 0: micro-batch 0 was forwarded and never backwarded",
    ]
    worker.forward(0, image)
    worker.backward(0, grad)
    assert worker.close_global_batch() == []
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in worker.model.parameters())


@pytest.mark.parametrize(("dv", "dt"), [(2, 1), (3, 2), (2, 3), (1, 2)])
def test_misroute_hook_sends_every_vision_backward_elsewhere(dv, dt):
    """Routed, every gradient goes back to the replica that encoded its micro-batch; with the test hook on, each
    goes to the next replica (none moves when there is one)."""
    rng = random.Random(dv * 10 + dt)
    patches = [[rng.choice([0, 16, 64]) for _ in range(3)] for _ in range(dt)]
    calls = route(patches, dv, False, False, 2)
    assert MISROUTE not in os.environ and misrouted(calls, dv) is calls  # off unless asked
    encoder = {k: r for c in calls if c.kind == VISION_FORWARD for r, k in c.members}
    back = {k: r for c in calls if c.kind == VISION_BACKWARD for r, k in c.members}
    assert back == encoder and len(back) == 3 * dt
    moved = misrouted(calls, dv, {MISROUTE: "1"})
    assert [c for c in moved if c.kind != VISION_BACKWARD] == [c for c in calls if c.kind != VISION_BACKWARD]
    assert {k: r for c in moved if c.kind == VISION_BACKWARD for r, k in c.members} == {
        k: (r + 1) % dv for k, r in encoder.items()
    }


def test_every_fan_backwards_each_forward_on_its_replica_padding_included():
    """What the ledgers rely on, in every fan, lockstep pools included: each (replica, micro-batch) a vision forward
    runs gets one backward on that replica; a lockstep pool's padding (key None) is numbered by its slot, as
    `Trainer.accumulate` numbers it (-1 - slot)."""
    for dv, dt, vision_lockstep, text_lockstep in itertools.product((1, 2, 3), (1, 2, 3), (False, True), (False, True)):
        if check_fan(dv, dt, vision_lockstep, text_lockstep, 2):
            continue
        calls = route([[16, 0, 64][: 1 + t % 3] for t in range(dt)], dv, vision_lockstep, text_lockstep, 2)
        ids = lambda c, k: k if k is not None else (-1, c.slot)  # noqa: E731 (padding: Trainer.accumulate's -1 - slot)
        forwards = sorted((r, ids(c, k)) for c in calls if c.kind == VISION_FORWARD for r, k in c.members)
        backwards = sorted((r, ids(c, k)) for c in calls if c.kind == VISION_BACKWARD for r, k in c.members)
        assert forwards == backwards and len(set(forwards)) == len(forwards), (dv, dt, vision_lockstep, text_lockstep)


def test_misrouted_gradients_stop_the_run_in_one_line(ray_session, tmp_path, monkeypatch, capsys):
    """`dhp train` with each vision backward sent to the other vision replica (fan-in: two vision replicas, one
    text replica): the ranks refuse the gradients at once, the step stops before the optimizer, one line says why."""
    from dhp.stages.cli import main

    # Planted in this process's trainer alone: set in the process's environment, the variable would reach every
    # process the background runs start meanwhile (tests/background.py), and misroute their gradients too.
    monkeypatch.setattr(trainer_module, "misrouted", functools.partial(misrouted, environ={MISROUTE: "1"}))
    code = main(
        [
            "train",
            *ONE_EACH,
            "vision.num_actors=2",
            f"output.dir={tmp_path}/runs",
            "output.name=misroute",
            f"data.synthetic.dir={tmp_path}/synth",
            "data.synthetic.num=8",
            "data.synthetic.eval_num=2",
            "data.microbatch_tokens=256",
            "data.max_seq_len=256",
            "training.steps=2",
            "training.global_batch_size=4",
            "data.preprocess_num_cpus=0.25",
            "pipeline.max_in_flight=2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("dhp: error:")]
    assert line.startswith(
        "dhp: error: step 1: not every forward of the global batch had its one backward, so no optimizer step: "
    ), line
    refused = re.findall(
        r"vision pool, replica (\d), rank (\d): a backward of micro-batch (\d+), which this rank "
        r"never forwarded",
        line,
    )
    left = re.findall(
        r"vision pool, replica (\d), rank (\d): micro-batch (\d+) was forwarded and never backwarded", line
    )
    assert refused and sorted(mb for *_, mb in refused) == sorted(mb for *_, mb in left), line
    encoder = {mb: replica for replica, _, mb in left}
    assert all(replica == str(1 - int(encoder[mb])) for replica, _, mb in refused)  # each went to the other one
    assert "Traceback" not in err


def test_leftover_graph_stops_the_step_then_a_whole_batch_steps(parity_setup, trainers):
    """Fan-out (one vision replica serving two text replicas): a forward with no backward before the step is named
    and nothing steps; the next global batch, routed as it should be, passes the same check and steps."""
    from dhp.dataflow.loader import GlobalBatch
    from dhp.stages.config import load_config
    from tests.test_parity import _microbatch, collect

    _, ckpt, samples = parity_setup
    cfg = load_config(
        "tiny",
        ONE_EACH
        + [
            "text.num_actors=2",
            f"model.path={ckpt}",
            "data.microbatch_tokens=1024",
            "training.steps=2",
            "training.warmup_steps=0",
        ],
    )
    with trainers.use(cfg) as trainer:
        batches = [
            GlobalBatch([_microbatch([samples[0]], cfg)], epoch=0),
            GlobalBatch([_microbatch([samples[1]], cfg), _microbatch([samples[2]], cfg)], epoch=0),
        ]
        before = collect(trainer)
        ray.get(trainer.vision.forward(0, 1000, batches[0].microbatches[0].vision))  # its backward never comes
        with pytest.raises(StepInvariantError) as failed:
            trainer.train_step(batches)
        assert str(failed.value) == (
            "step 1: not every forward of the global batch had its one backward, so no "
            "optimizer step: vision pool, replica 0, rank 0: micro-batch 1000 was forwarded "
            "and never backwarded"
        )
        after = collect(trainer)
        assert all(torch.equal(after[n], t) for n, t in before.items())  # no optimizer step
        assert trainer.train_step(batches)["grad_norm"] > 0  # ledgers start clean; a whole batch steps
        assert any(not torch.equal(t, before[n]) for n, t in collect(trainer).items())
