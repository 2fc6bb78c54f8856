"""Every layout of the two pools must train exactly like the single-process transformers model.

The reference is `Qwen2_5_VLForConditionalGeneration` on the whole batch in one forward (it computes its
own mRoPE positions); dhp splits the same batch into micro-batches (one text-only) over data-parallel
replicas, runs the vision and text stages in their own actor pools with the layout under test, and moves
embeddings and their gradients actor to actor. Also: pipelined orders equal the serial one, and the
per-rank checkpoint exports to a Hugging Face directory that computes what the dhp model computes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator

import pytest
import ray
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.dataflow.loader import GlobalBatch, MicroBatch, split_for_ranks
from dhp.dataflow.packing import meta_of, text_inputs, vision_inputs
from dhp.models.architectures import architecture_config
from dhp.models.family import family_of
from dhp.models.fine_tuning import FineTuning, group_lrs
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.stages.config import load_config
from dhp.stages.stage_worker import build_optimizer
from dhp.stages.trainer import Trainer, pool_shape
from tests.conftest import rel_err

STEPS = 3
# The layouts below are written relative to one vision and one text actor without parallelism (the
# shipped default is the SP2 / TP2 layout).
BASE = [
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "text.parallelism=none",
    "text.num_actors=1",
    "text.degree=1",
]
SP2 = ["vision.parallelism=sequence", "vision.num_actors=2", "vision.degree=2"]
TP2 = ["text.parallelism=tensor", "text.num_actors=2", "text.degree=2"]
AC_FULL = ["vision.activation_checkpointing=full", "text.activation_checkpointing=full"]
AC_EVERY_2 = ["vision.activation_checkpointing=every_n", "text.activation_checkpointing=every_n"]


def collect(trainer: Trainer, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors under HF names from every replica, asserting that all replicas agree."""
    out: dict[str, torch.Tensor] = {}
    for pool, module in ((trainer.vision, VisionModel), (trainer.text, TextModel)):
        for r in range(1 if pool.zero3 else pool.dp):  # zero3: the pool holds one copy, spread over all ranks
            for name, t in ray.get(pool.full_state(r, grads)).items():
                name = module.hf_name(name)
                assert name not in out or torch.equal(out[name], t), f"replicas disagree on {name}"
                out[name] = t
    return out


def _microbatch(chosen: list[dict], cfg, model_config=None) -> MicroBatch:
    vision, text = vision_inputs(chosen), text_inputs(chosen, pad_id=151643)
    meta = meta_of(vision, text)
    sp = cfg.vision.degree if cfg.vision.parallelism == "sequence" else 0
    parts = split_for_ranks(vision, text, sp, model_config or architecture_config("tiny"))  # what the loader sends
    return MicroBatch([ray.put(p) for p in parts], ray.put(text), meta)


