"""The CUDA path: nccl groups, bf16 autocast over fp32 master weights, SDPA, on one shared GPU.

Marked `gpu` and skipped where no GPU is visible; the same logic runs on CPU/gloo in test_parity.py
(this file adds only what differs on a GPU: the backend, the device, the compute dtype). One vision and
one text actor share the GPU with half each, as `pipeline.placement: shared` places them: each pool is an
nccl world of one. Multi-rank pools need a GPU per rank (nccl refuses two ranks of one communicator on
one GPU, "Duplicate GPU detected"), so SP/TP over nccl waits for a multi-GPU machine; their collectives
run on gloo in test_parity.py. Ray detects the GPU itself (the shared `ray_session` asks only for CPUs).
"""

from __future__ import annotations

import copy

import pytest
import ray
import torch

from dhp.dataflow.loader import GlobalBatch
from dhp.dataflow.packing import text_inputs, vision_inputs
from dhp.stages import step_logs
from dhp.stages.config import load_config
from dhp.stages.trainer import Trainer
from tests.conftest import ONE_GPU_POOLS
from tests.test_parity import BASE, _microbatch, collect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


# `dhp train` on one GPU: each pool one rank with half of it, bf16 autocast over fp32 master weights, SDPA
ONE_GPU = [*ONE_GPU_POOLS, "model.dtype=bfloat16", "model.attn_implementation=sdpa"]


@pytest.mark.parametrize(
    ("dtype", "loss_tol", "grad_cos", "boundary"),
    [
        ("float32", 1e-4, 0.9999, "host"),
        ("bfloat16", 3e-2, 0.99, "host"),
        # the embeddings and their gradients stay on the GPU (stages/boundary.py)
        ("float32", 1e-4, 0.9999, "cuda_ipc"),
        ("bfloat16", 3e-2, 0.99, "cuda_ipc"),
    ],
)
def test_cuda_shared_gpu_matches_cpu_reference(parity_setup, ray_session, dtype, loss_tol, grad_cos, boundary):
    ref, ckpt, samples = parity_setup
    ref = copy.deepcopy(ref)
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ray.cluster_resources().get("GPU", 0) >= 1, "Ray did not detect the GPU torch sees"
    cfg = load_config(
        "tiny",
        BASE
        + [
            f"model.path={ckpt}",
            f"model.dtype={dtype}",
            "model.attn_implementation=sdpa",
            "vision.num_gpus_per_actor=0.5",
            "text.num_gpus_per_actor=0.5",
            "vision.num_cpus_per_actor=0.5",
            "text.num_cpus_per_actor=0.5",
            f"pipeline.boundary={boundary}",
        ],
    )
    trainer = Trainer(cfg)
    try:
        where = ray.get([a.where.remote() for a in trainer.vision.actors + trainer.text.actors])
        assert all(w["device"].startswith("cuda") for w in where)
        batches = [GlobalBatch([_microbatch([s], cfg) for s in samples], epoch=0)]
        loss = trainer.accumulate(batches)
        ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
        grads = collect(trainer, grads=True)
    finally:
        trainer.shutdown()
    v, t = vision_inputs(samples), text_inputs(samples, pad_id=151643)
    out = ref(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        labels=t["labels"],
        pixel_values=v["pixel_values"],
        image_grid_thw=v["image_grid_thw"],
        mm_token_type_ids=(t["input_ids"] == 151655).int(),
    )
    out.loss.backward()
    assert abs(loss - out.loss.item()) / out.loss.item() <= loss_tol
    for name, p in ref.named_parameters():
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten().double(), p.grad.flatten().double(), dim=0)
        assert cos >= grad_cos or p.grad.norm() < 1e-8, f"{name}: cosine {cos:.5f}"


