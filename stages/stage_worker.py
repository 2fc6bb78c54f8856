"""What every stage worker shares: model construction, the optimizer, clipping, weight export.

Parameters are kept in fp32 (they are the master weights); on GPU the forward runs under bf16 autocast
when `model.dtype: bfloat16`. AdamW + warmup/cosine come from torch and transformers. Gradient clipping
is by the global norm over *both* stages: each worker reports its squared norm, the driver adds them
and hands every worker the same clip coefficient.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from dhp.models.weights import load_stage_weights, save_shard, stage_state_for_export
from dhp.stages.actor_group import DistributedWorker
from dhp.stages.config import Config


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only, not biases or norm weights (the transformers Trainer convention)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(module: nn.Module, cfg: Config, lr_scale: float = 1.0):
    """AdamW + linear warmup + cosine decay to `min_lr_ratio`; one scheduler step per optimizer step."""
    t = cfg.training
    optimizer = torch.optim.AdamW(
        param_groups(module, t.weight_decay),
        lr=t.lr * lr_scale,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
    )
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.steps, min_lr_rate=t.min_lr_ratio
    )
    return optimizer, scheduler


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """As `torch.nn.utils.clip_grad_norm_`: scale by max_norm / (norm + 1e-6), never up."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class StageWorker(DistributedWorker):
    """A stage's model on one actor. Subclasses build `self.model` and define forward/backward."""

    stage = ""  # "vision" | "text"
    owned_prefixes: tuple[str, ...] = ()  # checkpoint-name prefixes this stage loads

    def __init__(self, cfg: Config, model_config: Any, rank: int, world_size: int, torch_threads: int = 1):
        super().__init__(rank, world_size, torch_threads)
        self.cfg, self.model_config = cfg, model_config
        torch.manual_seed(cfg.model.init_seed)
        self.model = self.build_model(model_config)
        if cfg.model.path:
            load_stage_weights(self.model, self.model.hf_name, cfg.model.path, self.owned_prefixes)
        self.model.to(self.device).train()
        stage_cfg = getattr(cfg, self.stage)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, stage_cfg.lr_scale)

    def build_model(self, model_config: Any) -> nn.Module:
        raise NotImplementedError

    def autocast(self):
        if self.device.type == "cuda" and self.cfg.model.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def grad_sq_norm(self) -> float:
        """Sum of squared gradient entries of this stage (0 for parameters without a gradient)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            if p.grad is not None:
                total += p.grad.detach().double().pow(2).sum()
        return float(total)

    def optimizer_step(self, clip_coef: float) -> float:
        """Scale gradients by the global clip coefficient, step, zero; returns the LR that was used."""
        if clip_coef < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(clip_coef)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def parameters_hf(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under checkpoint names (CPU copies): for tests and export."""
        return stage_state_for_export(self.model, self.model.hf_name)

    def gradients_hf(self) -> dict[str, torch.Tensor]:
        return {
            self.model.hf_name(n): p.grad.detach().cpu().clone()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }

    def save_weights(self, out_dir: str) -> dict[str, str]:
        """Write this stage's tensors as one shard of an HF checkpoint dir; returns its weight_map."""
        state = stage_state_for_export(self.model, self.model.hf_name)
        return save_shard(state, Path(out_dir), f"model-{self.stage}.safetensors")
