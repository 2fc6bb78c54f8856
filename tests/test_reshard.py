"""Resharding (models/weights/reshard.py): parts laid out by one layout's slicers, refilled into another's.

For every pair of a small set of layouts per stage (each parallelism kind, TP 2 <-> 4 with KV heads split
and replicated, ZeRO-3 over 2 <-> 3 ranks with uneven and empty rows, several replicas), a random full
state is cut with A's slicers, every rank of B is filled from A's parts, and the result must equal B's
slicers applied to the full state exactly. Then the checkpoint path: rank files written as the workers
write them (weights, and moments by name split over replicas as ZeRO-1 does) are read by `SavedRanks`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import save_file

from dhp.models.architectures import architecture_config
from dhp.models.parallel.layouts import make_layout
from dhp.models.parallel.tensor_parts import read_part
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.weights.reshard import MOMENT_SEP, Part, SavedRanks, blocks, fill, index_of, local_shape

LAYOUTS = {  # (name, degree, num_actors)
    "vision": [
        ("none", 1, 1),
        ("sequence", 2, 2),
        ("tensor", 2, 2),
        ("tensor", 4, 4),
        ("zero3", 1, 2),
        ("zero3", 1, 3),
    ],
    "text": [("none", 1, 2), ("tensor", 2, 4), ("tensor", 4, 4), ("zero3", 1, 2), ("zero3", 1, 3)],
}
PAIRS = [(stage, a, b) for stage, lays in LAYOUTS.items() for a, b in itertools.product(lays, lays)]


@pytest.fixture(scope="module")
def full_states():
    config = architecture_config("tiny")
    with torch.device("meta"):
        shapes = {"vision": VisionModel(config).state_dict(), "text": TextModel(config).state_dict()}
    g = torch.Generator().manual_seed(0)
    states = {stage: {n: torch.randn(t.shape, generator=g) for n, t in sd.items()} for stage, sd in shapes.items()}
    return config, states


def _part(full: torch.Tensor, idx) -> torch.Tensor:
    return full if idx is None else read_part(full, idx).clone()


def test_blocks_and_local_shape():
    shape = (12, 5)
    assert blocks(shape, None) == [(((0, 12), (0, 5)), 0)]
    assert blocks(shape, (slice(2, 4),)) == [(((2, 4), (0, 5)), 0)]
    qkv = [(slice(0, 2), slice(None)), (slice(4, 6), slice(None)), (slice(8, 10), slice(None))]
    assert [b.row for b in blocks(shape, qkv)] == [0, 2, 4] and local_shape(shape, qkv) == (6, 5)
    assert local_shape(shape, (slice(None), slice(1, 3))) == (12, 2)
    assert local_shape(shape, (slice(12, 12),)) == (0, 5)  # a ZeRO-3 rank with no rows
    assert local_shape((), None) == ()


@pytest.mark.parametrize(("stage", "a", "b"), PAIRS, ids=lambda v: v if isinstance(v, str) else "{}{}x{}".format(*v))
def test_reshard_equals_slicing_the_full_state(full_states, stage, a, b):
    config, states = full_states
    full = states[stage]
    shapes = {n: t.shape for n, t in full.items()}
    la, lb = make_layout(stage, *a, config), make_layout(stage, *b, config)
    stored = {}  # every rank of A (all replicas: duplicates must be skipped, not double-counted)
    for r in range(la.num_actors):
        slicer = la.slicer(r, shapes)
        stored[r] = {n: _part(t, index_of(slicer, n)) for n, t in full.items()}
    for r in range(lb.num_actors):
        slicer = lb.slicer(r, shapes)
        for name, t in full.items():
            want = _part(t, index_of(slicer, name))
            got = torch.full_like(want, float("nan"))
            sources = [
                Part(
                    index_of(la.slicer(s, shapes), name),
                    tuple(stored[s][name].shape),
                    lambda region, t=stored[s][name]: t[region],
                )
                for s in range(la.num_actors)
            ]
            fill(got, shapes[name], index_of(slicer, name), sources, name)
            assert torch.equal(got, want), (name, r)


def test_missing_holder_and_wrong_shape_are_errors():
    shape = (8, 2)
    full = torch.arange(16.0).reshape(shape)
    halves = [(slice(0, 4),), (slice(4, 8),)]
    only_first = [Part(halves[0], (4, 2), lambda region: full[:4][region])]
    with pytest.raises(ValueError, match="cover 8 of the 16"):
        fill(torch.empty(shape), shape, None, only_first, "w")
    wrong = [Part(halves[0], (3, 2), lambda region: full[:3][region])]
    with pytest.raises(ValueError, match="another model shape"):
        fill(torch.empty(4, 2), shape, halves[0], wrong, "w")


def _write_checkpoint(path, stage, layout, full, shapes, params):
    """Rank files as `StageWorker.save_state` writes them: local tensors, and AdamW moments by name with a
    0-dim step, each parameter's moments on one replica only (ZeRO-1 style, alternating)."""
    for r in range(layout.num_actors):
        slicer = layout.slicer(r, shapes)
        save_file(
            {n: _part(t, index_of(slicer, n)).contiguous() for n, t in full.items()},
            str(path / f"{stage}-rank{r:05d}.safetensors"),
        )
        replica, dp = divmod(r, layout.degree)[0], layout.dp
        moments = {}
        for i, name in enumerate(params):
            if layout.spans_pool or i % dp == replica:
                part = _part(full[name], index_of(slicer, name))
                moments |= {
                    f"{name}{MOMENT_SEP}exp_avg": part * 2,
                    f"{name}{MOMENT_SEP}exp_avg_sq": part.abs(),
                    f"{name}{MOMENT_SEP}step": torch.tensor(7.0),
                }
        save_file(
            {k: v.contiguous() for k, v in moments.items()}, str(path / f"{stage}-rank{r:05d}-moments.safetensors")
        )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("tensor", 2, 4), ("tensor", 4, 4)),
        (("tensor", 2, 4), ("zero3", 1, 3)),
        (("zero3", 1, 3), ("none", 1, 2)),
        (("tensor", 4, 4), ("tensor", 2, 4)),
    ],
)
def test_saved_ranks_read_weights_and_moments_into_another_layout(full_states, tmp_path, a, b):
    config, states = full_states
    stage = "text"
    full = {n: t for n, t in states[stage].items() if "layers.0." in n or "norm" in n}  # small: fast
    shapes = {n: t.shape for n, t in full.items()}
    params = sorted(full)
    la, lb = make_layout(stage, *a, config), make_layout(stage, *b, config)
    _write_checkpoint(tmp_path, stage, la, full, shapes, params)
    for r in range(lb.num_actors):
        slicer = lb.slicer(r, shapes)
        with SavedRanks(tmp_path, stage, la, shapes) as files:
            for name in params:
                idx = index_of(slicer, name)
                want = _part(full[name], idx)
                got = torch.empty_like(want)
                files.fill_weight(got, name, idx)
                assert torch.equal(got, want), name
                assert files.moment_keys(name) == ["exp_avg", "exp_avg_sq", "step"]
                assert torch.equal(files.read_moment(name, "exp_avg", idx), want * 2)
                assert torch.equal(files.read_moment(name, "exp_avg_sq", idx), want.abs())
                assert files.read_moment(name, "step", idx).item() == 7.0
