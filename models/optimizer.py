"""Which AdamW implementation a stage steps with: one object per `training.optimizer` choice, asked by the stage
workers (`build`: torch's AdamW, ZeRO-1 sharded or not) and the memory plan (`step_temp_numel`).

| `training.optimizer` | torch's AdamW | memory it allocates while it steps (elements, the moments' dtype) |
|---|---|---|
| `fused` | `fused=True`: one kernel per device and dtype updates parameters and moments in place | none |
| `foreach` | `foreach=True`: one list op per update term over a whole optimizer group | the largest group's |
| `for_loop` | `foreach=False, fused=False`: tensor by tensor | max over a group of 2 n_i + n_(i-1) |
| `auto` (default) | `fused` on CUDA, `foreach` elsewhere | |

The temporaries, from torch 2.13's `torch/optim/adam.py` (AdamW's weight decay is decoupled: `mul_` in place):
- `_fused_adam` calls `torch._fused_adamw_`, which writes parameters and moments in place (CUDA: one
  multi-tensor kernel; CPU: a vectorised loop over each tensor's buffers);
- `_multi_tensor_adam` allocates `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, one moment-sized buffer
  for every parameter of the optimizer group (per device and dtype), and frees it when the group is done;
- `_single_tensor_adam` computes `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` per
  parameter: the square root and the quotient of parameter i exist together, while `denom` of parameter i-1
  is still bound.
tests/test_optimizer.py measures these allocations on the CPU and holds `step_temp_numel` to them.

On CPU, `foreach` computes the same values as `for_loop`, bit for bit, which is why `auto` keeps it there;
`fused` differs from both by rounding. An implementation torch has no kernel for on the parameters' device or
dtype is a ConfigError that names `training.optimizer` and what to choose instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from dhp.errors import ConfigError, one_line
from dhp.models.parallel.layout import NOT_SHARDED


class AdamWImplementation:
    name: ClassVar[str] = ""
    torch_kwargs: ClassVar[dict[str, bool]] = {}

    def step_temp_numel(self, groups: Sequence[Sequence[float]]) -> float:
        """Elements of the most memory one step allocates beyond the states, for optimizer groups whose
        parameters have these element counts, in the order the optimizer holds them."""
        raise NotImplementedError

    def build(self, groups: list[dict[str, Any]], zero_group: Any = NOT_SHARDED, **hyper: Any) -> torch.optim.Optimizer:
        """AdamW over `groups` with `hyper` (lr, betas, eps); `zero_group` (a process group, None = the
        default group; NOT_SHARDED = off) shards its state ZeRO-1 style with torch's ZeroRedundancyOptimizer."""
        kwargs = {**hyper, **self.torch_kwargs}
        with self._explained():
            self._probe(groups)
            if zero_group is NOT_SHARDED:
                return torch.optim.AdamW(groups, **kwargs)
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, process_group=zero_group, **kwargs
            )

    def _probe(self, groups: list[dict[str, Any]]) -> None:
        """One step on a one-element tensor of each device and dtype of `groups`' parameters: torch checks
        fused's devices and dtypes only when a step first meets them, which for a stage is its first step."""
        for device, dtype in {(p.device, p.dtype) for g in groups for p in g["params"]}:
            x = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
            x.grad = torch.zeros_like(x)
            torch.optim.AdamW([x], **self.torch_kwargs).step()

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """torch's refusal of an implementation for these parameters, as a config error naming the key."""
        try:
            yield
        except RuntimeError as e:
            others = ", ".join(n for n in IMPLEMENTATIONS if n != self.name)
            raise ConfigError(f"training.optimizer={self.name}: {one_line(e)}; choose one of {others}") from None


class Fused(AdamWImplementation):
    name = "fused"
    torch_kwargs = {"fused": True}

    def step_temp_numel(self, groups: Sequence[Sequence[float]]) -> float:
        return 0.0


class Foreach(AdamWImplementation):
    name = "foreach"
    torch_kwargs = {"foreach": True}

    def step_temp_numel(self, groups: Sequence[Sequence[float]]) -> float:
        return max((sum(g) for g in groups), default=0.0)


class ForLoop(AdamWImplementation):
    name = "for_loop"
    torch_kwargs = {"foreach": False, "fused": False}

    def step_temp_numel(self, groups: Sequence[Sequence[float]]) -> float:
        # 0 before a group's first parameter: no earlier denominator is bound yet.
        return max((2 * n + prev for g in groups for prev, n in zip([0.0, *g], g)), default=0.0)


IMPLEMENTATIONS: dict[str, AdamWImplementation] = {i.name: i for i in (Fused(), Foreach(), ForLoop())}
CHOICES = ("auto", *IMPLEMENTATIONS)


def adamw_of(name: str, device_type: str) -> AdamWImplementation:
    """The implementation `training.optimizer` names for parameters on `device_type` ("cuda", "cpu"); `auto`:
    fused on CUDA, foreach elsewhere."""
    if name == "auto":
        name = "fused" if device_type == "cuda" else "foreach"
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ConfigError(f"training.optimizer={name!r}: choose one of {', '.join(CHOICES)}") from None


def device_type_of(groups: list[dict[str, Any]]) -> str:
    """The device type of the first parameter of `groups` (every parameter of a stage lives on one)."""
    return next((p.device.type for g in groups for p in g["params"]), "cpu")


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0, then cosine decay to `min_lr_ratio` of each group's LR at `total_steps`: the formula of
    transformers' `get_cosine_with_min_lr_schedule_with_warmup` (half a cycle), which tests/test_optimizer.py holds
    this to step by step.

    Written here rather than imported because `transformers.optimization` imports its Trainer utilities and, through
    them, peft: about 1.5 s more start-up in every stage actor, for eight lines of arithmetic.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, cosine * (1 - min_lr_ratio) + min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