# (overrides, each replica's micro-batches as sample indices): every layout dhp must train exactly like the
# reference; their parity tests also hold the memory plan to what the ranks keep (tests/test_plan_measured.py).
LAYOUTS = [
    # one vision + one text actor; three micro-batches, one of them text-only (an empty vision call)
    ([], [[[0], [1], [2]]]),
    # data parallel x2 on both pools: replicas see different samples, gradients are summed
    (["vision.num_actors=2", "text.num_actors=2"], [[[0], [2]], [[1]]]),
    # text tensor parallel x2 (vision pool 1 actor, text pool 2: M:N boundary 1 -> 2)
    (["text.parallelism=tensor", "text.num_actors=2", "text.degree=2"], [[[0], [1, 2]]]),
    # text tensor parallel x4 (KV heads replicated: tiny has 2) with data parallel x2 on both pools
    (["vision.num_actors=2", "text.parallelism=tensor", "text.num_actors=8", "text.degree=4"], [[[0]], [[1], [2]]]),
    # vision sequence parallel x2 (Ulysses), text tensor parallel x2
    (SP2 + TP2, [[[0, 1], [2]]]),
    # sp4 / tp2: the 4x6-patch image is smaller than a window, so some SP ranks hold nothing of it
    (["vision.parallelism=sequence", "vision.num_actors=4", "vision.degree=4"] + TP2, [[[0], [1, 2]]]),
    # sp2 / tp4 (vision pool 2 actors, text pool 4)
    (SP2 + ["text.parallelism=tensor", "text.num_actors=4", "text.degree=4"], [[[0, 1, 2]]]),
    # sp2 x dp2 and tp2 x dp2
    (
        [
            "vision.parallelism=sequence",
            "vision.num_actors=4",
            "vision.degree=2",
            "text.parallelism=tensor",
            "text.num_actors=4",
            "text.degree=2",
        ],
        [[[0], [2]], [[1]]],
    ),
    # ZeRO-3 on both pools (2 actors each = 2 replicas): replica 1 has one micro-batch fewer (padded),
    # and the text-only micro-batch makes vision rank 0 encode a placeholder to join the all-gathers
    (
        ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"],
        [[[0], [2]], [[1]]],
    ),
    # the uniform tensor-parallel baseline: vision TP 2 and text TP 2
    (["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"] + TP2, [[[0], [1, 2]]]),
    # activation checkpointing: recomputed blocks re-run their collectives in backward, in the same order
    # on every rank (sp4: ranks holding no patches recompute their empty blocks and join)
    (AC_EVERY_2, [[[0], [1], [2]]]),
    (SP2 + TP2 + AC_FULL, [[[0, 1], [2]]]),
    (["vision.parallelism=sequence", "vision.num_actors=4", "vision.degree=4"] + TP2 + AC_FULL, [[[0], [1, 2]]]),
    (["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"] + TP2 + AC_FULL, [[[0], [1, 2]]]),
    (
        ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"] + AC_FULL,
        [[[0], [2]], [[1]]],
    ),
]
# Fan-out and fan-in: vision and text replica counts differ (models/parallel/routing.py). `replicas` are the text
# replicas' micro-batches; the vision replicas take them by patch count.
FAN_LAYOUTS = [
    # one SP-2 vision replica serving two TP-2 text replicas
    (SP2 + ["text.parallelism=tensor", "text.num_actors=4", "text.degree=2"], [[[0], [2]], [[1]]]),
    # three vision replicas feeding one TP-2 text replica
    (["vision.num_actors=3"] + TP2, [[[0], [1], [2]]]),
    # two SP-2 vision replicas feeding one text replica
    (["vision.parallelism=sequence", "vision.num_actors=4", "vision.degree=2"], [[[0], [1], [2]]]),
    # ZeRO-3 vision (lockstep: 2 slots of 2, the second padded) feeding one text replica
    (["vision.parallelism=zero3", "vision.num_actors=2"], [[[0], [1], [2]]]),
    # one vision replica serving a ZeRO-3 text pool of 2 (lockstep: replica 1's second call is padding)
    (["text.parallelism=zero3", "text.num_actors=2"], [[[0], [2]], [[1]]]),
]
FAN_IDS = ["fanout-sp2-2xtp2", "fanin-3v-tp2", "fanin-2xsp2", "fanin-zero3v", "fanout-zero3t"]
LAYOUT_IDS = [
    "1v1t",
    "dp2",
    "tp2",
    "dp2-tp4",
    "sp2-tp2",
    "sp4-tp2",
    "sp2-tp4",
    "dp2-sp2-tp2",
    "zero3-zero3",
    "tp2-tp2",
    "1v1t-ac2",
    "sp2-tp2-ac",
    "sp4-tp2-ac",
    "tp2-tp2-ac",
    "zero3-zero3-ac",
]


# What `check_parity` reserves per actor: part of the pools' shape (`pool_shape`), as the layout is.
RESOURCES = ["vision.num_cpus_per_actor=0.5", "text.num_cpus_per_actor=0.5"]


