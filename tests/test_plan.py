"""The memory plan (models/memory_plan.py, `dhp plan`): presets fit their GPUs, `dhp train` refuses what does not,
and the plan's model-state bytes are what the actors really hold."""

from __future__ import annotations

import json

import pytest
import ray

from dhp.dataflow.loader import GlobalBatch
from dhp.models.memory_plan import GIB, plan
from dhp.stages.cli import main
from dhp.stages.config import load_config
from dhp.stages.trainer import Trainer, model_config_of
from tests.test_parity import BASE, SP2, TP2, _microbatch

PRESETS = {"qwen2_5_vl_7b": 4, "qwen2_5_vl_32b": 8, "qwen2_5_vl_72b": 16}


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_fit_80gb_gpus(preset, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", preset, "--gpu-memory", "80", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fits" in text and "DOES NOT FIT" not in text
    rows = json.loads(out.read_text())
    assert [r["stage"] for r in rows] == ["vision", "text"] and all(r["fits"] for r in rows)
    assert rows[0]["num_actors"] == rows[1]["num_actors"] == PRESETS[preset]  # GPUs: both pools share them
    for r in rows:
        parts = ("params", "grads", "optimizer", "optimizer_step_temp", "activations", "transients")
        assert r["total"] == sum(r[k] for k in parts) and r["activations"] > 0
    assert rows[0]["per_device"] == rows[0]["total"] + rows[1]["total"] <= 0.9 * 80 * GIB


def test_a_layout_that_does_not_fit_is_refused_before_anything_starts(tmp_path, capsys):
    """32B without activation checkpointing on 80 GB: `dhp plan` says so (exit 1), `dhp train` stops with the
    table and what would fit (exit 2) before Ray or a run directory; skip_memory_check gets past it."""
    over = ["vision.activation_checkpointing=none", "text.activation_checkpointing=none", "model.precision=fp32",
            f"output.dir={tmp_path}/runs", "training.gpu_memory_gib=80"]
    assert main(["plan", "--config", "qwen2_5_vl_32b", *over]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["train", "--config", "qwen2_5_vl_32b", *over]) == 2
    err = capsys.readouterr().err
    assert "does not fit its GPUs" in err and "activation_checkpointing=full" in err and "model.precision=bf16" in err
    assert not (tmp_path / "runs").exists()
    main(["train", "--config", "qwen2_5_vl_32b", *over, "training.skip_memory_check=true"])
    assert "does not fit" not in capsys.readouterr().err  # past the check (it stops later: no data here)


def test_cpu_runs_are_reported_not_compared():
    cfg = load_config("tiny")
    result = plan(cfg, model_config_of(cfg))
    assert result["fits"] is None and result["device"] is None and "CPU actors" in result["device_source"]


@pytest.mark.parametrize(("layout", "replicas"), [
    (SP2 + TP2, [0]),
    (["vision.num_actors=2", "text.num_actors=2"], [0, 1]),
    (["vision.parallelism=zero3", "vision.num_actors=2", "text.parallelism=zero3", "text.num_actors=2"], [0, 1]),
], ids=["sp2-tp2", "dp2", "zero3"])
def test_planned_model_states_are_what_the_actors_hold(parity_setup, ray_session, layout, replicas):
    """Parameters, gradients and AdamW states of every rank after a step against the plan's numbers (the
    plan is per rank 0; ranks of one pool hold the same up to replicated-KV and padding: 10 %)."""
    _, ckpt, samples = parity_setup
    cfg = load_config("tiny", BASE + layout + [
        f"model.path={ckpt}", "data.microbatch_tokens=1024", "vision.num_cpus_per_actor=0.5",
        "text.num_cpus_per_actor=0.5",
    ])
    planned = plan(cfg, model_config_of(cfg))["ranks"]
    trainer = Trainer(cfg)
    try:
        trainer.accumulate([GlobalBatch([_microbatch([samples[i]], cfg)], epoch=0) for i in replicas])
        ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
        before = {s: pool.execute_all("state_bytes") for s, pool in trainer.pools()}
        trainer.optimizer_step()
        after = {s: pool.execute_all("state_bytes") for s, pool in trainer.pools()}
    finally:
        trainer.shutdown()
    for stage, p in planned.items():
        for rank, (b, a) in enumerate(zip(before[stage], after[stage])):
            for got, want, what in ((b["params"], p.params, "params"), (b["grads"], p.grads, "grads"),
                                    (a["optimizer"], p.optimizer, "optimizer")):
                assert abs(got - want) <= 0.1 * want, (stage, rank, what, got, want)


def test_text_activation_formula_matches_what_autograd_keeps():
    """The plan's per-token count for the language model against torch's MemTracker on a tiny-but-deep model
    (12 layers, 1 k tokens, fp32, no checkpointing): the bytes alive when the forward ends, within 10 %."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from dhp.models.memory_plan import text_activations
    from dhp.models.qwen2_5_vl import TextModel
    from dhp.scripts.bench_checkpointing import STATE, deep_config

    config = deep_config(text_layers=12)
    torch.manual_seed(0)
    model = TextModel(config).train()
    ids = torch.randint(0, 1000, (1, 1024))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model.language_model(input_ids=ids, use_cache=False).last_hidden_state  # noqa: F841 (kept alive)
        snap = tracker.get_tracker_snapshot()[torch.device("cpu")]
    kept = snap["Total"] - sum(v for k, v in snap.items() if str(k).split(".")[-1] in STATE)  # `out` included
    want, _ = text_activations(config.text_config, 1024, tp=1, b=4)
    assert abs(kept - want) <= 0.1 * want, (kept, want)
