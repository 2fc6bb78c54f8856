"""Build a stage on the `meta` device, then give each rank only the tensors (or slices) it holds.

Why not simply build the whole stage and slice it: the 3B text stage peaks at 13 GiB of host RAM that way
(32B: ~125 GiB per rank), whatever the layout. torchtitan and VeOmni build on `meta`, apply the layout,
`to_empty`, then initialise or load per shard; dhp does the same, with one difference: dhp's random init
must stay *exactly* the seeded init of the single-process build (`torch.manual_seed(s); TextModel(cfg)`),
so that a run without `model.path` is the same model whatever its layout, and a parity test can compare a
meta build against transformers' own. Random values come from one CPU generator stream, so the meta build
*records* every in-place write that construction and transformers' `_init_weights` make to a parameter
(in order: `uniform_`/`normal_`/`zero_`/`fill_`/...), and `replay` performs the same writes in the same
order on one full-size tensor at a time (so the generator advances exactly as in the full build), keeps
this rank's part (`slicer`) and drops the rest. Peak memory: the rank's own parts + one full tensor.
Time: the same random-number work as the full build (every write is replayed, also the ones a later write
overwrites: skipping one would shift the stream), minus the full model's allocation.

How the recording works: while the stage is constructed, `nn.Module.register_parameter` moves each new
parameter to `meta` (its CPU `torch.empty` is never touched, so never paged in); a parameter created with
real values (an RMSNorm's `torch.ones`) keeps a copy of them as its first write. Buffers stay real CPU
tensors (rotary `inv_freq` and the like are computed as usual, so nothing needs rebuilding). A
`TorchDispatchMode` logs every mutating aten op whose target is a meta parameter. transformers skips
`_init_weights` under a `torch.device("meta")` context, which is why parameters are moved one by one
instead: its init runs, on meta, and is recorded. A write that reads another tensor (e.g. `copy_` from a
meta source) cannot be replayed and is refused with its op name, as is a write to a view of a parameter
(its replay would write the whole tensor) and a parameter nothing initialised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SMALL = 1 << 20  # elements: a parameter created with real values this small keeps them as its first write
# ops that overwrite every element without reading it: an episode of writes to one tensor must start with one
_WRITERS = {
    "uniform_",
    "normal_",
    "zero_",
    "fill_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "_initial_value",
}


@dataclass
class Write:
    target: int  # storage key of the meta parameter written
    shape: torch.Size
    dtype: torch.dtype
    op: Any  # an aten overload, or None for a parameter's real initial value
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    value: torch.Tensor | None = None  # op None: the initial value


@dataclass
class InitRecipe:
    """The writes of one build, in order, and which module names each written storage goes by."""

    writes: list[Write]
    names: dict[int, list[str]]  # storage key -> parameter names (several when tied)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.writes: list[Write] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.is_meta and func._schema.is_mutable:
            base = func.overloadpacket.__name__
            if target._is_view():  # e.g. an Embedding's padding row zeroed: replayed, it would zero the whole table
                raise NotImplementedError(
                    f"meta build: {base} writes a view of a parameter (part of it); it cannot be replayed"
                )
            if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
                raise NotImplementedError(f"meta build: {func} reads another tensor; it cannot be replayed")
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type != "cpu":
                raise NotImplementedError(f"meta build: {base} with a {gen.device} generator")
            self.writes.append(Write(_key(target), target.shape, target.dtype, func, tuple(args[1:]), dict(kwargs)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _params_on_meta(recorder: _Recorder):
    real = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            if param.numel() <= SMALL:  # real values (ones, zeros): the first write; large ones are torch.empty
                recorder.writes.append(Write(_key(meta), meta.shape, meta.dtype, None, value=param.detach().clone()))
            param = meta
        real(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = real


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecipe]:
    """`build()` with every parameter on `meta` (buffers real) and the recipe of its initial values."""
    recorder = _Recorder()
    with _params_on_meta(recorder), recorder:
        model = build()
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(_key(p), []).append(name)
    return model, InitRecipe(recorder.writes, names)


def replay(
    recipe: InitRecipe,
    slicer: Callable[[str], Any] | None = None,
    keep: Callable[[str], bool] | None = None,
    sink: Callable[[str, torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Initial values by parameter name: this rank's part of each (`slicer(name)`: an index, None = whole).

    Run right after `build_on_meta` with the generator state it started from (the caller re-seeds): each
    write is performed on a full-size CPU tensor in the recorded order, so the random stream is exactly
    that of the full build; only the part is kept. `keep(name)` False: generated (the stream needs it)
    but not kept. Writes to a storage no parameter kept (a Linear's weight replaced by a tied one) are
    performed and dropped for the same reason. `sink(name, part)`: called with each part as soon as it is
    made, instead of collecting them (nothing is returned then: peak memory is one full tensor, not the
    rank's whole state twice).
    """
    from dhp.models.parallel.tensor_parts import read_part

    def make(episode: list[Write], names: list[str]) -> Callable[[Any], torch.Tensor]:
        first = episode[0]  # the full tensor now, kept or not: the stream needs every write
        full = first.value.clone() if first.op is None else torch.empty(first.shape, dtype=first.dtype)
        for w in episode:
            if w.op is not None:
                w.op(full, *w.args, **w.kwargs)
        return lambda idx: full if idx is None else read_part(full, idx).clone()

    out: dict[str, torch.Tensor] = {}
    fill_parts(recipe, make, slicer, keep, out.__setitem__ if sink is None else sink)
    return out


