"""The boundary between the vision pool and the text pool: layouts, the forward transform, its adjoint.

Vision output layout (per data-parallel replica): `k` shards, one per vision rank of the replica (k = the
sequence-parallel degree; 1 without SP, and 1 under vision tensor parallelism, where every TP rank ends
with the same full merged sequence: rank 0's crosses, and its gradient is sent back to every TP rank,
since the row-parallel merger's adjoint needs the full output gradient on each). Shard j is a tensor
[n_j, W] of merged vision tokens, one row per token, in the dtype the merger computed it in (fp32; bf16
under autocast or pure bf16: the text stage casts it to its embeddings' dtype, and its gradient comes back
in the same dtype, the rounding the vision stage would apply anyway); concatenated in rank order they are
the replica's merged tokens in *window order*.

Row width W is the model family's `boundary_width` (models/family/): D, the text hidden size, for Qwen2.5-VL;
(1 + k) x D for Qwen3-VL with k DeepStack blocks: row i holds the merged embedding of token i, then its k
DeepStack features (models/qwen3_vl.py). Every step below moves whole rows, so each text rank receives the
embeddings and the DeepStack features of its own positions, and their gradients (same width) go back to the
vision rank that produced them, with nothing else to route.

Text input layout: the full merged sequence [N, W], N = sum_j n_j = number of `<|image_pad|>` tokens of
the micro-batch, in *raster order* (image after image, row-major inside an image), replicated on every
tensor-parallel rank of the replica (M:N: each of the M text ranks receives all k shards).

Forward (`assemble`, on each text rank): full[merged_index] = cat(shards), where `merged_index[i]` is the
raster position of the i-th window-ordered token (None = identity: no SP, shards already raster order).

Backward (the exact adjoint, on text rank 0 of the replica only): d_cat = d_full[merged_index], split
back into the k shard gradients, shard j going to the vision rank that produced shard j. The TP ranks
hold identical d_full (the text layout replicates its input), so one rank's is taken — not a sum.

On the wire (between the actors, through Ray's object store) each shard and each shard gradient is a
`WireTensor`: its bytes as a numpy uint8 array plus dtype and shape. Ray stores a numpy array with one copy
and hands it to the reader without one (pickle 5 out-of-band buffers, the reader maps the store's memory);
a torch tensor goes through torch's own pickling (`torch.save` into bytes, then Ray's copies). For a 4 096 x
3 584 bf16 shard (the 7B at 16 k patches, 29 MB) on this 2-core machine: store 20 ms instead of ~65, read
0.5 ms instead of ~24 (`to_wire` / `from_wire`; `dhp bench boundary`, docs/pipelining.md). On an H200 the
7B at 16 k patches spent 164 ms per micro-batch in Ray's part of the boundary with plain tensors (docs/gpu.md).

How they travel is `pipeline.boundary`, one `Transport` object the workers and pools ask (`transport_of`):
  host      (default) a `WireTensor` through Ray's object store: one device->host copy on the sender, one
            host->device copy on the receiver; works everywhere (CPU, GPUs, across nodes).
  cuda_ipc  the tensor stays on the GPU: the call returns it through Ray Direct Transport's CUDA IPC transport
            (alpha in Ray 2.60), the receiver maps the sender's memory and copies it on the device (its own
            memory, as `from_wire`'s contract). One-sided, no collective group, but only between actors Ray
            gave the *same* GPU, on one node: the pools must share one GPU (`pipeline.placement=shared`,
            one actor each, fractional `num_gpus_per_actor`); `check` refuses anything else up front. A Ray
            Direct Transport call has one return value, so the text rank sends its shard gradients by one
            `gradient(mb_id, j)` call each instead of as extra returns of `forward_backward`.

Preconditions: shards arrive in vision-rank order; `merged_index` is a permutation of range(N) computed
by the loader from the same plan that cut the pixels; W is the text stage's `boundary_width`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor as it crosses between the pools: `data` its bytes (numpy uint8, contiguous), `dtype` the
    torch dtype's name (bf16 has no numpy dtype, hence bytes), `shape` its shape."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]


def to_wire(t: torch.Tensor) -> WireTensor:
    """A tensor (any device) -> its bytes on the host, for Ray's object store (one device->host copy, if any).
    A contiguous CPU tensor is not copied: the array shares its memory until Ray serializes it (a call's return
    value, `ray.put`), so the tensor must not change in between."""
    t = t.detach().to("cpu").contiguous()
    return WireTensor(t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def from_wire(w: WireTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor back, on `device`, in memory of its own: what Ray hands over maps the object store read-only,
    so it is copied (to the device, or on the host) before anyone may write to it or keep it past the call."""
    if w.data.size == 0:  # an empty SP shard: no bytes to view as the dtype
        return torch.empty(w.shape, dtype=getattr(torch, w.dtype), device=device)
    with warnings.catch_warnings():  # the read-only map: torch warns about a non-writable array; it is copied next
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(w.data)
    t = t.view(getattr(torch, w.dtype)).reshape(w.shape)
    return t.to(device, copy=True)


