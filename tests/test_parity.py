"""One vision actor + one text actor on Ray must train exactly like the single-process transformers model.

The reference is `Qwen2_5_VLForConditionalGeneration` on the whole batch in one forward (it computes its
own mRoPE positions); dhp splits the same batch into three micro-batches (one text-only), runs the vision stage and the
text stage in separate actors, and moves embeddings and their gradients actor to actor.
"""

from __future__ import annotations

import json

import pytest
import ray
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.dataflow.loader import GlobalBatch, MicroBatch
from dhp.dataflow.packing import meta_of, text_inputs, vision_inputs
from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
from dhp.models.architectures import architecture_config
from dhp.stages.config import load_config
from dhp.stages.stage_worker import build_optimizer
from dhp.stages.trainer import Trainer

STEPS = 3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float(a.norm())


@pytest.fixture(scope="module")
def setup(tmp_path_factory, parity_data):
    torch.manual_seed(1234)
    model_config = architecture_config("tiny")
    ref = Qwen2_5_VLForConditionalGeneration(model_config).float().train()
    ckpt = tmp_path_factory.mktemp("ckpt")
    ref.save_pretrained(ckpt)
    settings = PreprocessSettings(str(parity_data), min_pixels=56 * 56, max_pixels=224 * 224, max_seq_len=1024)
    pre = Preprocessor(settings, model_config)
    lines = (parity_data / "train.jsonl").read_text().splitlines()
    samples = [decode_sample(pre({"source": "t", "record": line})["sample"]) for line in lines]
    return ref, ckpt, samples


def test_one_step_and_three_updates_match_transformers(setup, ray_session, tmp_path):
    ref, ckpt, samples = setup
    longest = max(s["input_ids"].shape[0] for s in samples)
    cfg = load_config(
        "tiny",
        [
            f"model.path={ckpt}",
            f"data.microbatch_tokens={longest}",
            f"data.max_seq_len={longest}",
            f"training.steps={STEPS}",
            "training.warmup_steps=1",
            "training.lr=1e-3",
            "training.weight_decay=0.1",
            "training.max_grad_norm=1.0",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
        ],
    )
    # One sample per micro-batch: accumulation over three, one of them text-only (an empty vision call).
    microbatches = []
    for group in ([0], [1], [2]):
        chosen = [samples[i] for i in group]
        vision, text = vision_inputs(chosen), text_inputs(chosen, pad_id=151643)
        microbatches.append(MicroBatch(ray.put(vision), ray.put(text), meta_of(vision, text)))
    batch = GlobalBatch(microbatches, epoch=0)

    # The reference sees the whole batch at once, padded together, and derives positions itself.
    full_v, full_t = vision_inputs(samples), text_inputs(samples, pad_id=151643)
    assert samples[2]["image_grid_thw"].shape[0] == 0
    assert full_v["image_grid_thw"].shape[0] == 3 and len({tuple(g) for g in full_v["image_grid_thw"].tolist()}) == 2
    ref_inputs = dict(
        input_ids=full_t["input_ids"],
        attention_mask=full_t["attention_mask"],
        labels=full_t["labels"],
        pixel_values=full_v["pixel_values"],
        image_grid_thw=full_v["image_grid_thw"],
        mm_token_type_ids=(full_t["input_ids"] == 151655).int(),
    )
    optimizer, scheduler = build_optimizer(ref, cfg)

    trainer = Trainer(cfg)
    try:
        for step in range(STEPS):
            loss = trainer.accumulate(batch)
            grads = {}
            for part in trainer.vision.execute_all("gradients_hf") + trainer.text.execute_all("gradients_hf"):
                grads.update(part)

            ref_loss = ref(**ref_inputs).loss
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) / ref_loss.item() <= 1e-6, (step, loss, ref_loss.item())
            ref_params = dict(ref.named_parameters())
            assert set(grads) == set(ref_params)
            errors = {n: rel_err(grads[n], p.grad) for n, p in ref_params.items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, f"step {step}: gradient of {worst} off by {errors[worst]:.2e}"

            grad_norm, lr = trainer.optimizer_step()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.training.max_grad_norm)
            assert abs(grad_norm - ref_norm.item()) / ref_norm.item() <= 1e-5
            assert lr == optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        assert grad_norm > cfg.training.max_grad_norm or step == 0  # clipping was exercised at least once

        params = {}
        for part in trainer.vision.execute_all("parameters_hf") + trainer.text.execute_all("parameters_hf"):
            params.update(part)
        for name, p in ref.named_parameters():
            # Absolute: Adam turns fp-rounding noise in near-zero gradients into updates of up to ~1e-2 x lr.
            diff = (params[name] - p.detach()).abs().max().item()
            assert diff <= 1e-5, f"{name} differs by {diff:.2e} after {STEPS} steps"

        # The exported checkpoint is a Hugging Face directory that transformers loads as is.
        out = tmp_path / "export"
        trainer.save_weights(out)
        loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        for name, p in loaded.named_parameters():
            assert torch.equal(p.detach(), params[name]), name
    finally:
        trainer.shutdown()
