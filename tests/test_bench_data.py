"""`dhp bench data --quick` runs end to end and writes a well-formed row (no timing is asserted)."""

from __future__ import annotations

import functools
import json
import math

from dhp.stages.cli import main


def test_bench_data_quick_writes_its_row(trainers, tmp_path, capsys, monkeypatch):
    """On the tests' shared Ray (reused, left running), as `dhp bench data` does under a caller's Ray; its training
    run takes the tests' kept trainers (`train(cfg, trainers=trainers)`) instead of starting four stage actors."""
    from dhp.stages import driver

    monkeypatch.setattr(driver, "train", functools.partial(driver.train, trainers=trainers))
    out = tmp_path / "data.json"
    assert main(["bench", "data", "--quick", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    for key in (
        "ray_data_samples_per_s",
        "baseline_samples_per_s",
        "ray_data_s3_samples_per_s",
        "ray_data_vision_tokens_per_s",
        "baseline_vision_tokens_per_s",
    ):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert 0.0 <= row["data_wait_fraction"] < 1.0 and row["train_steps_measured"] == 3
    small, big = row["memory"]
    assert big["records"] == 2 * small["records"] > 0  # the repeated stream really was longer
    assert big["streamed_mb"] > small["streamed_mb"] > 0 and small["peak_pss_mb"] > 0
    one, more = row["webdataset_memory"]  # the same images as shards: one, then `repeat` of them
    assert more["records"] == 2 * one["records"] == 2 * small["records"] and one["peak_pss_mb"] > 0
    assert math.isfinite(row["webdataset_samples_per_s"]) and row["webdataset_samples_per_s"] > 0
    assert isinstance(row["goal"]["data_wait_fraction"], bool)
    printed = capsys.readouterr().out
    assert "Ray Data, s3:// (moto)" in printed and "WebDataset shards" in printed and "waited for data" in printed
