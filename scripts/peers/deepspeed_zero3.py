"""The peer users run instead of dhp: transformers' Qwen2.5-VL trained by DeepSpeed's own ZeRO-3 engine.

Run as qwen-vl-finetune runs it: every process a data-parallel replica with micro-batch 1, the DeepSpeed JSON
config (`zero3.json` here is qwen-vl-finetune's, "auto" values and all), `HfDeepSpeedConfig` alive before
`from_pretrained` so the weights are partitioned as they load (zero.Init), torch's AdamW handed to
`deepspeed.initialize` as the HF Trainer hands it, and the "auto" values filled the way the HF Trainer fills them.

Launch (torchrun-style environment, N local processes; gloo on CPU, nccl on GPU):

    python -m dhp.scripts.peers.deepspeed_zero3 --launch 4 --model CKPT --samples SAMPLES.pt --out OUT.json

`--launch N` spawns the N ranks (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, as torchrun or the
`deepspeed` launcher set them) and waits; without it the process is one rank of an already-launched job.
SAMPLES.pt is a `torch.save`d list of dhp-preprocessed samples (`decode_sample` dicts): rank r trains sample
`(r + N * step) % len` at each step, so dhp and the peer can be handed exactly the same data.

With `--probe-sides` the ranks then climb those image sides (`probe.largest_fitting`), one training step per
probe, for the largest image whose per-rank bytes (ZeRO-3 state + what autograd keeps) stay within `--cap-bytes`.

Rank 0 writes OUT.json: per step the token-weighted loss over all ranks (sum of loss_r * tokens_r / sum of
tokens_r, which is dhp's loss of the same global batch) and the step's seconds (the last step also counts
the bytes autograd keeps, which costs time: time the others); per rank the peak bytes autograd
kept for backward (`models/saved_tensors.SavedBytes`, gathered ZeRO-3 parameters excluded) and the peak RSS;
and the seconds of `deepspeed.init_distributed` + `deepspeed.initialize` with the DeepSpeed ops JIT-built in
them (on CPU, the first run on a machine builds `deepspeed_shm_comm_op` with the system's C++ compiler; later
runs load it from torch's extension cache, and `jit_built` is then empty).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).with_name("zero3.json")


def fill_auto(config: dict[str, Any], world: int, precision: str, max_grad_norm: float, hidden: int) -> dict:
    """The HF Trainer's filling of a DeepSpeed config's "auto" values (`HfTrainerDeepSpeedConfig`), for
    micro-batch 1, no gradient accumulation and torch's AdamW (the config names no optimizer)."""
    values = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": max_grad_norm,
    }
    zero = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    out = json.loads(json.dumps(config))
    for key, value in values.items():
        if out.get(key) == "auto":
            out[key] = value
    for key, value in zero.items():
        if out.get("zero_optimization", {}).get(key) == "auto":
            out["zero_optimization"][key] = value
    import torch

    from dhp.models.precision import precision_of

    bf16 = precision_of(precision).param_dtype == torch.bfloat16  # dhp's precision object: the runs it is set against
    for section, on in (("fp16", False), ("bf16", bf16)):
        if out.get(section, {}).get("enabled") == "auto":
            out[section]["enabled"] = on
    left = [k for k, v in _leaves(out) if v == "auto"]
    if left:
        raise ValueError(f"DeepSpeed config values left 'auto' that this driver cannot fill: {left}")
    return out


