"""Activation checkpointing (models/activation_checkpointing.py): which blocks recompute, that they keep fewer
activations and give the same gradients. Parity in every layout with it on is in tests/test_parity.py."""

from __future__ import annotations

import pytest
import torch

from dhp.models.activation_checkpointing import ActivationCheckpointing
from dhp.models.architectures import architecture_config
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.stages.config import ConfigError, load_config


def test_chosen_blocks():
    assert ActivationCheckpointing("none").chosen(6) == []
    assert ActivationCheckpointing("full").chosen(3) == [0, 1, 2]
    assert ActivationCheckpointing("every_n", 2).chosen(5) == [0, 2, 4]
    modes = [ActivationCheckpointing(m, 2) for m in ("none", "full", "every_n")]
    assert [(m.recomputes, m.recomputes_all) for m in modes] == [(False, False), (True, True), (True, False)]
    assert ActivationCheckpointing("every_n", 1).recomputes_all  # every block, as `full`
    with pytest.raises(ValueError, match="choose one of none, full, every_n"):
        ActivationCheckpointing("some")
    with pytest.raises(ConfigError, match="text.activation_checkpointing_every"):
        load_config("tiny", ["text.activation_checkpointing_every=0"])


def _saved_bytes_and_grads(model, run):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(model)
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage", ["vision", "text"])
def test_full_keeps_fewer_activations_and_the_same_gradients(stage):
    """The bytes autograd keeps at the forward's end (checkpointed blocks keep only their inputs; the
    recomputation's own saves come and go inside backward) drop well below half; gradients are bit-equal."""
    config = architecture_config("tiny")
    torch.manual_seed(0)
    if stage == "vision":
        model = VisionModel(config)
        grid = torch.tensor([[1, 8, 8]])
        pixels = torch.randn(64, 3 * 2 * 14 * 14)

        def run(m):
            return m(pixels, grid).square().mean()
    else:
        model = TextModel(config)
        ids = torch.randint(0, 1000, (1, 64))

        def run(m):
            return m.language_model(input_ids=ids).last_hidden_state.square().mean()

    model.train()
    results = {}
    for mode in ("none", "full"):
        ActivationCheckpointing(mode).apply(model.blocks())
        model.zero_grad(set_to_none=True)
        results[mode] = _saved_bytes_and_grads(model, run)
    (none_bytes, none_grads), (full_bytes, full_grads) = results["none"], results["full"]
    assert full_bytes < 0.5 * none_bytes, (full_bytes, none_bytes)
    assert none_grads.keys() == full_grads.keys()
    for n, g in none_grads.items():
        torch.testing.assert_close(full_grads[n], g, rtol=0, atol=0, msg=n)


@pytest.mark.slow  # a subprocess or a measured bench run
def test_bench_checkpointing_quick(tmp_path):
    """The benchmark behind docs/layouts.md's table, on its quick size: `full` keeps several times fewer bytes
    after the forward than `none` in both stages, `every_n` in between (bytes only: times are not asserted)."""
    import json

    from dhp.stages.cli import main

    out = tmp_path / "ac.json"
    assert main(["bench", "checkpointing", "--quick", "--json", str(out)]) == 0
    rows = {(r["stage"], r["mode"]): r for r in json.loads(out.read_text())}
    for stage in ("vision", "text"):
        none, every, full = (rows[stage, m]["kept_activation_bytes"] for m in ("none", "every_n", "full"))
        assert full * 4 < none and full < every < none, (stage, none, every, full)
        assert rows[stage, "full"]["recomputed_blocks"] == rows[stage, "full"]["blocks"]
