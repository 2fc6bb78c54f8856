"""`dhp train plan.layout=auto` (stages/auto_layout.py): the layout `dhp plan --search` ranks first for the
cluster Ray reports. The resources are plain dicts, as `ray.cluster_resources()` returns them; only the last
test starts Ray (and trains)."""

from __future__ import annotations

import copy
import json

import pytest

from dhp.errors import ConfigError
from dhp.models.activation_checkpointing import ActivationCheckpointing
from dhp.models.parallel.checks import check_layout
from dhp.models.planning.hardware import datasheet
from dhp.models.planning.layout_search import predict, prepare, search
from dhp.models.planning.length_mix import longest
from dhp.models.planning.time_model import Workload
from dhp.stages.auto_layout import choose_layout, kept_keys
from dhp.stages.config import load_config
from dhp.stages.trainer import model_config_of

# 2 H100s on one node, as Ray's cluster_resources() reads on such a machine
TWO_H100 = {
    "CPU": 32.0,
    "GPU": 2.0,
    "memory": 4.0e11,
    "object_store_memory": 1.0e11,
    "accelerator_type:H100": 1.0,
    "node:10.0.0.7": 1.0,
    "node:__internal_head__": 1.0,
}


def _auto(*overrides: str):
    return load_config("tiny", ["plan.layout=auto", *overrides])


def test_auto_trains_the_searchs_top_row_and_says_why():
    cfg = _auto()
    chosen, lines = choose_layout(cfg, TWO_H100)
    # tiny: a 224 x 224 image (data.max_pixels) is 256 patches, 64 merged tokens; data.max_seq_len 1024 in all
    rows = search(cfg, model_config_of(cfg), datasheet("h100-sxm"), 2, Workload(256, 1024 - 64))
    top = rows[0]["config"]
    assert chosen.plan.layout == "given" and top.plan.layout == "auto"
    top.plan.layout = "given"
    assert chosen.to_dict() == top.to_dict()
    check_layout(chosen, model_config_of(chosen))
    assert chosen.model.dtype == "bfloat16" and chosen.vision.num_gpus_per_actor > 0
    text = "\n".join(lines)
    assert f"{len(rows)} layouts of 2 x h100-sxm on 1 node (Ray: 2 GPUs, accelerator_type:H100)" in lines[0]
    assert "samples of 256 patches + 960 text tokens" in lines[0]
    assert text.count("\n| ") == 1 + cfg.plan.top  # the table's header and plan.top rows
    assert f"chosen #1: {rows[0]['layout']}, a predicted step of {rows[0]['step_s']:.3f} s" in text
    assert "pipeline bubble" in text and "GiB per GPU" in text


def test_a_layout_key_on_the_command_line_is_kept():
    free, _ = choose_layout(_auto(), TWO_H100)
    overrides = ["plan.layout=auto", "vision.parallelism=sequence", "model.precision=fp32", "training.steps=3"]
    keep = kept_keys(overrides)
    assert keep == ["vision.parallelism", "model.precision"]
    assert free.vision.parallelism != "sequence"  # so that keeping it changes the choice
    chosen, lines = choose_layout(load_config("tiny", overrides), TWO_H100, keep)
    assert chosen.vision.parallelism == "sequence" and chosen.model.precision == "fp32"
    assert "kept from the command line: vision.parallelism=sequence, model.precision=fp32" in lines[1]
    # values the search would not try are kept too: 3 in flight, a budget of its own, recomputation it needs not
    overrides = ["pipeline.max_in_flight=3", "data.microbatch_tokens=2048", "vision.activation_checkpointing=full"]
    chosen, _ = choose_layout(_auto(*overrides), TWO_H100, kept_keys(overrides))
    assert (chosen.pipeline.max_in_flight, chosen.data.microbatch_tokens) == (3, 2048)
    assert chosen.vision.activation_checkpointing == "full"
    cfg = load_config("tiny", ["plan.layout=auto", "text.num_actors=3", "text.degree=1"])
    with pytest.raises(ConfigError, match=r"no layout of 2 x h100-sxm .* with text.num_actors=3 \(given on the"):
        choose_layout(cfg, TWO_H100, ["text.num_actors"])


@pytest.mark.parametrize(
    "resources,message",
    [
        ({**TWO_H100, "accelerator_type:A100": 1.0}, "accelerator types A100, H100 for 2 GPUs"),
        ({"CPU": 8.0, "GPU": 4.0, "accelerator_type:A100": 1.0}, "no profile for Ray's accelerator_type:A100"),
        ({"CPU": 8.0, "GPU": 4.0}, "no accelerator type for 4 GPUs"),
    ],
)
def test_an_unknown_gpu_type_is_one_line_naming_the_profiles_and_the_knob(resources, message):
    with pytest.raises(ConfigError) as e:
        choose_layout(_auto(), resources)
    text = str(e.value)
    assert message in text and "\n" not in text
    assert "set plan.hardware to one of h100-sxm, h200, a100-80gb, l40s or to a `dhp bench ops --json` file" in text
    # the knob it names picks the profile
    chosen, lines = choose_layout(_auto("plan.hardware=a100-80gb"), {"CPU": 8.0, "GPU": 4.0})
    assert "4 x a100-80gb" in lines[0] and max(chosen.vision.num_actors, chosen.text.num_actors) <= 4


