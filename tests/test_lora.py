"""LoRA on the language model (models/lora.py) against peft's LoRA on the single-process transformers model.

peft is the reference (a test dependency), not reimplemented: `get_peft_model` wraps the same checkpoint with the
same rank, alpha and targets, its factors are set to dhp's initial ones, and tests/test_parity.py's check then
holds loss, every trainable gradient (the LoRA factors, and the ViT's where it trains), the clip norm, the LRs and
the parameters after 3 steps to the usual tolerances, in the `none` and `tensor` layouts (TP 2 and 4: B split
with a column-parallel base, A with a row-parallel one, a shared KV head's B summed over its holders). The export
merges the factors into their base weights and writes a peft adapter directory that peft loads onto the base.
"""

from __future__ import annotations

import pytest
import ray
import torch

from dhp.stages.config import ConfigError, load_config
from tests.test_parity import SP2, TP2, check_parity, collect, hf_name

LORA = [
    "text.train=lora",
    "text.lora.rank=4",
    "text.lora.alpha=8",
    "text.lora.dropout=0.0",
    "text.lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    "training.max_grad_norm=0.1",
]
CASES = {
    "1v1t": ([], [[[0], [1], [2]]]),
    # the default layout, the ViT training too: text rank 0 sends the embedding gradient back, rank 1 does not
    "sp2-tp2": (SP2 + TP2, [[[0, 1], [2]]]),
    # TP 4 over 2 KV heads: each head's k/v rows (and their B) held by two ranks, summed over those two
    "tp4-frozen-vit": (
        ["text.parallelism=tensor", "text.num_actors=4", "text.degree=4", "vision.train=none"],
        [[[0], [1, 2]]],
    ),
}


def peft_reference(ref, trainer):
    """peft's LoRA model of `ref` with dhp's initial factors (gathered from the trainer's ranks)."""
    from peft import LoraConfig, get_peft_model

    lora = trainer.cfg.text.lora
    targets = "|".join(lora.targets.split(","))
    model = get_peft_model(
        ref,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=rf".*language_model\.layers\.\d+\..*\.({targets})",
        ),
    )
    initial = collect(trainer)
    with torch.no_grad():
        factors = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
        assert len(factors) == 2 * 7 * trainer.model_config.text_config.num_hidden_layers
        for name, p in factors:
            p.copy_(initial[hf_name(name)])
    return model


# Qwen3-VL (q/k RMSNorms, its own head_dim, DeepStack into the first decoder layers) in one layout
QWEN3_CASES = {"qwen3-sp2-tp2": (SP2 + TP2, [[[0, 1], [2]]])}


@pytest.mark.parametrize("case", list(CASES) + list(QWEN3_CASES))
def test_lora_matches_peft(request, trainers, tmp_path, case):
    from peft import PeftModel

    from dhp.models.family import family_of

    qwen3 = case in QWEN3_CASES
    small_parity_setup = request.getfixturevalue("small_qwen3_parity_setup" if qwen3 else "small_parity_setup")
    layout, replicas = (QWEN3_CASES if qwen3 else CASES)[case]
    hf_class = family_of(small_parity_setup[0].config).hf_class
    base_grads = {}

    def probe(trainer):
        stats = ray.get(
            [
                a.__ray_call__.remote(
                    lambda w: (
                        sum(p.grad is not None for n, p in w.model.named_parameters() if ".lora_" not in n),
                        w.optimizer is not None,
                    )
                )
                for a in trainer.text.actors
            ]
        )
        base_grads["text"] = stats

    params = check_parity(
        small_parity_setup, tmp_path, layout + LORA, replicas, probe, reference=peft_reference, trainers=trainers
    )
    assert all(n == 0 and has_opt for n, has_opt in base_grads["text"])  # base frozen, factors stepped
    initial = small_parity_setup[0].state_dict()
    for name, t in params.items():
        if name.startswith(("model.language_model.", "lm_head.")) and ".lora_" not in name:
            assert torch.equal(t, initial[name]), f"frozen base {name} changed"
    assert any(".lora_B." in n and t.abs().sum() > 0 for n, t in params.items())  # B left zero: it trained

    # the export's adapter directory: peft loads it onto the base and computes the merged model
    adapter = tmp_path / "export" / "adapter"
    base = hf_class.from_pretrained(small_parity_setup[1]).float()
    peft_model = PeftModel.from_pretrained(base, adapter)
    merged = hf_class.from_pretrained(tmp_path / "export").float()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                assert torch.equal(p, params[hf_name(name)]), name
        folded = dict(peft_model.merge_and_unload().named_parameters())
        for name, p in merged.named_parameters():  # the language model: peft's merge of the adapter onto the
            if name.startswith("model.language_model."):  # base equals dhp's merged export
                assert torch.allclose(p, folded[name], rtol=0, atol=1e-6), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["text.parallelism=zero3", "text.num_actors=2"],
            "text.train=lora is not available with text.parallelism=zero3",
        ),
        (["text.lora.rank=0"], "text.lora.rank must be >= 1"),
        (["text.lora.targets= ,"], "text.lora.targets names no layer"),
    ],
)
def test_lora_rejects_what_cannot_run(overrides, message):
    from dhp.models.parallel.checks import check_layout

    with pytest.raises(ConfigError, match=message):
        check_layout(load_config("tiny", ["text.train=lora", *overrides]))


