"""The DeepSpeed ZeRO-3 peer (scripts/peers/deepspeed_zero3.py) trains the same model on the same data as dhp.

Two DeepSpeed ranks (gloo, torchrun's environment, qwen-vl-finetune's zero3.json) each train one sample from
the parity checkpoint; their token-weighted first-step loss must equal dhp's loss of the same two samples as
one global batch, from the same initial weights (fp32, relative 1e-5).
"""

from __future__ import annotations

import json

import torch

from dhp.dataflow.loader import GlobalBatch
from dhp.scripts.peers.deepspeed_zero3 import CONFIG, _extensions, fill_auto, launch
from dhp.stages.config import load_config
from dhp.stages.trainer import Trainer
from tests.test_parity import BASE, _microbatch


def test_fill_auto_fills_every_auto_like_the_hf_trainer():
    filled = fill_auto(json.loads(CONFIG.read_text()), world=4, precision="bf16", max_grad_norm=1.0, hidden=64)
    assert filled["train_batch_size"] == 4 and filled["train_micro_batch_size_per_gpu"] == 1
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert filled["zero_optimization"]["stage"] == 3
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    assert "auto" not in json.dumps(filled)


def test_deepspeed_zero3_first_loss_equals_dhp(parity_setup, ray_session, tmp_path):
    _, ckpt, samples = parity_setup
    pair = samples[:2]  # rank r trains sample r at step 0
    torch.save(pair, tmp_path / "samples.pt")
    built = _extensions()
    peer = launch(
        2,
        [
            "--model",
            str(ckpt),
            "--samples",
            str(tmp_path / "samples.pt"),
            "--out",
            str(tmp_path / "peer.json"),
            "--steps",
            "1",
        ],
    )
    assert peer["world"] == 2 and peer["config"]["zero_optimization"]["stage"] == 3
    # the first run on a machine JIT-builds DeepSpeed's CPU comm op: reported, never hidden
    assert set(peer["jit_built"]) == _extensions() - built and peer["initialize_s"] > 0
    assert all(r["peak_saved_bytes"] > 0 for r in peer["ranks"])

    longest = max(s["input_ids"].shape[0] for s in pair)
    cfg = load_config(
        "tiny",
        BASE
        + [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={longest}",
            f"data.max_seq_len={longest}",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ],
    )
    trainer = Trainer(cfg)
    try:
        loss = trainer.accumulate([GlobalBatch([_microbatch([s], cfg) for s in pair], epoch=0)])
    finally:
        trainer.shutdown()
    ranks = [r["first_loss"] for r in peer["ranks"]]
    assert ranks[0] != ranks[1]  # two different samples, so the token weighting is exercised
    assert abs(peer["steps"][0]["loss"] - loss) / loss <= 1e-5, (peer["steps"][0]["loss"], loss)
