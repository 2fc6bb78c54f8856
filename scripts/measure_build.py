"""Peak host memory and time of building one rank's part of a stage, at any released size, in this process.

    python -m dhp.scripts.measure_build --model qwen2_5_vl_3b --stage text --layout tensor --degree 4 \
        [--rank 0] [--path CHECKPOINT] [--precision fp32] [--random-init exact|per_part]

Runs what a stage worker's setup runs (models/stage_build.py: meta build, precision, layout, allocation,
then its checkpoint slices from `--path` or its part of the seeded init), as rank `--rank` of a pool of
`--degree` ranks whose other members are a fake process group (torch's `fake` backend: collectives are
no-ops, nothing else runs). Prints one JSON row with the fields of `dhp bench memory`: model, stage, layout,
degree, precision, held_bytes (the rank's tensors), largest_tensor_bytes, peak_rss_bytes (ru_maxrss of this
process: interpreter, torch and transformers included), build_s. Run it in a fresh process per row: peak
RSS only grows. `--whole` builds the whole stage in fp32 instead (the old pattern, for comparison). `--random-init`
is `model.random_init` (models/weights/random_init.py): `per_part` draws only the rank's part, here on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time


def measure(
    model: str,
    stage: str,
    layout: str,
    degree: int,
    rank: int = 0,
    whole: bool = False,
    path: str | None = None,
    precision: str = "fp32",
    init: str = "exact",
) -> dict:
    import torch

    from dhp.models.architectures import architecture_config
    from dhp.models.family import family_of
    from dhp.models.parallel.layouts import layout_class
    from dhp.models.precision import precision_of
    from dhp.models.stage_build import build_stage
    from dhp.models.weights.random_init import random_init

    torch.set_num_threads(1)
    config = architecture_config(model)
    cls = family_of(config).stage_module_class(stage)  # the model family's stage module
    lay = layout_class(stage, layout).of_size(stage, degree, config)  # zero3: a pool of `degree` ranks
    start = time.perf_counter()
    if whole:
        torch.manual_seed(0)
        module = cls(config)
    else:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from dhp.models.parallel.layout import pool_ranks

        dist.init_process_group("fake", rank=rank, world_size=degree, store=FakeStore())
        ranks = pool_ranks(rank, degree, degree, torch.device("cpu"))
        module, _ = build_stage(
            lambda: cls(config), lay, ranks, precision_of(precision), seed=0, path=path, init=random_init(init)
        )
    build_s = time.perf_counter() - start
    seen, held = set(), 0
    for t in module.state_dict().values():  # tied tensors once; a DTensor (ZeRO-3) by its local rows
        t = getattr(t, "_local_tensor", t)
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held += t.numel() * t.element_size()
    shapes = {n: t.shape for n, t in module.state_dict().items()}
    return dict(
        model=model,
        stage=stage,
        layout=layout,
        degree=degree,
        precision="fp32" if whole else precision,
        rank=rank,
        whole=whole,
        loaded=bool(path),
        random_init=None if path or whole else init,
        held_bytes=held,
        largest_tensor_bytes=max(math.prod(s) for s in shapes.values()) * 4,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        build_s=round(build_s, 2),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dhp.scripts.measure_build", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2_5_vl_3b", help="a released shape (models/architectures.py)")
    p.add_argument("--stage", choices=("vision", "text"), default="text", help="which stage one rank builds")
    p.add_argument("--layout", default="tensor", help="none | sequence | tensor | zero3")
    p.add_argument("--degree", type=int, default=4, help="model-parallel degree (zero3: pool size)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose share is built (default 0)")
    p.add_argument("--whole", action="store_true", help="build the whole stage in fp32 (the old pattern)")
    p.add_argument("--path", default=None, help="load from this HF checkpoint dir instead of the seeded init")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 (models/precision.py)")
    p.add_argument(
        "--random-init",
        default="exact",
        choices=("exact", "per_part"),
        help="model.random_init without --path (models/weights/random_init.py; default exact)",
    )
    args = p.parse_args(argv)
    row = measure(
        args.model,
        args.stage,
        args.layout,
        args.degree,
        args.rank,
        args.whole,
        args.path,
        args.precision,
        args.random_init,
    )
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
