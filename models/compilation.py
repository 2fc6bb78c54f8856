"""`torch.compile` of a stage's transformer blocks (`vision.compile`, `text.compile`), applied from outside.

What it buys: a block's elementwise work (RMSNorm's upcast, square, mean, rsqrt and scale; the rotary
embedding's halves; SiLU times the up projection; the residual adds) runs as a few fused kernels instead of
dozens of launches, each reading and writing the whole activation. The matrix products and the attention
kernel are the same calls as without it.

How, torchtitan's way: each unit (the layout's `compile_units`: a block, or the parts of a block that a layout
calls one by one) gets its own `forward` compiled, so

- the model is untouched: parameter names, state dicts, checkpoints and exports are those of the eager model;
- hooks on the unit itself stay outside the compiled code (FSDP2's all-gathers, the heartbeat's progress), and
  so does activation checkpointing, which recomputes the compiled forward in backward (`_compiled_forward`);
- every block is the same code with different parameters, so one compiled graph serves all of them
  (torch inlines built-in modules and passes their parameters as inputs);
- `dynamic=True`: a packed micro-batch has a new length every time, and a graph with the length as a symbol
  is compiled once, where a specialised one would recompile for each new length until torch gives up on it.

What stays outside the graphs: host work (the per-sample and per-window grouping read on the host,
models/window_attention.py `segment_groups`; the per-length SDPA loop of the CPU path) is marked
`torch.compiler.disable`, so a block compiles into the part before its attention and the part after. On a GPU
the decoder's attention is one varlen kernel call (torch's is a torch custom op), and a decoder layer is one graph:
tests/test_compile.py checks that with a custom op of the same contract in the kernel's place.

The first micro-batch pays the compilation (its time on a GPU is not measured yet). `aot_eager` traces and runs
the same graphs without generating code: a check, in seconds, that a model compiles, with no speed-up.

| `compile` | what runs |
|---|---|
| `none` | the eager modules |
| `inductor` | torch's default compiler: fused kernels (Triton on a GPU, C++ on a CPU) |
| `aot_eager` | the traced forward and backward graphs, run op by op |
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

BACKENDS = ("none", "inductor", "aot_eager")


@dataclass(frozen=True)
class BlockCompile:
    """Whether and how a stage's blocks are compiled (module docstring)."""

    backend: str = "none"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"compile={self.backend!r}: choose one of {', '.join(BACKENDS)}")

    @classmethod
    def of(cls, stage: Any) -> BlockCompile:
        """The setting of a stage's config (`vision` / `text`: `compile`)."""
        return cls(stage.compile)

    @property
    def on(self) -> bool:
        return self.backend != "none"

    def apply(self, units: Sequence[nn.Module]) -> int:
        """Compile each unit's `forward` in place (the unit keeps its class, parameters and hooks); returns how many
        were compiled. A unit already compiled is compiled anew from its eager forward."""
        if not self.on:
            return 0
        for unit in units:
            unit.forward = _compiled_forward(unit, self.backend)
            unit.forward.dhp_compiled = True  # what `compiled` asks (layouts replace other forwards too)
        return len(units)


def _compiled_forward(unit: nn.Module, backend: str) -> Callable[..., Any]:
    """`unit`'s forward, compiled, with transformers' activation checkpointing kept outside the compiled code.

    transformers' `GradientCheckpointingLayer` wraps its class's `forward` (`functools.wraps`) in a function that
    checkpoints it when `gradient_checkpointing` is set (models/activation_checkpointing.py sets it per block).
    Compiling that wrapper would trace the checkpoint as one higher-order op, which refuses any side effect inside
    it, such as the context variable transformers' kernel hub sets in each norm: torch then runs the whole block
    eagerly. So the wrapped forward is compiled, and the checkpoint is taken around it as the wrapper takes it."""
    forward = type(unit).forward
    checkpointed = getattr(forward, "__wrapped__", None) is not None and isinstance(unit, GradientCheckpointingLayer)
    compiled_forward = torch.compile(
        (forward.__wrapped__ if checkpointed else forward).__get__(unit), backend=backend, dynamic=True
    )
    if not checkpointed:
        return compiled_forward

    def checkpointing(*args: Any, **kwargs: Any) -> Any:
        if unit.gradient_checkpointing and unit.training and torch.is_grad_enabled():
            return unit._gradient_checkpointing_func(functools.partial(compiled_forward, **kwargs), *args)
        return compiled_forward(*args, **kwargs)

    return checkpointing


def compile_stats() -> dict[str, int]:
    """What torch compiled in this process so far: distinct graphs, and graph breaks (a break at a dhp function
    marked `torch.compiler.disable` counts too). Read after a run's first micro-batches, a graph count that keeps
    growing means recompilation. torch keeps these counts in `torch._dynamo.utils.counters`, not a public API: where
    a torch has no such counters, {}."""
    try:
        from torch._dynamo.utils import counters

        return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    except (ImportError, AttributeError, KeyError, TypeError):
        return {}


def compiled(unit: nn.Module) -> bool:
    """Whether `unit`'s forward was compiled by `BlockCompile.apply`."""
    return getattr(vars(unit).get("forward"), "dhp_compiled", False)
