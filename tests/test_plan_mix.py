"""`dhp plan --time/--search --data-profile FILE`: predictions of the real length mix
(models/planning/length_mix.py). No wall-clock: a mixed prediction is compared with the one-size prediction of
the same model.
"""

from __future__ import annotations

import json

import pytest

from dhp.models.architectures import architecture_config
from dhp.models.parallel.checks import check_layout, replicas
from dhp.models.planning.hardware import datasheet, profile
from dhp.models.planning.length_mix import global_batch, longest, mixed_step_time, split
from dhp.models.planning.memory_plan import GIB, plan
from dhp.models.planning.time_model import Workload
from dhp.scripts.plan_time import predict, prepare, search
from dhp.stages.cli import main as cli_main
from dhp.stages.config import load_config
from tests.test_time_model import CPU_PROFILE


def _sample(patches: int, text: int) -> dict:
    return {"patches": [patches], "text_tokens": text, "tokens": patches // 4 + text}


def _tiny(*overrides: str, budget: int | None = None):
    """The tiny model, a global batch of 8; `budget`: data.microbatch_tokens (and max_seq_len)."""
    tokens = [f"data.microbatch_tokens={budget}", f"data.max_seq_len={budget}"] if budget else []
    cfg = load_config("tiny", ["model.name=tiny", "training.global_batch_size=8", *tokens, *overrides])
    return cfg, architecture_config("tiny", "sdpa")


# One size, 4 samples a micro-batch (a budget of 4 x 96 tokens): every layout kind, serial and pipelined,
# padded and packed, on a datasheet GPU and on the measured CPU profile
ONE_SIZE = [
    ("h100-sxm", 2, ["data.packing=false"]),
    ("h100-sxm", 2, ["data.packing=true"]),
    ("h100-sxm", 4, ["pipeline.placement=disjoint", "pipeline.max_in_flight=3"]),
    (
        "h100-sxm",
        4,
        ["vision.parallelism=zero3", "vision.degree=1", "vision.num_actors=4", "text.num_actors=4"],
    ),
    ("cpu", None, ["text.parallelism=none", "text.degree=1", "text.num_actors=2"]),
]


@pytest.mark.parametrize("gpu,gpus,overrides", ONE_SIZE)
def test_a_mix_of_one_size_predicts_the_one_size_step_exactly(gpu, gpus, overrides):
    prof = profile(str(CPU_PROFILE)) if gpu == "cpu" else datasheet(gpu)
    w = Workload(256, 32)
    cfg, mc = _tiny(*overrides, budget=4 * w.sample_tokens)
    check_layout(cfg, mc)
    cfg = prepare(cfg, prof, gpus, w)
    mix = [_sample(256, 32)] * 5
    one, mixed = predict(cfg, mc, prof, w), predict(cfg, mc, prof, w, mix)
    assert mixed["microbatches"] == 8 // 4
    for key in ("step_s", "makespan_s", "bubble_s", "tail_s", "per_call_s", "parts_s", "vision_tokens_per_s"):
        assert mixed[key] == one[key], key
    assert mixed["memory_per_device_gib"] == one["memory_per_device_gib"]
    assert mixed["memory_patches"] == one["memory_patches"] == 4 * 256


def _long_tail() -> list[dict]:
    """30 samples: most small images and short captions, a tail of large images and long text."""
    small = [_sample(p, t) for p in (192, 224, 256) for t in (24, 32, 40)] * 3  # 27
    return small + [_sample(2048, 120), _sample(3072, 200), _sample(4096, 300)]


def test_a_long_tail_costs_more_than_its_median_and_its_largest_microbatch_sets_memory():
    prof = datasheet("h100-sxm")
    mix = _long_tail()
    median = Workload(224, 32)
    # 16 median samples a micro-batch and a step of one micro-batch per text replica: the one-size step holds
    # the global batch exactly (it rounds a step up to whole micro-batches)
    budget = 16 * median.sample_tokens
    assert budget >= longest(mix)
    cfg, mc = _tiny("pipeline.placement=disjoint", budget=budget)
    cfg.training.global_batch_size = 16 * replicas(cfg, "text")
    check_layout(cfg, mc)
    cfg = prepare(cfg, prof, 4, median, longest(mix))
    one, mixed = predict(cfg, mc, prof, median), predict(cfg, mc, prof, median, mix)
    assert mixed["step_s"] >= one["step_s"]
    # The batch holds the tail (both ends of the quantiles), and memory is planned for the largest micro-batch
    batch = global_batch(mix, cfg.training.global_batch_size)
    assert batch[0]["tokens"] == min(s["tokens"] for s in mix) and batch[-1]["patches"] == [4096]
    micro = [mb for mbs in split(cfg, batch, replicas(cfg, "text")) for mb in mbs]
    assert mixed["memory_patches"] == max(mb.patches for mb in micro) >= 4096
    mem = plan(cfg, mc, prof.memory_gib, vision_patches=mixed["memory_patches"])
    assert mixed["memory_per_device_gib"] == mem["per_device"] / GIB
    # (disjoint pools: a device holds the larger rank, here the text one; the vision rank is the one that grows)
    at_median = plan(cfg, mc, prof.memory_gib, vision_patches=one["memory_patches"])
    assert mixed["memory_patches"] > one["memory_patches"]
    assert mem["ranks"]["vision"].activations > at_median["ranks"]["vision"].activations
    # Without its tail the same mix plans less memory and a shorter step
    body = predict(cfg, mc, prof, median, mix[:27])
    assert body["memory_patches"] < mixed["memory_patches"] and body["step_s"] < mixed["step_s"]


def test_the_mixed_step_takes_a_list_of_samples_and_refuses_a_budget_below_the_longest():
    prof = datasheet("h100-sxm")
    cfg, mc = _tiny(budget=512)
    cfg = prepare(cfg, prof, 2, Workload(256, 32))
    r = mixed_step_time(cfg, mc, prof, _long_tail()[:27])
    assert r["mix"]["samples"] == 27 and r["mix"]["batch_samples"] == 8 and r["step_s"] > 0
    with pytest.raises(ValueError, match="below the longest sample"):
        mixed_step_time(cfg, mc, prof, _long_tail())


def _write_profile(path, samples: list[dict]) -> str:
    path.write_text(json.dumps({"samples": len(samples), "per_sample": samples}))
    return str(path)


def test_plan_time_and_search_with_a_data_profile(tmp_path, capsys):
    prof_json = _write_profile(tmp_path / "mix.json", _long_tail())
    out = tmp_path / "plan.json"
    time = ["plan", "--time", "--gpu", "h100-sxm", "--gpus", "2", "--data-profile", prof_json]
    rc = cli_main([*time, "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "the length mix of 30 samples (per sample p50/p99: 224/4096 patches, 32/300 text tokens" in text
    assert "planned for the mix's largest micro-batch" in text
    row = json.loads(out.read_text())
    assert row["mix"]["samples"] == 30 and row["memory_patches"] >= 4096
    best = tmp_path / "best.yaml"
    rc = cli_main(
        ["plan", "--search", "--gpu", "h100-sxm", "--gpus", "2", "--data-profile", prof_json, "--out", str(best)]
    )
    assert rc == 0
    assert "ranked by the mixed prediction" in capsys.readouterr().out
    cfg, mc = _tiny()
    rows = search(cfg, mc, datasheet("h100-sxm"), 2, Workload(1024), _long_tail())
    rates = [r["vision_tokens_per_s"] for r in rows]
    assert rates and rates == sorted(rates, reverse=True) and all("mix" in r and r["fits"] for r in rows)
    assert load_config(str(best)).to_dict() == rows[0]["config"].to_dict()


@pytest.mark.parametrize(
    "content,why",
    [
        (None, "no such file"),
        ("{not json", "not a JSON file"),
        ('{"summary": {}}', "no `per_sample` list"),
        ('{"per_sample": []}', "no samples"),
        ('{"per_sample": [{"patches": [256], "tokens": 96}]}', "sample 0 needs patches"),
        ('{"per_sample": [{"patches": [0], "text_tokens": 1, "tokens": 1}]}', "sample 0 has a size below 1"),
    ],
)
def test_a_bad_data_profile_is_one_line_and_exit_2(tmp_path, capsys, content, why):
    path = tmp_path / "mix.json"
    if content is not None:
        path.write_text(content)
    rc = cli_main(["plan", "--time", "--gpu", "h100-sxm", "--gpus", "2", "--data-profile", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and err.count("\n") == 1, err


def test_a_microbatch_costs_its_own_sizes_padded_or_packed():
    """Text: padded, every row as long as the longest; packed, the sum of the lengths, attention per sample.
    Vision: attention per image, so the same patches in unequal images cost more full attention."""
    from dhp.models.planning.time_model import MicroBatchShape, text_call, vision_calls

    prof = datasheet("h100-sxm")
    cfg, mc = _tiny()
    cfg = prepare(cfg, prof, 2, Workload(256, 32))
    padded = text_call(cfg, mc, prof, MicroBatchShape((256, 256), (100, 300), (36, 236)))
    as_long = text_call(cfg, mc, prof, MicroBatchShape((256, 256), (300, 300), (36, 236)))
    packed = text_call(cfg, mc, prof, MicroBatchShape((256, 256), (100, 300), (36, 236), packed=True))
    assert padded.parts["linear"] == as_long.parts["linear"] and padded.parts["attention"] == as_long.parts["attention"]
    assert packed.parts["linear"] == pytest.approx(padded.parts["linear"] * 400 / 600, rel=1e-12)
    assert packed.parts["attention"] == pytest.approx(padded.parts["attention"] * (100**2 + 300**2) / (2 * 300**2))

    def vision(images: tuple[int, ...]):
        return vision_calls(cfg, mc, prof, MicroBatchShape(images, (300, 300), (36, 36)))[0]

    even, uneven = vision((544, 544)), vision((64, 1024))
    assert uneven.parts["linear"] == even.parts["linear"]
    ratio = (64**2 + 1024**2) / (2 * 544**2)
    assert uneven.parts["full_attention"] == pytest.approx(even.parts["full_attention"] * ratio, rel=1e-12)
