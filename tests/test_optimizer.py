"""`training.optimizer` (models/optimizer.py): each AdamW implementation trains like torch's plain per-parameter
loop, and the memory plan counts what each one allocates while it steps, as measured here."""

from __future__ import annotations

import contextlib
import copy
import typing
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import Qwen2_5_VLForConditionalGeneration, get_cosine_with_min_lr_schedule_with_warmup

from dhp.errors import ConfigError
from dhp.models.architectures import architecture_config
from dhp.models.optimizer import CHOICES, IMPLEMENTATIONS, adamw_of, warmup_cosine_schedule
from dhp.models.planning.memory_plan import stage_plan
from dhp.stages.config import TrainingConfig, load_config
from dhp.stages.stage_worker import build_optimizer, clipped_step
from dhp.stages.trainer import model_config_of
from tests.conftest import perturbed_reference

STEPS = 3


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only waits, and on a busy 2-core machine its spinning
    multiplied the training test's CPU time by 20."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_config_names_each_implementation_and_auto_picks_by_device():
    assert typing.get_args(typing.get_type_hints(TrainingConfig)["optimizer"]) == CHOICES
    assert load_config("tiny").training.optimizer == "auto"
    assert adamw_of("auto", "cuda") is IMPLEMENTATIONS["fused"]
    assert adamw_of("auto", "cpu") is IMPLEMENTATIONS["foreach"]
    assert adamw_of("for_loop", "cuda") is IMPLEMENTATIONS["for_loop"]
    with pytest.raises(ConfigError, match="training.optimizer.*expects one of"):
        load_config("tiny", ["training.optimizer=adam"])
    with pytest.raises(ConfigError, match="training.optimizer='adam': choose one of auto, fused, foreach, for_loop"):
        adamw_of("adam", "cpu")


def test_an_implementation_torch_has_no_kernel_for_is_a_config_error():
    """torch's fused AdamW runs on CPU and CUDA tensors only: parameters elsewhere (here `meta`) are refused with
    the key and the other choices."""
    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ConfigError, match=r"training.optimizer=fused: .*fused=True.*; choose one of foreach, for_loop"):
        IMPLEMENTATIONS["fused"].build([{"params": [param]}], lr=1e-3)


VOCAB = 512  # the tiny shape with a small vocabulary: lm_head and the embedding would be most of the work
IMAGE, START, END = VOCAB - 3, VOCAB - 2, VOCAB - 1
GRID = (1, 8, 12)  # 4 x 6 merge units: a whole window and a partial one


def _batch(step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s sample: text, an image of `GRID` patches, text; the answer's 20 tokens carry the loss. Each
    step's differs, so that the moments' betas matter."""
    g = torch.Generator().manual_seed(step)
    merged = GRID[0] * GRID[1] * GRID[2] // 4
    text = torch.randint(0, IMAGE - 1, (60,), generator=g).tolist()
    ids = torch.tensor([text[:30] + [START] + [IMAGE] * merged + [END] + text[30:]])
    labels = torch.full_like(ids, -100)
    labels[0, -20:] = ids[0, -20:]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=labels,
        pixel_values=torch.randn(GRID[0] * GRID[1] * GRID[2], 1176, generator=g),
        image_grid_thw=torch.tensor([GRID]),
        mm_token_type_ids=(ids == IMAGE).int(),
    )


def _small_vocab_model() -> torch.nn.Module:
    config = architecture_config("tiny", "eager")
    config.text_config.vocab_size = VOCAB
    config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = IMAGE, START, END
    config.video_token_id = VOCAB - 4
    return perturbed_reference(Qwen2_5_VLForConditionalGeneration, config)


def _reference_optimizer(model: torch.nn.Module, t: TrainingConfig):
    """torch's AdamW as a one-process script writes it: the per-parameter loop, decay on matrices only, the same
    warm-up and cosine."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=False, fused=False
    )
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.steps, min_lr_rate=t.min_lr_ratio
    )
    return optimizer, schedule


