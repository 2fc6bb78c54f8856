"""dataflow/balance.py: samples dealt to micro-batches by predicted cost keep every sample once, keep the token
budget, and leave the costliest micro-batch no costlier than `pack`'s on a long-tailed mix; the loader's
`next_batch` with `data.balance` groups so, at the same data position; a run with it trains the same samples to
the same losses (the one test here on the shared Ray)."""

from __future__ import annotations

import random

import pytest

from dhp.dataflow.balance import balance_groups, micro_batches, pipeline_order, sample_cost, split_ends
from dhp.dataflow.packing import pack
from dhp.stages import step_logs


def long_tail(seed: int, n: int) -> tuple[list[int], list[float]]:
    """Small images (64-400 patches) and one in eight 8-16x larger; text tokens = merged patches + caption."""
    rng = random.Random(seed)
    lengths, costs = [], []
    for _ in range(n):
        patches = rng.randint(64, 400) * (rng.randint(8, 16) if rng.random() < 0.125 else 1)
        tokens = patches // 4 + rng.randint(10, 60)
        lengths.append(tokens)
        costs.append(sample_cost(tokens, patches))
    return lengths, costs


def fits(group: list[int], lengths: list[int], budget: int, packed: bool) -> bool:
    ls = [lengths[i] for i in group]
    return (sum(ls) if packed else len(ls) * max(ls)) <= budget


def group_costs(groups: list[list[int]], costs: list[float]) -> list[float]:
    return [sum(costs[i] for i in g) for g in groups]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_every_sample_once_within_the_budget(seed, packed):
    lengths, costs = long_tail(seed, 48)
    budget = 4 * max(lengths)
    groups = balance_groups(lengths, costs, budget, packed)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(fits(g, lengths, budget, packed) for g in groups)


@pytest.mark.parametrize("packed", [False, True])
def test_costliest_micro_batch_no_worse_than_pack(packed):
    worse, better = 0, 0
    for seed in range(20):
        lengths, costs = long_tail(seed, 48)
        budget = 4 * max(lengths)
        old = max(group_costs(pack(lengths, budget, packed), costs))
        new = max(group_costs(balance_groups(lengths, costs, budget, packed), costs))
        worse += new > old
        better += new < old
    assert worse == 0 and better > 0, (worse, better)


def test_mismatched_costs_are_refused():
    with pytest.raises(ValueError, match="2 lengths but 1 costs"):
        balance_groups([5, 6], [1.0], 100)


def test_pipeline_order_puts_the_fewest_patches_at_the_ends():
    patches = [50, 10, 40, 30, 20]
    groups = [[0], [1], [2], [3], [4]]
    # fewest (10) last, next fewest (20) first, the rest in their order
    assert pipeline_order(groups, patches) == [[4], [0], [2], [3], [1]]
    assert pipeline_order([[0], [1]], patches) == [[0], [1]]
    assert pipeline_order([[0, 1], [2], [3, 4]], patches) == [[3, 4], [0, 1], [2]]


def test_split_ends_stands_the_smallest_quarter_of_each_end_alone_outermost():
    patches = [40, 10, 30, 20, 50, 5, 60, 70, 25]
    groups = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    # head 80 patches: 10 alone (a quarter is 20); tail 160: 5 and 25 (a quarter is 40), the rest before them
    assert split_ends(groups, patches) == [[1], [0, 2], [3, 4], [6, 7], [5, 8]]
    assert split_ends([[0], [1, 2], [3]], patches) == [[0], [1, 2], [3]]
    assert split_ends(groups[:2], patches) == groups[:2]


@pytest.mark.parametrize("packed", [False, True])
def test_balanced_micro_batches_keep_every_sample_once_within_the_budget_with_small_ends(packed):
    for seed in range(6):
        lengths, costs = long_tail(seed, 48)
        patches = [round(c - t) for c, t in zip(costs, lengths)]
        budget = 4 * max(lengths)
        groups = micro_batches(lengths, patches, budget, packed, balanced=True)
        assert sorted(i for g in groups for i in g) == list(range(48))
        assert all(fits(g, lengths, budget, packed) for g in groups)
        balanced = balance_groups(lengths, costs, budget, packed)
        if len(balanced) >= 3:
            assert len(groups) <= len(balanced) + 2
            middle = sorted(sum(patches[i] for i in g) for g in balanced)[2:]
            assert sum(patches[i] for i in groups[0]) < min(middle)
            assert sum(patches[i] for i in groups[-1]) < min(middle)


