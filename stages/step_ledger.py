"""One backward for every forward: what a stage rank owes for the micro-batches of the current global batch.

A vision rank keeps the graph of each micro-batch it encoded until that micro-batch's gradient comes back; a
text rank under a Ray Direct Transport boundary keeps each micro-batch's shard gradients until the pool asks
for them (`TextWorker.gradient`). A gradient sent to a rank that never forwarded its micro-batch would go
nowhere, and the graph it was meant for would stay behind: the step would train on part of the batch and
say nothing. So:

- a backward of a micro-batch this rank did not forward, or already backwarded, raises at once, naming the
  micro-batch, the pool, the replica and the rank; so does a second forward of one micro-batch;
- before every optimizer step the driver asks every rank of both pools to `close` its ledger: what it
  forwarded and never backwarded, and what it raised (the driver may never fetch the result of the call that
  raised), one line each. Any of them stops the run (`StepInvariantError`, stages/trainer.py) before the
  gradients are summed, on every rank alike: no rank enters a collective the others skip.

A micro-batch with nothing to backward (a text-only one: the encoder ran on no image) is recorded all the same,
so that its backward is legal and does nothing. The cost is a few dictionary operations per call.
"""

from __future__ import annotations

from typing import Any


class StepInvariantError(RuntimeError):
    """A rank's forwards and backwards of one global batch do not match; the message says where, on one line."""


class StepLedger:
    """The micro-batches one rank forwarded in the current global batch, and which of them it backwarded."""

    def __init__(self, stage: str, replica: int, rank: int):
        self.where = f"{stage} pool, replica {replica}, rank {rank}"
        self.owed: dict[int, Any] = {}  # forwarded, backward still owed: micro-batch id -> what the backward needs
        self.done: set[int] = set()  # backwarded in this global batch
        self.errors: list[str] = []  # what this ledger raised in this global batch

    def forwarded(self, mb_id: int, graph: Any = None) -> None:
        """`mb_id` was forwarded here; `graph` (None: nothing) is what its backward will need."""
        if mb_id in self.owed or mb_id in self.done:
            self.fail(f"micro-batch {mb_id} forwarded a second time in one global batch")
        self.owed[mb_id] = graph

    def keep(self, mb_id: int, graph: Any) -> None:
        """Replace what the backward of `mb_id`, forwarded and still owed, will need."""
        self.owe(mb_id)
        self.owed[mb_id] = graph

    def owe(self, mb_id: int, what: str = "a backward of") -> Any:
        """What the backward of `mb_id` needs, still owed; raises if this rank owes none (`what`: the call asked
        for, as the message names it)."""
        if mb_id not in self.owed:
            state = "already backwarded" if mb_id in self.done else "never forwarded"
            self.fail(
                f"{what} micro-batch {mb_id}, which this rank {state} in this global batch (backwards "
                f"owed: {sorted(self.owed) or 'none'})"
            )
        return self.owed[mb_id]

    def backward(self, mb_id: int) -> Any:
        """What the forward of `mb_id` left for its backward (None: nothing), which is then no longer owed."""
        graph = self.owe(mb_id)
        del self.owed[mb_id]
        self.done.add(mb_id)
        return graph

    def close(self) -> list[str]:
        """This global batch's broken invariants, one line each (none: every forward had its one backward), and
        a clean ledger for the next global batch. Graphs still owed are dropped with it."""
        problems = self.errors + [
            f"{self.where}: micro-batch {m} was forwarded and never backwarded" for m in sorted(self.owed)
        ]
        self.owed, self.done, self.errors = {}, set(), []
        return problems

    def fail(self, message: str) -> None:
        """Raise `StepInvariantError` with `message`, prefixed with this rank's place, and remember it for `close`."""
        message = f"{self.where}: {message}"
        self.errors.append(message)
        raise StepInvariantError(message)
