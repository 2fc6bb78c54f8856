"""Peak host memory and time of building one rank's part of a stage, at any released size, in this process.

    python -m dhp.scripts.measure_build --model qwen2_5_vl_3b --stage text --layout tensor --degree 4 [--rank 0]

Does what a stage worker does before its layout's hooks (models/materialize.py): build on `meta`, then
replay the seeded init one full tensor at a time and keep rank `--rank`'s part (the layout's slicer). Prints
one JSON row with the fields `dhp bench memory` will carry: model, stage, layout, degree, precision,
held_bytes (what the rank keeps), largest_tensor_bytes, peak_rss_bytes (ru_maxrss of this process:
interpreter, torch and transformers included), build_s. Run it in a fresh process per row: peak RSS
only grows. The same shape built whole (`--whole`) is today's pattern, for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time


def measure(model: str, stage: str, layout: str, degree: int, rank: int = 0, whole: bool = False) -> dict:
    import torch

    from dhp.models.architectures import architecture_config
    from dhp.models.layouts import layout_class
    from dhp.models.materialize import build_on_meta, replay
    from dhp.models.qwen2_5_vl import TextModel, VisionModel

    torch.set_num_threads(1)
    config = architecture_config(model)
    cls = TextModel if stage == "text" else VisionModel
    lay = layout_class(stage, layout).of_size(stage, degree, config)  # zero3: a pool of `degree` ranks
    start = time.perf_counter()
    torch.manual_seed(0)
    if whole:
        parts = cls(config).state_dict()
        shapes = {n: t.shape for n, t in parts.items()}
    else:
        meta, recipe = build_on_meta(lambda: cls(config))
        shapes = {n: t.shape for n, t in meta.state_dict().items()}
        torch.manual_seed(0)
        parts = replay(recipe, lay.slicer(rank, shapes))
    build_s = time.perf_counter() - start
    seen, held = set(), 0
    for t in parts.values():  # tied tensors once
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held += t.numel() * t.element_size()
    return dict(
        model=model, stage=stage, layout=layout, degree=degree, precision="fp32", rank=rank, whole=whole,
        held_bytes=held, largest_tensor_bytes=max(math.prod(s) for s in shapes.values()) * 4,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, build_s=round(build_s, 2),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dhp.scripts.measure_build", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2_5_vl_3b")
    p.add_argument("--stage", choices=("vision", "text"), default="text")
    p.add_argument("--layout", default="tensor", help="none | sequence | tensor | zero3")
    p.add_argument("--degree", type=int, default=4, help="model-parallel degree (zero3: pool size)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--whole", action="store_true", help="build the whole stage in fp32 (the old pattern)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.stage, args.layout, args.degree, args.rank, args.whole)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
