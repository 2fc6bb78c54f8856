"""`model.random_init`: how a rank fills its tensors when no `model.path` is given.

`exact` (the default) replays the single-process build's random stream on the CPU, one full tensor at a time,
and keeps the rank's part (models/weights/materialize.py): the model is bit-for-bit `torch.manual_seed(model.init_seed);
TextModel(config)` in every layout, which the parity tests need. Its cost is the whole stage's random-number
generation on every rank's CPU, whatever the layout: 54 s for the 3B text stage on this project's 2-core
machine, and it grows with the model (the 72B's text stage is 23x the 3B's), on every rank at once.

`per_part` performs the same recorded writes (`normal_(0, std)`, `zero_`, `fill_(1)`, ...) on the rank's part
only, on the rank's device, each part from its own generator seeded by (`model.init_seed`, the parameter's
name, the part's index): the same distribution per element as the exact build (the writes are element-wise
with scalar arguments: applied to a part they draw what they would have drawn there), and the same values
wherever two ranks hold the same part (tensor-parallel replicated tensors, data-parallel replicas, tied
weights), so the ranks still form one model; but another random stream, so not the one-process model's values,
and not the same values under another layout or on another kind of device. For runs whose weights' values do
not matter (throughput benchmarks at released sizes, `dhp bench one-gpu`) or a from-scratch run that does not
need to equal a single-process build. Not for the frozen base of a partial run (`vision.train` / `text.train`
other than `all`): its checkpoint holds only what trains and the base is rebuilt at resume, possibly resharded
(`stages/pools.check_layout` refuses it).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from dhp.models.weights.materialize import _WRITERS, InitRecipe, Write, fill_parts, replay


class RandomInit(ABC):
    """How a rank fills its tensors from the recipe of a meta build (`materialize.build_on_meta`)."""

    name: ClassVar[str]
    # whether another layout or device rebuilds the same values from the seed (a frozen base is rebuilt at resume)
    same_in_every_layout: ClassVar[bool]

    @abstractmethod
    def fill(
        self,
        recipe: InitRecipe,
        slicer: Callable[[str], Any],
        sink: Callable[[str, torch.Tensor], None],
        seed: int,
        device: torch.device,
    ) -> None:
        """Call `sink(name, part)` with this rank's part (`slicer(name)`) of every parameter's initial value."""


class Exact(RandomInit):
    name = "exact"
    same_in_every_layout = True

    def fill(self, recipe, slicer, sink, seed, device) -> None:
        torch.manual_seed(seed)  # the stream the single-process build started from
        replay(recipe, slicer, sink=sink)


class PerPart(RandomInit):
    name = "per_part"
    same_in_every_layout = False  # parts follow the layout; CUDA's random kernels follow the device's shape

    def fill(self, recipe, slicer, sink, seed, device) -> None:
        def make(episode: list[Write], names: list[str]) -> Callable[[Any], torch.Tensor]:
            return lambda idx: _part(episode, idx, _seed(seed, names[0], idx), device)  # tied: the first name's

        fill_parts(recipe, make, slicer, None, sink)


MODES: dict[str, type[RandomInit]] = {m.name: m for m in (Exact, PerPart)}


def random_init(name: str) -> RandomInit:
    """The mode of `model.random_init`."""
    if name not in MODES:
        raise ValueError(f"model.random_init must be one of {sorted(MODES)}, got {name!r}")
    return MODES[name]()


def _seed(seed: int, name: str, idx: Any) -> int:
    """A generator seed per (init seed, parameter, part): stable across processes (no Python hash)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{idx!r}".encode()).digest()[:8], "little") >> 1


def _part(episode: list[Write], idx: Any, seed: int, device: torch.device) -> torch.Tensor:
    """The writes of one tensor performed on the part `idx` of it (None: the whole), on `device`."""
    from dhp.models.parallel.tensor_parts import read_part

    first = episode[0]
    if first.op is None:  # created with real values (ones, zeros): their part
        part = (first.value if idx is None else read_part(first.value, idx)).to(device, copy=True)
    else:
        shape = first.shape if idx is None else read_part(torch.empty(first.shape, device="meta"), idx).shape
        part = torch.empty(shape, dtype=first.dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for w in episode:
        if w.op is None:
            continue
        base = w.op.overloadpacket.__name__
        if base not in _WRITERS and torch.Tag.pointwise not in w.op.tags:
            raise NotImplementedError(
                f"model.random_init=per_part: {w.op} is not element-wise, so it cannot be "
                f"applied to a part; use model.random_init=exact"
            )
        kwargs = dict(w.kwargs)
        if any(a.name == "generator" for a in w.op._schema.arguments):
            kwargs["generator"] = generator
        w.op(part, *w.args, **kwargs)
    return part