def by_pool_shape(cases: list) -> list:
    """`cases` (`pytest.param`s, a layout's overrides first), each marked `pool_shape` with the shape of its pools:
    conftest.py `shapes_together` runs the module's cases of one shape one after another, each taking over the
    previous one's actors (`TrainerCache`) instead of starting new ones, across both families' tests."""
    return [
        pytest.param(*case.values, marks=[*case.marks, pytest.mark.pool_shape(repr(shape_of(case)))], id=case.id)
        for case in cases
    ]


def shape_of(case) -> tuple:
    return pool_shape(load_config("tiny", BASE + RESOURCES + case.values[0]))


# The fan layouts are left out of the plan's check: one sample per text replica leaves some vision replicas idle.
PARITY_CASES = by_pool_shape(
    [pytest.param(*case, True, id=name) for case, name in zip(LAYOUTS, LAYOUT_IDS)]
    + [pytest.param(*case, False, id=name) for case, name in zip(FAN_LAYOUTS, FAN_IDS)]
)


@pytest.mark.parametrize(("layout", "replicas", "planned"), PARITY_CASES)
def test_steps_match_transformers(parity_setup, plan_sample, trainers, tmp_path, layout, replicas, planned):
    """Parity, then (`planned`) the memory plan against what the ranks keep for one more step, of one 2 048-patch
    image (tests/test_plan_measured.py)."""
    from tests.test_plan_measured import plan_probe  # which imports this module

    probe = plan_probe(plan_sample, len(replicas)) if planned else None
    check_parity(parity_setup, tmp_path, layout, replicas, probe, trainers=trainers)


# Qwen3-VL (DeepStack on): the layouts its family has (models/family/qwen3_vl.py), micro-batches with two images
# and a text-only sample together; vision tensor parallelism with the DeepStack mergers split as the merger;
# sequence parallelism with an all-to-all in every block (sp4: the 6 x 4-patch image cut into pieces of one or
# two merge units); fan-out: one SP-2 vision replica serving two TP-2 text replicas; fan-in: two vision replicas
# serving one TP-2 text replica.
QWEN3_LAYOUTS = [
    pytest.param([], [[[0, 2], [1]]], False, id="1v1t"),
    pytest.param(SP2 + TP2, [[[0, 2], [1]]], True, id="sp2-tp2"),
    pytest.param(
        ["vision.parallelism=tensor", "vision.num_actors=2", "vision.degree=2"] + TP2,
        [[[0, 2], [1]]],
        True,
        id="tp2-tp2",
    ),
    pytest.param(
        ["vision.parallelism=sequence", "vision.num_actors=4", "vision.degree=4"] + TP2,
        [[[0], [1, 2]]],
        False,
        id="sp4-tp2",
    ),
    pytest.param(SP2 + TP2 + AC_FULL, [[[0, 2], [1]]], False, id="sp2-tp2-ac"),
    pytest.param(
        ["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"],
        [[[0], [2]], [[1]]],
        False,
        id="zero3-zero3",
    ),
    pytest.param(
        SP2 + ["text.parallelism=tensor", "text.num_actors=4", "text.degree=2"],
        [[[0], [2]], [[1]]],
        False,
        id="fanout-sp2-2xtp2",
    ),
    # fan-in: two vision replicas feeding one TP-2 text replica, each encoding one of its micro-batches
    pytest.param(["vision.num_actors=2"] + TP2, [[[0, 2], [1]]], False, id="fanin-2v-tp2"),
]


@pytest.mark.parametrize(("layout", "replicas", "planned"), by_pool_shape(QWEN3_LAYOUTS))
def test_qwen3_vl_steps_match_transformers(qwen3_parity_setup, trainers, tmp_path, layout, replicas, planned):
    """Qwen3-VL's parity with `Qwen3VLForConditionalGeneration`: the boundary carries the merged embeddings and the
    DeepStack features of each text rank's positions, their gradients come back; the export loads in transformers.
    `planned`: then the memory plan against what the ranks keep for one more step, of the 26 x 30-patch image's
    sample (tests/test_plan_measured.py: full attention in every block, the position embedding, the DeepStack
    mergers)."""
    from tests.test_plan_measured import plan_probe  # which imports this module

    probe = plan_probe(qwen3_parity_setup[2][0], len(replicas)) if planned else None
    params = check_parity(qwen3_parity_setup, tmp_path, layout, replicas, probe, trainers=trainers)
    assert any("deepstack_merger_list" in n for n in params)


