"""A step of the real length mix: the samples of a `dhp data profile` (dataflow/length_profile.py) as one
global batch, split the way a run splits it, for `dhp plan --time/--search --data-profile FILE`.

The global batch: `training.global_batch_size` samples at evenly spaced quantiles of the profile's samples
ordered by sequence length, both ends included (the shortest and the longest sample are always in it; a
batch larger than the profile takes samples more than once). Quantiles rather than a seeded draw: the
prediction is deterministic without a seed to choose, and a batch of 8 from a long tail drawn at random
sometimes holds the tail and sometimes not; the quantiles hold the whole distribution in every batch.

The split, as a run makes it: each text replica's loader takes `global_batch_size // text replicas` samples
(the batch's samples dealt in turn, so each replica gets the same mix) and `packing.pack` groups them into
micro-batches of at most `data.microbatch_tokens` (padded: samples x longest, sorted by length; packed with
`data.packing`: the sum of the lengths); with `data.balance`, `balance.balance_groups` by tokens and patches.
Each micro-batch is a `MicroBatchShape` of its own images and lengths, and `time_model.step_time_of` costs and
schedules those.

A visual is its patch count and its temporal patches (the profile's `frames`): a video's attention is counted
per temporal patch where the family's encoder attends so (`ModelFamily.frame_attention`, both families); a
profile written before it kept `frames` reads as every visual one temporal patch, which overstates a video's
attention. A sample's text tokens are what the real preprocessing wrote, a Qwen3-VL video's timestamps included.

Memory is planned for the largest micro-batch: the most vision patches of any micro-batch of the batch, and
at least the profile's sample with the most patches (a micro-batch holds at least one sample).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dhp.errors import ConfigError
from dhp.models.planning.time_model import MicroBatchShape, step_time_of


def load_samples(path: str) -> list[dict[str, Any]]:
    """The `per_sample` list of a `dhp data profile --out` JSON, checked: each with `patches` (a list of
    ints), `text_tokens`, `tokens` and, where the profile has them, `frames`. A missing or malformed file is a
    ConfigError of one line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data-profile {path}: no such file (write one with `dhp data profile --out FILE`)")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data-profile {path}: not a JSON file ({str(e).splitlines()[0]})") from None
    samples = data.get("per_sample") if isinstance(data, dict) else None
    if not isinstance(samples, list):
        raise ConfigError(f"--data-profile {path}: no `per_sample` list (is it a `dhp data profile --out` file?)")
    try:
        return check_samples(samples)
    except ValueError as e:
        raise ConfigError(f"--data-profile {path}: {e}") from None


def check_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`samples` as plain dicts of ints, or ValueError saying which sample is wrong and why. `frames` (temporal
    patches per visual) is optional: a profile without it has one per visual."""
    if not samples:
        raise ValueError("no samples (every record was skipped?)")
    out = []
    for i, s in enumerate(samples):
        try:
            patches = [int(n) for n in s["patches"]]
            text, tokens = int(s["text_tokens"]), int(s["tokens"])
            frames = [int(t) for t in s.get("frames", [1] * len(patches))]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"sample {i} needs patches (a list), text_tokens and tokens: {s!r:.80}") from None
        if min(patches, default=1) < 1 or text < 0 or tokens < 1:
            raise ValueError(f"sample {i} has a size below 1: {s!r:.80}")
        if len(frames) != len(patches) or any(t < 1 or n % t for n, t in zip(patches, frames)):
            raise ValueError(f"sample {i}'s frames do not divide its visuals' patches: {s!r:.80}")
        out.append({"patches": patches, "frames": frames, "text_tokens": text, "tokens": tokens})
    return out


def global_batch(samples: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` samples at evenly spaced quantiles of `samples` by sequence length, both ends included (module
    docstring); one sample: the median."""
    ordered = sorted(samples, key=lambda s: (s["tokens"], sum(s["patches"]), s["text_tokens"]))
    last = len(ordered) - 1
    if n == 1:
        return [ordered[last // 2]]
    return [ordered[round(i * last / (n - 1))] for i in range(n)]


def split(cfg: Any, batch: list[dict[str, Any]], replicas: int) -> list[list[MicroBatchShape]]:
    """Each text replica's micro-batches of `batch` (module docstring), in its loader's order."""
    from dhp.dataflow.balance import micro_batches

    per = max(1, len(batch) // replicas)
    out = []
    for r in range(replicas):
        mine = batch[r::replicas][:per]
        lengths, patches = [s["tokens"] for s in mine], [sum(s["patches"]) for s in mine]
        groups = micro_batches(lengths, patches, cfg.data.microbatch_tokens, cfg.data.packing, cfg.data.balance)
        out.append([shape([mine[i] for i in g], cfg.data.packing) for g in groups])
    return out


def shape(samples: list[dict[str, Any]], packed: bool) -> MicroBatchShape:
    """One micro-batch of these samples: their visuals in order (and the temporal patches of each), their
    lengths."""
    frames = tuple(t for s in samples for t in s.get("frames", [1] * len(s["patches"])))
    return MicroBatchShape(
        tuple(p for s in samples for p in s["patches"]),
        tuple(s["tokens"] for s in samples),
        tuple(s["text_tokens"] for s in samples),
        packed,
        frames if any(t > 1 for t in frames) else (),
    )


def longest(samples: list[dict[str, Any]]) -> int:
    """Tokens of the longest sample: the least `data.microbatch_tokens` that takes every sample."""
    return max(s["tokens"] for s in samples)


def mixed_step_time(cfg: Any, mc: Any, prof: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The predicted step of a global batch of `samples` (the profile's `per_sample` dicts: `patches`,
    `text_tokens`, `tokens`): `step_time_of`'s result, what memory must hold (`memory_patches`: the largest
    micro-batch's vision patches) and the mix it used (`mix`)."""
    from dhp.models.parallel.checks import replicas

    samples = check_samples(samples)
    dt = replicas(cfg, "text")
    if cfg.data.microbatch_tokens < longest(samples):
        raise ValueError(
            f"data.microbatch_tokens {cfg.data.microbatch_tokens} is below the longest sample of the mix "
            f"({longest(samples)} tokens)"
        )
    batch = global_batch(samples, dt * max(1, cfg.training.global_batch_size // dt))
    batches = split(cfg, batch, dt)
    result = step_time_of(cfg, mc, prof, batches)
    every = [mb for mbs in batches for mb in mbs]
    most = max(max(s["patches"], default=0) for s in samples)
    return {
        **result,
        "memory_patches": max(result["largest_microbatch_patches"], most),
        "microbatches": len(every),
        "mix": summary(samples, batch),
    }


def summary(samples: list[dict[str, Any]], batch: list[dict[str, Any]]) -> dict[str, Any]:
    """How many samples the mix has, the spread of patches and tokens per sample, and the batch drawn."""
    from dhp.dataflow.length_profile import spread

    return {
        "samples": len(samples),
        "batch_samples": len(batch),
        "draw": "quantiles by sequence length, both ends included",
        "patches_per_sample": spread([sum(s["patches"]) for s in samples]),
        "text_tokens_per_sample": spread([s["text_tokens"] for s in samples]),
        "tokens_per_sample": spread([s["tokens"] for s in samples]),
    }
