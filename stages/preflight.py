"""What `dhp train` checks before it writes anything or starts Ray, each a one-line error naming its setting: the
layout, the attention kernel's package, the checkpoint and tokenizer directories, the memory plan, the cluster's
address and the checkpoint to resume from. Each of these would otherwise fail later and deeper: in every actor's
setup, in every data worker, after minutes of Ray's retries, or once the pools are built."""

from __future__ import annotations

import os
from typing import Any

import ray

from dhp.stages.checkpoint_files import resume_from
from dhp.stages.config import Config, ConfigError


def preflight(cfg: Config) -> None:
    """Every check below that `cfg` can fail before anything is written (`check_attention` runs earlier: before
    `plan.layout=auto` starts Ray)."""
    from dhp.models.parallel.checks import check_layout
    from dhp.stages.trainer import model_config_of  # heavy imports: after the config's own errors

    model_config = model_config_of(cfg)  # a model.path that is no checkpoint of a family dhp trains
    check_layout(cfg, model_config)
    check_tokenizer(cfg)
    check_memory(cfg, model_config)
    if not ray.is_initialized():  # a Ray this process already has is what the run uses (`init_ray`)
        check_reachable(*ray_address(cfg))
    resume_from(cfg.training.resume).check()


# model.attn_implementation -> (the module it imports, its package, how to install it), for those torch lacks
ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn", "pip install flash-attn --no-build-isolation, CUDA only")
}


def check_attention(implementation: str) -> None:
    """The asked-for attention kernel must be importable here, before Ray starts (else every actor would fail
    its setup with an ImportError minutes later)."""
    import importlib.util

    module, package, install = ATTENTION_PACKAGES.get(implementation, (None, None, None))
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"model.attn_implementation={implementation} needs the {package} package, which is not installed: "
            f"install it ({install}) or use "
            "model.attn_implementation=sdpa (PyTorch's SDPA, with a flash kernel on CUDA)"
        )


def check_tokenizer(cfg: Config) -> None:
    """The tokenizer directory (`model.tokenizer_path`, else `model.path`), when one is set, must hold a tokenizer:
    checked here, before Ray starts (else every data worker would fail on it, deep in Ray Data)."""
    from dhp.dataflow.tokenizer import tokenizer_dir_problem

    path = cfg.model.tokenizer_dir
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    problem = tokenizer_dir_problem(path) if path else None
    if problem:
        raise ConfigError(f"{key}={path} {problem}")


def check_memory(cfg: Config, model_config: Any) -> None:
    """Refuse a layout the memory plan (models/planning/memory_plan.py) says will not fit its GPUs, with the
    plan's table and what would fit; `training.skip_memory_check=true` starts anyway."""
    from dhp.models.planning.memory_plan import advice, plan, table

    result = plan(cfg, model_config)
    if result["fits"] is False and not cfg.training.skip_memory_check:
        tips = "; ".join(advice(cfg, result, model_config))
        raise ConfigError(
            f"this layout does not fit its GPUs (dhp plan):\n{table(result)}\nwhat would fit: {tips}; or "
            f"training.skip_memory_check=true to start anyway"
        )


HEAD_ADDRESS = (
    "give the address `ray start --head` printed (HOST:6379 by default), or leave ray.address unset to start a "
    "local Ray"
)


def ray_address(cfg: Config) -> tuple[str, str | None]:
    """(the setting, the cluster's address) a run connects to: `ray.address`, else `RAY_ADDRESS` (a Ray Job's),
    else none (a local Ray)."""
    if cfg.ray.address:
        return "ray.address", cfg.ray.address
    return "RAY_ADDRESS", os.environ.get("RAY_ADDRESS") or None


def check_reachable(key: str, address: str | None, timeout_s: float = 10.0) -> None:
    """A cluster's `HOST:PORT` must accept a connection (Ray itself retries an unreachable head for minutes, with
    warnings only). `auto`, `ray://` (Ray Client) and other forms are left to Ray."""
    import socket

    if not address:
        return
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"{key}={address}: no Ray head answers there ({e.strerror or e}); {HEAD_ADDRESS}") from None
