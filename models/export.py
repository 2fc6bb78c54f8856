"""`dhp export-hf`: a dhp checkpoint (one safetensors file per rank, any layout) -> a Hugging Face dir, streamed.

A dhp checkpoint directory holds `{stage}-rank{rank:05d}.safetensors` (each rank's local tensors under
module names: slices under tensor parallelism, rows under ZeRO-3, full copies otherwise), `config.json`
(the model's `Qwen2_5_VLConfig`) and `dhp_checkpoint.json` (each stage's layout). Export opens only the
ranks that make one copy of each stage (`layout.state_ranks`, memory-mapped), plans the output from their
headers (full shapes by gathering meta tensors), then reassembles one full tensor at a time as the workers
do (`layout.gather` of that tensor's parts), renames it as transformers does and writes it into
`output.max_shard_size` shards (models/hf_writer.py), so `from_pretrained(out)` loads it. Peak memory is
the largest tensor twice (its parts and the gathered whole), never a stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import Qwen2_5_VLConfig

from dhp.models.hf_writer import DEFAULT_MAX_SHARD_SIZE, DTYPE_OF, Entry, write_shards
from dhp.models.layouts import make_layout
from dhp.models.qwen2_5_vl import TextModel, VisionModel

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
    sources: dict[str, tuple[Any, list[Any], str]] = {}  # hf name -> (layout, open rank files, module name)
    for stage, lay in meta["layout"].items():
        layout = make_layout(stage, lay["parallelism"], lay["degree"], lay["num_actors"], config)
        files = [ckpt_dir / f"{stage}-rank{r:05d}.safetensors" for r in layout.state_ranks(0)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{ckpt_dir}: missing rank files {missing}")
        handles = [safe_open(str(f), framework="pt") for f in files]
        for name in sorted(handles[0].keys()):
            hf = HF_NAME[stage](name)
            if stage == "text" and config.tie_word_embeddings and hf == "lm_head.weight":
                continue  # stored once, under the embedding
            parts = [h.get_slice(name) for h in handles]
            dtype = DTYPE_OF[parts[0].get_dtype()]
            metas = [{name: torch.empty(p.get_shape(), dtype=dtype, device="meta")} for p in parts]
            entries.append(Entry(hf, tuple(layout.gather(metas)[name].shape), dtype))
            sources[hf] = (layout, handles, name)

    def produce(e: Entry) -> torch.Tensor:
        layout, handles, name = sources[e.name]
        return layout.gather([{name: h.get_tensor(name)} for h in handles])[name]

    weight_map = write_shards(out_dir, entries, produce, max_shard_size)
    config.save_pretrained(out_dir)
    return weight_map
