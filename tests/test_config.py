"""Tests for the typed run configuration (dhp.stages.config) and the `dhp` command's error handling.

Fast and Ray-free: configs are loaded in-process; only a handful of tests start the real command in a
subprocess (each costs about a second of imports). Several tests pin bugs found and fixed while
this file was written (YAML errors escaping as tracebacks, a directory as --config, negative --num).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dhp.stages.cli import main
from dhp.stages.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainingConfig,
    VisionStageConfig,
    load_config,
    preset_path,
    save_config,
    validate,
)

PRESETS = ("tiny", "qwen2_5_vl_7b", "qwen2_5_vl_32b", "qwen2_5_vl_72b", "qwen3_vl_2b", "qwen3_vl_8b", "qwen3_vl_32b")


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(source: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return str(info.value)


def _yaml_error(tmp_path: Path, text: str) -> tuple[str, str]:
    """(message, file path) of the ConfigError raised by loading a YAML file with `text`."""
    path = _write(tmp_path, text)
    return _error(path), path


# --- presets -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_validates(name):
    path = preset_path(name)
    assert path.is_file() and path.name == f"{name}.yaml"
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    validate(cfg)  # idempotent: a loaded config is valid
    assert load_config(str(path)) == cfg  # the preset by name and by path are the same config


def test_presets_directory_holds_exactly_the_known_presets():
    known = sorted(p.stem for p in preset_path("tiny").parent.glob("*.yaml"))
    assert known == sorted(PRESETS)


def test_tiny_is_the_default():
    cfg = load_config()
    assert cfg == load_config("tiny")
    assert cfg.model.name == "tiny"
    assert cfg.model.path is None
    assert cfg.model.dtype == "float32"
    # the default layout: vision sequence parallel 2, text tensor parallel 2, pipelined
    assert (cfg.vision.parallelism, cfg.vision.num_actors, cfg.vision.degree) == ("sequence", 2, 2)
    assert (cfg.text.parallelism, cfg.text.num_actors, cfg.text.degree) == ("tensor", 2, 2)
    assert cfg.pipeline.max_in_flight == 3
    assert cfg.vision.num_gpus_per_actor == 0.0 and cfg.text.num_gpus_per_actor == 0.0  # CPU only
    assert cfg.data.train == ""  # the synthetic set


@pytest.mark.parametrize(("name", "n"), [("qwen2_5_vl_7b", 4), ("qwen2_5_vl_32b", 8)])
def test_large_presets_layout(name, n):
    cfg = load_config(name)
    assert cfg.model.name == name
    assert cfg.model.path is None
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.attn_implementation == "sdpa"  # installed everywhere (flash-attn is not: see below)
    assert (cfg.vision.parallelism, cfg.vision.num_actors, cfg.vision.degree) == ("sequence", n, n)
    assert (cfg.text.parallelism, cfg.text.num_actors, cfg.text.degree) == ("tensor", n, n)
    assert cfg.vision.num_gpus_per_actor == 0.5 and cfg.text.num_gpus_per_actor == 0.5
    assert cfg.training.lr == pytest.approx(5e-5)
    assert isinstance(cfg.vision.num_cpus_per_actor, float)  # `2` in YAML became a float


def test_flash_attention_without_flash_attn_is_refused_before_ray(tmp_path, capsys):
    """Every actor would fail its setup with an ImportError minutes in: `dhp train` says so in one line first."""
    import importlib.util

    from dhp.stages.cli import main
    from dhp.stages.preflight import check_attention

    check_attention("sdpa")
    if importlib.util.find_spec("flash_attn") is not None:  # a GPU machine with it installed: accepted
        check_attention("flash_attention_2")
        return
    code = main(["train", f"output.dir={tmp_path}", "model.attn_implementation=flash_attention_2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and list(tmp_path.iterdir()) == []  # nothing written, no actor started
    assert len(err.splitlines()) == 1 and "pip install flash-attn" in err and "attn_implementation=sdpa" in err


def _refused(args: list[str], tmp_path, capsys) -> str:
    """`dhp train ARGS` in this process: exit status 2, one line, nothing written. (Not for what is checked when a
    Ray starts: in the full tier the tests' own Ray may run in this process, and a run then uses it as it is.)"""
    code = main(["train", f"output.dir={tmp_path / 'runs'}", f"data.synthetic.dir={tmp_path / 'synth'}", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("dhp: error: "), err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "synth").exists()
    return err


def test_a_model_path_that_is_no_checkpoint_is_one_line_naming_it(tmp_path, capsys):
    err = _refused([f"model.path={tmp_path / 'nowhere'}"], tmp_path, capsys)
    assert f"model.path={tmp_path / 'nowhere'} is not a directory" in err
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _refused([f"model.path={tmp_path / 'empty'}"], tmp_path, capsys)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    err = _refused([f"model.path={llama}"], tmp_path, capsys)
    assert "no dhp model family for a LlamaConfig" in err and "Qwen2_5_VLConfig" in err


def test_a_tokenizer_path_without_a_tokenizer_is_refused_before_any_worker_reads_it(tmp_path, capsys):
    err = _refused([f"model.tokenizer_path={tmp_path / 'nowhere'}"], tmp_path, capsys)
    assert f"model.tokenizer_path={tmp_path / 'nowhere'} is not a directory" in err
    err = _refused([f"model.tokenizer_path={tmp_path}"], tmp_path, capsys)
    assert "has no tokenizer files (expected one of tokenizer.json" in err


def test_a_ray_address_where_nothing_listens_is_refused_and_other_forms_are_left_to_ray():
    from dhp.stages.preflight import check_reachable
    from tests.conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=f"ray.address={address}: no Ray head answers there") as refused:
        check_reachable("ray.address", address)
    assert "leave ray.address unset" in str(refused.value)
    for other in (None, "auto", "local", "ray://127.0.0.1:1", "localhost"):
        check_reachable("ray.address", other)


@pytest.mark.slow  # a subprocess: in this process the tests' own Ray may run, which a run then uses as it is
def test_dhp_train_at_a_ray_address_where_nothing_listens_is_one_line_not_minutes_of_retries(tmp_path):
    from tests.conftest import free_port

    begun = time.monotonic()
    proc = _dhp("train", f"ray.address=127.0.0.1:{free_port()}", f"output.dir={tmp_path / 'runs'}", cwd=tmp_path)
    _assert_one_line_error(proc, "no Ray head answers there")
    assert time.monotonic() - begun < 60  # Ray's own retries of an unreachable head last minutes
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # stopped before any work


def test_a_resume_checkpoint_that_is_not_one_is_refused_before_ray_starts(tmp_path, capsys):
    from dhp.stages.checkpoint_files import MANIFEST

    err = _refused([f"training.resume={tmp_path / 'nowhere'}"], tmp_path, capsys)
    assert f"training.resume={tmp_path / 'nowhere'}: not a usable checkpoint (no such directory)" in err
    partial = tmp_path / "step_000004"
    partial.mkdir()
    (partial / MANIFEST).write_text(json.dumps({"text-rank00000.safetensors": {"size": 8, "sha256": "0" * 64}}))
    err = _refused([f"training.resume={partial}"], tmp_path, capsys)
    assert "not a usable checkpoint (text-rank00000.safetensors is missing)" in err


def test_training_files_that_are_all_empty_are_one_line_before_ray_starts(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    err = _refused([f"data.train={tmp_path / '*.jsonl'}"], tmp_path, capsys)
    assert (
        err
        == f"dhp: error: data.train: every annotation file is empty ({tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'})"
    )


def test_an_output_dir_that_cannot_be_made_names_the_key(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code = main(["train", f"output.dir={tmp_path / 'file'}", f"data.synthetic.dir={tmp_path / 'synth'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"dhp: error: output.dir={tmp_path / 'file'}: the run directory ")
    assert "cannot be made" in err and len(err.splitlines()) == 1


def test_unknown_preset_lists_presets():
    message = _error("no_such_preset")
    assert "no_such_preset" in message
    for name in PRESETS:
        assert name in message


def test_preset_path_returns_paths_as_is():
    assert preset_path("some/dir/x.yml") == Path("some/dir/x.yml")
    assert preset_path("x.yaml") == Path("x.yaml")


def test_missing_file_names_the_path():
    message = _error("/nonexistent/dir/run.yaml")
    assert "not found" in message and "/nonexistent/dir/run.yaml" in message


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(_write(tmp_path, "# nothing\n")) == Config()


def test_partial_section_keeps_other_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "training: {steps: 7}\n"))
    assert cfg.training == dataclasses.replace(TrainingConfig(), steps=7)
    assert cfg.model == ModelConfig() and cfg.data == DataConfig()


def test_top_level_must_be_a_mapping(tmp_path):
    message, path = _yaml_error(tmp_path, "- a\n- b\n")
    assert path in message and "mapping" in message


def test_invalid_yaml_is_a_config_error(tmp_path):
    message, path = _yaml_error(tmp_path, "training: {steps: [1\n")
    assert path in message and "YAML" in message


# --- unknown keys --------------------------------------------------------------------------------------


def test_unknown_nested_key(tmp_path):
    message, path = _yaml_error(tmp_path, "training:\n  stepz: 3\n")
    assert "'training.stepz'" in message
    assert path in message
    assert "known keys" in message
    for key in ("training.steps", "training.lr", "training.global_batch_size"):
        assert key in message


def test_unknown_top_level_section(tmp_path):
    message, path = _yaml_error(tmp_path, "trainin:\n  steps: 3\n")
    assert "'trainin'" in message and path in message and "known keys" in message
    for section in ("model", "vision", "text", "data", "training", "ray", "output"):
        assert section in message


def test_unknown_deeply_nested_key(tmp_path):
    message, path = _yaml_error(tmp_path, "data:\n  synthetic:\n    numm: 3\n")
    assert "'data.synthetic.numm'" in message and path in message
    assert "data.synthetic.num" in message and "data.synthetic.eval_num" in message


def test_method_name_is_not_a_key(tmp_path):
    message, _ = _yaml_error(tmp_path, "to_dict: {}\n")
    assert "'to_dict'" in message and "unknown key" in message


# --- types ---------------------------------------------------------------------------------------------


def test_string_for_int(tmp_path):
    message, path = _yaml_error(tmp_path, "training: {steps: ten}\n")
    assert "training.steps" in message and "int" in message and path in message and "ten" in message


def test_literal_lists_allowed_values(tmp_path):
    message, path = _yaml_error(tmp_path, "model: {dtype: fp8}\n")
    assert "model.dtype" in message and path in message and "fp8" in message
    assert "float32" in message and "bfloat16" in message


def test_literal_parallelism_lists_allowed_values(tmp_path):
    message, _ = _yaml_error(tmp_path, "vision: {parallelism: pipeline}\n")
    assert "vision.parallelism" in message
    for value in ("none", "sequence", "tensor", "zero3"):
        assert value in message


@pytest.mark.parametrize("text", ["training: 5\n", "training: [1, 2]\n", "data: {synthetic: 3}\n"])
def test_section_given_as_scalar(tmp_path, text):
    message, path = _yaml_error(tmp_path, text)
    key = "data.synthetic" if text.startswith("data") else "training"
    assert f"'{key}'" in message and "mapping" in message and path in message


def test_bool_for_int_is_rejected(tmp_path):
    message, path = _yaml_error(tmp_path, "training: {steps: true}\n")
    assert "training.steps" in message and "int" in message and path in message


def test_bool_for_float_is_rejected(tmp_path):
    message, _ = _yaml_error(tmp_path, "training: {lr: true}\n")
    assert "training.lr" in message and "float" in message


def test_float_for_int_is_rejected(tmp_path):
    message, _ = _yaml_error(tmp_path, "training: {steps: 2.5}\n")
    assert "training.steps" in message and "int" in message


def test_int_for_str_is_rejected(tmp_path):
    message, _ = _yaml_error(tmp_path, "model: {name: 7}\n")
    assert "model.name" in message and "str" in message


def test_int_for_float_becomes_float(tmp_path):
    cfg = load_config(_write(tmp_path, "training: {lr: 1, max_grad_norm: 0}\nvision: {num_cpus_per_actor: 2}\n"))
    assert cfg.training.lr == 1.0 and type(cfg.training.lr) is float
    assert cfg.training.max_grad_norm == 0.0 and type(cfg.training.max_grad_norm) is float
    assert cfg.vision.num_cpus_per_actor == 2.0 and type(cfg.vision.num_cpus_per_actor) is float


def test_exponent_without_dot_for_float(tmp_path):
    assert yaml.safe_load("x: 1e-3")["x"] == "1e-3"  # the YAML 1.1 quirk the loader works around
    cfg = load_config(_write(tmp_path, "training: {lr: 1e-3, adam_eps: 1e-8}\n"))
    assert cfg.training.lr == pytest.approx(0.001) and type(cfg.training.lr) is float
    assert cfg.training.adam_eps == pytest.approx(1e-8)


def test_non_numeric_string_for_float_is_rejected(tmp_path):
    message, _ = _yaml_error(tmp_path, "training: {lr: fast}\n")
    assert "training.lr" in message and "float" in message


def test_null_for_optional(tmp_path):
    cfg = load_config(_write(tmp_path, "model: {path: null}\nray: {num_cpus: null, address: null}\n"))
    assert cfg.model.path is None and cfg.ray.num_cpus is None and cfg.ray.address is None
    cfg = load_config(_write(tmp_path, "model: {path: /ckpt}\nray: {num_cpus: 3}\n"))
    assert cfg.model.path == "/ckpt"
    assert cfg.ray.num_cpus == 3.0 and type(cfg.ray.num_cpus) is float


def test_wrong_type_for_optional_names_both_options(tmp_path):
    message, _ = _yaml_error(tmp_path, "ray: {num_cpus: many}\n")
    assert "ray.num_cpus" in message and "float" in message and "null" in message


def test_null_for_non_optional_int_is_rejected(tmp_path):
    message, path = _yaml_error(tmp_path, "training: {steps: null}\n")
    assert "training.steps" in message and "int" in message and path in message
    message, _ = _yaml_error(tmp_path, "training:\n  steps:\n")  # an empty value is null too
    assert "training.steps" in message


# --- overrides -----------------------------------------------------------------------------------------


def test_overrides_apply_with_types():
    cfg = load_config("tiny", ["training.steps=20", "vision.num_actors=4", "model.path=/x", "data.synthetic.num=7"])
    assert cfg.training.steps == 20 and type(cfg.training.steps) is int
    assert cfg.vision.num_actors == 4
    assert cfg.model.path == "/x"
    assert cfg.data.synthetic.num == 7
    assert cfg.text.num_actors == 2  # only the named stage changed
    base = load_config("tiny")
    assert cfg.training.lr == base.training.lr and cfg.data.max_pixels == base.data.max_pixels


def test_overrides_float_null_and_last_wins():
    cfg = load_config(
        "qwen2_5_vl_7b",
        [
            "training.lr=1e-3",
            "vision.num_cpus_per_actor=3",
            "model.path=null",
            "ray.num_cpus=",
            "training.steps=5",
            "training.steps=6",
        ],
    )
    assert cfg.training.lr == pytest.approx(0.001)
    assert cfg.vision.num_cpus_per_actor == 3.0 and type(cfg.vision.num_cpus_per_actor) is float
    assert cfg.model.path is None and cfg.ray.num_cpus is None
    assert cfg.training.steps == 6


def test_override_value_may_contain_equals():
    assert load_config("tiny", ["data.train=a=b.jsonl"]).data.train == "a=b.jsonl"


def test_overrides_do_not_leak_between_loads():
    load_config("tiny", ["training.steps=3"])
    assert load_config("tiny").training.steps == 100


def test_override_unknown_key_names_it():
    message = _error("tiny", ["training.stepz=1"])
    assert "'training.stepz'" in message and "known keys" in message and "training.steps" in message


def test_override_unknown_section_names_it():
    message = _error("tiny", ["trainin.steps=1"])
    assert "trainin" in message and "unknown key" in message


def test_override_missing_equals():
    message = _error("tiny", ["training.steps"])
    assert "training.steps" in message and "KEY=VALUE" in message


def test_override_wrong_type():
    message = _error("tiny", ["training.steps=ten"])
    assert "'training.steps'" in message and "command line" in message and "int" in message
    message = _error("tiny", ["model.dtype=fp8"])
    assert "'model.dtype'" in message and "command line" in message and "bfloat16" in message


def test_override_non_optional_empty_value_is_rejected():
    message = _error("tiny", ["training.steps="])
    assert "training.steps" in message and "command line" in message


@pytest.mark.parametrize("item", ["training.stepz=1", "training.steps"])
def test_override_structural_errors_say_command_line(item):
    message = _error("tiny", [item])
    assert "command line" in message and item.split("=")[0] in message


@pytest.mark.parametrize("item", ["training.steps=[oops", "ray.num_cpus=*x", "training.lr=@foo"])
def test_override_value_that_is_not_yaml_is_a_config_error(item):
    message = _error("tiny", [item])
    assert item.split("=")[0] in message and "command line" in message


@pytest.mark.parametrize("item", ["model.path=[oops", "output.name=2024", "data.train=@foo", "output.name=*x"])
def test_string_overrides_are_taken_verbatim(item):
    key, value = item.split("=", 1)
    section, field = key.split(".")
    assert getattr(getattr(load_config("tiny", [item]), section), field) == value


def test_partial_section_override_keeps_other_keys():
    cfg = load_config("qwen2_5_vl_7b", ["vision={num_actors: 8, degree: 8}"])
    assert (cfg.vision.num_actors, cfg.vision.degree, cfg.vision.parallelism) == (8, 8, "sequence")
    assert cfg.vision.num_gpus_per_actor == 0.5


# --- value validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["training.steps=0"], "training.steps"),
        (["training.global_batch_size=0"], "training.global_batch_size"),
        (["training.lr=0"], "training.lr"),
        (["training.min_lr_ratio=1.5"], "training.min_lr_ratio"),
        (["training.warmup_steps=-1"], "training.warmup_steps"),
        (["data.min_pixels=60000", "data.max_pixels=50000"], "data.min_pixels"),
        (["data.max_seq_len=4096"], "data.max_seq_len"),
        (["data.preprocess_workers=0"], "data.preprocess_workers"),
        (["vision.num_actors=3", "vision.degree=2"], "vision.num_actors"),
        (["text.num_actors=0"], "text.num_actors"),
        (["text.degree=0"], "text.degree"),
        (["vision.num_gpus_per_actor=-1"], "vision"),
    ],
)
def test_value_validation(overrides, key):
    message = _error("tiny", overrides)
    assert key in message


def test_value_validation_applies_to_files(tmp_path):
    message, _ = _yaml_error(tmp_path, "data: {min_pixels: 60000, max_pixels: 50000}\n")
    assert "data.min_pixels" in message and "data.max_pixels" in message


def test_valid_multiples_pass():
    cfg = load_config("tiny", ["vision.num_actors=4", "vision.degree=2", "text.num_actors=6", "text.degree=3"])
    assert (cfg.vision.num_actors, cfg.vision.degree, cfg.text.num_actors, cfg.text.degree) == (4, 2, 6, 3)


def test_validate_on_a_built_config():
    cfg = Config(vision=VisionStageConfig(num_actors=3, degree=2))
    with pytest.raises(ConfigError, match=r"vision\.num_actors"):
        validate(cfg)
    validate(Config())


# --- save / load round trip ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_save_load_round_trip(tmp_path, name):
    cfg = load_config(name, ["training.lr=1e-3", "output.name=run1", "model.tokenizer_path=/tok", "ray.num_cpus=2"])
    path = tmp_path / "saved.yaml"
    save_config(cfg, path)
    again = load_config(str(path))
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert yaml.safe_load(path.read_text())["training"]["lr"] == pytest.approx(0.001)


# --- the `dhp` command -----------------------------------------------------------------------------------


def _dhp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dhp.stages.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dhp: error:")
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.slow  # a subprocess or a measured bench run
def test_cli_train_unknown_override_key(tmp_path):
    proc = _dhp("train", "training.stepz=1", cwd=tmp_path)
    _assert_one_line_error(proc, "training.stepz")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # stopped before any work


@pytest.mark.slow  # a subprocess or a measured bench run
def test_cli_train_missing_config_file(tmp_path):
    proc = _dhp("train", "--config", "/nonexistent.yaml", cwd=tmp_path)
    _assert_one_line_error(proc, "/nonexistent.yaml")


@pytest.mark.slow  # a subprocess or a measured bench run
def test_cli_config_prints_resolved_yaml(tmp_path):
    proc = _dhp("config", "training.steps=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["training"]["steps"] == 3
    assert printed["model"]["name"] == "tiny"


@pytest.mark.slow  # a subprocess or a measured bench run
def test_cli_data_synth(tmp_path):
    out = tmp_path / "ds"
    proc = _dhp("data", "synth", "--out", str(out), "--num", "6", "--seed", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = (out / "train.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(line.strip() for line in lines)


# In-process `main()` checks (no subprocess; the `config` command never imports Ray).


def test_main_config_error_exit_status(capsys):
    assert main(["config", "vision.num_actors=3", "vision.degree=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dhp: error:") and "vision.num_actors" in err and len(err.splitlines()) == 1


def test_main_config_with_preset_and_overrides(capsys):
    assert main(["config", "--config", "qwen2_5_vl_32b", "training.steps=9"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["steps"] == 9 and printed["vision"]["degree"] == 8


def test_main_invalid_yaml_file_is_one_line(tmp_path, capsys):
    path = _write(tmp_path, "training: {steps: [1\n")
    assert main(["config", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dhp: error:") and path in err
    assert len(err.splitlines()) == 1, err


def test_main_config_path_is_a_directory(tmp_path, capsys):
    assert main(["config", "--config", str(tmp_path) + "/"]) == 2
    assert capsys.readouterr().err.startswith("dhp: error:")


def test_main_override_not_yaml(capsys):
    assert main(["config", "training.steps=[oops"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dhp: error:") and "training.steps" in err and len(err.splitlines()) == 1


def test_main_data_synth_negative_num(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path / "ds"), "--num", "-1"]) == 2
    assert capsys.readouterr().err.startswith("dhp: error:")


# What the command line imports: the help and `dhp config` answer in a fraction of a second; a bench's module (torch,
# transformers: seconds of CPU) is imported only when its own command is given.
_IMPORTED = """
import sys
from dhp.stages.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
import json
heavy = sorted(m for m in ("torch", "transformers", "ray") if m in sys.modules)
benches = sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("dhp.scripts.bench."))
print("IMPORTED", json.dumps([heavy, benches]))
"""


def _imported(*args: str) -> tuple[list[str], list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTED, *args], capture_output=True, text=True, timeout=120, check=True
    )
    printed, _, imported = proc.stdout.rpartition("IMPORTED ")
    heavy, benches = json.loads(imported)
    return heavy, benches, printed + proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["plan", "--help"], ["config"]])
def test_help_and_config_import_neither_torch_nor_a_bench(args):
    heavy, benches, out = _imported(*args)
    assert heavy == [] and benches == [], out
    if args == ["config"]:
        assert yaml.safe_load(out)["model"]["name"] == "tiny"


def test_a_bench_command_imports_its_own_bench_only_and_the_bench_help_lists_them_all():
    from dhp.stages.cli import BENCHES

    _, benches, out = _imported("bench", "layouts", "--help")
    assert benches == ["layouts"], out
    _, benches, out = _imported("bench", "--help")
    assert {m.rsplit(".", 1)[1] for m in BENCHES.values()} <= set(benches)
    assert all(name in out for name in BENCHES)
