"""`dhp bench time-model`: the plan predicts the step times measured here, and the profile curves it relies on
read as documented.

The check: this machine's profile is measured right before the steps (`run` without a
profile: `dhp bench ops --quick` sizes), then every configuration of the bench trains and its median step must
be within `TOLERANCE` of the plan's prediction from that profile. It fails when the step-time model and the
trainer drift apart. The profile is not the test session's shared one: measured minutes earlier on a shared 2-core
machine (Ray's workers still booting, another test's processes), it put every ratio 20-30 % off in CI. The
configurations whose ratio is off are measured once more after the machine has been quiet (`wait_quiet`): in CI,
pools of two ranks that wait for each other in collectives measured 15-30 % slower than predicted, and twice.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from dhp.models.planning.hardware import datasheet, profile
from dhp.scripts.bench.cpu_load import wait_quiet
from dhp.scripts.bench.time_model import CONFIGS, MIXED, OVERSUBSCRIBED, TOLERANCE, run, table

CPU_PROFILE = Path(__file__).resolve().parent.parent / "docs" / "results" / "ops_profile_cpu.json"


@pytest.mark.times_steps
def test_plan_predicts_every_measured_step_within_tolerance(trainers):
    # each configuration's actors alone: no idle kept trainer beside them
    trainers = SimpleNamespace(take=trainers.take_alone, give_back=trainers.give_back)
    result = run(None, quick=True, steps=3, trainers=trainers)
    assert [r["config"] for r in result["rows"]] == list(CONFIGS) + list(MIXED) and len(CONFIGS) >= 6
    # a global batch of unequal images, predicted from each micro-batch's own sizes
    assert all(len(set(r["mixed_patches"])) == len(r["mixed_patches"]) == 3 for r in result["rows"][len(CONFIGS) :])
    for r in result["rows"]:
        assert r["checked"] and r["measured_s"] > 0 and r["predicted_s"] > 0
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        assert {"vision.forward", "vision.backward", "text.forward_backward", "text.optimizer_step"} <= set(
            r["measured_calls_s"]
        )
    rows = {r["config"]: r for r in result["rows"]}
    # one actor per pool: the plan overlaps them, and so does the trainer
    assert rows["none / none, pipelined"]["predicted_s"] < rows["none / none, serial"]["predicted_s"]
    off = [r["config"] for r in result["rows"] if abs(r["ratio"] - 1) > TOLERANCE]
    if off:
        # Another process may have taken a core for a while (the table's `others` column says how much): once
        # the machine is quiet, profile and measure those configurations once more. A machine that never gets
        # quiet fails the test with the processes that kept it busy.
        quiet = wait_quiet()
        again = run(None, quick=True, steps=3, configs={k: {**CONFIGS, **MIXED}[k] for k in off}, trainers=trainers)
        off = [r["config"] for r in again["rows"] if abs(r["ratio"] - 1) > TOLERANCE]
        assert not off, (
            f"predicted / measured outside 1 +- {TOLERANCE} twice: {off}\n{table(result)}\n"
            f"before the second try: {quiet}\nagain:\n{table(again)}"
        )
    assert set(OVERSUBSCRIBED).isdisjoint(CONFIGS)


def test_collective_curve_is_read_between_and_beyond_its_points():
    prof = profile(str(CPU_PROFILE))
    pts = prof.all_reduce_by_size
    assert len(pts) >= 4
    (b0, t0), (b1, t1) = pts[1], pts[2]
    assert prof.collective_s("all_reduce", b0, 2) == pytest.approx(t0)
    mid = prof.collective_s("all_reduce", math.sqrt(b0 * b1), 2)
    assert min(t0, t1) <= mid <= max(t0, t1)
    last_b, last_t = pts[-1]
    assert prof.collective_s("all_reduce", 4 * last_b, 2) == pytest.approx(4 * last_t)  # bandwidth-bound past it
    assert prof.collective_s("all_reduce", b0, 4) == pytest.approx(t0 * 1.5)  # (n-1)/n of the bytes per rank
    assert prof.collective_s("all_reduce", b0, 1) == 0.0
    gpu = datasheet("h100-sxm")  # no curve: latency + bytes / bandwidth
    nbytes = 2**26
    assert gpu.collective_s("all_reduce", nbytes, 8) == pytest.approx(
        gpu.collective_latency_s + 2 * 7 / 8 * nbytes / gpu.comm_rate("all_reduce")
    )


def test_attention_rate_follows_the_head_dim_curve_and_the_causal_rate():
    prof = profile(str(CPU_PROFILE))
    ref = prof.attention_head_dim
    assert prof.attention_rate("attention", ref) == pytest.approx(prof.rate("attention"))
    curve = dict((int(d), r) for d, r in prof.attention_by_head_dim)
    small = min(curve)
    assert prof.attention_rate("attention", small) == pytest.approx(prof.rate("attention") * curve[small] / curve[ref])
    assert prof.attention_rate("causal_attention", ref) == pytest.approx(prof.causal_attention_tflops * 1e12)
    gpu = datasheet("h100-sxm")  # datasheet: a causal kernel skips the masked half, no head_dim curve
    assert gpu.attention_rate("causal_attention", 64) == gpu.attention_rate("attention", 128) == gpu.rate("attention")
    assert gpu.attention_backward_ratio == 2.0 and gpu.optimizer_s_per_param is None
