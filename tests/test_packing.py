"""Packed micro-batches (`data.packing`): several samples back to back in one sequence must train exactly like
each sample alone.

In process, no Ray (quick tier): the data side (tokens, positions, labels, boundaries) against the samples, the
text attention against transformers' own packed-sequence path, and the model (both halves, several images and a
text-only sample in one micro-batch) against `Qwen2_5_VLForConditionalGeneration` run on each sample alone and
against dhp's padded micro-batch: loss, every gradient. Through the pools (slow): the parity test of
tests/test_parity.py on packed micro-batches in four layouts.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import ray
import torch

import tests.test_parity as parity
from dhp.dataflow.loader import MicroBatch, split_for_ranks
from dhp.dataflow.packing import meta_of, microbatch_inputs, pack, packed_text_inputs, text_inputs, vision_inputs
from dhp.labels import count_label_tokens
from dhp.models import packed_attention
from dhp.models.architectures import architecture_config
from dhp.models.packed_attention import PACKED_SDPA, VarlenKernel, packed_sdpa_forward, varlen_kernel
from dhp.models.qwen2_5_vl import IGNORE_INDEX, TextModel, VisionModel
from dhp.stages.run_log import throughput
from tests.conftest import rel_err

IMAGE_PAD = 151655
PAD_ID = 151643


# The data side -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_pack_packed_fills_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (40,), generator=g).tolist()
    groups = pack(lengths, 600, packed=True)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in group) <= 600 for group in groups)
    # first fit: no sample of a later group would have fit into an earlier one when it was placed
    assert len(groups) <= len(pack(lengths, 600))
    assert len(groups) <= -(-sum(lengths) * 11 // 10 // 600) + 1  # within 10 % of the least possible, + 1


def test_pack_packed_refuses_a_sample_over_the_budget():
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        pack([10, 700], 600, packed=True)


def test_packed_text_is_each_sample_back_to_back(parity_setup):
    _, _, samples = parity_setup
    order = [2, 0, 1]  # the text-only sample first, then the two-image and the one-image sample
    chosen = [samples[i] for i in order]
    vision, text = microbatch_inputs(chosen, PAD_ID, packed=True)
    lengths = [s["input_ids"].shape[0] for s in chosen]
    cu = text["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert set(text) == {"input_ids", "labels", "position_ids", "cu_seqlens"}  # no mask: nothing is padding
    assert text["input_ids"].shape == text["labels"].shape == (1, sum(lengths))
    assert text["position_ids"].shape == (3, 1, sum(lengths))
    shifted = torch.nn.functional.pad(text["labels"][0], (0, 1), value=IGNORE_INDEX)[1:]  # what position i predicts
    for s, a, b in zip(chosen, cu[:-1].tolist(), cu[1:].tolist()):
        assert torch.equal(text["input_ids"][0, a:b], s["input_ids"])
        assert torch.equal(text["position_ids"][:, 0, a:b], s["position_ids"])  # restarts with each sample
        assert text["position_ids"][:, 0, a].eq(0).all()
        assert text["labels"][0, a] == IGNORE_INDEX and torch.equal(text["labels"][0, a + 1 : b], s["labels"][1:])
        own = torch.nn.functional.pad(s["labels"], (0, 1), value=IGNORE_INDEX)[1:]
        assert torch.equal(shifted[a:b], own)  # the last token predicts nothing of the next sample
    assert shifted[cu[1:] - 1].eq(IGNORE_INDEX).all()
    # the images' merged tokens in the order of the vision inputs' images
    merge = 4
    per_image = (vision["image_grid_thw"].prod(-1) // merge).tolist()
    pads = [int((s["input_ids"] == IMAGE_PAD).sum()) for s in chosen]
    assert sum(pads) == sum(per_image) and pads == [0, per_image[0] + per_image[1], per_image[2]]
    meta = meta_of(vision, text)
    assert (meta.samples, meta.tokens, meta.padded_tokens) == (3, sum(lengths), sum(lengths))
    assert meta.label_tokens == sum(count_label_tokens(s["labels"]) for s in chosen)
    assert meta.images == 3 and meta.patches == vision["pixel_values"].shape[0]
    padded = meta_of(*microbatch_inputs(chosen, PAD_ID))
    assert padded.label_tokens == meta.label_tokens and padded.padded_tokens == 3 * max(lengths) > meta.tokens


def test_padding_share_in_the_metrics(parity_setup):
    _, _, samples = parity_setup
    padded, packed = (meta_of(*microbatch_inputs(samples, PAD_ID, p)) for p in (False, True))
    slots, tokens = 3 * max(s["input_ids"].shape[0] for s in samples), sum(s["input_ids"].shape[0] for s in samples)
    assert (padded.padded_tokens, padded.tokens, packed.padded_tokens) == (slots, tokens, tokens)

    def share(*metas) -> float:
        batch = SimpleNamespace(microbatches=[SimpleNamespace(meta=m) for m in metas])
        return throughput([batch], architecture_config("tiny"), 1.0, 1e12)["padding_share"]

    assert share(padded) == pytest.approx((slots - tokens) / slots, abs=1e-4) and share(padded) > 0.1
    assert share(packed) == 0.0
    assert share(padded, packed) == pytest.approx((slots - tokens) / (slots + tokens), abs=1e-4)


# The attention kernel ------------------------------------------------------------------------------------------


def test_kernel_is_chosen_in_one_place(monkeypatch):
    assert varlen_kernel() == VarlenKernel("sdpa_segments", PACKED_SDPA)  # no flash-attn on this machine
    try:
        monkeypatch.setattr(packed_attention.importlib.util, "find_spec", lambda name: object())
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        varlen_kernel.cache_clear()
        kernel = varlen_kernel()
    finally:
        monkeypatch.undo()
        varlen_kernel.cache_clear()
    assert kernel == VarlenKernel("flash_attn", "flash_attention_2")
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    assert kernel.model_kwargs(cu, torch.device("cpu"))["max_length_q"] == 5  # flash-attn's varlen arguments
    config = architecture_config("tiny").text_config
    assert kernel.text_config(config)._attn_implementation == "flash_attention_2"
    assert config._attn_implementation == "sdpa"  # the caller's config is left as it was


def _tiny_text(packed: bool) -> tuple[TextModel, object]:
    config = architecture_config("tiny")
    torch.manual_seed(0)
    return TextModel(config, packed=packed).float().train(), config


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_packed_attention_is_transformers_packed_path(device):
    """transformers' own packed sequence (a 4-row position_ids whose first row restarts per sample, no mask: a
    block-diagonal causal mask through SDPA) and dhp's kernel give the same hidden states. On a GPU with flash-attn
    the kernel is flash-attn's varlen one, which computes in bf16 only."""
    model, _ = _tiny_text(packed=True)
    bf16 = varlen_kernel().name in ("flash_attn", "torch_varlen")
    model.to(device, torch.bfloat16 if bf16 else torch.float32)
    lengths = [5, 1, 9, 4]
    total = sum(lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    embeds = torch.randn(1, total, model.language_model.config.hidden_size).to(device, model.lm_head.weight.dtype)
    text_positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    positions = text_positions.expand(3, 1, total)
    lm = functools.partial(model.language_model, inputs_embeds=embeds, use_cache=False)
    ours = lm(position_ids=positions, **varlen_kernel().model_kwargs(cu, embeds.device))
    model.language_model.config._attn_implementation = "sdpa"
    theirs = lm(position_ids=torch.cat([text_positions[None], positions]))
    crossing = lm(position_ids=positions)  # plain causal over the whole sequence
    tolerance = 2e-2 if bf16 else 1e-6 if device == "cpu" else 1e-5
    assert rel_err(ours.last_hidden_state.float(), theirs.last_hidden_state.float()) <= tolerance
    if not bf16:
        assert rel_err(crossing.last_hidden_state, theirs.last_hidden_state) > 1e-2


def test_packed_sdpa_groups_equal_lengths_and_checks_its_cover():
    torch.manual_seed(0)
    module = type("M", (), {"num_key_value_groups": 2, "is_causal": True})()
    q = torch.randn(1, 4, 12, 8)
    k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    cu = torch.tensor([0, 3, 7, 10, 12])  # lengths 3, 4, 3, 2: two of length 3, not adjacent
    out, _ = packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk, vv = (t[:, :, a:b].repeat_interleave(2, dim=1) for t in (k, v))
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], kk, vv, is_causal=True)
        assert torch.allclose(out[0, a:b], alone[0].transpose(0, 1), atol=1e-6)
    with pytest.raises(ValueError, match="covers 10 tokens"):
        packed_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu[:-1])
    with pytest.raises(ValueError, match="no attention mask"):
        packed_sdpa_forward(module, q, k, v, torch.ones(1, 1, 12, 12, dtype=torch.bool), cu_seq_lens_q=cu)


