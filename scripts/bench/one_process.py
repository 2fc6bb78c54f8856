"""The one-process loops `dhp bench one-gpu` compares dhp with, each training a workload's micro-batches in the
bench's own process:

- `run_stock`: transformers' `Qwen2_5_VLForConditionalGeneration` as a user writes the loop: each micro-batch
  right-padded to its longest sample with an attention mask (what the model takes for several samples), the
  model's own mRoPE positions, SDPA, activation checkpointing on the blocks dhp recomputes, torch's AdamW
  over all parameters, `clip_grad_norm_`. Its loss is the mean over the step's labelled tokens
  (`num_items_in_batch`), as dhp's.
- `run_same_kernels`: dhp's two halves (`VisionModel` with grouped window attention, `TextModel(packed=...)`
  with per-sample attention on packed micro-batches), built by `build_stage` as a dhp rank builds them, with
  dhp's activation checkpointing, its optimizer (`build_optimizer`: `training.optimizer`, fused AdamW in the
  bench) and its clipped step, in one autograd graph: dhp without actors, object store or pipeline, so that dhp
  against it is the framework's cost.

Both start from the weights a dhp rank of the same config builds (the stock model copies them in), so on the tiny
shape the three systems' first losses agree. Each returns the median step, every step's seconds and loss, what it
trained (`trained`: samples, images, patches, tokens, label tokens, micro-batches, padded token slots) and the
process's peak memory; with `profile_steps`, that many more steps under torch.profiler.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

STAGES = ("vision", "text")
PAD_ID = 151643  # <|endoftext|>: what dhp's loader pads text with


def trained(metas: list[Any]) -> dict[str, int]:
    """What a step trains, summed over its micro-batches' `MicroBatchMeta`s."""
    fields = ("samples", "images", "patches", "tokens", "label_tokens", "padded_tokens")
    return {"microbatches": len(metas), **{f: sum(getattr(m, f) for m in metas) for f in fields}}


def build_half(cfg: Any, mc: Any, stage: str, device: Any) -> Any:
    """`stage`'s model as a dhp rank of `cfg` builds it (models/stage_build.py: seed, precision, init or
    checkpoint, fine-tuning's frozen parts), alone on `device`, with `cfg`'s activation checkpointing and
    compilation."""
    from dhp.models.activation_checkpointing import ActivationCheckpointing
    from dhp.models.compilation import BlockCompile
    from dhp.models.fine_tuning import FineTuning
    from dhp.models.parallel.layout import PoolRanks
    from dhp.models.parallel.layouts import stage_layout
    from dhp.models.precision import precision_of
    from dhp.models.qwen2_5_vl import TextModel, VisionModel
    from dhp.models.stage_build import build_stage
    from dhp.models.weights.random_init import random_init

    build = (lambda: VisionModel(mc)) if stage == "vision" else (lambda: TextModel(mc, packed=cfg.data.packing))
    layout = stage_layout(cfg, stage, mc)
    model, _ = build_stage(
        build,
        layout,
        PoolRanks(0, 1, 1, 0, 0, None, None, device),
        precision_of(cfg.model.precision),
        seed=cfg.model.init_seed,
        path=cfg.model.path,
        freeze=FineTuning(cfg).freeze,
        init=random_init(cfg.model.random_init),
    )
    ActivationCheckpointing.of(getattr(cfg, stage)).apply(model.blocks())
    BlockCompile.of(getattr(cfg, stage)).apply(layout.compile_units(model))
    return model


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_loop(step: Callable[[], float], steps: int, profile_steps: int) -> dict[str, Any]:
    """1 + `steps` calls of `step` (the first a warm-up), each timed to the device's end: median step, every
    step's seconds and loss, this process's peak; then `profile_steps` more under torch.profiler (none of the
    measured ones carries its overhead)."""
    from dhp.scripts.bench.one_gpu import _peak_bytes, _peak_reserved, _reset_peak, profile_summary, profiled

    _reset_peak()
    times, losses = [], []
    for _ in range(1 + steps):
        _synchronize()
        start = time.perf_counter()
        losses.append(step())
        _synchronize()
        times.append(time.perf_counter() - start)
    out = {
        "step_s": statistics.median(times[1:]),
        "steps_s": times,
        "losses": losses,
        "peak_bytes": {"process": _peak_bytes()},
        "peak_reserved_bytes": {"process": _peak_reserved()},
    }
    if profile_steps:
        with profiled(profile_steps) as prof:
            wall = 0.0
            for i in range(1 + profile_steps):  # the first is the profiler's warm-up, not recorded
                _synchronize()
                start = time.perf_counter()
                step()
                _synchronize()
                wall += time.perf_counter() - start if i else 0.0
                prof.step()
        began = time.perf_counter()
        summary = profile_summary(prof.events(), wall)
        out["profile"] = {"process": {**summary, "summary_s": time.perf_counter() - began}}
    return out


def _release() -> None:
    """Give this process's freed device memory back before the next system starts (a reference cycle first)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stock_model(cfg: Any, mc: Any, device: Any) -> Any:
    """transformers' whole model on `device` in the precision's dtype, holding the weights dhp's ranks build
    (each half built and copied in, one at a time: the device holds the model and one half at most)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.models.precision import precision_of

    with device:
        model = Qwen2_5_VLForConditionalGeneration._from_config(  # a copy: _from_config sets its dtype
            copy.deepcopy(mc),
            attn_implementation=cfg.model.attn_implementation,
            dtype=precision_of(cfg.model.precision).param_dtype,
        ).train()
    missing = set(model.state_dict())
    for stage in STAGES:
        half = build_half(cfg, mc, stage, device)
        state = {half.hf_name(n): t for n, t in half.state_dict().items()}
        with torch.no_grad():
            unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"dhp's {stage} half has tensors transformers' model lacks: {unexpected[:3]}")
        missing -= set(state)
        del half, state
        _release()
    if missing:
        raise ValueError(f"no dhp half holds {sorted(missing)[:3]}")
    return model