def fill_parts(
    recipe: InitRecipe,
    make: Callable[[list[Write], list[str]], Callable[[Any], torch.Tensor]],
    slicer: Callable[[str], Any] | None,
    keep: Callable[[str], bool] | None,
    sink: Callable[[str, torch.Tensor], None],
) -> None:
    """Walk the recipe one parameter at a time: `make(writes, names)` is called with each tensor's writes (in
    order; the first overwrites every element) and the names it goes by, and answers the part at an index
    (`slicer(name)`; None = whole); `sink(name, part)` gets each kept name's part, tied names with the same index
    sharing one. A kept name nothing initialised is an error."""
    done: set[str] = set()
    writes, i = recipe.writes, 0
    while i < len(writes):
        first = writes[i]
        base = "_initial_value" if first.op is None else first.op.overloadpacket.__name__
        if base not in _WRITERS:
            raise NotImplementedError(f"meta build: the first write to a parameter is {first.op}, which reads it")
        j = i
        while j < len(writes) and writes[j].target == first.target:  # consecutive writes act on one tensor
            j += 1
        names = recipe.names.get(first.target, [])
        part_at = make(writes[i:j], names)
        parts: dict[str, torch.Tensor] = {}
        for name in names:
            if keep is None or keep(name):
                idx = slicer(name) if slicer else None
                if repr(idx) not in parts:
                    parts[repr(idx)] = part_at(idx)
                sink(name, parts[repr(idx)])
                done.add(name)
        i = j
    missing = [n for names in recipe.names.values() for n in names if n not in done and (keep is None or keep(n))]
    if missing:
        raise ValueError(f"meta build: nothing initialised {missing[:8]} ({len(missing)})")


def materialize_params(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter (already laid out: local shapes) uninitialised storage on `device`.

    Not `module.to_empty`: that makes new Parameter objects per module, which unties tied weights and
    drops what a layout attached to a parameter (`_dhp_sharded`, `_dhp_partial`, any hooks). Each
    parameter is replaced once, everywhere it is used, keeping its attributes and hooks.
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                q = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                for hook in (p._backward_hooks or {}).values():
                    q.register_hook(hook)
                new[id(p)] = q
            module._parameters[name] = new[id(p)]


def materialize_sharded(model: nn.Module, device: torch.device) -> None:
    """For a model whose parameters a wrapper owns (FSDP2's DTensors): `to_empty`, which FSDP2 supports
    (it re-registers its sharded parameters), with the real buffers put back."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
