"""Hugging Face checkpoint directories in and out, one stage's tensors at a time.

A stage reads only the tensors it owns (`safe_open` + `get_tensor` per key, never the whole file), so a
vision actor never materialises the language model. Missing, unexpected or mis-shaped tensors are
errors: a silently random-initialised weight is the worst possible failure of a fine-tuning run.
Names are the transformers 5 names (`model.visual.*`, `model.language_model.*`, `lm_head.*`); the
original Qwen2.5-VL release names (`visual.*`, `model.*`) are mapped onto them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dhp.models.parallel.tensor_parts import read_part

INDEX_FILE = "model.safetensors.index.json"
_LEGACY = [  # original release names -> transformers 5 names
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!visual\.|language_model\.)"), "model.language_model."),
]


def canonical_name(name: str) -> str:
    for pattern, repl in _LEGACY:
        if pattern.match(name):
            return pattern.sub(repl, name, count=1)
    return name


def checkpoint_index(path: str | os.PathLike) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name -> (safetensors file holding it, the name it is stored under)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model.path {root} is not a directory")
    index = root / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: root / file for name, file in weight_map.items()}
    else:
        files = {}
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                files.update({name: file for name in f.keys()})
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return {canonical_name(name): (file, name) for name, file in files.items()}


def load_stage_weights(
    module: nn.Module,
    hf_name,
    path: str | os.PathLike,
    prefixes: tuple[str, ...],
    slicer: Callable[[str], tuple | list | None] | None = None,
    full_shapes: dict[str, torch.Size] | None = None,
    assign: Callable[[nn.Module, dict[str, torch.Tensor]], None] | None = None,
) -> None:
    """Fill `module` from the checkpoint at `path`; `hf_name` maps a module name to a checkpoint name.

    `prefixes` are the checkpoint-name prefixes this stage owns: any checkpoint tensor under them that
    the module does not expect is reported, as is any expected tensor the checkpoint lacks.
    A sharded module passes `slicer` (module name -> index of this rank's part, None = whole tensor) and
    the unsharded `full_shapes`: each rank then reads only its slices (`get_slice`), never a full copy,
    and the checkpoint's full shapes are still checked. Each tensor is copied into its parameter as soon
    as it is read (`into_model`); `assign(module, {name: part})` does that where parameters are not plain
    tensors (ZeRO-3: DTensors holding this rank's rows).
    """
    index = checkpoint_index(path)
    expected = {hf_name(n): n for n in module.state_dict(keep_vars=False)}
    tied = tied_names(module, hf_name)
    present = {n for n in index if n.startswith(prefixes)}
    missing = sorted(set(expected) - present - tied)
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)})"
        )
    shapes = full_shapes or {n: t.shape for n, t in module.state_dict().items()}
    put = into_model(module, assign)
    for name, local in expected.items():
        if name not in present:
            continue  # tied to a tensor loaded under its other name
        file, stored_as = index[name]
        with safe_open(file, framework="pt") as f:
            part = f.get_slice(stored_as)
            if tuple(part.get_shape()) != tuple(shapes[local]):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(part.get_shape())}, model shape {tuple(shapes[local])}"
                )
            idx = slicer(local) if slicer else None
            if idx is None:
                value = f.get_tensor(stored_as)
            else:  # a list index (vision TP's fused qkv): its row blocks, read one by one, concatenated
                value = read_part(part, idx)
        put(local, value)  # copied into the parameter now: the rank never holds its state twice


def into_model(
    module: nn.Module, assign: Callable[[nn.Module, dict[str, torch.Tensor]], None] | None = None
) -> Callable[[str, torch.Tensor], None]:
    """`put(name, value)`: copy one tensor (this rank's part, any dtype) into the module's tensor of that name,
    checking its shape; `assign` instead where parameters are not plain tensors (ZeRO-3's DTensors)."""
    own = module.state_dict()

    def put(name: str, value: torch.Tensor) -> None:
        if assign is not None:
            assign(module, {name: value})
            return
        if own[name].shape != value.shape:
            raise ValueError(f"{name}: this rank's part is {tuple(value.shape)}, its tensor {tuple(own[name].shape)}")
        with torch.no_grad():
            own[name].copy_(value)

    return put


def tied_names(module: nn.Module, hf_name) -> set[str]:
    """Checkpoint names that share storage with an earlier parameter (tied lm_head / embedding)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            tied.add(hf_name(name))
        seen[key] = name
    return tied


def save_shard(state: dict[str, torch.Tensor], out_dir: str | os.PathLike, filename: str) -> dict[str, str]:
    """Write one safetensors shard; returns its part of the index's weight_map."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / filename), metadata={"format": "pt"})
    return {name: filename for name in state}