def _dhp_step(model: torch.nn.Module, optimizer, scheduler, max_norm: float) -> None:
    """The step as the stage workers take it: the driver's clip coefficient from the global norm, then
    `clipped_step`."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    clipped_step(optimizer, model.parameters(), min(1.0, max_norm / (norm.item() + 1e-6)))
    scheduler.step()


def test_each_implementation_trains_like_torchs_per_parameter_loop():
    """dhp's `build_optimizer` + `clipped_step` under each `training.optimizer` against torch's for-loop AdamW,
    each training its own copy of a tiny Qwen2.5-VL on the same batch for 3 steps: the parity tests' tolerances
    (loss 1e-6 relative, parameters 1e-5), with clipping exercised; foreach exactly as the for loop."""
    overrides = [
        f"training.steps={STEPS}",
        "training.warmup_steps=1",
        "training.lr=1e-3",
        "training.adam_eps=1e-6",
        "training.weight_decay=0.1",
        "training.max_grad_norm=1.0",
    ]
    t = load_config("tiny", overrides).training
    ref = _small_vocab_model()
    initial = copy.deepcopy(ref)
    ref_optimizer, ref_scheduler = _reference_optimizer(ref, t)
    dhp = {}
    for name in IMPLEMENTATIONS:
        model = copy.deepcopy(initial)
        dhp[name] = (model, *build_optimizer(model, load_config("tiny", [*overrides, f"training.optimizer={name}"])))
    flags = {name: (opt.defaults["fused"], opt.defaults["foreach"]) for name, (_, opt, _) in dhp.items()}
    assert flags == {"fused": (True, None), "foreach": (None, True), "for_loop": (False, False)}
    clipped = []
    for step in range(STEPS):
        batch = _batch(step)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        for name, (model, optimizer, scheduler) in dhp.items():
            loss = model(**batch).loss
            loss.backward()
            assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item(), (name, step, loss.item())
            _dhp_step(model, optimizer, scheduler, t.max_grad_norm)
        clipped.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_grad_norm).item() > t.max_grad_norm)
        ref_optimizer.step()
        ref_scheduler.step()
        ref_optimizer.zero_grad(set_to_none=True)
    assert any(clipped)
    for name, (model, _, _) in dhp.items():
        trained = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            diff = (trained[n] - p).abs().max().item()
            assert diff <= 1e-5, f"{name}: {n} differs by {diff:.2e} after {STEPS} steps"
    # `auto` picks foreach on CPU because it computes what torch's CPU default, the for loop, computes.
    assert all(torch.equal(p, q) for p, q in zip(dhp["foreach"][0].parameters(), dhp["for_loop"][0].parameters()))
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), initial.parameters()))
    assert moved > 100 * 1e-5  # the steps moved the parameters far more than the tolerance


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors torch ops allocate (outputs sharing no storage with an input) while they are alive,
    and the peak: what an optimizer step needs beyond the states it updates in place."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


# Two optimizer groups, the for loop's worst moment a large tensor right after another one.
GROUPS = [[(40, 30), (100, 20), (64, 64), (7, 9)], [(50,), (300,), (8,)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_the_step_allocates_what_the_plan_counts(name, dtype):
    """One AdamW step after the first (which allocates the moments) allocates `step_temp_numel` elements of the
    parameters' dtype at its peak: none fused, the largest group foreach, 2 n_i + n_(i-1) in the for loop."""
    torch.manual_seed(0)
    params = [[torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes] for shapes in GROUPS]
    impl = IMPLEMENTATIONS[name]
    optimizer = impl.build([{"params": ps, "weight_decay": 0.1} for ps in params], lr=1e-3)
    for measured in (False, True):
        for p in (p for ps in params for p in ps):
            p.grad = torch.randn_like(p)
        with LiveBytes() if measured else contextlib.nullcontext() as live:
            optimizer.step()
    numels = [[p.numel() for p in ps] for ps in params]
    assert live.peak == impl.step_temp_numel(numels) * dtype.itemsize
    expected = {"fused": 0, "foreach": 1200 + 2000 + 4096 + 63, "for_loop": 2000 + 2 * 4096}
    assert impl.step_temp_numel(numels) == expected[name]


def test_the_plan_counts_the_step_temporary_of_the_implementation_it_will_run():
    """Text TP 2 of the tiny model: auto on GPU ranks is fused (no temporary), on CPU ranks foreach (one moment
    of the largest group: the decayed matrices); the for loop's about two of the largest matrix."""
    base = ["text.parallelism=tensor", "text.degree=2", "text.num_actors=2"]

    def temp(*overrides: str) -> int:
        cfg = load_config("tiny", base + list(overrides))
        return stage_plan(cfg, model_config_of(cfg), "text").optimizer_step_temp

    assert temp("text.num_gpus_per_actor=0.5") == temp("training.optimizer=fused") == 0
    vocab, hidden = 151936, 64
    largest = vocab * hidden // 2  # the embedding (and lm_head), split by TP 2
    foreach = temp()
    assert foreach == temp("training.optimizer=foreach", "text.num_gpus_per_actor=0.5")
    assert 2 * largest * 4 < foreach < 2.2 * largest * 4  # embedding and lm_head, the layers' matrices on top
    down = hidden * 176 // 2  # the last layer's down_proj, whose denominator is still bound when lm_head's starts
    assert temp("training.optimizer=for_loop") == (2 * largest + down) * 4


@pytest.mark.parametrize(("warmup", "total", "min_ratio"), [(0, 5, 0.0), (2, 10, 0.1), (3, 3, 0.5), (4, 20, 0.05)])
def test_warmup_cosine_schedule_is_transformers_schedule(warmup, total, min_ratio):
    """dhp's schedule against transformers' `get_cosine_with_min_lr_schedule_with_warmup`, every step and one past
    the end, for two parameter groups of different LRs."""

    def lrs(make):
        params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
        optimizer = torch.optim.SGD([{"params": params[:1], "lr": 1e-3}, {"params": params[1:], "lr": 3e-4}])
        scheduler, seen = make(optimizer), []
        for _ in range(total + 2):
            seen.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            scheduler.step()
        return seen

    ours = lrs(lambda o: warmup_cosine_schedule(o, warmup, total, min_ratio))
    theirs = lrs(lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr_rate=min_ratio))
    assert ours == theirs