def encoded_row(n: int, tokens: int, patches: int) -> dict:
    """A preprocessed row as the stream hands it to `next_batch`: one image of `patches` patches (a 1 x 2 x
    patches/2 grid), `tokens` text tokens whose second half carries labels."""
    import numpy as np

    from dhp.dataflow.preprocess import encode_sample

    ids = np.arange(tokens, dtype=np.int64) % 1000 + n
    labels = np.where(np.arange(tokens) >= tokens // 2, ids, -100)
    sample = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": np.tile(np.arange(tokens, dtype=np.int64), (3, 1)),
        "pixel_values": np.zeros((patches, 1176), dtype=np.float32),
        "image_grid_thw": np.array([[1, 2, patches // 2]], dtype=np.int64),
    }
    return {"source": f"mix.jsonl:{n}", "part": 0, "error": "", "detail": "", "sample": encode_sample(sample)}


@pytest.mark.parametrize("packed", [False, True])
def test_next_batch_balanced_micro_batches_cost_less_at_the_top(monkeypatch, packed):
    """The loader object itself (no actor, `ray.put` kept in-process): the same long-tailed global batch with
    `balance` off and on. On: the costliest micro-batch costs less, every sample is in it once, and the position
    (`state`) and sample ids are the same as off."""
    import ray

    from dhp.dataflow.loader import BatchLoader
    from dhp.dataflow.preprocess import PreprocessSettings
    from dhp.models.architectures import architecture_config

    monkeypatch.setattr(ray, "put", lambda value: value)
    lengths, costs = long_tail(3, 32)
    patches = [round((c - t) / 2) * 2 for t, c in zip(lengths, costs)]  # even: the grid is 1 x 2 x patches/2
    settings = PreprocessSettings("", min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=4096)
    batches = {}
    for balance in (False, True):
        loader = BatchLoader(
            ["mix.jsonl"],
            settings,
            architecture_config("tiny"),
            global_batch_size=len(lengths),
            microbatch_tokens=4 * max(lengths),
            repeat=False,
            packing=packed,
            balance=balance,
        )
        loader.rows = iter([encoded_row(n, t, p) for n, (t, p) in enumerate(zip(lengths, patches))])
        batches[balance] = loader.next_batch()
    off, on = batches[False], batches[True]

    def top(batch) -> float:
        return max(sample_cost(mb.meta.tokens, mb.meta.patches) for mb in batch.microbatches)

    assert top(on) < 0.9 * top(off), (top(on), top(off))
    assert on.ids == off.ids and on.state == off.state and on.label_tokens == off.label_tokens
    if not packed:  # each sample's first token is its index n: every sample once
        assert sorted(int(row[0]) for mb in on.microbatches for row in mb.text["input_ids"]) == list(range(32))
    assert sum(mb.meta.samples for mb in on.microbatches) == len(lengths)
    for mb in on.microbatches:
        assert mb.meta.padded_tokens <= 4 * max(lengths)


def write_mix(root, records: int) -> None:
    """`records` JSONL records, in each 8 two 224 px images (256 patches) and six 56 px ones (16 patches)."""
    import json

    from tests.conftest import write_image

    lines = []
    for i in range(records):
        side = 224 if i % 8 < 2 else 56
        write_image(root / f"images/{i}.png", (side, side), seed=i)
        turns = [{"from": "human", "value": f"<image>\nWhat is {i}?"}, {"from": "gpt", "value": f"Picture {i}."}]
        lines.append(json.dumps({"id": f"m{i}", "image": f"images/{i}.png", "conversations": turns}))
    (root / "mix.jsonl").write_text("\n".join(lines) + "\n")


def test_balanced_run_trains_the_same_samples_to_the_same_losses(trainers, tmp_path):
    """Two steps of 8 on the mix, file order, `data.balance` off and on: the same samples per step, each once,
    and the same losses (the grouping only reorders the sum: each loss is scaled by the global batch's label
    tokens). The mix does group differently: 2 x 224 px share a micro-batch off, are apart on."""
    import json

    from dhp.dataflow.balance import micro_batches
    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.models.architectures import architecture_config
    from dhp.stages.config import load_config
    from dhp.stages.driver import train

    write_mix(tmp_path, 16)
    budget = 200
    pre = Preprocessor(PreprocessSettings(str(tmp_path), 56 * 56, 224 * 224, budget), architecture_config("tiny"))
    lines = (tmp_path / "mix.jsonl").read_text().splitlines()[:8]
    first = [decode_sample(pre({"source": "mix", "record": line})["sample"]) for line in lines]
    lengths, patches = [s["input_ids"].shape[0] for s in first], [s["pixel_values"].shape[0] for s in first]
    assert micro_batches(lengths, patches, budget) != micro_batches(lengths, patches, budget, balanced=True)

    runs = {}
    for balance in ("false", "true"):
        cfg = load_config(
            "tiny",
            [
                f"output.dir={tmp_path}/runs",
                f"output.name=balance-{balance}",
                "output.save_final_checkpoint=false",
                "output.tensorboard=false",
                f"data.train={tmp_path}/mix.jsonl",
                "data.shuffle_seed=null",
                f"data.microbatch_tokens={budget}",
                f"data.max_seq_len={budget}",
                f"data.balance={balance}",
                "training.steps=2",
                "training.global_batch_size=8",
                "training.eval_every=0",
                "training.keep_last=0",
                *(f"{s}.{k}" for s in ("vision", "text") for k in ("parallelism=none", "degree=1", "num_actors=1")),
            ],
        )
        train(cfg, trainers=trainers)
        run = tmp_path / "runs" / f"balance-{balance}"
        samples = step_logs.read(run, "samples")
        metrics = step_logs.read(run)
        runs[balance] = ({r["step"]: sorted(map(json.dumps, r["ids"])) for r in samples}, [m["loss"] for m in metrics])
    (ids_off, loss_off), (ids_on, loss_on) = runs["false"], runs["true"]
    assert ids_on == ids_off and sorted(ids_on) == [1, 2]
    trained = [i for step in ids_on.values() for i in step]
    assert len(trained) == 16 and len(set(trained)) == 16
    assert len(loss_on) == len(loss_off) == 2 and loss_on == pytest.approx(loss_off, rel=1e-4)
