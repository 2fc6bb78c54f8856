"""Meta-device construction and per-rank materialisation (models/weights/materialize.py): every rank's part of the
seeded init is exactly the single-process build's, and a run without `model.path` trains that model."""

from __future__ import annotations

import pytest
import ray
import torch
from torch import nn

from dhp.dataflow.loader import GlobalBatch
from dhp.dataflow.packing import text_inputs, vision_inputs
from dhp.models.architectures import architecture_config
from dhp.models.parallel.layouts import make_layout
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.weights.materialize import build_on_meta, materialize_params, replay
from dhp.stages.config import load_config
from tests.test_layouts import CASES
from tests.test_parity import BASE, SP2, TP2, _microbatch, collect


def _config(tied: bool = False, deep: bool = False):
    config = architecture_config("tiny")
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = tied
    if deep:  # tiny but deep: the released block structure repeated (full attention every 4th ViT block)
        config.text_config.num_hidden_layers = 12
        config.text_config.layer_types = ["full_attention"] * 12
        config.vision_config.depth = 16
        config.vision_config.fullatt_block_indexes = [3, 7, 11, 15]
    return config


@pytest.mark.parametrize(
    ("cls", "tied", "deep"),
    [
        (TextModel, False, False),
        (TextModel, True, False),
        (VisionModel, False, False),
        (TextModel, True, True),
        (VisionModel, False, True),
    ],
)
def test_replay_is_the_seeded_full_build(cls, tied, deep):
    config = _config(tied, deep)
    torch.manual_seed(11)
    ref = cls(config)
    after_full = torch.get_rng_state()
    torch.manual_seed(11)
    model, recipe = build_on_meta(lambda: cls(config))
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    torch.manual_seed(11)
    values = replay(recipe)
    assert torch.equal(torch.get_rng_state(), after_full)  # the stream advanced exactly as in the full build
    expected = dict(ref.named_parameters(remove_duplicate=False))
    assert values.keys() == expected.keys()
    for name, p in expected.items():
        assert torch.equal(values[name], p), name
    materialize_params(model, torch.device("cpu"))
    model.load_state_dict(values, strict=False)
    assert not any(p.is_meta for p in model.parameters())
    if tied:
        assert model.lm_head.weight is model.language_model.embed_tokens.weight  # still one tensor
    for (name, b), (_, want) in zip(model.named_buffers(), ref.named_buffers()):  # rotary inv_freq: real
        assert torch.equal(b, want), name


@pytest.mark.parametrize(("stage", "name", "degree", "num_actors"), CASES)
def test_each_rank_replays_only_its_part(stage, name, degree, num_actors):
    config = _config()
    cls = VisionModel if stage == "vision" else TextModel
    torch.manual_seed(5)
    full = cls(config).state_dict()
    layout = make_layout(stage, name, degree, num_actors, config)
    shapes = {n: t.shape for n, t in full.items()}
    parts = []
    for rank in layout.state_ranks(0):
        torch.manual_seed(5)
        _, recipe = build_on_meta(lambda: cls(config))
        torch.manual_seed(5)
        part = replay(recipe, layout.slicer(rank, shapes))
        assert sum(t.numel() for t in part.values()) == layout.state_numel(shapes, rank)
        parts.append(part)
    gathered = layout.gather(parts)
    for n, t in full.items():
        assert torch.equal(gathered[n], t), n


class _CopiesFromATensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))
        with torch.no_grad():
            self.w.copy_(torch.arange(4.0))


class _NeverInitialised(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(2048, 1024))  # large: its empty values are not kept


class _ZeroesARow(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 4))
        with torch.no_grad():
            self.w.normal_()
            self.w[0].zero_()  # what Embedding's init does to a padding row


def test_what_cannot_be_replayed_is_refused():
    with pytest.raises(NotImplementedError, match="copy_"):
        build_on_meta(_CopiesFromATensor)
    with pytest.raises(NotImplementedError, match="zero_ writes a view of a parameter"):
        build_on_meta(_ZeroesARow)
    _, recipe = build_on_meta(_NeverInitialised)
    with pytest.raises(ValueError, match="nothing initialised"):
        replay(recipe)


ZERO3 = ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"]


@pytest.mark.parametrize(
    ("layout", "replicas", "model"),
    [
        (SP2 + TP2, [[0, 1, 2]], "tiny"),
        (ZERO3, [[0, 1], [2]], "tiny"),
        # Qwen3-VL: the position embedding, the DeepStack mergers, the q/k norms from the seed too
        (SP2 + TP2, [[0, 1, 2]], "qwen3_vl_tiny"),
    ],
    ids=["sp2-tp2", "zero3-zero3", "qwen3-sp2-tp2"],
)
def test_random_init_is_the_seeded_model_in_every_layout(request, trainers, layout, replicas, model):
    """No `model.path`: the pools' tensors are the seeded single-process build's, bit for bit, and the first
    loss is that model's in transformers (a rotary buffer or parameter left uninitialised would show)."""
    from dhp.models.family import family_of_shape

    qwen3 = model != "tiny"
    _, _, samples = request.getfixturevalue("qwen3_parity_setup" if qwen3 else "parity_setup")
    cfg = load_config(
        "tiny",
        BASE
        + layout
        + [
            "data.microbatch_tokens=1024",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ]
        + [f"model.name={model}"] * qwen3,
    )
    family = family_of_shape(model)
    config = architecture_config(model)
    vision_class, text_class = family.stage_module_class("vision"), family.stage_module_class("text")
    torch.manual_seed(cfg.model.init_seed)
    vision = vision_class(config)
    torch.manual_seed(cfg.model.init_seed)
    text = text_class(config)
    expected = {vision_class.hf_name(n): t for n, t in vision.state_dict().items()}
    expected |= {text_class.hf_name(n): t for n, t in text.state_dict().items()}
    ref = family.hf_class(config).float()
    ref.load_state_dict(expected)
    with trainers.use(cfg) as trainer:
        params = collect(trainer)
        assert params.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(params[name], t), name
        batches = [GlobalBatch([_microbatch([samples[i] for i in group], cfg, config)], epoch=0) for group in replicas]
        loss = trainer.accumulate(batches)
        ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
    full_v, full_t = vision_inputs(samples), text_inputs(samples, pad_id=151643)
    ref_loss = ref(
        input_ids=full_t["input_ids"],
        attention_mask=full_t["attention_mask"],
        labels=full_t["labels"],
        pixel_values=full_v["pixel_values"],
        image_grid_thw=full_v["image_grid_thw"],
        mm_token_type_ids=(full_t["input_ids"] == 151655).int(),
    ).loss.item()
    assert abs(loss - ref_loss) / ref_loss <= 1e-6, (loss, ref_loss)


@pytest.mark.slow  # a subprocess or a measured bench run
def test_measure_build_script_on_the_tiny_model():
    """The script behind docs/models.md's build-memory rows, on the tiny shape in a fresh interpreter."""
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "dhp.scripts.measure_build",
        "--model",
        "tiny",
        "--stage",
        "text",
        "--layout",
        "tensor",
        "--degree",
        "2",
        "--rank",
        "1",
    ]
    row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    config = architecture_config("tiny")
    layout = make_layout("text", "tensor", 2, 2, config)
    torch.manual_seed(0)
    shapes = {n: t.shape for n, t in TextModel(config).state_dict().items()}
    assert row["held_bytes"] == 4 * layout.state_numel(shapes, 1)
    assert row["peak_rss_bytes"] > row["held_bytes"] and row["build_s"] > 0
    assert {"model", "stage", "layout", "degree", "precision", "largest_tensor_bytes"} <= row.keys()
