"""What trains, and at which learning rate and weight decay: the one object workers, pools and the driver ask.

The model has three trainable modules, each with its own optimizer groups (its matrices decay, its biases and
norm weights do not, the transformers Trainer convention):

| module          | parameters                               | LR = training.lr x       | weight decay                 |
|-----------------|------------------------------------------|--------------------------|------------------------------|
| `vision_blocks` | ViT patch embedding, blocks (`visual.*`) | `vision.lr_scale`        | `vision.weight_decay`        |
| `merger`        | the projector (`visual.merger.*`)        | `vision.merger_lr_scale` | `vision.merger_weight_decay` |
| `text`          | the language model, embedding, lm_head   | `text.lr_scale`          | `text.weight_decay`          |

A None weight decay is `training.weight_decay` (the merger's: the vision one); a None `merger_lr_scale` is
`vision.lr_scale`.

What trains (`vision.train`, `text.train`) and qwen-vl-finetune's flags for the same choice:

| `vision.train` | trains                | qwen-vl-finetune                          |
|----------------|-----------------------|-------------------------------------------|
| `all`          | blocks and merger     | `tune_mm_vision=True tune_mm_mlp=True`    |
| `merger`       | the merger only       | `tune_mm_vision=False tune_mm_mlp=True`   |
| `none`         | nothing               | `tune_mm_vision=False tune_mm_mlp=False`  |

| `text.train`   | trains                | qwen-vl-finetune                          |
|----------------|-----------------------|-------------------------------------------|
| `all`          | the language model    | `tune_mm_llm=True`                        |
| `lora`         | LoRA adapters on it   | `lora_enable=True` (LLaVA-style scripts)  |
| `none`         | nothing               | `tune_mm_llm=False`                       |

A stage that trains nothing holds no gradients and no optimizer: a frozen vision pool runs its forwards under
`no_grad` (no graph kept), the driver submits no vision backward and asks the text pool for no embedding
gradient; a frozen text pool still back-propagates to the vision embeddings when the vision side trains.
Parameter names are classified the same way in a stage module (`visual.merger.ln_q.weight`) and in the whole
transformers model (`model.visual.merger.ln_q.weight`), so the single-process reference gets the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dhp.errors import ConfigError
from dhp.models.lora import is_lora_factor


@dataclass(frozen=True)
class ModuleGroup:
    """One trainable module's choices (the optimizer groups holding its parameters list it in `modules`)."""

    name: str
    stage: str
    trains: bool
    lr: float
    weight_decay: float


# The vision-language mergers: the merger, and Qwen3-VL's DeepStack mergers (tuned with it, as `tune_mm_mlp`)
_MERGERS = ("visual.merger.", "visual.deepstack_merger_list.")


def module_of(name: str) -> str:
    """The module a parameter belongs to, by its name in a stage module or in the whole transformers model."""
    if any(name.startswith(m) or f".{m}" in name for m in _MERGERS):
        return "merger"
    if name.startswith("visual.") or ".visual." in name:
        return "vision_blocks"
    return "text"


