"""Samples of one global batch -> micro-batches even in predicted cost, within the token budget.

`packing.pack` groups by tokens only: a micro-batch of one 16x-larger image and one of a few small ones cost
the same budget, yet the vision pool spends far longer on the first. Here each sample has a cost (text tokens
plus patches, `sample_cost`) and the samples are dealt to as many micro-batches as `pack` makes, the costliest
first to the cheapest micro-batch it still fits in (LPT under the budget); a sample that fits in none opens a
new one. Where that leaves a costlier most-loaded micro-batch than `pack`'s, `pack`'s grouping is kept. Only
the grouping inside the global batch changes: the same samples, each once, so the data position (the loader's
state) is what it was.

The micro-batches then go in the order that shortens the pipeline's fill and drain (`pipeline_order`): the text
pool waits for the first one's vision forward before it starts, and the step ends with the last one's vision
backward after the text pool is done, so the two with the fewest patches go at the ends. Both ends are then split
(`split_ends`): the samples with the fewest patches, about a quarter of an end's patches, stand alone outermost.
"""

from __future__ import annotations

from typing import Any

from dhp.dataflow.packing import pack

# One vision patch against one text token. A proxy: the encoder runs each patch as a token before the 2x2
# merge, and the merged tokens are already in the text count. The one place the weight is chosen.
PATCH_WEIGHT = 1.0


def sample_cost(tokens: int, patches: int, patch_weight: float = PATCH_WEIGHT) -> float:
    """A sample's predicted cost in token units: its text tokens plus its patches weighted."""
    return tokens + patch_weight * patches


def text_cost(meta: Any, balanced: bool = False) -> float:
    """What a micro-batch (its `MicroBatchMeta`) weighs when `routing.balance_text` deals micro-batches to the text
    replicas: its padded tokens (the decoder's work), or with `balanced` (`data.balance`) the same predicted cost
    the loader grouped by, `sample_cost` of its padded tokens and patches."""
    return sample_cost(meta.padded_tokens, meta.patches) if balanced else meta.padded_tokens


def _fits(group: list[int], i: int, lengths: list[int], budget: int, packed: bool) -> bool:
    members = [lengths[j] for j in group] + [lengths[i]]
    return (sum(members) if packed else len(members) * max(members)) <= budget


def balance_groups(lengths: list[int], costs: list[float], budget: int, packed: bool = False) -> list[list[int]]:
    """Indices grouped as `pack` would count them (each group within `budget`: padded len x max length,
    packed the sum), with the groups' summed `costs` as even as LPT makes them. Every index appears once."""
    if len(lengths) != len(costs):
        raise ValueError(f"{len(lengths)} lengths but {len(costs)} costs")
    loaded = pack(lengths, budget, packed)  # the token grouping: how many groups, and the fallback below
    groups: list[list[int]] = [[] for _ in loaded]
    load = [0.0] * len(loaded)
    for i in sorted(range(len(lengths)), key=lambda i: (-costs[i], -lengths[i], i)):
        room = [g for g in range(len(groups)) if _fits(groups[g], i, lengths, budget, packed)]
        if not room:
            groups.append([])
            load.append(0.0)
            room = [len(groups) - 1]
        g = min(room, key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += costs[i]
    balanced = [sorted(g) for g in groups if g]
    # LPT under a budget can open more groups or do worse than the token grouping: keep the better of the two
    return min((balanced, loaded), key=lambda gs: max((sum(costs[i] for i in g) for g in gs), default=0.0))


def pipeline_order(groups: list[list[int]], patches: list[int]) -> list[list[int]]:
    """`groups` reordered: the one with the fewest patches last (its vision backward is the step's drain, about
    twice a forward), the one with the next fewest first (its vision forward is the fill), the others between in
    their order. Ties keep the earlier group first. Fewer than three groups keep their order."""
    if len(groups) < 3:
        return list(groups)
    cheapest = sorted(range(len(groups)), key=lambda g: (sum(patches[i] for i in groups[g]), g))
    last, first = cheapest[0], cheapest[1]
    middle = [g for g in range(len(groups)) if g not in (first, last)]
    return [groups[g] for g in [first, *middle, last]]


# The share of an end micro-batch's patches split off to stand alone at the very end: small enough that the
# fill and drain are a fraction of one micro-batch, and at least one sample.
END_SHARE = 0.25


def _split_smallest(group: list[int], patches: list[int], share: float = END_SHARE) -> tuple[list[int], list[int]]:
    """`group` in two: its samples with the fewest patches, up to `share` of the group's patches (at least one),
    and the rest, each in the group's order."""
    small: list[int] = []
    for i in sorted(group, key=lambda i: (patches[i], i)):
        if small and sum(patches[j] for j in small) + patches[i] > share * sum(patches[j] for j in group):
            break
        small.append(i)
    return [i for i in group if i in small], [i for i in group if i not in small]


def split_ends(groups: list[list[int]], patches: list[int]) -> list[list[int]]:
    """`groups` with their first and last split (`_split_smallest`), the small part outermost: the fill and the
    drain shrink to a fraction of a micro-batch, for one more micro-batch at each end. A group of one sample,
    and fewer than three groups, stay whole."""
    if len(groups) < 3:
        return list(groups)
    head, *middle, tail = groups
    head_parts = [p for p in _split_smallest(head, patches) if p]
    tail_parts = [p for p in reversed(_split_smallest(tail, patches)) if p]
    return [*head_parts, *middle, *tail_parts]


def micro_batches(
    lengths: list[int], patches: list[int], budget: int, packed: bool = False, balanced: bool = False
) -> list[list[int]]:
    """The micro-batches a loader makes of one global batch's samples (`lengths` tokens, `patches` vision
    patches each): `pack`'s token grouping, or with `balanced` (`data.balance`) `balance_groups` by
    `sample_cost`, in `pipeline_order`, with `split_ends`."""
    if not balanced:
        return pack(lengths, budget, packed)
    costs = [sample_cost(t, p) for t, p in zip(lengths, patches)]
    return split_ends(pipeline_order(balance_groups(lengths, costs, budget, packed), patches), patches)
