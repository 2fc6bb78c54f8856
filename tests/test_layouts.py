"""The layout objects (models/parallel/layout.py): registry, slicer/gather round trips, held elements, boundary fan-out,
and that nothing outside config validation and the registry compares layout names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch

from dhp.models.architectures import architecture_config
from dhp.models.parallel.layouts import LAYOUTS, available, layout_class, make_layout
from dhp.models.parallel.tensor_parts import read_part
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.stages.config import StageConfig

ROOT = Path(__file__).resolve().parents[1]
# (stage, name, degree, num_actors): every layout at a size the tiny model allows, KV heads split and replicated
CASES = [
    ("vision", "none", 1, 2),
    ("vision", "sequence", 2, 4),
    ("vision", "tensor", 2, 2),
    ("vision", "zero3", 1, 3),
    ("text", "none", 1, 1),
    ("text", "tensor", 2, 2),
    ("text", "tensor", 4, 4),
    ("text", "zero3", 1, 3),
]


@pytest.fixture(scope="module")
def full_states():
    config = architecture_config("tiny")
    torch.manual_seed(0)
    return config, {"vision": VisionModel(config).state_dict(), "text": TextModel(config).state_dict()}


def test_every_configurable_name_has_a_class():
    names = set(typing.get_args(typing.get_type_hints(StageConfig)["parallelism"]))
    assert {name for _, name in LAYOUTS} == names
    assert available("text") == ("none", "tensor", "zero3")
    assert set(available("vision")) == {"none", "sequence", "tensor", "zero3"}
    with pytest.raises(ValueError, match="available for text: none, tensor, zero3"):
        layout_class("text", "sequence")


@pytest.mark.parametrize(("stage", "name", "degree", "num_actors"), CASES)
def test_slicer_gather_round_trip_and_held_elements(full_states, stage, name, degree, num_actors):
    """Each state rank's slices (what it loads and saves) gathered back give the full tensors exactly, and
    `state_numel` (the bytes of the memory plan, no allocation) equals the elements of those slices."""
    config, states = full_states
    full = states[stage]
    layout = make_layout(stage, name, degree, num_actors, config)
    shapes = {n: t.shape for n, t in full.items()}
    ranks = layout.state_ranks(0)
    locals_ = []
    for rank in ranks:
        slicer = layout.slicer(rank, shapes)
        local = {
            n: t if slicer is None or slicer(n) is None else read_part(t, slicer(n)).clone() for n, t in full.items()
        }
        assert layout.state_numel(shapes, rank) == sum(t.numel() for t in local.values())
        locals_.append(local)
    gathered = layout.gather(locals_)
    assert gathered.keys() == full.keys()
    for n, t in full.items():
        assert torch.equal(gathered[n], t), n
    total = sum(t.numel() for t in full.values())
    held = [layout.state_numel(shapes, r) for r in ranks]
    if layout.spans_pool:
        assert sum(held) == total and len(ranks) == num_actors
    elif layout.slicer(0, shapes) is None:
        assert held == [total] * degree
    else:
        assert max(held) < total


def test_boundary_fan_out():
    x, g = ["x0", "x1"], ["g0", "g1"]
    sp = make_layout("vision", "sequence", 2, 4)
    assert (sp.rank_inputs(x), sp.crossing(["o0", "o1"]), sp.rank_grads(g)) == (x, ["o0", "o1"], g)
    assert sp.rank_inputs(None) == []
    tp = make_layout("vision", "tensor", 2, 2)
    assert tp.rank_inputs(["x"]) == ["x", "x"] and tp.crossing(["o0", "o1"]) == ["o0"]
    assert tp.rank_grads(["g"]) == ["g", "g"] and tp.rank_inputs(None) == [] and tp.rank_grads([]) == []
    z = make_layout("vision", "zero3", 1, 2)
    assert z.lockstep and z.rank_inputs(None) == [None] and z.rank_grads([]) == [None]
    assert make_layout("text", "zero3", 1, 4).state_ranks(1) == [0, 1, 2, 3]
    assert make_layout("text", "tensor", 2, 4).state_ranks(1) == [2, 3]
    assert sp.loader_shards == 2 and tp.loader_shards == 0 and sp.optimizer_fraction == 0.25


def test_degree_checks_name_what_works():
    assert "use vision.degree=1" in layout_class("vision", "none").check_degree("vision", 2)
    assert "use text.degree=1" in layout_class("text", "zero3").check_degree("text", 2)
    config = architecture_config("tiny")
    with pytest.raises(ValueError, match="valid degrees"):
        make_layout("text", "tensor", 3, 3).check_shape(config)
    with pytest.raises(ValueError, match="must divide"):
        make_layout("vision", "sequence", 3, 3).check_shape(config)


def test_no_layout_name_tests_outside_the_registry():
    """The count: workers, pools, trainer and scripts ask the layout object, never compare its name; the
    same for the placement (stages/placement_modes.py), the resume choice (checkpoint_files.ResumeFrom) and the
    checkpoint-error policy (TrainingConfig.stops_on_checkpoint_error)."""
    pattern = re.compile(
        r"parallelism\s*(==|!=|in\b|not in\b)|\blayout\s*(==|!=)\s*['\"]|\.zero3\b(?!\.)"
        r"|\b(placement|resume|on_checkpoint_error)\s*(==|!=|in\b|not in\b)"
    )
    # config.py validates the names; a family lists the layout names it has (models/family/base.py check_layout)
    allowed = {ROOT / "stages/config.py", ROOT / "models/family/base.py"}
    hits = []
    for folder in ("stages", "scripts", "models", "dataflow"):
        for path in (ROOT / folder).rglob("*.py"):  # subpackages too (models/parallel/, scripts/bench/, ...)
            if path in allowed:
                continue
            lines = enumerate(path.read_text().splitlines(), 1)
            hits += [
                f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
                for i, line in lines
                if pattern.search(line) and "import" not in line
            ]
    assert hits == []
