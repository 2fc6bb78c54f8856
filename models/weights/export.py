"""`dhp export-hf`: a dhp checkpoint (one safetensors file per rank, any layout) -> a Hugging Face dir, streamed.

A dhp checkpoint directory holds `{stage}-rank{rank:05d}.safetensors` (each rank's local tensors under module
names: slices under tensor parallelism, rows under ZeRO-3, full copies otherwise), `config.json` (the model's
config, which names its family: models/family/) and `dhp_checkpoint.json` (each stage's layout). Export opens
only the ranks that make one copy of each stage (`layout.state_ranks`), plans the output from their headers
(full shapes by gathering meta tensors), then assembles one full tensor at a time: each rank's part is read
(plain file reads, no memory map) into its place in the output tensor, found by the layout's own `slicer` (the
index a rank's part has in the full tensor, as the workers use it to load). A part that is a contiguous block of
the output (ZeRO-3 rows, vocab-parallel rows, column-parallel rows, a fused qkv's blocks) is read straight
into it; a strided one (row-parallel columns) a few rows at a time (`hf_writer.CHUNK_BYTES`).
The tensor is renamed as transformers does and written into `output.max_shard_size` shards
(models/weights/hf_writer.py), so `from_pretrained(out)` loads it. Peak memory: the largest tensor plus 16 MiB
(tests/test_export_streaming.py measures it), never a stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dhp.models.family import family_of, load_config
from dhp.models.lora import is_lora_factor
from dhp.models.parallel.layouts import make_layout
from dhp.models.parallel.tensor_parts import part_blocks
from dhp.models.weights.hf_checkpoint import checkpoint_index
from dhp.models.weights.hf_writer import DEFAULT_MAX_SHARD_SIZE, Entry, SafetensorsReader, write_shards

META = "dhp_checkpoint.json"


def write_meta(ckpt_dir: Path, layout: dict[str, dict[str, Any]], step: int, model_config, **extra: Any) -> None:
    """layout: stage -> {parallelism, degree, num_actors}. `extra` (None values left out): `lora`, the text
    stage's adapters ({rank, alpha, dropout, targets}); `partial`, the stages whose rank files hold only what
    trains; `base`, where their other tensors come from ({path, init_seed}: `model.path`, `model.init_seed`)."""
    model_config.save_pretrained(ckpt_dir)
    meta = {"format": 1, "step": step, "layout": layout, **{k: v for k, v in extra.items() if v}}
    (ckpt_dir / META).write_text(json.dumps(meta, indent=1))


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / META
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a dhp checkpoint (no {META})")
    return json.loads(path.read_text())


def export_hf(
    ckpt_dir: str | Path, out_dir: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> dict[str, str]:
    """Write the HF directory; returns its weight_map (checkpoint name -> file).

    LoRA (`lora` in the checkpoint's meta): each adapted weight is written merged, W + alpha / r x B A, and the
    factors also go to `out_dir/adapter` as a peft adapter directory (`PeftModel.from_pretrained(base, DIR)`).
    A stage whose rank files hold only what trains (`partial`: frozen modules, a LoRA base) takes its other
    tensors from the base checkpoint the meta points to (`base.path`).
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = read_meta(ckpt_dir)
    lora = meta.get("lora")
    from_base: dict[str, tuple[SafetensorsReader, str]] = {}  # hf name -> (base file, stored name)
    config = load_config(ckpt_dir)
    entries: list[Entry] = []
    factors: dict[str, Entry] = {}  # LoRA factors by HF name
    sources: dict[str, tuple[Any, list[int], list[SafetensorsReader], str]] = {}  # hf name -> where its parts are
    readers: list[SafetensorsReader] = []
    try:
        for stage, lay in meta["layout"].items():
            layout = make_layout(stage, lay["parallelism"], lay["degree"], lay["num_actors"], config)
            ranks = layout.state_ranks(0)
            files = [ckpt_dir / f"{stage}-rank{r:05d}.safetensors" for r in ranks]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{ckpt_dir}: missing rank files {missing}")
            handles = [SafetensorsReader(f) for f in files]
            readers += handles
            for name in sorted(handles[0].keys()):
                hf = family_of(config).stage_module_class(stage).hf_name(name)
                if stage == "text" and config.tie_word_embeddings and hf == "lm_head.weight":
                    continue  # stored once, under the embedding
                metas = [
                    {name: torch.empty(h.entries[name].shape, dtype=h.entries[name].dtype, device="meta")}
                    for h in handles
                ]
                entry = Entry(hf, tuple(layout.gather(metas)[name].shape), handles[0].entries[name].dtype)
                sources[hf] = (layout, ranks, handles, name)
                if is_lora_factor(name):
                    factors[hf] = entry
                else:
                    entries.append(entry)
            if stage in meta.get("partial", []):
                readers += _base_entries(ckpt_dir, meta.get("base") or {}, stage, config, sources, entries, from_base)

        def produce(e: Entry) -> torch.Tensor:
            if e.name in from_base:
                out = torch.empty(e.shape, dtype=e.dtype)
                from_base[e.name][0].read_into(from_base[e.name][1], out)
            else:
                out = _assemble(*sources[e.name], e)
            a, b = (adapters.get(e.name.removesuffix(".weight") + f".lora_{f}.weight") for f in "AB")
            if a is not None and b is not None:  # a LoRA-adapted weight, written merged
                out = (out.float() + lora["alpha"] / lora["rank"] * (b.float() @ a.float())).to(e.dtype)
            return out

        adapters = {h: _assemble(*sources[h], e) for h, e in factors.items()}  # full factors: r x the layers' width
        weight_map = write_shards(out_dir, entries, produce, max_shard_size)
        if adapters:
            write_adapter(out_dir / "adapter", adapters, lora, str(out_dir))
    finally:
        for h in readers:
            h.close()
    config.save_pretrained(out_dir)
    return weight_map


def _base_entries(
    ckpt_dir: Path,
    base: dict[str, Any],
    stage: str,
    config: Any,
    sources: dict,
    entries: list[Entry],
    from_base: dict[str, tuple[SafetensorsReader, str]],
) -> list[SafetensorsReader]:
    """Add to `entries` / `from_base` the tensors of `stage` that its rank files do not hold, from the base
    checkpoint; returns the readers it opened."""
    if not base.get("path"):
        raise ValueError(
            f"{ckpt_dir} holds only the trained tensors of the {stage} stage and its base is a seeded random init "
            f"(model.init_seed={base.get('init_seed')}), which export cannot read: export the run's final model "
            f"(RUN_DIR/checkpoint) instead, or train from a saved base (model.path)"
        )
    prefixes = family_of(config).stage_module_class(stage).checkpoint_prefixes
    opened: dict[Path, SafetensorsReader] = {}
    for hf, (file, stored) in sorted(checkpoint_index(base["path"]).items()):
        if not hf.startswith(prefixes) or hf in sources or hf in from_base:
            continue
        if stage == "text" and config.tie_word_embeddings and hf == "lm_head.weight":
            continue
        reader = opened.setdefault(file, SafetensorsReader(file))
        entries.append(Entry(hf, tuple(reader.entries[stored].shape), reader.entries[stored].dtype))
        from_base[hf] = (reader, stored)
    return list(opened.values())


def _assemble(layout: Any, ranks: list[int], handles: list[SafetensorsReader], name: str, e: Entry) -> torch.Tensor:
    """The full tensor `name` from the parts the ranks of one copy hold (read into place, as the slicer says)."""
    out = torch.empty(e.shape, dtype=e.dtype)
    shapes = {name: torch.Size(e.shape)}
    for rank, h in zip(ranks, handles):
        slicer = layout.slicer(rank, shapes)
        idx = slicer(name) if slicer else None
        if idx is None:  # replicated: every holder has the whole tensor
            h.read_into(name, out)
            break
        for view, row in part_blocks(out, idx):
            h.read_into(name, view, row)
    return out


def write_adapter(out: Path, factors: dict[str, torch.Tensor], lora: dict[str, Any], base: str) -> None:
    """A peft LoRA adapter directory: `adapter_model.safetensors` (peft's names: `base_model.model.` + the HF
    name) and `adapter_config.json` (peft's LoraConfig fields dhp's adapters use; peft fills the rest)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {f"base_model.model.{name}": t.contiguous() for name, t in factors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    targets = [t.strip() for t in lora["targets"].split(",") if t.strip()]
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
        "target_modules": rf".*language_model\.layers\.\d+\..*\.({'|'.join(targets)})",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