def test_a_cluster_without_gpus_needs_a_cpu_profile(tmp_path):
    with pytest.raises(ConfigError, match=r"Ray reports no GPUs; plan.hardware=FILE names the CPU profile"):
        choose_layout(_auto(), {"CPU": 16.0})
    with pytest.raises(ConfigError, match=r"plan.data_profile=.*no such file"):
        choose_layout(_auto("plan.data_profile=/nonexistent/mix.json"), TWO_H100)
    with pytest.raises(ConfigError, match=r"plan.hardware=/no/cpu.json: no such datasheet or file; set plan.hardware"):
        choose_layout(_auto("plan.hardware=/no/cpu.json"), {"CPU": 16.0})
    (tmp_path / "cpu.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"plan.hardware=.*cpu.json: not a `dhp bench ops --json` profile"):
        choose_layout(_auto(f"plan.hardware={tmp_path / 'cpu.json'}"), {"CPU": 16.0})


def _mix(path, patches: int, text: int) -> list[dict]:
    """30 samples of one image of `patches` patches and `text` text tokens, written as `dhp data profile` does."""
    samples = [{"patches": [patches], "text_tokens": text, "tokens": patches // 4 + text}] * 30
    path.write_text(json.dumps({"samples": len(samples), "per_sample": samples}))
    return samples


def test_a_mix_of_large_images_chooses_another_layout_than_small_ones(tmp_path):
    """Qwen2.5-VL 7B on 2 H100s: on small images the fastest layout recomputes nothing; its pools do not hold
    images of 4096 patches without recomputation, so on those the search chooses another layout."""
    _mix(tmp_path / "small.json", 256, 32)
    large = _mix(tmp_path / "large.json", 4096, 64)
    model = "model.name=qwen2_5_vl_7b"
    small_cfg = _auto(model, f"plan.data_profile={tmp_path / 'small.json'}")
    for_small, lines = choose_layout(small_cfg, TWO_H100)
    assert f"ranked on the length mix of {tmp_path / 'small.json'} (30 samples)" in lines[0]
    cfg = _auto(model, f"plan.data_profile={tmp_path / 'large.json'}")
    for_large, _ = choose_layout(cfg, TWO_H100)
    assert _recomputes(for_small) == (False, False)
    assert _pools(for_large) != _pools(for_small) and _recomputes(for_large) != (False, False)
    # the small images' layout, recomputing nothing, does not hold the large images, even one a micro-batch
    prof, one = datasheet("h100-sxm"), longest(large)
    as_before = prepare(copy.deepcopy(for_small), prof, 2, Workload(4096, 64), one)
    as_before.data.microbatch_tokens = as_before.data.max_seq_len = one
    assert predict(as_before, model_config_of(cfg), prof, Workload(4096, 64), large)["fits"] is False


def _pools(cfg) -> tuple:
    return cfg.pipeline.placement, *((s.parallelism, s.degree, s.num_actors) for s in (cfg.vision, cfg.text))


def _recomputes(cfg) -> tuple[bool, bool]:
    return tuple(ActivationCheckpointing.of(s).recomputes for s in (cfg.vision, cfg.text))


def _searched_part(resources: dict) -> dict:
    """What the search reads of Ray's resources (the placement groups of a run are not part of it)."""
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU") or k.startswith(("node:", "accelerator_type:"))}


@pytest.mark.slow
def test_dhp_train_with_an_automatic_layout_trains_the_chosen_one(ray_session, tmp_path, capsys, monkeypatch):
    """`dhp train plan.layout=auto` on the session's Ray (no GPUs: the measured CPU profile), the pools' sizes kept
    from the command line: the ranking is printed, the chosen layout trains 2 steps and is the run's config."""
    from dhp.stages import auto_layout
    from dhp.stages.cli import main as cli_main
    from tests.test_time_model import CPU_PROFILE

    # What the run's search was given and what it chose, recorded as the run calls it: a second search of the CPU
    # profile's layouts here would take seconds more (the tests above hold the choice itself to `search`)
    searched, search = [], auto_layout.choose_layout

    def recorded(*args):
        searched.append((args, search(*args)))
        return searched[-1][1]

    monkeypatch.setattr(auto_layout, "choose_layout", recorded)
    overrides = [
        "plan.layout=auto",
        f"plan.hardware={CPU_PROFILE}",
        *("vision.num_actors=1", "vision.degree=1", "text.num_actors=1", "text.degree=1"),
        *("training.steps=2", "training.global_batch_size=4", "output.save_final_checkpoint=false"),
        *("output.tensorboard=false", f"output.dir={tmp_path}", "output.name=run"),
        *(f"data.synthetic.dir={tmp_path / 'synth'}", "data.synthetic.num=8", "data.synthetic.eval_num=0"),
        *("data.synthetic.video_fraction=0", "output.peak_tflops=1"),
    ]
    assert cli_main(["train", *overrides]) == 0
    out = capsys.readouterr().out
    assert "layouts of 2 x measured:vm on 1 node (Ray: 16 CPUs; the profile's 2 cores a node)" in out
    kept = "vision.degree=1, vision.num_actors=1, text.degree=1, text.num_actors=1"
    assert f"kept from the command line: {kept} (only the layouts with these values are ranked)" in out
    # one search: of the config the command line gives, on the resources Ray reports, with the keys it set kept
    [((cfg, resources, keep), (chosen, lines))] = searched
    assert cfg.to_dict() == load_config("tiny", overrides).to_dict()
    assert _searched_part(resources) == _searched_part(ray_session.cluster_resources())
    assert keep == kept_keys(overrides)
    assert all(line in out for line in lines) and chosen.pipeline.placement == "disjoint"
    run = tmp_path / "run"
    assert load_config(str(run / "config.yaml")).to_dict() == chosen.to_dict()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_loss"] > 0