def _leaves(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    return [
        kv
        for k, v in d.items()
        for kv in (_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    ]


def hf_batch(sample: dict, dtype: Any) -> dict[str, Any]:
    """One sample as `Qwen2_5_VLForConditionalGeneration.forward` takes it (what tests/test_parity.py feeds)."""
    from dhp.dataflow.packing import text_inputs, vision_inputs

    v, t = vision_inputs([sample]), text_inputs([sample], pad_id=151643)
    return dict(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        labels=t["labels"],
        pixel_values=v["pixel_values"].to(dtype),
        image_grid_thw=v["image_grid_thw"],
        mm_token_type_ids=(t["input_ids"] == 151655).int(),
    )


def _extensions() -> set[str]:
    """DeepSpeed ops built so far (torch's JIT extension cache)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return {str(p.relative_to(root)) for p in root.glob("*/*") if p.is_dir()} if root.exists() else set()


def rank_main(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.integrations import HfDeepSpeedConfig

    from dhp.models.planning.saved_tensors import SavedBytes
    from dhp.models.precision import precision_of
    from dhp.scripts.peers.probe import image_sample, largest_fitting, patches

    # DeepSpeed 0.19 calls collectives torch 2.13 renamed: one FutureWarning per call and rank, nothing to act on
    warnings.filterwarnings("ignore", message="`torch.distributed.", category=FutureWarning)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    built_before = _extensions()
    start = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # on CPU: JIT-builds its shm comm op once
    init_s = time.perf_counter() - start
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = precision_of(args.precision).param_dtype
    hidden = AutoConfig.from_pretrained(args.model).text_config.hidden_size
    ds_config = fill_auto(json.loads(Path(args.config).read_text()), world, args.precision, args.max_grad_norm, hidden)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (must stay alive: from_pretrained reads it -> zero.Init)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=args.adam_eps, weight_decay=args.weight_decay
    )
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    init_s += time.perf_counter() - start
    jit = sorted(_extensions() - built_before)

    def train_one(sample: dict, count_saved: bool) -> tuple[Any, int, int]:
        """One DeepSpeed step on `sample`: (loss, its labelled tokens, bytes autograd kept for backward; 0
        unless `count_saved`: the saved-tensor hooks cost time)."""
        batch = {k: v.to(device) for k, v in hf_batch(sample, dtype).items()}
        with SavedBytes(engine.module) if count_saved else contextlib.nullcontext() as saved:
            loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss, int((batch["labels"][:, 1:] != -100).sum()), saved.total if count_saved else 0

    samples = torch.load(args.samples, weights_only=False)
    steps, peak_saved = [], 0
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        measured = step == args.steps - 1  # only the last step counts bytes
        loss, tokens, saved_bytes = train_one(samples[(rank + world * step) % len(samples)], measured)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        peak_saved = max(peak_saved, saved_bytes)
        parts = torch.tensor([loss.item() * tokens, tokens], dtype=torch.float64)
        dist.all_reduce(parts)
        steps.append(
            {
                "loss": (parts[0] / parts[1]).item(),
                "seconds": seconds,
                "measured": measured,
                "rank_loss": loss.item(),
                "rank_tokens": tokens,
            }
        )

    # ZeRO-3 state on this rank: its partition of every parameter, with its gradient and Adam's two moments
    # (fp32: 4 + 4 + 8 bytes an element; bf16 with fp32 master weights comes to the same 16)
    state_bytes = 16 * sum(
        p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters()
    )
    probes: list[dict[str, int]] = []

    def fits(side: int) -> bool:
        """One training step on one side x side image on every rank; fits when every rank's state plus the
        bytes its autograd kept for backward stay within --cap-bytes."""
        saved_bytes = train_one(image_sample(engine.module.config, side, Path(args.work) / f"rank{rank}"), True)[2]
        peak = torch.tensor([state_bytes + saved_bytes], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        probes.append({"side": side, "patches": patches(side), "peak_bytes": int(peak)})
        return int(peak) <= args.cap_bytes

    sides = [int(s) for s in args.probe_sides.split(",")] if args.probe_sides else []
    largest = largest_fitting(fits, sides) if sides else None

    per_rank = [None] * world
    mine = {
        "rank": rank,
        "peak_saved_bytes": peak_saved,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "first_loss": steps[0]["rank_loss"] if steps else None,
    }
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        out = {
            "system": "deepspeed-zero3",
            "deepspeed": deepspeed.__version__,
            "world": world,
            "device": "cuda" if cuda else "cpu",
            "precision": args.precision,
            "activation_checkpointing": args.activation_checkpointing,
            "config": ds_config,
            "initialize_s": init_s,
            "jit_built": jit,
            "steps": steps,
            "ranks": per_rank,
            "state_bytes_per_rank": state_bytes,
            "cap_bytes": args.cap_bytes,
            "probes": probes,
            "largest_side": largest,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, argv: list[str], timeout_s: float = 1200) -> dict[str, Any]:
    """Run `world` local ranks of this driver (torchrun's environment) and return rank 0's JSON (its --out)."""
    out = Path(argv[argv.index("--out") + 1])
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "dhp.scripts.peers.deepspeed_zero3", *argv], env=env))
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"DeepSpeed ZeRO-3 peer failed: exit codes {codes} (the ranks' output is above)")
    return json.loads(out.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", type=int, default=0, help="spawn this many local ranks and wait (0: be one rank)")
    p.add_argument("--model", required=True, help="a Hugging Face Qwen2.5-VL checkpoint directory")
    p.add_argument("--samples", required=True, help="torch.save'd list of dhp-preprocessed samples")
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--config", default=str(CONFIG), help="DeepSpeed JSON config (default: qwen-vl-finetune's)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--probe-sides",
        default="",
        help="after the steps: image sides (px, ascending) to climb "
        "for the largest image that fits --cap-bytes (scripts/peers/probe.py)",
    )
    p.add_argument("--cap-bytes", type=int, default=0, help="per-rank cap: ZeRO-3 state + kept activations")
    p.add_argument("--work", default=".", help="where the probes' images are written")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.launch:
        i = argv.index("--launch")
        result = launch(args.launch, argv[:i] + argv[i + 2 :])
        print(
            json.dumps(
                {"losses": [s["loss"] for s in result["steps"]], "seconds": [s["seconds"] for s in result["steps"]]}
            )
        )
        return 0
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
