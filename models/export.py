"""`dhp export-hf`: a dhp checkpoint (one safetensors file per rank, any layout) -> a Hugging Face dir, streamed.

A dhp checkpoint directory holds `{stage}-rank{rank:05d}.safetensors` (each rank's local tensors under
module names: slices under tensor parallelism, rows under ZeRO-3, full copies otherwise), `config.json`
(the model's `Qwen2_5_VLConfig`) and `dhp_checkpoint.json` (each stage's layout). Export opens only the
ranks that make one copy of each stage (`layout.state_ranks`), plans the output from their headers (full
shapes by gathering meta tensors), then assembles one full tensor at a time: each rank's part is read (plain
file reads, no memory map) into its place in the output tensor, found by the layout's own `slicer` (the
index a rank's part has in the full tensor, as the workers use it to load). A part that is a contiguous block
of the output (ZeRO-3 rows, vocab-parallel rows, column-parallel rows, a fused qkv's blocks) is read straight
into it; a strided one (row-parallel columns) a few rows at a time (`hf_writer.CHUNK_BYTES`).
The tensor is renamed as transformers does and written into `output.max_shard_size` shards
(models/hf_writer.py), so `from_pretrained(out)` loads it. Peak memory: the largest tensor plus 16 MiB
(tests/test_export_streaming.py measures it), never a stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5_VLConfig

from dhp.models.hf_writer import DEFAULT_MAX_SHARD_SIZE, Entry, SafetensorsReader, write_shards
from dhp.models.layouts import make_layout
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.tensor_parallel import part_blocks

META = "dhp_checkpoint.json"
HF_NAME = {"vision": VisionModel.hf_name, "text": TextModel.hf_name}


def write_meta(ckpt_dir: Path, layout: dict[str, dict[str, Any]], step: int, model_config) -> None:
    """layout: stage -> {parallelism, degree, num_actors}."""
    model_config.save_pretrained(ckpt_dir)
    (ckpt_dir / META).write_text(json.dumps({"format": 1, "step": step, "layout": layout}, indent=1))


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / META
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a dhp checkpoint (no {META})")
    return json.loads(path.read_text())


def export_hf(
    ckpt_dir: str | Path, out_dir: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> dict[str, str]:
    """Write the HF directory; returns its weight_map (checkpoint name -> file)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = read_meta(ckpt_dir)
    config = Qwen2_5_VLConfig.from_pretrained(ckpt_dir)
    entries: list[Entry] = []
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
                hf = HF_NAME[stage](name)
                if stage == "text" and config.tie_word_embeddings and hf == "lm_head.weight":
                    continue  # stored once, under the embedding
                metas = [{name: torch.empty(h.entries[name].shape, dtype=h.entries[name].dtype, device="meta")}
                         for h in handles]
                entries.append(Entry(hf, tuple(layout.gather(metas)[name].shape), handles[0].entries[name].dtype))
                sources[hf] = (layout, ranks, handles, name)

        def produce(e: Entry) -> torch.Tensor:
            layout, ranks, handles, name = sources[e.name]
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

        weight_map = write_shards(out_dir, entries, produce, max_shard_size)
    finally:
        for h in readers:
            h.close()
    config.save_pretrained(out_dir)
    return weight_map
