"""What `dhp bench peers` does the same way on every system: the image a probe trains, the ladder of image
sides the memory search climbs, and the search itself (the peer's ranks import this too)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIDE_UNIT = 28  # px: 2 x 2 patches of 14 merge into one token, so an image side is a multiple of 28


def patches(side: int) -> int:
    """ViT patches (= vision tokens before the 2 x 2 merge) of one side x side px image."""
    return (side // 14) ** 2


def ladder(first: int, last: int) -> list[int]:
    """Image sides from `first` to `last` px, each ~sqrt(2) times the last (patches double), multiples of 28."""
    sides, side = [], first
    while side <= last:
        sides.append(side)
        side = max(side + SIDE_UNIT, round(side * 2**0.5 / SIDE_UNIT) * SIDE_UNIT)
    return sides


def image_sample(config: Any, side: int, root: Path) -> dict:
    """One preprocessed one-image conversation (dhp's Preprocessor, `decode_sample` form) of a seeded random
    side x side px image: what every system trains at that size."""
    import torch
    from PIL import Image

    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample

    rng = torch.Generator().manual_seed(side)
    pixels = torch.randint(0, 256, (side, side, 3), generator=rng, dtype=torch.uint8).numpy()
    root.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(root / f"{side}.png")
    record = {
        "image": f"{side}.png",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe it."},
            {"from": "gpt", "value": "Noise in many colours."},
        ],
    }
    settings = PreprocessSettings(
        str(root), min_pixels=56 * 56, max_pixels=side * side, max_seq_len=patches(side) // 4 + 256
    )
    out = Preprocessor(settings, config)({"source": "probe", "record": json.dumps(record)})
    assert not out["error"], out["error"]
    return decode_sample(out["sample"])


def largest_fitting(fits: Callable[[int], bool], sides: list[int], refine: int = 2) -> int | None:
    """The largest side that `fits`: climb `sides` (ascending) to the first that does not fit, then halve the
    gap to the last one that did `refine` times (in SIDE_UNIT steps). None when even the first does not fit;
    the last side when all do (the search's ceiling: the result is then a lower bound)."""
    good = None
    for side in sides:
        if not fits(side):
            bad = side
            break
        good = side
    else:
        return good
    if good is None:
        return None
    for _ in range(refine):
        mid = (good + bad) // 2 // SIDE_UNIT * SIDE_UNIT
        if mid in (good, bad):
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good