def assemble(shards: list[torch.Tensor], merged_index: torch.Tensor | None) -> torch.Tensor:
    """Differentiable: k window-ordered shards [n_j, W] -> [N, W] in raster order."""
    flat = torch.cat(shards) if len(shards) > 1 else shards[0]
    if merged_index is None:
        return flat
    return flat.new_empty(flat.shape).index_copy(0, merged_index.to(flat.device), flat)


def shard_gradients(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of each received shard (zeros where the loss did not reach it), for the vision ranks."""
    return [s.grad if s.grad is not None else torch.zeros_like(s) for s in shards]


class Transport:
    """How boundary tensors travel between the pools (`pipeline.boundary`; module docstring)."""

    name: ClassVar[str] = ""
    ray_transport: ClassVar[str | None] = None  # Ray's `tensor_transport` for the crossing calls; None: object store

    @property
    def direct(self) -> bool:
        """Through Ray Direct Transport: the actors are built with `enable_tensor_transport`, and a crossing
        call returns one value (the text rank's shard gradients then go by `gradient` calls)."""
        return self.ray_transport is not None

    def send(self, t: torch.Tensor) -> Any:
        """What a crossing call returns for tensor `t` (the sender must not change `t` afterwards)."""
        raise NotImplementedError

    def receive(self, x: Any, device: torch.device | str) -> torch.Tensor:
        """What `send` returned, as the receiver's own tensor on `device`."""
        raise NotImplementedError

    def check(self, cfg: Any) -> str | None:
        """Why this transport cannot connect the configured pools (None: it can)."""
        return None


class HostTransport(Transport):
    name = "host"

    def send(self, t: torch.Tensor) -> WireTensor:
        return to_wire(t)

    def receive(self, x: WireTensor, device: torch.device | str) -> torch.Tensor:
        return from_wire(x, device)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    ray_transport = "CUDA_IPC"

    def send(self, t: torch.Tensor) -> torch.Tensor:
        # Ray's GPU object store keeps it (and so its memory) until every reference to the call's result is gone
        return t.detach().contiguous()

    def receive(self, x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        # x maps the sender's memory (the receiving stream already waits on the sender's event): a copy of our own
        return x.to(device, copy=True)

    def check(self, cfg: Any) -> str | None:
        gpus = (cfg.vision.num_gpus_per_actor, cfg.text.num_gpus_per_actor)
        if (
            all(g > 0 for g in gpus)
            and sum(gpus) <= 1
            and cfg.pipeline.shared
            and cfg.vision.num_actors == cfg.text.num_actors == 1
        ):
            return None
        return (
            "pipeline.boundary=cuda_ipc maps GPU memory between actors Ray gave the same GPU, so both pools "
            "must share one GPU: pipeline.placement=shared, vision.num_actors=text.num_actors=1, and "
            "vision.num_gpus_per_actor and text.num_gpus_per_actor above 0 and together at most 1 (e.g. 0.5 "
            "each); got "
            f"placement {cfg.pipeline.placement}, {cfg.vision.num_actors} vision and {cfg.text.num_actors} "
            f"text actors with {cfg.vision.num_gpus_per_actor:g} and {cfg.text.num_gpus_per_actor:g} GPUs "
            "each. Use pipeline.boundary=host otherwise"
        )


TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (HostTransport, CudaIpcTransport)}


def transport_of(name: str) -> Transport:
    """The `pipeline.boundary` string as the object everything asks."""
    if name not in TRANSPORTS:
        raise ValueError(f"pipeline.boundary must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return TRANSPORTS[name]()
