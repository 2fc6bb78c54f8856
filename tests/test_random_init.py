"""`model.random_init=per_part` (models/weights/random_init.py): each rank draws only its part, and the parts still form
one model with the exact build's distribution; `exact`'s bit-for-bit equality is tests/test_meta_build.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dhp.dataflow.loader import GlobalBatch
from dhp.models.architectures import architecture_config
from dhp.models.parallel.layouts import make_layout
from dhp.models.parallel.tensor_parts import read_part
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.weights.materialize import build_on_meta
from dhp.models.weights.random_init import PerPart, random_init
from dhp.stages.config import load_config
from tests.test_layouts import CASES
from tests.test_parity import BASE, _microbatch, collect

SEED = 5


def _per_part(cls, config, slicer, seed: int = SEED) -> dict[str, torch.Tensor]:
    _, recipe = build_on_meta(lambda: cls(config))
    out: dict[str, torch.Tensor] = {}
    PerPart().fill(recipe, slicer, out.__setitem__, seed, torch.device("cpu"))
    return out


def _same_distribution(name: str, got: torch.Tensor, exact: torch.Tensor) -> None:
    """Constant tensors (norm weights, zero biases) equal; random ones: same mean and spread, other values."""
    assert got.shape == exact.shape and got.dtype == exact.dtype, name
    if torch.all(exact == exact.flatten()[0]):
        assert torch.equal(got, exact), name
    elif exact.numel() >= 1024:
        assert not torch.equal(got, exact), name  # another stream
        assert got.std().item() == pytest.approx(exact.std().item(), rel=0.1), name
        assert abs(got.mean().item() - exact.mean().item()) <= 0.1 * exact.std().item(), name


@pytest.mark.parametrize(("stage", "name", "degree", "num_actors"), CASES)
def test_per_part_ranks_form_one_model_of_the_exact_distribution(stage, name, degree, num_actors):
    config = architecture_config("tiny")
    cls = VisionModel if stage == "vision" else TextModel
    torch.manual_seed(SEED)
    exact = cls(config).state_dict()
    shapes = {n: t.shape for n, t in exact.items()}
    layout = make_layout(stage, name, degree, num_actors, config)
    parts = {rank: _per_part(cls, config, layout.slicer(rank, shapes)) for rank in range(num_actors)}
    for rank, part in parts.items():
        assert sum(t.numel() for t in part.values()) == layout.state_numel(shapes, rank)
    full = layout.gather([parts[r] for r in layout.state_ranks(0)])
    assert full.keys() == exact.keys()
    for n, t in exact.items():
        _same_distribution(n, full[n], t)
        for rank, part in parts.items():  # every rank holds the part of that one model: replicas agree
            slicer = layout.slicer(rank, shapes)
            idx = slicer(n) if slicer else None
            assert torch.equal(part[n], full[n] if idx is None else read_part(full[n], idx)), (n, rank)


def test_per_part_is_seeded_and_draws_each_part_apart():
    config = architecture_config("tiny")
    whole = _per_part(TextModel, config, lambda n: None)
    assert all(torch.equal(t, _per_part(TextModel, config, lambda n: None)[n]) for n, t in whole.items())
    other = _per_part(TextModel, config, lambda n: None, seed=SEED + 1)
    name = "language_model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(whole[name], other[name])
    torch.manual_seed(SEED)
    shapes = {n: t.shape for n, t in TextModel(config).state_dict().items()}
    layout = make_layout("text", "tensor", 2, 2, config)
    first, second = (_per_part(TextModel, config, layout.slicer(r, shapes))[name] for r in (0, 1))
    assert first.shape == second.shape and not torch.equal(first, second)  # not one part drawn twice


class _Triangular(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(64, 64))
        with torch.no_grad():
            self.w.normal_().tril_()  # not element-wise: a part's lower triangle is not the whole's


def test_a_write_that_is_not_element_wise_is_refused_with_the_way_out():
    _, recipe = build_on_meta(_Triangular)
    with pytest.raises(NotImplementedError, match="tril_.*model.random_init=exact"):
        PerPart().fill(recipe, lambda n: None, lambda n, t: None, SEED, torch.device("cpu"))
    with pytest.raises(ValueError, match="model.random_init must be one of"):
        random_init("fast")


def test_per_part_pools_train_one_model(parity_setup, trainers):
    """Through the workers: data-parallel replicas of a tensor-parallel text pool and of the vision pool hold one
    model (`collect` asserts the replicas agree) of the exact build's distribution, and it trains."""
    _, _, samples = parity_setup
    cfg = load_config(
        "tiny",
        BASE
        + [
            "model.random_init=per_part",
            "data.microbatch_tokens=1024",
            "training.warmup_steps=0",
            "vision.num_actors=2",
            "text.parallelism=tensor",
            "text.num_actors=4",
            "text.degree=2",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ],
    )
    config = architecture_config("tiny")
    torch.manual_seed(cfg.model.init_seed)
    exact = {VisionModel.hf_name(n): t for n, t in VisionModel(config).state_dict().items()}
    torch.manual_seed(cfg.model.init_seed)
    exact |= {TextModel.hf_name(n): t for n, t in TextModel(config).state_dict().items()}
    with trainers.use(cfg) as trainer:
        params = collect(trainer)
        assert params.keys() == exact.keys()
        for name, t in exact.items():
            _same_distribution(name, params[name], t)
        batches = [GlobalBatch([_microbatch([samples[i]], cfg)], epoch=0) for i in (0, 1)]
        loss = trainer.accumulate(batches)
        trainer.optimizer_step()  # syncs the replicas' gradients first
        after = collect(trainer)
    assert 0 < loss < 2 * torch.log(torch.tensor(float(config.text_config.vocab_size))).item()
    assert any(not torch.equal(after[n], params[n]) for n in params)  # it stepped, and replicas still agree


def test_a_partial_checkpoint_resumes_only_onto_the_init_it_was_trained_on():
    """A frozen base from a seeded init is rebuilt at resume, so its mode is part of the base; checkpoints written
    before `model.random_init` existed were exact."""
    from dhp.stages.resume_checks import same_base

    exact = {"path": None, "init_seed": 0, "random_init": "exact"}
    assert same_base({"path": None, "init_seed": 0}, exact)
    assert same_base(exact, exact)
    assert not same_base(exact, {**exact, "random_init": "per_part"})
    assert not same_base({**exact, "random_init": "per_part"}, {**exact, "init_seed": 1, "random_init": "per_part"})
    assert not same_base(exact, {**exact, "path": "/ckpt"})  # this run's base would come from a checkpoint


@pytest.mark.parametrize("frozen", ["text.train=lora", "vision.train=merger", "text.train=none"])
def test_per_part_is_refused_as_a_frozen_base(frozen):
    """Its values follow the layout and the device, and a partial checkpoint's base is rebuilt at resume."""
    from dhp.models.parallel.checks import check_layout
    from dhp.stages.config import ConfigError

    with pytest.raises(ConfigError, match=f"model.random_init=per_part cannot be the frozen base of {frozen}"):
        check_layout(load_config("tiny", ["model.random_init=per_part", frozen]))
    check_layout(load_config("tiny", ["model.random_init=exact", frozen]))
    check_layout(load_config("tiny", ["model.random_init=per_part"]))
