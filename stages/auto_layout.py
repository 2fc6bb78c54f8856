"""`plan.layout=auto`: the layout a run trains, chosen by the planner for the cluster Ray reports.

`choose_layout` takes the config, `ray.cluster_resources()` (a plain dict) and the layout keys the command line
set; it ranks every layout of the cluster's devices with `dhp plan --search`'s search
(models/planning/layout_search.py), on the length mix of `plan.data_profile` when it names one, and returns the
fastest layout that fits as the run's config, with the lines that say what was ranked and why the winner won.
The driver calls it once, before the checks of the layout and before any pool is built.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dhp.errors import ConfigError, one_line
from dhp.models.planning.hardware import DATASHEETS, RAY_ACCELERATORS, Profile, profile
from dhp.models.planning.layout_search import LAYOUT_KEYS, SEARCHED_KEYS, search, search_table, value_at
from dhp.stages.config import Config


def kept_keys(overrides: Iterable[str]) -> list[str]:
    """The keys the search sets (layout_search.SEARCHED_KEYS) among command-line `KEY=VALUE` overrides: with
    plan.layout=auto they are kept, and only the layouts with their values are ranked."""
    return [k for k in (o.partition("=")[0].strip() for o in overrides) if k in SEARCHED_KEYS]


def choose_layout(cfg: Config, resources: dict[str, float], keep: Iterable[str] = ()) -> tuple[Config, list[str]]:
    """(the config of the best layout of the cluster `resources` describes, the lines to print); `keep`: searched
    keys whose value in `cfg` every ranked layout must have. The returned config says `plan.layout: given`, so
    that RUN_DIR/config.yaml trains the same layout again."""
    from dhp.stages.trainer import model_config_of

    mc = model_config_of(cfg)
    prof, devices, nodes, cluster = _hardware(cfg, resources)
    mix, workload, what = _workload(cfg, mc, nodes)
    keep = [k for k in SEARCHED_KEYS if k in set(keep)]
    rows = search(cfg, mc, prof, devices, workload, mix, keep)
    kept = ", ".join(f"{k}={value_at(cfg, k)}" for k in keep)
    if not rows:
        raise ConfigError(
            f"plan.layout=auto: no layout of {cluster} fits {what}"
            + (f" with {kept} (given on the command line)" if kept else "")
            + "; see `dhp plan --search` for the ranking, or set the layout and plan.layout=given"
        )
    lines = [f"plan.layout=auto: {len(rows)} layouts of {cluster} that fit, ranked on {what}"]
    if kept:
        lines.append(f"kept from the command line: {kept} (only the layouts with these values are ranked)")
    lines += [search_table(rows, cfg.plan.top), *_why(rows, prof)]
    chosen = copy.deepcopy(rows[0]["config"])
    chosen.plan.layout = "given"
    if chosen.data.max_seq_len < cfg.data.max_seq_len:
        lines.append(
            f"data.max_seq_len {cfg.data.max_seq_len} -> {chosen.data.max_seq_len} (the chosen micro-batch "
            f"budget; longer samples are skipped)"
        )
    lines.append("the run trains #1; RUN_DIR/config.yaml keeps its layout (plan.layout: given)")
    return chosen, lines


def _hardware(cfg: Config, resources: dict[str, float]) -> tuple[Profile, int, int, str]:
    """(profile, devices to lay out, nodes, how the cluster reads in the printed lines) from Ray's resources:
    its GPUs and their `accelerator_type:NAME`, or `plan.hardware`; without GPUs, the CPU profile's cores."""
    types = sorted(k.partition(":")[2] for k in resources if k.startswith("accelerator_type:"))
    gpus = int(resources.get("GPU", 0))
    name = cfg.plan.hardware
    if name is None and not gpus:
        raise ConfigError(
            "plan.layout=auto: Ray reports no GPUs; plan.hardware=FILE names the CPU profile to plan with "
            "(write one with `dhp bench ops --json FILE` on a node of the cluster)"
        )
    if name is None and len(types) != 1:
        found = f"accelerator types {', '.join(types)}" if types else "no accelerator type"
        raise ConfigError(f"plan.layout=auto: Ray reports {found} for {gpus} GPUs; {_pick()}")
    if name is None and types[0] not in RAY_ACCELERATORS:
        raise ConfigError(f"plan.layout=auto: no profile for Ray's accelerator_type:{types[0]}; {_pick()}")
    name = name or RAY_ACCELERATORS[types[0]]
    if name not in DATASHEETS and not Path(name).is_file():
        raise ConfigError(f"plan.hardware={name}: no such datasheet or file; {_pick()}")
    try:
        prof = profile(name)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"plan.hardware={name}: not a `dhp bench ops --json` profile ({one_line(e)})") from None
    hosts = sum(1 for k in resources if k.startswith("node:") and not k.startswith("node:__"))
    if prof.kind == "gpu":
        nodes = int(resources.get(f"accelerator_type:{types[0]}", 1)) if len(types) == 1 else max(hosts, 1)
        devices = gpus
        prof.devices_per_node = math.ceil(devices / nodes)
        seen = f"Ray: {gpus} GPUs" + (f", accelerator_type:{types[0]}" if types else "")
    else:
        nodes = max(hosts, 1)
        devices = min(prof.devices_per_node * nodes, int(resources.get("CPU", 0)))
        seen = f"Ray: {resources.get('CPU', 0):g} CPUs; the profile's {prof.devices_per_node} cores a node"
    if devices < 1:
        raise ConfigError(f"plan.layout=auto: no device to lay out ({seen})")
    return prof, devices, nodes, f"{devices} x {prof.name} on {nodes} node{'s' if nodes > 1 else ''} ({seen})"


