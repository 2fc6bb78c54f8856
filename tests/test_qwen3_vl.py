"""Qwen3-VL as a model family: its two stages train exactly like `Qwen3VLForConditionalGeneration` in one process,
DeepStack on; the family says what dhp asks of it and refuses the layouts it has not got; its released-name
checkpoint loads into the stages.

The layouts' parity (Ray pools, the boundary, text TP, ZeRO-3, fan-out) is tests/test_parity.py's
`test_qwen3_vl_steps_match_transformers`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dhp.dataflow.packing import text_inputs, vision_inputs
from dhp.errors import ConfigError
from dhp.labels import count_label_tokens
from dhp.models.architectures import architecture_config
from dhp.models.family import QWEN2_5_VL, QWEN3_VL, family_of, family_of_shape, load_config
from dhp.models.parallel.checks import check_layout
from dhp.models.parallel.layouts import available
from dhp.models.weights.hf_checkpoint import load_stage_weights
from dhp.stages.config import load_config as load_run_config
from tests.conftest import rel_err

STEPS = 3


def test_the_name_picks_shape_and_family():
    config = architecture_config("qwen3_vl_tiny")
    assert family_of_shape("qwen3_vl_tiny") is family_of(config) is QWEN3_VL
    assert family_of(architecture_config("tiny")) is QWEN2_5_VL
    assert family_of(config.vision_config) is family_of(config.text_config) is QWEN3_VL
    assert QWEN3_VL.deepstack_indexes(config.vision_config) == [1, 2]
    assert QWEN3_VL.full_attention_blocks(config.vision_config) == [0, 1, 2, 3]  # no windows: all-to-all in each
    assert QWEN2_5_VL.full_attention_blocks(architecture_config("tiny").vision_config) == [1, 3]
    assert QWEN3_VL.boundary_width(config) == 3 * config.text_config.hidden_size
    with pytest.raises(ValueError, match="unknown model.name 'qwen4'"):
        family_of_shape("qwen4")


def test_both_families_take_every_layout():
    for family in (QWEN2_5_VL, QWEN3_VL):
        assert {stage: set(family.layouts[stage]) for stage in ("vision", "text")} == {
            stage: set(available(stage)) for stage in ("vision", "text")
        }


class _WithoutVisionTP(type(QWEN3_VL)):
    """A family that has no vision tensor parallelism (what a new family may lack at first)."""

    layouts = {"vision": ("none", "sequence", "zero3"), "text": ("none", "tensor", "zero3")}


def test_a_layout_the_family_has_not_got_is_refused(monkeypatch):
    cfg = load_run_config(
        "tiny", ["model.name=qwen3_vl_tiny", "vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"]
    )
    config = architecture_config("qwen3_vl_tiny")
    check_layout(cfg, config)
    monkeypatch.setattr("dhp.models.family.FAMILIES", (QWEN2_5_VL, _WithoutVisionTP()))
    with pytest.raises(
        ConfigError,
        match="vision.parallelism=tensor is not available for Qwen3-VL models; available: none, sequence, zero3",
    ):
        check_layout(cfg, config)


def test_positions_are_transformers(small_qwen3_parity_setup):
    """The data pipeline's positions (the family's, dataflow/preprocess.py) are what transformers' Qwen3-VL model
    computes for the padded batch it trains on (`get_rope_index` with the attention mask)."""
    ref, _, samples = small_qwen3_parity_setup
    t, v = text_inputs(samples, pad_id=151643), vision_inputs(samples)
    ids = t["input_ids"]
    expected, _ = ref.model.get_rope_index(
        ids, (ids == 151655).int(), image_grid_thw=v["image_grid_thw"], attention_mask=t["attention_mask"]
    )
    mask = t["attention_mask"].bool()
    assert torch.equal(t["position_ids"][:, mask], expected[:, mask])


def _stages(ref, ckpt):
    """dhp's two Qwen3-VL stages, loaded from the released-name checkpoint `ckpt` (what `model.path` does)."""
    config = load_config(ckpt, "sdpa")
    vision, text = QWEN3_VL.vision_model(config), QWEN3_VL.text_model(config)
    for stage in (vision, text):
        load_stage_weights(stage, stage.hf_name, ckpt, stage.checkpoint_prefixes)
        for name, t in stage.state_dict().items():
            assert torch.equal(t, ref.state_dict()[stage.hf_name(name)]), name
    return vision.train(), text.train()