def test_lora_checkpoint_holds_only_what_trains_and_resumes(parity_setup, ray_session, tmp_path):
    """A frozen ViT and a LoRA language model: the checkpoint's rank files hold only the LoRA factors (and their
    moments) plus a pointer to the base; a new run resumes them bit-identically, and `dhp export-hf` rebuilds
    the whole merged model from the base it points to."""
    import json

    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.dataflow.loader import GlobalBatch
    from dhp.stages.cli import main
    from dhp.stages.trainer import Trainer
    from tests.test_parity import _microbatch, merged_lora

    _, ckpt, samples = parity_setup
    cfg = load_config(
        "tiny",
        LORA
        + [
            "vision.parallelism=none",
            "vision.num_actors=1",
            "vision.degree=1",
            "vision.train=none",
            *TP2,
            f"model.path={ckpt}",
            "training.steps=3",
            "data.microbatch_tokens=1024",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ],
    )
    batches = [GlobalBatch([_microbatch(samples[:2], cfg)], epoch=0)]
    trainer = Trainer(cfg)
    try:
        trainer.train_step(batches)
        saved = trainer.save_checkpoint(tmp_path / "checkpoints", batches)
        params = collect(trainer)
    finally:
        trainer.shutdown()
    meta = json.loads((saved / "dhp_checkpoint.json").read_text())
    assert sorted(meta["partial"]) == ["text", "vision"] and meta["base"]["path"] == str(ckpt)
    for f in saved.glob("*-rank*.safetensors"):
        with safe_open(f, framework="pt") as h:
            assert all(".lora_" in k for k in h.keys()), f.name  # vision files: empty
            assert bool(list(h.keys())) == f.name.startswith("text"), f.name

    trainer = Trainer(cfg)
    try:
        assert trainer.restore_checkpoint(saved) == 1
        resumed = collect(trainer)
    finally:
        trainer.shutdown()
    assert resumed.keys() == params.keys()
    for name, t in params.items():
        assert torch.equal(resumed[name], t), name

    assert main(["export-hf", "--checkpoint", str(saved), "--out", str(tmp_path / "hf")]) == 0
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")
    expected = merged_lora(params, cfg)
    for name, p in hf.named_parameters():
        assert torch.allclose(p.detach(), expected[name], rtol=0, atol=1e-6), name
    assert (tmp_path / "hf" / "adapter" / "adapter_config.json").is_file()


def test_lora_dropout_under_tp_draws_the_one_rank_masks(parity_setup, trainers):
    """With dropout on, TP 2 computes one rank's gradients: the same masks (a column-parallel layer's replicated
    input alike on both ranks, a row-parallel layer's split input the parts of the whole-width mask). Gradients
    are compared, not trained parameters: Adam's first steps are nearly sign(gradient), blind to the masks. Two
    steps first move B off zero, so that A's gradients (and the loss) see the masks too."""
    from dhp.dataflow.loader import GlobalBatch
    from tests.conftest import rel_err
    from tests.test_parity import _microbatch

    _, ckpt, samples = parity_setup
    common = [
        *LORA,
        "vision.parallelism=none",
        "vision.num_actors=1",
        "vision.degree=1",
        "vision.train=none",
        f"model.path={ckpt}",
        "training.lr=1e-2",
        "data.microbatch_tokens=1024",
        "vision.num_cpus_per_actor=0.5",
        "text.num_cpus_per_actor=0.5",
    ]
    runs = {}
    one_rank = ["text.parallelism=none", "text.num_actors=1", "text.degree=1"]
    for name, extra in (
        ("one rank", [*one_rank, "text.lora.dropout=0.3"]),
        ("tp2", [*TP2, "text.lora.dropout=0.3"]),
        ("no dropout", [*TP2]),
    ):
        cfg = load_config("tiny", common + extra)
        batches = [GlobalBatch([_microbatch(samples[:2], cfg), _microbatch(samples[2:], cfg)], epoch=0)]
        with trainers.use(cfg) as trainer:
            for _ in range(2):  # the first step's LR is 0 (warm-up from 0)
                trainer.train_step(batches)
            loss = trainer.accumulate(batches)
            ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())  # what optimizer_step does first
            runs[name] = loss, {n: t for n, t in collect(trainer, grads=True).items() if ".lora_" in n}
    (one_loss, one), (tp_loss, tp), (_, plain) = runs["one rank"], runs["tp2"], runs["no dropout"]
    assert tp_loss == pytest.approx(one_loss, rel=1e-6)
    assert len(one) == 2 * 7 * 2 and tp.keys() == one.keys()
    errors = {n: rel_err(tp[n], t) for n, t in one.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"gradient of {worst} off by {errors[worst]:.2e}"
    assert min(rel_err(plain[n], t) for n, t in one.items()) > 1e-2  # every factor's gradient sees its mask


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_dropout_is_one_process_dropout_sliced_and_keeps_a_bool_mask(dtype, device):
    """A rank's `ColumnsDropout` of columns 2:5 of an 8-wide input: output and input gradient equal to one
    process's `nn.Dropout` of the whole width, sliced, exactly, on CPU (bernoulli_) and on CUDA (the fused
    native_dropout); what autograd keeps of it is a bool mask of the rank's width (the plan counts 1 byte)."""
    from dhp.models.lora import ColumnsDropout

    x = torch.randn(3, 8, dtype=dtype, device=device, requires_grad=True)
    torch.manual_seed(7)
    whole = torch.nn.Dropout(0.3)(x)
    whole.backward(torch.ones_like(whole))
    part = x.detach()[:, 2:5].clone().requires_grad_()
    assert 0 < int((whole == 0).sum()) < whole.numel()  # some dropped, some kept: the masks can differ
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        torch.manual_seed(7)
        mine = ColumnsDropout(0.3, 8, slice(2, 5))(part)
    mine.backward(torch.ones_like(mine))
    assert torch.equal(mine, whole[:, 2:5]) and torch.equal(part.grad, x.grad[:, 2:5])
    assert [(t.dtype, tuple(t.shape)) for t in kept] == [(torch.bool, (3, 3))]