class FineTuning:
    """The run's fine-tuning choices (`vision.*` / `text.*` keys above), checked when built: a choice that
    cannot run raises ConfigError naming the key."""

    def __init__(self, cfg: Any):  # a stages.config.Config
        v, t, tr = cfg.vision, cfg.text, cfg.training
        if v.train == "none" and t.train == "none":
            raise ConfigError("vision.train=none and text.train=none: nothing would train")
        self.lora = t.lora if t.train == "lora" else None  # LoRA factors train, the language model's base is frozen
        if self.lora is not None:
            lo = self.lora
            for ok, why in (
                (lo.rank >= 1, "text.lora.rank must be >= 1"),
                (lo.alpha > 0, "text.lora.alpha must be > 0"),
                (0 <= lo.dropout < 1, "text.lora.dropout must be in [0, 1)"),
                (any(x.strip() for x in lo.targets.split(",")), "text.lora.targets names no layer"),
            ):
                if not ok:
                    raise ConfigError(why)
        for key, value in (
            ("vision.lr_scale", v.lr_scale),
            ("text.lr_scale", t.lr_scale),
            ("vision.merger_lr_scale", v.merger_lr_scale),
        ):
            if value is not None and value <= 0:
                raise ConfigError(f"{key} must be > 0 (freeze a module with {key.split('.')[0]}.train)")
        v_wd = tr.weight_decay if v.weight_decay is None else v.weight_decay
        self.groups = {
            "vision_blocks": ModuleGroup("vision_blocks", "vision", v.train == "all", tr.lr * v.lr_scale, v_wd),
            "merger": ModuleGroup(
                "merger",
                "vision",
                v.train in ("all", "merger"),
                tr.lr * (v.lr_scale if v.merger_lr_scale is None else v.merger_lr_scale),
                v_wd if v.merger_weight_decay is None else v.merger_weight_decay,
            ),
            "text": ModuleGroup(
                "text",
                "text",
                t.train in ("all", "lora"),
                tr.lr * t.lr_scale,
                tr.weight_decay if t.weight_decay is None else t.weight_decay,
            ),
        }

    def trains(self, stage: str) -> bool:
        """Whether any parameter of `stage` ("vision" | "text") trains: its pool runs backward and steps."""
        return any(g.trains for g in self.groups.values() if g.stage == stage)

    def trains_all(self, stage: str) -> bool:
        """Whether every parameter of `stage` trains (the default, `train: all`)."""
        return self.trains(stage) and not self.partial(stage)

    def partial(self, stage: str) -> bool:
        """Whether some of `stage` is frozen: its checkpoints then hold only what trains, the rest is the base's."""
        if stage == "text" and self.lora is not None:
            return True
        return not all(g.trains for g in self.groups.values() if g.stage == stage)

    def trainable(self, name: str) -> bool:
        module = module_of(name)
        if module == "text" and self.lora is not None:
            return is_lora_factor(name)
        return self.groups[module].trains

    def freeze(self, model: nn.Module) -> None:
        """`requires_grad` of every parameter from its module's choice (before a layout wraps the model)."""
        for name, p in model.named_parameters():
            p.requires_grad_(self.trainable(name))

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Optimizer groups of `model`'s trainable parameters: decayed matrices and the rest, per distinct (LR,
        weight decay), each listing the modules in it (`modules`). Modules that share both share a group, so the
        default (one LR, one decay) gives the two groups of the transformers Trainer, and ZeRO-1, which splits
        each group over its ranks on its own, stays as balanced as it was. Empty groups are left out; the
        result depends on names and shapes only, the same on every rank of a layout."""
        named = [(n, p, p.ndim) for n, p in model.named_parameters() if p.requires_grad]
        return self.grouped(named)

    def grouped(self, named: list[tuple[str, Any, int]]) -> list[dict[str, Any]]:
        """`param_groups` over (name, item, ndim) of trainable parameters, in that order: the memory plan asks
        it with shapes for items, to lay out ZeRO-1's partition without building anything."""
        groups: dict[tuple[float, float], dict[str, Any]] = {}
        for decay in (True, False):
            for name, item, ndim in named:
                if (ndim >= 2) != decay:
                    continue
                g = self.groups[module_of(name)]
                group = groups.setdefault(
                    (g.lr, g.weight_decay if decay else 0.0),
                    {"params": [], "lr": g.lr, "weight_decay": g.weight_decay if decay else 0.0, "modules": []},
                )
                group["params"].append(item)
                if g.name not in group["modules"]:
                    group["modules"].append(g.name)
        return list(groups.values())


def group_lrs(optimizer: Any) -> dict[str, float]:
    """The LR each module's groups run at now (the `modules` of the groups `param_groups` made)."""
    return {module: group["lr"] for group in optimizer.param_groups for module in group["modules"]}
