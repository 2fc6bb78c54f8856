"""`dhp plan --time` (one configuration's predicted step) and `dhp plan --search` (the best layouts).

    dhp plan --time --gpu h100-sxm --gpus 8 --image-patches 16384 [--text-tokens 512] [--nodes 1]
             [--gpu-set FIELD=VALUE ...] [--config C] [KEY=VALUE ...] [--json PATH]
    dhp plan --search --gpu h100-sxm --gpus 8 [--image-patches P] [--top 10] [--out best.yaml] [--json PATH]
    dhp plan --time|--search ... --data-profile PROFILE.json   (the length mix `dhp data profile --out` wrote)
    dhp plan --time|--search ... --video FRAMESxHxW [--image-patches P]   (a sample with a video: plan_workload.py)

`--gpu` is a datasheet name (models/planning/hardware.py) or the JSON `dhp bench ops` wrote; `--gpu-set` replaces a
profile field (e.g. `intra_gbps=300`). The layout is the config's, with what the GPU count implies filled in
(models/planning/layout_search.py `prepare`: GPUs per actor, bf16 compute, the GPU's memory, a micro-batch of
at least one sample); `--search` ranks every layout with `layout_search.search`, the function
`dhp train plan.layout=auto` asks too.

With `--data-profile` the step is a global batch of the profile's samples (models/planning/length_mix.py says
which and how it is split), each micro-batch costed at its own sizes, and memory planned for the largest one.
`--search` then ranks the layouts by that prediction; its micro-batch lever is 1/2/4 median samples of tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dhp.models.planning.hardware import Profile, profile

# The search lives in models/planning/ so that `dhp train plan.layout=auto` asks it without importing a script;
# `dhp plan` uses it from here, and the benches and tests that time its predictions import it from here too
from dhp.models.planning.layout_search import (  # noqa: F401
    predict,
    prepare,
    search,
    search_table,
)
from dhp.scripts.plan_workload import describe as describe_visuals
from dhp.scripts.plan_workload import workload
from dhp.scripts.results import write_json
from dhp.stages.config import ConfigError


def workload_line(r: dict[str, Any]) -> str:
    """What the prediction is of: one size, or the mix (its samples, p50/p99 per sample, the batch drawn)."""
    if "mix" not in r:
        visuals = describe_visuals(r.get("visuals", [[1, r["image_patches"]]]))
        return (
            f"workload: {visuals} + {r['text_tokens']} text tokens per sample, "
            f"{r['samples_per_microbatch']} per micro-batch, global batch {r['global_batch_size']}, "
            f"{r['microbatches_per_text_replica']} micro-batches per text replica; profile {r['profile']}"
        )
    n_mb = r["microbatches"]
    return (
        f"{mix_line(r['mix'])}, in {n_mb} micro-batch{'es' if n_mb > 1 else ''} (at most "
        f"{r['microbatches_per_text_replica']} per text replica); profile {r['profile']}"
    )


def mix_line(m: dict[str, Any]) -> str:
    """The mix a prediction used: its samples, p50/p99 per sample, the global batch drawn from it."""
    p, t, n = m["patches_per_sample"], m["text_tokens_per_sample"], m["tokens_per_sample"]
    return (
        f"workload: the length mix of {m['samples']} samples (per sample p50/p99: {p['p50']:g}/{p['p99']:g} "
        f"patches, {t['p50']:g}/{t['p99']:g} text tokens, {n['p50']:g}/{n['p99']:g} tokens); global batch "
        f"{m['batch_samples']} of them at {m['draw']}"
    )


def table(r: dict[str, Any]) -> str:
    mixed = "mix" in r
    lines = [
        f"{r['layout']}",
        workload_line(r),
        "",
        "| part | seconds per step (one rank) |",
        "|---|---:|",
    ]
    for part, sec in sorted(r["parts_s"].items(), key=lambda kv: -kv[1]):
        if sec > 0:
            lines.append(f"| {part} | {sec:.4f} |")
    lines += [
        "",
        ("largest micro-batch's calls: " if mixed else "micro-batch calls: ")
        + f"{', '.join(f'{k} {v * 1e3:.1f} ms' for k, v in r['per_call_s'].items())}",
        f"simulated micro-batch makespan {r['makespan_s']:.3f} s (pipeline bubble {r['bubble_s']:.3f} s on "
        f"the busiest device) + gradient sync {r['tail_s']['grad_sync']:.3f} s + optimizer "
        f"{r['tail_s']['optimizer']:.3f} s",
        f"step {r['step_s']:.3f} s; {r['vision_tokens_per_s']:.0f} vision tokens/s; memory "
        f"{r['memory_per_device_gib']:.1f} GiB per device ({'fits' if r['fits'] else 'DOES NOT FIT'}; "
        f"{r['memory_source']})"
        + (f", planned for the mix's largest micro-batch ({r['memory_patches']} patches)" if mixed else ""),
    ]
    return "\n".join(lines)


def _profile(args: Any) -> Profile:
    overrides = {}
    for item in args.gpu_set or []:
        key, _, value = item.partition("=")
        overrides[key] = float(value)
    try:
        prof = profile(args.gpu, **overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.nodes > 1:
        prof.devices_per_node = math.ceil((args.gpus or prof.devices_per_node) / args.nodes)
    return prof


def _json_row(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "config"}


def main(args: Any) -> int:
    from dhp.models.parallel.checks import check_layout
    from dhp.models.planning.length_mix import load_samples, longest
    from dhp.stages.config import load_config, save_config
    from dhp.stages.trainer import model_config_of

    if not args.gpu:
        raise ConfigError("--time and --search need --gpu NAME (h100-sxm, h200, a100-80gb, l40s) or a profile JSON")
    cfg = load_config(args.config, args.overrides)
    mc = model_config_of(cfg)
    prof = _profile(args)
    w = workload(args, cfg, mc)
    mix = load_samples(args.data_profile) if args.data_profile else None
    least = None if mix is None else longest(mix)
    if args.search:
        if not args.gpus:
            raise ConfigError("--search needs --gpus N")
        rows = search(cfg, mc, prof, args.gpus, w, mix)
        what = f"{describe_visuals(w.shapes)} per sample" if mix is None else f"the mix of {args.data_profile}"
        if not rows:
            print(f"no layout of {args.gpus} x {prof.name} fits {what}")
            return 1
        if mix is not None:
            print(f"{mix_line(rows[0]['mix'])}; profile {prof.name}; ranked by the mixed prediction\n")
        print(search_table(rows, args.top))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_config(rows[0]["config"], out)
        print(f"\nbest layout written to {out} (dhp train --config {out})")
        if args.json:
            write_json(args.json, [_json_row(r) for r in rows[: args.top]], default=str)
        return 0
    check_layout(cfg, mc)
    cfg = prepare(cfg, prof, args.gpus, w, least)
    r = predict(cfg, mc, prof, w, mix)
    print(table(r))
    if args.json:
        write_json(args.json, _json_row(r), default=str)
    return 0 if r["fits"] else 1
