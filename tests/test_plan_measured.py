"""The memory plan against what the actors really hold, for every layout of the parity test.

Each layout of tests/test_parity.py (`LAYOUTS`) is checked on its parity test's trainer, after the parity steps
(`plan_probe`): the tiny Qwen2.5-VL (4 ViT blocks, 2 of them full attention; 2 decoder layers; the real
vocabulary) trains one more step, of one 2 048-patch image per text replica (the `plan_sample` fixture). Every
rank records the bytes its training forward keeps for backward (saved-tensor hooks,
`StageWorker.measure_activations`: the whole encoder call; the decoder from embedding output to final norm) and
reports its parameter, gradient and AdamW bytes (`state_bytes`). The plan's formulas, evaluated for that rank at
that micro-batch's size (`memory_plan.kept_activations`, `model_state_bytes`), must be within 10 % of each
(AdamW: the plan's largest ZeRO-1 share against the largest rank's); a change to the model or the code that the
plan does not follow fails there. Qwen3-VL's parity cases marked `planned` (SP 2 / TP 2 and TP 2 / TP 2) do the same
on the tiny Qwen3-VL, with its 26 x 30-patch parity sample (its own 16 px patches).

The fine-tuning cases here hold it to what trains, zero where nothing does, on a tiny-but-deep Qwen2.5-VL (16 ViT
blocks, 4 of them full attention; 12 decoder layers) and the same image; the frozen ViT under SP 2 / TP 2 is
checked on tests/test_fine_tuning.py's trainer of that case (`PLANNED` there).
"""

from __future__ import annotations

import pytest
import ray

from dhp.dataflow.loader import GlobalBatch
from dhp.models.fine_tuning import FineTuning
from dhp.models.parallel.layouts import stage_layout
from dhp.models.planning.memory_plan import kept_activations, model_state_bytes, stage_shapes
from dhp.models.precision import precision_of
from dhp.stages.config import load_config
from tests.test_parity import BASE, SP2, TP2, _microbatch

TOLERANCE = 0.10


@pytest.fixture(scope="module")
def deep_setup(tmp_path_factory):
    """A seeded tiny-but-deep checkpoint and one preprocessed one-image sample (`dhp bench time-model`'s)."""
    from dhp.scripts.bench.time_model import IMAGE, deep_sample  # 2 048 patches, 512 merged tokens

    config, ckpt, sample = deep_sample(tmp_path_factory.mktemp("deep"))
    assert int(sample["image_grid_thw"].prod()) == IMAGE[0] * IMAGE[1] // 14**2
    return config, ckpt, sample


def _planned(cfg, model_config, stage: str, record: dict, rank: int) -> tuple[int, dict[str, int]]:
    """(activation bytes of the recorded micro-batch, model-state bytes) the plan gives pool rank `rank`."""
    act, _ = kept_activations(cfg, model_config, stage, record["patches" if stage == "vision" else "tokens"])
    layout, ft = stage_layout(cfg, stage, model_config), FineTuning(cfg)
    shapes = stage_shapes(model_config, stage, ft.lora)
    states = model_state_bytes(layout, precision_of(cfg.model.precision), shapes, rank, ft)
    return round(act), states


def plan_probe(sample: dict, replicas: int):
    """A `check_parity` probe: `check_plan` on the parity test's trainer."""
    return lambda trainer: check_plan(trainer, sample, replicas)


# What trains changes what is kept: a frozen ViT keeps nothing, a merger-only one only the merger's inputs, a
# frozen or LoRA decoder only what the embedding gradient (and the factors') needs; no grads or AdamW where
# nothing trains (models/fine_tuning.py). A frozen ViT with a training decoder under SP 2 / TP 2:
# tests/test_fine_tuning.py.
FINE_TUNING = {
    "sp2-tp2-merger-lora": (SP2 + TP2 + ["vision.train=merger", "text.train=lora"], [[[0, 1], [2]]]),
    "tp2-lora-dropout": (
        TP2 + ["text.train=lora", "text.lora.dropout=0.1", "text.lora.targets=q_proj,o_proj,down_proj"],
        [[[0], [1, 2]]],
    ),
    "1v1t-all-none-ac2": (
        ["vision.activation_checkpointing=every_n", "text.train=none", "text.activation_checkpointing=every_n"],
        [[[0], [1], [2]]],
    ),
}


@pytest.mark.parametrize("case", list(FINE_TUNING))
def test_plan_follows_fine_tuning(deep_setup, trainers, case):
    _, ckpt, sample = deep_setup
    layout, replicas = FINE_TUNING[case]
    cfg = load_config(
        "tiny",
        BASE
        + layout
        + [
            f"model.path={ckpt}",
            "data.microbatch_tokens=1024",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ],
    )
    with trainers.use(cfg) as trainer:
        check_plan(trainer, sample, len(replicas))


def check_plan(trainer, sample: dict, replicas: int) -> None:
    """One step of `sample` on each of the trainer's `replicas` text replicas: what every rank keeps and holds
    against the plan for that rank."""
    cfg, model_config = trainer.cfg, trainer.model_config
    for _, pool in trainer.pools():
        pool.execute_all("measure_activations", True)
    trainer.accumulate([GlobalBatch([_microbatch([sample], cfg, model_config)], epoch=0) for _ in range(replicas)])
    ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
    before = {s: pool.execute_all("state_bytes") for s, pool in trainer.pools()}
    trainer.optimizer_step()
    after = {s: pool.execute_all("state_bytes") for s, pool in trainer.pools()}
    measured = {s: pool.execute_all("measure_activations", False) for s, pool in trainer.pools()}
    report = []
    for stage in ("vision", "text"):
        for rank, records in enumerate(measured[stage]):
            assert records, f"{stage} rank {rank} recorded no training forward"
            b = before[stage][rank]
            for record in records:
                act, states = _planned(cfg, model_config, stage, record, rank)
                report.append((stage, rank, "activations", record["bytes"], act))
            report += [
                (stage, rank, "params", b["params"], states["params"]),
                (stage, rank, "grads", b["grads"], states["grads"]),
                (stage, rank, "optimizer", max(x["optimizer"] for x in after[stage]), states["optimizer"]),
            ]
    print(
        "\n".join(
            f"{s} r{r} {w}: measured {m} planned {p}" + (f" ({p / m - 1:+.1%})" if m else "")
            for s, r, w, m, p in report
        )
    )
    bad = [row for row in report if abs(row[4] - row[3]) > TOLERANCE * row[3]]
    assert not bad, f"the memory plan is off by more than {TOLERANCE:.0%}: {bad}"