def test_unpacked_model_refuses_a_packed_micro_batch(parity_setup):
    _, _, samples = parity_setup
    model, _ = _tiny_text(packed=False)
    text = packed_text_inputs(samples[2:])
    with pytest.raises(ValueError, match="built with packed=False"):
        model(text["input_ids"], torch.zeros(0, 64), text["position_ids"], None, text["labels"], text["cu_seqlens"])


def test_packed_model_on_padded_input_is_sdpa(parity_setup):
    """A packed model still takes a padded micro-batch (a ZeRO-3 replica's padding call is one) and computes
    exactly what an unpacked one does."""
    _, _, samples = parity_setup
    text = text_inputs([samples[2], samples[2]], pad_id=PAD_ID)
    text["attention_mask"][1, :3] = 0  # padding on the left, which the tokens after it must not see
    text["labels"][1, :4] = IGNORE_INDEX
    args = (text["input_ids"], torch.zeros(0, 64), text["position_ids"], text["attention_mask"], text["labels"])
    losses = [_tiny_text(packed)[0](*args) for packed in (True, False)]
    assert torch.equal(losses[0], losses[1])


def test_measure_script_runs_tiny():
    out = packed_attention._measure([3, 5], heads=2, dim=4, repeats=1)
    assert set(out) == {"dense_mask_s", "per_sample_s", "max_difference"} and out["max_difference"] <= 1e-6


