"""The memory plan (models/planning/memory_plan.py, `dhp plan`): presets fit their GPUs, `dhp train` refuses what
does not, and the plan's model-state bytes are what the actors really hold."""

from __future__ import annotations

import json
import re

import pytest

from dhp.models.planning.memory_plan import GIB, plan
from dhp.stages.cli import main
from dhp.stages.config import load_config
from dhp.stages.trainer import model_config_of

PRESETS = {
    "qwen2_5_vl_7b": 4,
    "qwen2_5_vl_32b": 8,
    "qwen2_5_vl_72b": 16,
    "qwen3_vl_2b": 2,
    "qwen3_vl_8b": 4,
    "qwen3_vl_32b": 8,
}


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
    over = [
        "vision.activation_checkpointing=none",
        "text.activation_checkpointing=none",
        "model.precision=fp32",
        f"output.dir={tmp_path}/runs",
        "training.gpu_memory_gib=80",
    ]
    assert main(["plan", "--config", "qwen2_5_vl_32b", *over]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["train", "--config", "qwen2_5_vl_32b", *over]) == 2
    err = capsys.readouterr().err
    assert "does not fit its GPUs" in err and "activation_checkpointing=full" in err and "model.precision=bf16" in err
    lora = re.search(r"text\.train=lora \(fine-tuning: ([\d.]+) GiB per device instead of ([\d.]+)\)", err)
    assert lora and float(lora.group(1)) < float(lora.group(2)), err  # the plan's own figure for LoRA
    assert "vision.train=merger (fine-tuning" in err
    assert not (tmp_path / "runs").exists()
    main(["train", "--config", "qwen2_5_vl_32b", *over, "training.skip_memory_check=true"])
    assert "does not fit" not in capsys.readouterr().err  # past the check (it stops later: no data here)


def test_cpu_runs_are_reported_not_compared():
    cfg = load_config("tiny")
    result = plan(cfg, model_config_of(cfg))
    assert result["fits"] is None and result["device"] is None and "CPU actors" in result["device_source"]


def test_text_activation_formula_matches_what_autograd_keeps():
    """The plan's per-token count for the language model against torch's MemTracker on a tiny-but-deep model
    (12 layers, 1 k tokens, fp32, no checkpointing): the bytes alive when the forward ends, within 10 %."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from dhp.models.planning.memory_plan import text_activations
    from dhp.models.qwen2_5_vl import TextModel
    from dhp.scripts.bench.checkpointing import STATE, deep_config

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


def test_lora_targets_that_match_nothing_fail_at_the_plan():
    """Said before Ray starts (dhp train plans first), not by add_lora inside a text worker."""
    from dhp.stages.config import ConfigError

    cfg = load_config("tiny", ["text.train=lora", "text.lora.targets=qkv"])
    with pytest.raises(ConfigError, match=r"text.lora.targets \['qkv'\] match no Linear"):
        plan(cfg, model_config_of(cfg))


def test_vision_graphs_alive_are_capped_by_the_micro_batches_of_a_step():
    """Each vision micro-batch in flight keeps its graph until its backward: `pipeline.max_in_flight` of them,
    but a step of 2 samples has at most 2 micro-batches (the H200's 7B at 16 k patches was planned for 3)."""

    def vision(*overrides: str) -> int:
        cfg = load_config("qwen2_5_vl_7b", list(overrides))
        return plan(cfg, model_config_of(cfg), vision_patches=4096)["ranks"]["vision"].activations

    one = vision("pipeline.max_in_flight=1")
    assert one > 0
    assert vision("pipeline.max_in_flight=3", "training.global_batch_size=8") == 3 * one
    assert vision("pipeline.max_in_flight=3", "training.global_batch_size=2") == 2 * one
    assert vision("pipeline.max_in_flight=2", "training.global_batch_size=8") == 2 * one