def stock_inputs(vision: dict, text: dict, dtype: Any, image_token_id: int) -> dict[str, Any]:
    """One padded micro-batch as `Qwen2_5_VLForConditionalGeneration.forward` takes it (it computes the positions)."""
    return {
        "input_ids": text["input_ids"],
        "attention_mask": text["attention_mask"],
        "labels": text["labels"],
        "pixel_values": vision["pixel_values"].to(dtype),
        "image_grid_thw": vision["image_grid_thw"],
        "mm_token_type_ids": (text["input_ids"] == image_token_id).int(),
    }


def in_this_process(run: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`run(cfg, ...)` with the intra-op threads a dhp actor of `cfg` computes with (`text.torch_threads`: on 2
    busy CPU cores the loops ran 3-7 times slower with torch's default of 2 than with dhp's 1), then its model's
    device memory handed back (once its frame is gone) for the next system."""

    def wrapped(cfg: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.text.torch_threads)
        try:
            return run(cfg, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)
            _release()

    return wrapped


@in_this_process
def run_stock(cfg: Any, mc: Any, workload: Any, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """transformers' model, the workload's micro-batches padded (module docstring)."""
    import torch

    from dhp.dataflow.packing import meta_of
    from dhp.models.activation_checkpointing import ActivationCheckpointing
    from dhp.models.precision import precision_of

    device, precision, t = _device(), precision_of(cfg.model.precision), cfg.training
    microbatches = workload.microbatches(packed=False)
    counted = trained([meta_of(v, x) for v, x in microbatches])
    batches = [stock_inputs(v, x, precision.param_dtype, mc.image_token_id) for v, x in microbatches]
    model = stock_model(cfg, mc, device)
    # the blocks dhp's ranks recompute, in transformers' own model (what gradient_checkpointing_enable sets, per block)
    ActivationCheckpointing.of(cfg.vision).apply(model.model.visual.blocks)
    ActivationCheckpointing.of(cfg.text).apply(model.model.language_model.layers)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay
    )
    autocast = precision.autocast(device, precision.compute_dtype(cfg.model.dtype))

    def step() -> float:
        total = torch.zeros((), device=device)
        for batch in batches:
            with autocast:
                loss = model(
                    **{k: v.to(device) for k, v in batch.items()}, num_items_in_batch=counted["label_tokens"]
                ).loss
            loss.backward()
            total += loss.detach()
            del loss  # its graph's leaves are the parameters: a live loss keeps the model after `del model`
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    return {**timed_loop(step, steps, profile_steps), "trained": counted}


@in_this_process
def run_same_kernels(cfg: Any, mc: Any, workload: Any, steps: int, profile_steps: int = 0) -> dict[str, Any]:
    """dhp's halves, optimizer and clipping in one process and one graph (module docstring)."""
    import torch

    from dhp.dataflow.packing import meta_of
    from dhp.models.compilation import compile_stats, compiled
    from dhp.models.precision import precision_of
    from dhp.stages.stage_worker import build_optimizer, clip_coefficient, clipped_step

    before = compile_stats()  # this process's counts so far: the earlier workloads' compilations
    device, precision = _device(), precision_of(cfg.model.precision)
    microbatches = workload.microbatches(packed=cfg.data.packing)
    counted = trained([meta_of(v, x) for v, x in microbatches])
    halves = {stage: build_half(cfg, mc, stage, device) for stage in STAGES}
    optimizers = {stage: build_optimizer(model, cfg) for stage, model in halves.items()}
    vision, text = halves["vision"], halves["text"]
    autocast = lambda: precision.autocast(device, cfg.model.dtype)  # noqa: E731 (a new context each use)
    scale = 1.0 / counted["label_tokens"]  # the mean over the step's labelled tokens, as dhp's loss_scale

    def step() -> float:
        total = torch.zeros((), device=device)
        for pixels, tokens in microbatches:
            tokens = {k: v.to(device) for k, v in tokens.items()}
            with autocast():
                embeds = vision(pixels["pixel_values"].to(device), pixels["image_grid_thw"].to(device))
            with autocast():
                loss = scale * text(
                    tokens["input_ids"],
                    embeds,
                    tokens["position_ids"],
                    tokens.get("attention_mask"),  # none when packed
                    tokens["labels"],
                    tokens.get("cu_seqlens"),
                )
            loss.backward()
            total += loss.detach()
            del loss, embeds
        grads = [p.grad for model in halves.values() for p in model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True))
        coef = clip_coefficient(norm, cfg.training.max_grad_norm)
        for stage, (optimizer, scheduler) in optimizers.items():
            clipped_step(optimizer, halves[stage].parameters(), coef)
            scheduler.step()
        return float(total)

    timed = timed_loop(step, steps, profile_steps)
    units = sum(compiled(m) for model in halves.values() for m in model.modules())
    if not units:
        return {**timed, "trained": counted}
    after = compile_stats()
    on_vision, on_text = cfg.vision.compile, cfg.text.compile
    # one process compiles both halves: its counts are the loop's, not a stage's (dhp's rows have one per pool)
    loop = {
        "backend": on_text if on_vision == on_text else f"vision {on_vision}, text {on_text}",
        "units": units,
        **{k: after[k] - before.get(k, 0) for k in after},
    }
    return {**timed, "trained": counted, "compiled": {"process": loop}}