def _pick() -> str:
    return (
        f"set plan.hardware to one of {', '.join(DATASHEETS)} or to a `dhp bench ops --json` file measured on "
        f"the cluster"
    )


def _workload(cfg: Config, mc: Any, nodes: int) -> tuple[list[dict] | None, Any, str]:
    """(the mix of plan.data_profile or None, the one-size workload, what the ranking is of): without a profile
    one sample of the config's own sizes, an image of data.max_pixels and data.max_seq_len tokens in all."""
    from dhp.models.planning.length_mix import load_samples
    from dhp.models.planning.time_model import Workload

    mix = None
    if cfg.plan.data_profile:
        try:
            mix = load_samples(cfg.plan.data_profile)
        except ConfigError as e:
            raise ConfigError(str(e).replace("--data-profile ", "plan.data_profile=", 1)) from None
    side = math.isqrt(cfg.data.max_pixels)
    image = Workload.of(mc.vision_config, images=[(side, side)], nodes=nodes)
    vision_tokens = image.sample_tokens - image.text_tokens
    w = dataclasses.replace(image, text_tokens=max(1, cfg.data.max_seq_len - vision_tokens))
    if mix is not None:
        return mix, w, f"the length mix of {cfg.plan.data_profile} ({len(mix)} samples)"
    return None, w, f"samples of {w.image_patches} patches + {w.text_tokens} text tokens (data.max_pixels, max_seq_len)"


def _why(rows: list[dict[str, Any]], prof: Profile) -> list[str]:
    """Why #1 is first: its predicted step in parts against the fastest layout whose pools differ (the rows in
    between differ in pipelining, micro-batch or recomputation only), and how many rows tie with it."""
    first, device = rows[0], "GPU" if prof.kind == "gpu" else "rank"
    ties = sum(1 for r in rows[1:] if math.isclose(r["step_s"], first["step_s"], rel_tol=1e-9))
    same = "#2" if ties == 1 else f"#2-#{ties + 1}"
    tied = f"; {same} predict{'s' if ties == 1 else ''} the same step and the search's order keeps #1" if ties else ""
    at = next((i for i, r in enumerate(rows) if _pools(r["config"]) != _pools(first["config"])), 0)
    if not at:
        return [f"chosen #1: {first['layout']}, no other pool layout fits{tied}", f"#1: {_split(first, device)}"]
    other = rows[at]
    return [
        f"chosen #1: {first['layout']}, a predicted step of {first['step_s']:.3f} s{tied}",
        f"the fastest other pools, #{at + 1} ({other['layout']}), take {other['step_s']:.3f} s "
        f"({other['step_s'] / first['step_s']:.2f}x); #1 / #{at + 1}: {_split(first, device, other)}",
    ]


def _pools(cfg: Config) -> tuple:
    """What the layout's pools are (their parallelism, degree, actors and placement), less its levers."""
    return tuple(value_at(cfg, k) for k in LAYOUT_KEYS)


def _split(r: dict[str, Any], device: str, other: dict[str, Any] | None = None) -> str:
    """A prediction's step in parts (the simulated micro-batches, their pipeline bubble included, then the gradient
    sync and optimizer), each pool's busy seconds on one rank and memory per device; with `other`, both values."""

    def both(key: str, fmt: str, of: Any = lambda x, k: x[k]) -> str:
        return format(of(r, key), fmt) + (" / " + format(of(other, key), fmt) if other else "")

    def busy(x: dict[str, Any], stage: str) -> float:
        return sum(v for k, v in x["parts_s"].items() if k.startswith(f"{stage}."))

    return (
        f"step = micro-batches {both('makespan_s', '.3f')} s (pipeline bubble {both('bubble_s', '.3f')} s) + "
        f"grad sync and optimizer {both('tail_s', '.3f', lambda x, k: sum(x[k].values()))} s; one rank busy: "
        f"vision {both('vision', '.3f', busy)} s, text {both('text', '.3f', busy)} s; "
        f"{both('memory_per_device_gib', '.1f')} GiB per {device}"
    )
