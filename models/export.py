"""`dhp export-hf`: a dhp checkpoint (one safetensors file per rank, any layout) -> a Hugging Face dir.

A dhp checkpoint directory holds `{stage}-rank{rank:05d}.safetensors` (each rank's local tensors under
module names: slices under tensor parallelism, rows under ZeRO-3, full copies otherwise), `config.json`
(the model's `Qwen2_5_VLConfig`) and `dhp_checkpoint.json` (each stage's layout). Export reads only the
ranks that make one copy of each stage (`layout.state_ranks`), reassembles full tensors as the workers do
(`layout.gather`), renames them as transformers does and writes one shard per stage plus the index, so
`Qwen2_5_VLForConditionalGeneration.from_pretrained(out)` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from transformers import Qwen2_5_VLConfig

from dhp.models.layouts import make_layout
from dhp.models.qwen2_5_vl import TextModel, VisionModel
from dhp.models.weights import save_shard, write_index

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


def export_hf(ckpt_dir: str | Path, out_dir: str | Path) -> dict[str, str]:
    """Write the HF directory; returns its weight_map (checkpoint name -> file)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = read_meta(ckpt_dir)
    config = Qwen2_5_VLConfig.from_pretrained(ckpt_dir)
    weight_map: dict[str, str] = {}
    for stage, lay in meta["layout"].items():
        layout = make_layout(stage, lay["parallelism"], lay["degree"], lay["num_actors"], config)
        files = [ckpt_dir / f"{stage}-rank{r:05d}.safetensors" for r in layout.state_ranks(0)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{ckpt_dir}: missing rank files {missing}")
        full = layout.gather([load_file(f) for f in files])
        named = {HF_NAME[stage](n): t.contiguous() for n, t in full.items()}
        if stage == "text" and config.tie_word_embeddings:
            named.pop("lm_head.weight", None)  # stored once, under the embedding
        weight_map.update(save_shard(named, out_dir, f"model-{stage}.safetensors"))
    write_index(out_dir, weight_map, config)
    return weight_map