def hf_name(name: str) -> str:
    """A reference parameter's name as dhp's export names it: peft's wrapping (`base_model.model.` prefix, the
    base layer, the adapter name) taken off."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".default.", ".")


def check_parity(
    parity_setup, tmp_path, layout: list[str], replicas: list, probe=None, reference=None, trainers=None
) -> dict[str, torch.Tensor]:
    """Train `STEPS` steps of `replicas`' micro-batches under `layout` (overrides after the common ones) and
    the reference in one process: losses, gradients, norms, per-module LRs and parameters must agree, and the
    export must load in transformers. dhp's trainer comes from `trainers` if given (a new one, or one that ran
    another layout on pools of the same shape), else it is a new one. The reference freezes and groups what
    `layout` freezes and groups (models/fine_tuning.py); dhp must hold no gradient of a frozen parameter. The
    reference trains once for all layouts that share its inputs, weights and optimizer (`reference_trajectory`).
    `reference(ref, trainer)`, if given, returns the reference to train instead (e.g. peft's LoRA model with
    dhp's initial factors).
    `probe(trainer)` runs last, before the trainer is given back (it may train on). Returns dhp's trained
    parameters (HF names)."""
    ref, ckpt, samples = parity_setup
    ref = copy.deepcopy(ref)
    longest = max(s["input_ids"].shape[0] for s in samples)
    cfg = load_config(
        "tiny",
        BASE
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={longest}",
            f"data.max_seq_len={longest}",
            f"training.steps={STEPS}",
            "training.warmup_steps=1",
            "training.lr=1e-3",
            # Adam divides by sqrt(v) + eps: with eps 1e-8, fp32 summation-order noise (~1e-9) in gradients of
            # size ~eps becomes parameter noise of ~1e-5 x (lr / 1e-3); gradients are compared directly above.
            "training.adam_eps=1e-6",
            "training.weight_decay=0.1",
            "training.max_grad_norm=1.0",
        ]
        + RESOURCES
        + layout,
    )
    batches = [
        GlobalBatch([_microbatch([samples[i] for i in group], cfg, ref.config) for group in replica], epoch=0)
        for replica in replicas
    ]

    # The reference sees the whole batch at once, padded together, and derives positions itself.
    full_v, full_t = vision_inputs(samples), text_inputs(samples, pad_id=151643)
    assert samples[2]["image_grid_thw"].shape[0] == 0
    assert full_v["image_grid_thw"].shape[0] == 3 and len({tuple(g) for g in full_v["image_grid_thw"].tolist()}) == 2
    ref_inputs = dict(
        input_ids=full_t["input_ids"],
        attention_mask=full_t["attention_mask"],
        labels=full_t["labels"],
        pixel_values=full_v["pixel_values"],
        image_grid_thw=full_v["image_grid_thw"],
        mm_token_type_ids=(full_t["input_ids"] == 151655).int(),
    )
    with trainers.use(cfg) if trainers is not None else new_trainer(cfg) as trainer:
        if reference is not None:
            ref = reference(ref, trainer)
        expected = reference_trajectory(ref, ref_inputs, cfg)
        for pool, stage in ((trainer.vision, cfg.vision), (trainer.text, cfg.text)):  # checkpointing is on where asked
            recomputing = ray.get(
                pool.actors[-1].__ray_call__.remote(lambda w: sum(b.gradient_checkpointing for b in w.model.blocks()))
            )
            assert (recomputing > 0) == (stage.activation_checkpointing != "none"), (pool.name, recomputing)
        for step in range(STEPS):
            loss = trainer.accumulate(batches)
            ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())  # what optimizer_step does first
            grads = collect(trainer, grads=True)

            ref_loss, ref_grads = expected.losses[step], expected.grads[step]
            assert abs(loss - ref_loss) / ref_loss <= 1e-6, (step, loss, ref_loss)
            assert set(grads) == set(ref_grads)
            errors = {n: rel_err(grads[n], g) for n, g in ref_grads.items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, f"step {step}: gradient of {worst} off by {errors[worst]:.2e}"

            grad_norm, lrs = trainer.optimizer_step()
            ref_norm = expected.norms[step]
            assert abs(grad_norm - ref_norm) / ref_norm <= 1e-5, (step, grad_norm, ref_norm)
            assert lrs == expected.lrs[step]
        assert grad_norm > cfg.training.max_grad_norm or step == 0  # clipping was exercised at least once
        for pool, stage in ((trainer.vision, cfg.vision), (trainer.text, cfg.text)):  # compiled where asked, each rank
            for rank, compiled in enumerate(pool.execute_all("compiled")):
                assert (compiled["units"] > 0) == (stage.compile != "none"), (pool.name, rank, compiled)
                assert stage.compile == "none" or compiled["graphs"] > 0, (pool.name, rank, compiled)

        params = collect(trainer)
        for name, p in expected.params.items():
            # Absolute: Adam turns fp-rounding noise in near-zero gradients into updates of up to ~1e-2 x lr.
            diff = (params[name] - p).abs().max().item()
            assert diff <= 1e-5, f"{name} differs by {diff:.2e} after {STEPS} steps"

        # The exported checkpoint is a Hugging Face directory that transformers loads as is.
        out = tmp_path / "export"
        trainer.save_weights(out)
        loaded = family_of(trainer.model_config).hf_class.from_pretrained(out)
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        merged = merged_lora(params, cfg)
        for name, p in loaded.named_parameters():
            if merged[name] is params[name]:
                assert torch.equal(p.detach(), params[name]), name
            else:  # folded in by the export: the same sum, maybe in another order
                assert torch.allclose(p.detach(), merged[name], rtol=0, atol=1e-6), name
        assert loaded.lm_head.weight.shape[0] == trainer.model_config.text_config.vocab_size
        if probe is not None:
            probe(trainer)
    return params


@contextlib.contextmanager
def new_trainer(cfg) -> Iterator[Trainer]:
    """A new trainer of `cfg`, shut down when the block ends (for callers without `trainers`)."""
    trainer = Trainer(cfg)
    try:
        yield trainer
    finally:
        trainer.shutdown()


@dataclasses.dataclass
class Trajectory:
    """The reference's `STEPS` steps: per step the loss, every trainable parameter's gradient, each module's LR
    and the global gradient norm before clipping; then every parameter. HF names (`hf_name`)."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    lrs: list[dict[str, float]]
    norms: list[float]
    params: dict[str, torch.Tensor]


# The reference's training depends on the batch, the initial weights, what trains and the optimizer, never on
# the layout: the layouts of one fine-tuning choice compare against one trajectory, trained once per test run.
# Each holds four copies of the model's trainable tensors (~300 MB with the 151 k vocabulary), so only the
# newest few are kept; the tests that share one run next to each other.
TRAJECTORIES: OrderedDict[str, Trajectory] = OrderedDict()
KEPT_TRAJECTORIES = 2


def reference_trajectory(ref: torch.nn.Module, inputs: dict[str, torch.Tensor], cfg) -> Trajectory:
    """`ref` (a copy this takes over) trained `STEPS` steps on `inputs` with `cfg`'s fine-tuning choice and
    optimizer, or the same training's trajectory from an earlier call."""
    FineTuning(cfg).freeze(ref)
    optimizer, scheduler = build_optimizer(ref, cfg)
    key = trajectory_key(ref, optimizer, inputs, cfg)
    if key not in TRAJECTORIES:
        TRAJECTORIES[key] = train_reference(ref, optimizer, scheduler, inputs, cfg.training.max_grad_norm)
    TRAJECTORIES.move_to_end(key)
    while len(TRAJECTORIES) > KEPT_TRAJECTORIES:
        TRAJECTORIES.popitem(last=False)
    return TRAJECTORIES[key]


def trajectory_key(ref: torch.nn.Module, optimizer, inputs: dict[str, torch.Tensor], cfg) -> str:
    """A digest of all the reference's training reads: the inputs; every parameter's name, value and
    `requires_grad`; the optimizer's groups (settings and members); the fine-tuning choices (LoRA's scale and
    dropout live in peft's modules, not in parameters); the training settings (schedule, clipping)."""
    digest = hashlib.blake2b()

    def add(t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())

    for name, t in sorted(inputs.items()):
        digest.update(name.encode())
        add(t)
    names = {}
    for name, p in ref.named_parameters():
        names[id(p)] = name
        digest.update(f"{name} {p.requires_grad}".encode())
        add(p)
    groups = [
        {k: [names[id(p)] for p in v] if k == "params" else v for k, v in g.items()} for g in optimizer.param_groups
    ]
    fine_tuning = FineTuning(cfg)
    digest.update(repr((groups, fine_tuning.groups, fine_tuning.lora, cfg.training, STEPS)).encode())
    return digest.hexdigest()


def train_reference(ref: torch.nn.Module, optimizer, scheduler, inputs: dict, max_grad_norm: float) -> Trajectory:
    """`STEPS` steps of `ref` on the whole batch in one process: what dhp's step does, in one forward."""
    run = Trajectory([], [], [], [], {})
    for _ in range(STEPS):
        loss = ref(**inputs).loss
        loss.backward()
        run.losses.append(loss.item())
        run.grads.append({hf_name(n): p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad})
        run.lrs.append(group_lrs(optimizer))
        run.norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    run.params = {hf_name(n): p.detach().clone() for n, p in ref.named_parameters()}
    return run


def merged_lora(params: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """`params` with every LoRA pair folded into its base weight (W + alpha / r x B A) and the factors dropped:
    what the export writes. Without LoRA, `params` itself."""
    lora = cfg.text.lora
    out = {n: t for n, t in params.items() if ".lora_" not in n}
    for name in [n for n in params if n.endswith(".lora_A.weight")]:
        base = name.removesuffix(".lora_A.weight") + ".weight"
        delta = params[name.replace(".lora_A.", ".lora_B.")] @ params[name]
        out[base] = params[base] + lora.alpha / lora.rank * delta
    return out


def test_layouts_share_one_reference_trajectory_and_nothing_else_does():
    """`trajectory_key` is the same for every layout, and changes with anything the reference trains on or with:
    what trains, LRs, weight decay, clipping, the schedule, LoRA's scale, the initial weights, the batch."""
    config = architecture_config("tiny")
    config.text_config.vocab_size = 512  # the key reads every parameter: a small vocabulary keeps this quick
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    inputs = {"input_ids": torch.arange(6)[None], "labels": torch.arange(6)[None]}

    def key(overrides: list[str], model: torch.nn.Module = model, inputs: dict = inputs) -> str:
        cfg = load_config("tiny", overrides)
        ref = copy.deepcopy(model)
        FineTuning(cfg).freeze(ref)
        return trajectory_key(ref, build_optimizer(ref, cfg)[0], inputs, cfg)

    base = key(BASE)
    assert key(SP2 + TP2 + AC_FULL) == key(["vision.parallelism=zero3", "vision.num_actors=2"]) == base
    changes = [
        ["vision.train=none"],
        ["vision.train=merger"],
        ["text.train=none"],
        ["text.train=lora"],
        ["text.train=lora", "text.lora.alpha=8"],
        ["vision.merger_lr_scale=2.0"],
        ["vision.weight_decay=0.2"],
        ["training.max_grad_norm=0.05"],
        ["training.warmup_steps=2"],
    ]
    keys = [base] + [key(BASE + change) for change in changes]
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.lm_head.weight[0, 0] += 1e-3
    keys += [key(BASE, model=perturbed), key(BASE, inputs=inputs | {"labels": torch.arange(1, 7)[None]})]
    assert len(set(keys)) == len(keys)


def test_pipelined_order_trains_like_serial(parity_setup, trainers):
    """max_in_flight 1 (serial), 2 and 4 on sp2 / tp2 with three accumulated micro-batches: same parameters."""
    _, ckpt, samples = parity_setup
    results = {}
    for k in (1, 2, 4):
        cfg = load_config(
            "tiny",
            SP2
            + TP2
            + RESOURCES
            + [
                f"model.path={ckpt}",
                "data.microbatch_tokens=1024",
                f"training.steps={STEPS}",
                "training.warmup_steps=1",
                f"pipeline.max_in_flight={k}",
            ],
        )
        batches = [GlobalBatch([_microbatch([s], cfg) for s in samples], epoch=0)]
        with trainers.use(cfg) as trainer:
            losses = []
            for _ in range(STEPS):
                losses.append(trainer.train_step(batches)["loss"])
            results[k] = (losses, collect(trainer))
    serial_losses, serial = results[1]
    for k in (2, 4):
        losses, params = results[k]
        assert losses == serial_losses, (k, losses, serial_losses)
        worst = max((params[n] - p).abs().max().item() for n, p in serial.items())
        assert worst <= 1e-6, f"max_in_flight={k}: parameters differ by {worst:.2e}"
    initial = parity_setup[0].state_dict()
    assert any((serial[n] != initial[n]).any() for n in serial if n in initial)  # it did train


@pytest.mark.parametrize(
    ("setup", "layout"), [("parity_setup", SP2 + TP2), ("qwen3_parity_setup", SP2 + TP2)], ids=["sp2-tp2", "qwen3"]
)
def test_export_hf_matches_dhp_model(request, trainers, tmp_path, setup, layout):
    """Per-rank dhp checkpoint -> `dhp export-hf` -> transformers: same tensors, same loss on a test batch; for each
    model family, from its released-name checkpoint."""
    from dhp.labels import count_label_tokens
    from dhp.stages.cli import main

    ref, ckpt, samples = request.getfixturevalue(setup)
    cfg = load_config(
        "tiny", layout + RESOURCES + [f"model.path={ckpt}", "training.steps=2", "training.warmup_steps=0"]
    )
    with trainers.use(cfg) as trainer:
        batches = [GlobalBatch([_microbatch(samples[:2], cfg, ref.config)], epoch=0)]
        trainer.train_step(batches)  # move the weights away from the checkpoint they were loaded from
        dhp_ckpt = trainer.save_checkpoint(tmp_path / "checkpoints", batches)
        mb = batches[0].microbatches[0]
        dhp_loss = ray.get(trainer.text.forward_eval(0, mb.text, trainer.vision.forward_eval(0, mb.vision)))
        params = collect(trainer)
    rank_files = sorted(p.name for p in dhp_ckpt.glob("*-rank*.safetensors"))
    assert rank_files == sorted(
        f"{s}-rank{r:05d}{kind}.safetensors" for s in ("text", "vision") for r in range(2) for kind in ("", "-moments")
    )  # each rank's tensors and its AdamW moments by name

    out = ["--out", str(tmp_path / "hf"), "--max-shard-size", "100KB"]
    assert main(["export-hf", "--checkpoint", str(dhp_ckpt), *out]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2  # from_pretrained reads them all
    hf = type(ref).from_pretrained(tmp_path / "hf").float().eval()
    for name, p in hf.named_parameters():
        assert torch.equal(p.detach(), params[name]), name
    v, t = vision_inputs(samples[:2]), text_inputs(samples[:2], pad_id=151643)
    with torch.no_grad():
        out = hf(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            labels=t["labels"],
            pixel_values=v["pixel_values"],
            image_grid_thw=v["image_grid_thw"],
            mm_token_type_ids=(t["input_ids"] == 151655).int(),
        )
    hf_loss = out.loss.item()
    mean = dhp_loss / count_label_tokens(t["labels"])
    assert abs(mean - hf_loss) / hf_loss <= 1e-6, (mean, hf_loss)
    assert main(["export-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # not a checkpoint