def test_stages_train_like_transformers(small_qwen3_parity_setup):
    """Three AdamW steps of dhp's halves (two micro-batches: the two-image sample padded together with the text-only
    one, then the one-image sample; the vision rows and their DeepStack features handed over as one tensor and its
    gradient handed back) and of the whole transformers model on the padded batch: loss, every gradient,
    parameters."""
    ref, ckpt, samples = small_qwen3_parity_setup
    ref = copy.deepcopy(ref).train()  # the session's model stays as saved
    vision, text = _stages(ref, ckpt)
    grids = [s["image_grid_thw"] for s in samples]
    assert [g.shape[0] for g in grids] == [2, 1, 0]  # two images, one, none
    assert len({tuple(g) for g in torch.cat(grids).tolist()}) == 2  # of two sizes
    params = {m.hf_name(n): p for m in (vision, text) for n, p in m.named_parameters()}
    assert set(params) == {n for n, _ in ref.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=1e-3, eps=1e-6, weight_decay=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1, foreach=True)
    full_v, full_t = vision_inputs(samples), text_inputs(samples, pad_id=151643)
    labelled = count_label_tokens(full_t["labels"])
    for step in range(STEPS):
        loss = 0.0
        for group in ([0, 2], [1]):
            chosen = [samples[i] for i in group]
            v, t = vision_inputs(chosen), text_inputs(chosen, pad_id=151643)
            rows = vision(v["pixel_values"], v["image_grid_thw"])
            sent = rows.detach().requires_grad_()  # what the text stage receives: a leaf, as across the boundary
            part = text(t["input_ids"], sent, t["position_ids"], t["attention_mask"], t["labels"]) / labelled
            part.backward()
            if rows.shape[0]:
                assert sent.grad.shape == rows.shape
                rows.backward(sent.grad)  # the gradient the vision stage receives back
            loss += part.item()
        out = ref(
            input_ids=full_t["input_ids"],
            attention_mask=full_t["attention_mask"],
            labels=full_t["labels"],
            pixel_values=full_v["pixel_values"],
            image_grid_thw=full_v["image_grid_thw"],
            mm_token_type_ids=(full_t["input_ids"] == 151655).int(),
        )
        out.loss.backward()
        assert abs(loss - out.loss.item()) / out.loss.item() <= 1e-6, (step, loss, out.loss.item())
        errors = {n: rel_err(params[n].grad, p.grad) for n, p in ref.named_parameters()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"step {step}: gradient of {worst} off by {errors[worst]:.2e}"
        deepstack = [n for n in errors if "deepstack_merger_list" in n]
        assert deepstack and all(params[n].grad.abs().sum() > 0 for n in deepstack)  # DeepStack was trained
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    for name, p in ref.named_parameters():
        diff = (params[name] - p).abs().max().item()
        assert diff <= 1e-5, f"{name} differs by {diff:.2e} after {STEPS} steps"


def test_boundary_rows_of_the_wrong_width_are_an_error(small_qwen3_parity_setup):
    ref, ckpt, samples = small_qwen3_parity_setup
    _, text = _stages(ref, ckpt)
    t = text_inputs(samples[1:2], pad_id=151643)
    n = int((t["input_ids"] == 151655).sum())
    with pytest.raises(ValueError, match=rf"2 DeepStack features, but boundary rows of shape \({n}, 64\)"):
        text(t["input_ids"], torch.zeros(n, 64), t["position_ids"], t["attention_mask"], t["labels"])