# The model: packed == padded == each sample alone ----------------------------------------------------------------


def _dhp_halves(ref, packed: bool) -> tuple[VisionModel, TextModel]:
    state = ref.state_dict()
    vision, text = VisionModel(ref.config), TextModel(ref.config, packed=packed)
    for half in (vision, text):
        half.load_state_dict({n: state[half.hf_name(n)] for n in half.state_dict()})
        half.float().train()
    return vision, text


def _dhp_step(ref, chosen: list[dict], packed: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Summed loss and the gradients (HF names) of one micro-batch of `chosen` through dhp's two halves."""
    vision, text = _dhp_halves(ref, packed)
    v, t = microbatch_inputs(chosen, PAD_ID, packed)
    embeds = vision(v["pixel_values"], v["image_grid_thw"])
    loss = text(t["input_ids"], embeds, t["position_ids"], t.get("attention_mask"), t["labels"], t.get("cu_seqlens"))
    loss.backward()
    grads = {half.hf_name(n): p.grad for half in (vision, text) for n, p in half.named_parameters()}
    return loss.item(), grads


def _each_sample_alone(ref, chosen: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers on each sample by itself (its own mRoPE positions): summed loss and gradients."""
    ref = copy.deepcopy(ref)
    total = 0.0
    for s in chosen:
        v, t = vision_inputs([s]), text_inputs([s], pad_id=PAD_ID)
        n = count_label_tokens(t["labels"])
        loss = (
            n
            * ref(
                input_ids=t["input_ids"],
                labels=t["labels"],
                pixel_values=v["pixel_values"] if v["image_grid_thw"].numel() else None,
                image_grid_thw=v["image_grid_thw"] if v["image_grid_thw"].numel() else None,
                mm_token_type_ids=(t["input_ids"] == IMAGE_PAD).int(),
            ).loss
        )
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in ref.named_parameters()}


ORDER = [0, 2, 1]  # one micro-batch: the two-image sample, the text-only one, the one-image sample


@pytest.fixture(scope="module")
def alone(parity_setup) -> tuple[float, dict[str, torch.Tensor]]:
    ref, _, samples = parity_setup
    return _each_sample_alone(ref, [samples[i] for i in ORDER])


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_step_equals_each_sample_alone(parity_setup, alone, packed):
    """dhp's two halves on one micro-batch of three samples (three images, one sample text-only), packed and padded,
    against transformers on each sample alone: the summed loss and every gradient."""
    ref, _, samples = parity_setup
    alone_loss, alone_grads = alone
    loss, grads = _dhp_step(ref, [samples[i] for i in ORDER], packed)
    assert abs(loss - alone_loss) / alone_loss <= 1e-6, (loss, alone_loss)
    assert set(grads) == set(alone_grads)
    errors = {n: rel_err(g, alone_grads[n]) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"gradient of {worst} off by {errors[worst]:.2e}"


def test_packed_step_attending_across_samples_is_caught(parity_setup, alone):
    """The check above can fail: the same packed sequence attended causally as a whole (its samples see the ones
    before them) moves the loss far past its tolerance. (Positions that ran on across the samples instead of
    restarting would not: mRoPE's rotations are relative, so the data-side test holds them to each sample's.)"""
    ref, _, samples = parity_setup
    vision, text = _dhp_halves(ref, packed=False)
    v, t = microbatch_inputs([samples[i] for i in ORDER], PAD_ID, packed=True)
    with torch.no_grad():
        embeds = vision(v["pixel_values"], v["image_grid_thw"])
        loss = text(t["input_ids"], embeds, t["position_ids"], None, t["labels"]).item()
    assert abs(loss - alone[0]) / alone[0] > 1e-3


# The loader ------------------------------------------------------------------------------------------------------


def test_loader_sends_packed_micro_batches(parity_setup, parity_data, ray_session):
    """The Ray Data path with `packing`: every sample once, each micro-batch one sequence within the budget, and
    under sequence-parallel vision each rank's patches and the text's `merged_index` for all its images."""
    from dhp.dataflow.loader import loader_actor
    from dhp.dataflow.preprocess import PreprocessSettings

    _, _, samples = parity_setup
    lengths = sorted(s["input_ids"].shape[0] for s in samples)
    budget = lengths[-1] + lengths[0]  # the longest and the shortest fit together, the middle one alone
    settings = PreprocessSettings(str(parity_data), min_pixels=56 * 56, max_pixels=448 * 448, max_seq_len=1024)
    loader = loader_actor().remote(
        [str(parity_data / "train.jsonl")],
        settings,
        architecture_config("tiny"),
        global_batch_size=3,
        microbatch_tokens=budget,
        seed=None,
        repeat=False,
        vision_sp=2,
        packing=True,
    )
    batch = ray.get(loader.next_batch.remote())
    texts = [ray.get(mb.text) for mb in batch.microbatches]
    assert sorted(len(t["cu_seqlens"]) - 1 for t in texts) == [1, 2]
    assert sorted(n for t in texts for n in torch.diff(t["cu_seqlens"]).tolist()) == lengths
    for mb, text in zip(batch.microbatches, texts):
        assert text["input_ids"].shape == (1, mb.meta.tokens) and mb.meta.tokens <= budget
        assert mb.meta.padded_tokens == mb.meta.tokens
        parts = ray.get(mb.vision)
        assert len(parts) == 2 and "attention_mask" not in text
        grid = parts[0]["image_grid_thw"]
        merged = int(grid.prod(-1).sum()) // 4
        assert int((text["input_ids"] == IMAGE_PAD).sum()) == merged
        if merged:
            assert sorted(text["merged_index"].tolist()) == list(range(merged))
            assert sum(p["pixel_values"].shape[0] for p in parts) == int(grid.prod(-1).sum())
    assert ray.get(loader.next_batch.remote()) is None


# Through the pools ---------------------------------------------------------------------------------------------


def _packed_microbatch(chosen: list[dict], cfg, model_config=None) -> MicroBatch:
    """`tests/test_parity._microbatch` with the text packed: what the loader sends with `data.packing`."""
    assert cfg.data.packing
    vision, text = microbatch_inputs(chosen, PAD_ID, packed=True)
    meta = meta_of(vision, text)
    sp = cfg.vision.degree if cfg.vision.parallelism == "sequence" else 0
    parts = split_for_ranks(vision, text, sp, model_config or architecture_config("tiny"))
    return MicroBatch([ray.put(p) for p in parts], ray.put(text), meta)


# (overrides, each replica's micro-batches as sample indices): several samples per packed micro-batch, the
# text-only one packed between or beside images
PACKED_LAYOUTS = [
    ([], [[[0, 2], [1]]]),
    (parity.SP2 + parity.TP2, [[[2, 0, 1]]]),
    (["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"] + parity.TP2, [[[1, 2, 0]]]),
    (
        ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"],
        [[[0, 2]], [[1]]],
    ),
]


PACKED_IDS = ["1v1t", "sp2-tp2", "tp2-tp2", "zero3-zero3"]
# sp2/tp2 again with both pools' blocks compiled (models/compilation.py; `aot_eager`: the traced graphs, as inductor
# gets them, run op by op) and full activation checkpointing: sequence parallelism compiles each block's norms and
# MLP, tensor parallelism whole decoder layers with its collectives' hooks inside them
COMPILED = parity.SP2 + parity.TP2 + parity.AC_FULL + ["vision.compile=aot_eager", "text.compile=aot_eager"]


@pytest.mark.parametrize(
    ("layout", "replicas"),
    [*PACKED_LAYOUTS, (COMPILED, PACKED_LAYOUTS[1][1])],
    ids=[*PACKED_IDS, "sp2-tp2-compiled"],
)
def test_packed_steps_match_transformers(parity_setup, trainers, tmp_path, monkeypatch, layout, replicas):
    monkeypatch.setattr(parity, "_microbatch", _packed_microbatch)
    parity.check_parity(parity_setup, tmp_path, layout + ["data.packing=true"], replicas, trainers=trainers)


def test_qwen3_vl_packed_steps_match_transformers(qwen3_parity_setup, trainers, tmp_path, monkeypatch):
    """Qwen3-VL packed under vision SP 2 / text TP 2: the three samples in one sequence (the text-only one first),
    the DeepStack features added at the image positions of the packed row, attention kept within each sample."""
    monkeypatch.setattr(parity, "_microbatch", _packed_microbatch)
    layout = parity.SP2 + parity.TP2 + ["data.packing=true"]
    params = parity.check_parity(qwen3_parity_setup, tmp_path, layout, [[[2, 0, 1]]], trainers=trainers)
    assert any("deepstack_merger_list" in n for n in params)
