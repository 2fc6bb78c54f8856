"""Fine-tuning modes (models/fine_tuning.py): what trains and each module's LR and weight decay.

Parity: every mode in the default sp2 / tp2 layout, the uniform tp2 / tp2 baseline and
ZeRO-3 trains exactly like the single-process transformers model with the same `requires_grad` choices and
a reference AdamW with the same groups (tests/test_parity.py's check, which compares losses, gradients, clip
norms, per-module LRs and parameters). Every case sets different LRs and weight decays for the ViT blocks,
the merger and the language model. Frozen parameters must come out bit-identical, and a frozen pool must hold
no gradient and no optimizer state and (vision) never run a backward.
"""

from __future__ import annotations

import pytest
import ray
import torch

from dhp.models.fine_tuning import FineTuning, module_of
from dhp.stages.config import ConfigError, load_config
from tests.test_parity import SP2, TP2, check_parity

VTP2 = ["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"]
ZERO3 = ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"]
LAYOUTS = {  # (overrides, each text replica's micro-batches), as in tests/test_parity.py
    "sp2-tp2": (SP2 + TP2, [[[0, 1], [2]]]),
    "tp2-tp2": (VTP2 + TP2, [[[0], [1, 2]]]),
    "zero3": (ZERO3, [[[0], [2]], [[1]]]),
}
GROUPS = [
    "vision.lr_scale=0.5",
    "vision.merger_lr_scale=2.0",
    "text.lr_scale=1.5",
    "vision.weight_decay=0.2",
    "vision.merger_weight_decay=0.0",
    "text.weight_decay=0.05",
    "training.max_grad_norm=0.05",
]  # a frozen module's gradients are not in the norm: clip all the same
MODES = {"vision-none": ["vision.train=none"], "merger": ["vision.train=merger"], "text-none": ["text.train=none"]}
# Mode by mode: the layouts of one mode share one reference trajectory (tests/test_parity.py keeps the latest two),
# and the SP 2 / TP 2 and TP 2 / TP 2 pools have one shape, so their trainers take over each other's actors.
CASES = [(lay, mode) for mode in MODES for lay in LAYOUTS] + [("sp2-tp2", "all")]
# Also the memory plan on this case's trainer: a frozen ViT keeps nothing (tests/test_plan_measured.py).
PLANNED = {("sp2-tp2", "vision-none")}


def _worker_summary(w) -> dict:
    """What a stage actor holds after training: gradients by module, optimizer state, backward calls."""
    return {
        "trains": w.trains,
        "optimizer": w.optimizer is not None,
        "grads": sorted({module_of(n) for n, p in w.model.named_parameters() if p.grad is not None}),
        "state_bytes": w.state_bytes(),
        "stepped": sorted({module_of(n) for n, _ in w._optimizer_params()}),
        "calls": sorted({e.name for e in w.recorder._events}),
        "pending": len(getattr(w, "pending", {})),
    }


@pytest.mark.parametrize(("layout", "mode"), CASES, ids=[f"{lay}-{mode}" for lay, mode in CASES])
def test_fine_tuning_matches_transformers(parity_setup, plan_sample, trainers, tmp_path, layout, mode):
    from tests.test_plan_measured import check_plan

    overrides, replicas = LAYOUTS[layout]
    chosen = MODES.get(mode, [])
    seen = {}

    def probe(trainer):
        for stage, pool in trainer.pools():
            seen[stage] = ray.get([a.__ray_call__.remote(_worker_summary) for a in pool.actors])
        if (layout, mode) in PLANNED:  # after the summaries: it trains one more step
            check_plan(trainer, plan_sample, len(replicas))

    params = check_parity(parity_setup, tmp_path, overrides + GROUPS + chosen, replicas, probe, trainers=trainers)

    ft = FineTuning(load_config("tiny", GROUPS + chosen))
    initial = parity_setup[0].state_dict()
    frozen = [n for n in params if not ft.trainable(n)]
    assert bool(frozen) == (mode != "all")
    for name in frozen:
        assert torch.equal(params[name], initial[name]), f"frozen {name} changed"
    assert any(not torch.equal(params[n], initial[n]) for n in params if ft.trainable(n))  # the rest trained
    for stage, summaries in seen.items():
        trained = {g.name for g in ft.groups.values() if g.stage == stage and g.trains}
        for s in summaries:
            assert s["trains"] == bool(trained) and s["optimizer"] == bool(trained)
            assert set(s["stepped"]) <= trained and set(s["grads"]) <= trained, s  # no state of a frozen module
            if not trained:
                assert s["state_bytes"]["grads"] == s["state_bytes"]["optimizer"] == 0
                assert "optimizer_step" not in s["calls"] and "grad_norm" not in s["calls"]
    for s in seen["vision"]:  # a frozen encoder kept no graph and ran no backward; a trained one did
        assert ("backward" in s["calls"]) == (mode != "vision-none") and s["pending"] == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["vision.train=none", "text.train=none"], "nothing would train"),
        (["text.train=merger"], "'text.train' expects one of \\['all', 'lora', 'none'\\]"),
        (["text.merger_lr_scale=2"], "unknown key 'text.merger_lr_scale'"),
        (["vision.merger_lr_scale=0"], "vision.merger_lr_scale must be > 0"),
    ],
)
def test_rejected_choices_fail_at_start(overrides, message):
    from dhp.models.parallel.checks import check_layout

    with pytest.raises(ConfigError, match=message):
        check_layout(load_config("tiny", overrides))


def test_groups_follow_module_names_in_both_naming_schemes():
    ft = FineTuning(load_config("tiny", GROUPS + ["vision.train=merger"]))
    assert module_of("visual.merger.mlp.0.weight") == module_of("model.visual.merger.mlp.0.weight") == "merger"
    assert module_of("visual.blocks.0.attn.qkv.weight") == module_of("model.visual.patch_embed.proj.weight")
    assert module_of("lm_head.weight") == module_of("language_model.layers.0.mlp.up_proj.weight") == "text"
    assert not ft.trainable("model.visual.blocks.0.norm1.weight") and ft.trainable("visual.merger.ln_q.weight")
    lr = load_config("tiny").training.lr
    assert ft.groups["merger"].lr == pytest.approx(2.0 * lr) and ft.groups["text"].lr == pytest.approx(1.5 * lr)
    assert ft.groups["vision_blocks"].weight_decay == 0.2 and ft.groups["merger"].weight_decay == 0.0


@pytest.mark.parametrize(
    ("vision", "text", "all_of"),
    [
        ("all", "all", {"vision", "text"}),
        ("merger", "lora", set()),
        ("none", "all", {"text"}),
        ("all", "none", {"vision"}),
    ],
)
def test_trains_all_is_the_default_choice_only(vision, text, all_of):
    ft = FineTuning(load_config("tiny", [f"vision.train={vision}", f"text.train={text}"]))
    assert {stage for stage in ("vision", "text") if ft.trains_all(stage)} == all_of
