"""Loading a stage from an HF checkpoint: exact when it matches, an error when anything is off."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.models.architectures import architecture_config
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.weights.hf_checkpoint import canonical_name, load_stage_weights

VISION = ("model.visual.",)
TEXT = ("model.language_model.", "lm_head.")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(7)
    config = architecture_config("tiny")
    model = Qwen2_5_VLForConditionalGeneration(config)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    return model, config, path


def _canonical_state(path):
    """The checkpoint's tensors under transformers-5 names (save_pretrained writes the release names)."""
    files = list(path.glob("*.safetensors"))
    assert len(files) == 1
    return {canonical_name(k): v for k, v in load_file(files[0]).items()}


def test_stages_load_exactly_their_tensors(reference):
    model, config, path = reference
    vision, text = VisionModel(config), TextModel(config)
    load_stage_weights(vision, vision.hf_name, path, VISION)
    load_stage_weights(text, text.hf_name, path, TEXT)
    expected = model.state_dict()
    for module in (vision, text):
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, expected[module.hf_name(name)]), name


def test_missing_tensor_is_an_error(reference, tmp_path):
    _, config, path = reference
    state = _canonical_state(path)
    del state["model.visual.blocks.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    vision = VisionModel(config)
    with pytest.raises(ValueError, match=r"missing \['model.visual.blocks.1.mlp.up_proj.weight'\]"):
        load_stage_weights(vision, vision.hf_name, tmp_path, VISION)


def test_unexpected_tensor_is_an_error(reference, tmp_path):
    _, config, path = reference
    state = _canonical_state(path)
    state["model.language_model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(state, tmp_path / "model.safetensors")
    text = TextModel(config)
    with pytest.raises(ValueError, match="unexpected.*layers.9"):
        load_stage_weights(text, text.hf_name, tmp_path, TEXT)


def test_shape_mismatch_is_an_error(reference, tmp_path):
    _, config, path = reference
    state = _canonical_state(path)
    state["lm_head.weight"] = state["lm_head.weight"][:-1].clone()
    save_file(state, tmp_path / "model.safetensors")
    text = TextModel(config)
    with pytest.raises(ValueError, match=r"lm_head.weight: checkpoint shape \(151935, 64\)"):
        load_stage_weights(text, text.hf_name, tmp_path, TEXT)


def test_both_naming_schemes_load(reference, tmp_path):
    """Release files name tensors `visual.*` / `model.*`; transformers 5 modules `model.visual.*` / ..."""
    model, config, path = reference
    state = _canonical_state(path)
    legacy = {}
    for name, tensor in state.items():
        name = name.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1)
        legacy[name] = tensor
    assert set(map(canonical_name, legacy)) == set(state)
    items = sorted(state.items())  # canonical names, split across two shards without an index
    half = len(items) // 2
    save_file(dict(items[:half]), tmp_path / "model-00001-of-00002.safetensors")
    save_file(dict(items[half:]), tmp_path / "model-00002-of-00002.safetensors")
    vision, text = VisionModel(config), TextModel(config)
    load_stage_weights(vision, vision.hf_name, tmp_path, VISION)
    load_stage_weights(text, text.hf_name, tmp_path, TEXT)
    assert torch.equal(vision.visual.merger.mlp[2].weight, model.model.visual.merger.mlp[2].weight)
    assert torch.equal(
        text.language_model.layers[1].mlp.down_proj.weight, model.model.language_model.layers[1].mlp.down_proj.weight
    )


def test_tied_embeddings_load_once(tmp_path):
    config = architecture_config("tiny")
    config.tie_word_embeddings = True
    config.text_config.tie_word_embeddings = True
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    text = TextModel(config)
    load_stage_weights(text, text.hf_name, tmp_path, TEXT)
    assert text.lm_head.weight is text.language_model.embed_tokens.weight
    assert torch.equal(text.lm_head.weight, model.lm_head.weight)


def test_not_a_checkpoint_dir(tmp_path):
    config = architecture_config("tiny")
    vision = VisionModel(config)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_stage_weights(vision, vision.hf_name, tmp_path, VISION)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_stage_weights(vision, vision.hf_name, tmp_path / "nope", VISION)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_rank_reads_only_its_slices(reference, tmp_path, rank):
    """A TP rank's module holds slices; it fills them from the checkpoint with get_slice, full shapes checked."""
    from dhp.models.parallel.tensor_parallel import shard_state_dict_for_rank, tp_slice

    model, config, path = reference
    text = TextModel(config)
    full_shapes = {n: t.shape for n, t in text.state_dict().items()}
    for name, p in text.named_parameters():  # the layout apply_tensor_parallel leaves (without its hooks)
        idx = tp_slice(name, rank, 2, config)
        if idx is not None:
            p.data = p.data[idx].clone()
    slicer = functools.partial(tp_slice, rank=rank, tp=2, config=config)
    load_stage_weights(text, text.hf_name, path, TEXT, slicer=slicer, full_shapes=full_shapes)
    full = {n: model.state_dict()[text.hf_name(n)] for n in full_shapes}
    expected = shard_state_dict_for_rank(full, rank, 2, config)
    for name, tensor in text.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    state = _canonical_state(path)  # one row short: rank 0's slice would still fit, the full shape does not
    state["lm_head.weight"] = state["lm_head.weight"][:-1].clone()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight: checkpoint shape"):
        load_stage_weights(text, text.hf_name, tmp_path, TEXT, slicer=slicer, full_shapes=full_shapes)