def test_dhp_train_on_one_gpu_learns(tmp_path):
    """The README's main command on CUDA: the default run (tiny model, synthetic data, 100 steps, vision forwards
    pipelined ahead), its pools one rank each sharing the GPU (a multi-rank nccl group needs a GPU per rank),
    bf16 autocast over fp32 master weights. It learns as the CPU default does (tests/test_train_job.py)."""
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "dhp.stages.cli",
        "train",
        *ONE_GPU,
        f"output.dir={tmp_path}/runs",
        "output.name=cuda",
        f"data.synthetic.dir={tmp_path}/synth",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("device cuda") == 2, proc.stdout[:2000]  # both pools' ranks on the GPU
    records = step_logs.read(tmp_path / "runs" / "cuda")
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert len(records) == 100 and last <= first / 2, f"train loss {first:.3f} -> {last:.3f}: did not fall by half"
    assert all(0 < r["mfu"] < 1 for r in records)


def test_qwen3_vl_2b_trains_videos_on_one_gpu(tmp_path):
    """Qwen3-VL at a released size (2B, drawn at random: nothing downloaded) on one GPU, both pools' ranks
    sharing it, bf16 autocast, a synthetic set half of whose records are short videos (MPEG-4 files and frame
    lists): every step's loss finite, nothing skipped, videos among the records trained. The same command with
    `model.name=qwen3_vl_tiny` runs on CPU; the layouts' Qwen3-VL video parity is tests/test_video_parity.py."""
    import json
    import math
    import os
    import subprocess
    import sys

    run = tmp_path / "runs" / "qwen3"
    cmd = [
        sys.executable,
        "-m",
        "dhp.stages.cli",
        "train",
        "model.name=qwen3_vl_2b",
        *ONE_GPU,
        "data.synthetic.num=32",
        "data.synthetic.eval_num=0",
        "data.synthetic.video_fraction=0.5",
        "data.video.max_pixels=200704",  # frames x height x width of a clip (Qwen3-VL bounds the whole clip)
        f"data.synthetic.dir={tmp_path}/synth",
        "training.steps=6",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        "output.save_final_checkpoint=false",
        f"output.dir={tmp_path}/runs",
        "output.name=qwen3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("device cuda") == 2, proc.stdout[:2000]
    assert "skipped records: none" in proc.stdout, proc.stdout[-2000:]
    records = step_logs.read(run)
    assert len(records) == 6 and all(math.isfinite(r["loss"]) for r in records)
    lines = (tmp_path / "synth" / "train.jsonl").read_text().splitlines()
    steps = step_logs.read(run, "samples")
    trained = [src for step in steps for _, src in step["ids"]]
    assert any("video" in json.loads(lines[int(src.rsplit(":", 1)[1]) - 1]) for src in trained)


def test_per_part_init_draws_each_part_on_the_gpu():
    """`model.random_init=per_part` (what `dhp bench one-gpu` builds released shapes with) on CUDA: each TP rank's
    parts drawn on the device form one model of the exact build's distribution (tests/test_random_init.py is the
    CPU case)."""
    from dhp.models.architectures import architecture_config
    from dhp.models.parallel.layouts import make_layout
    from dhp.models.qwen2_5_vl import TextModel
    from dhp.models.weights.materialize import build_on_meta
    from dhp.models.weights.random_init import PerPart
    from tests.test_random_init import _same_distribution

    config = architecture_config("tiny")
    torch.manual_seed(0)
    exact = TextModel(config).state_dict()
    shapes = {n: t.shape for n, t in exact.items()}
    layout = make_layout("text", "tensor", 2, 2, config)
    parts = []
    for rank in range(2):
        _, recipe = build_on_meta(lambda: TextModel(config))
        part: dict[str, torch.Tensor] = {}
        PerPart().fill(recipe, layout.slicer(rank, shapes), part.__setitem__, 0, torch.device("cuda"))
        assert all(t.is_cuda for t in part.values())
        parts.append({n: t.cpu() for n, t in part.items()})
    full = layout.gather(parts)
    for name, t in exact.items():
        _same_distribution(name, full[name], t)
