"""How far a rank's current call has got: what the step watchdog (stages/watchdog.py) judges, besides time.

A step that is slow is not hung. Each stage actor keeps one `Progress`: a counter that moves whenever a
transformer block's module runs forward (a pre-hook on each of its modules that holds parameters: the layouts
that run a block's parts themselves, like sequence parallelism's Ulysses loop, still call those), whenever the
gradient of such a module's output arrives in backward (a tensor hook, registered only in a forward that builds
a graph), whenever a gradient-sync bucket's all-reduce completes, and when a call starts or ends. A collective
inside a block completes between two of those hooks, so a rank waiting in one does not move. The `heartbeat`
(answered from its own thread) reports the counter, the seconds since it last moved, the call the rank is in
(None: idle, e.g. waiting for its inputs) and where it stands: the last hook's block and module, and the
innermost lines of the call's thread.

Where a block's forward is compiled (`vision.compile`, `text.compile`), its hooks sit on the block, outside the
compiled code: the counter then moves once a block in each direction.

The cost: one Python call per module of a block per forward, and one tensor hook per module output per
training forward (a few hundred per micro-batch at 72B; microseconds each).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from dhp.models.compilation import compiled


class Progress:
    def __init__(self) -> None:
        self.count = 0
        self.moved = time.monotonic()
        self.where = ""  # the last hook that moved it: "block 3 attn.qkv forward"
        self.call: str | None = None  # the call being executed (outermost), None between calls
        self._thread: int | None = None  # the thread executing it
        self._depth = 0

    def move(self, where: str | None = None) -> None:
        self.count += 1
        self.moved = time.monotonic()
        if where is not None:
            self.where = where

    def begin(self, name: str) -> None:
        self._depth += 1
        if self._depth == 1:
            self.call, self._thread, self.where = name, threading.get_ident(), ""
            self.move()

    def end(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.call = self._thread = None
            self.move()

    def watch(self, blocks: Sequence[nn.Module]) -> list[Any]:
        """Hooks on every module that holds parameters of each block (returned, for `.remove()`). A compiled module
        (models/compilation.py) is watched as a whole, and nothing inside it: a hook inside a compiled forward would
        be traced with it, or split its graph, rather than run as Python in every call."""
        handles = []
        for i, block in enumerate(blocks):
            inside_compiled: list[str] = []
            for name, module in block.named_modules():
                if any(name.startswith(outer + ".") or not outer for outer in inside_compiled):
                    continue
                if compiled(module):
                    inside_compiled.append(name)
                elif next(module.parameters(recurse=False), None) is None:
                    continue
                label = f"block {i}" + (f" {name}" if name else "")
                handles += [
                    module.register_forward_pre_hook(self._forward_hook(f"{label} forward")),
                    module.register_forward_hook(self._output_hook(f"{label} backward")),
                ]
        return handles

    def _forward_hook(self, label: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.move(label)

        return hook

    def _output_hook(self, label: str):
        def on_grad(grad: Any) -> None:
            self.move(label)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if getattr(output, "requires_grad", False) and output.grad_fn is not None:
                output.register_hook(on_grad)  # returns None: the gradient is untouched

        return hook

    def snapshot(self) -> dict[str, Any]:
        """What the heartbeat answers (plain values: it crosses Ray)."""
        call, thread = self.call, self._thread
        return {
            "pid": os.getpid(),
            "count": self.count,
            "still_s": time.monotonic() - self.moved,
            "call": call,
            "where": self.where,
            "at": _stack_of(thread) if call is not None and thread is not None else "",
        }


def _stack_of(thread: int) -> str:
    """The innermost line of dhp's own code in `thread`'s stack, and the innermost line of all (a collective's
    wait, a lock) when that is elsewhere: 'sequence_parallel.py:164 seq_to_heads < _functional_collectives.py:...'."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return ""

    def line(f: Any) -> str:
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"

    innermost, own = line(frame), None
    while frame is not None and own is None:
        if frame.f_globals.get("__name__", "").startswith("dhp.") and frame.f_globals["__name__"] != __name__:
            own = line(frame)
        frame = frame.f_back
    return innermost if own in (None, innermost) else f"{own} < {innermost}"


def tracked(worker_cls: type) -> type:
    """A subclass of `worker_cls` whose public methods mark their start and end on the actor's `progress`
    (calls made from within a call count as the outer one). The `health` group's (the heartbeat) are left as
    they are: they run beside a call."""
    wrapped = {}
    for name in dir(worker_cls):
        fn = inspect.getattr_static(worker_cls, name)
        if name.startswith("_") or not inspect.isfunction(fn) or hasattr(fn, "__ray_concurrency_group__"):
            continue
        wrapped[name] = _marking(fn, name)
    return type(worker_cls.__name__, (worker_cls,), wrapped)


def _marking(fn: Any, name: str) -> Any:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        progress = getattr(self, "progress", None)
        if progress is None:
            return fn(self, *args, **kwargs)
        progress.begin(name)
        try:
            return fn(self, *args, **kwargs)
        finally:
            progress.end()

    return call
