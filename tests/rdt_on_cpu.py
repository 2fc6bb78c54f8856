"""dhp's Ray Direct Transport boundary (`pipeline.boundary=cuda_ipc`) run on a CPU, for the test that checks it.

CUDA IPC needs a GPU. What dhp adds around it does not: crossing calls with one return value each, the text
rank's shard gradients as separate `gradient` calls, Ray's RDT references handed actor to actor through the
driver, the actors built with `enable_tensor_transport`. This module keeps all of that and swaps only the
mover: `BytesTransport` is a Ray tensor transport (`ray.experimental.TensorTransportManager`) whose metadata
carries the tensors' values, so Ray's own RDT machinery (its RDT store on the sender, the metadata to the
owner, the fetch on the receiver, the frees) runs as it does for CUDA IPC. The stand-in to CUDA IPC is what
gloo is to nccl in the parity tests.

`install()` registers it and points `CudaIpcTransport` at it (and lifts its one-GPU check); it runs in the
driver and, through Ray's `worker_process_setup_hook`, in every actor. Each send and receive is appended to
the file named by DHP_TEST_RDT_LOG, so the test can see that the tensors took this path.

`python -m tests.rdt_on_cpu CKPT SAMPLES OUT`: for each layout, one global batch under each boundary (host,
then the RDT path): the loss, every gradient, and an evaluation loss, saved to OUT with torch.save. Each boundary
starts its actors once, for the larger layout (SP 2 / TP 2), and rebuilds them for the other (`Trainer.reuse`: one
vision and one text actor of them form the 1v1t worlds): 8 processes, not 12.
`python -m tests.rdt_on_cpu --build DIR`: the same on the session's parity model and samples (`parity_setup` in
tests/conftest.py), built here under DIR; OUT is DIR/out.pt.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from tests.test_parity import SP2, TP2

NAME = "DHP_TEST_BYTES"
LAYOUTS = {  # overrides, each text replica's micro-batches as sample indices (tests/test_parity.py's); the
    # larger first: its actors are rebuilt for the next (`Trainer.reuse`)
    "sp2-tp2": (SP2 + TP2, [[0, 1], [2]]),
    "1v1t": ([], [[0], [1], [2]]),  # sample 2 is text-only: an empty vision call
}


@dataclass
class BytesMetadata(TensorTransportMetadata):
    values: list[torch.Tensor] = field(default_factory=list)


def _log(what: str) -> None:
    path = os.environ.get("DHP_TEST_RDT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what}\n")


class BytesTransport(TensorTransportManager):
    """One-sided, like CUDA IPC: the receiver gets everything from the metadata, the sender does nothing more."""

    @property
    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[torch.Tensor]) -> BytesMetadata:
        _log(f"send {[tuple(t.shape) for t in rdt_object]}")
        return BytesMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
            tensor_device="cpu",
            values=[t.detach().clone() for t in rdt_object],
        )

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None):
        return CommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: BytesMetadata,
        communicator_metadata: Any,
        target_buffers: Any = None,
    ) -> list[torch.Tensor]:
        _log("receive")
        return list(tensor_transport_metadata.values)

    def send_multiple_tensors(self, tensors: Any, tensor_transport_metadata: Any, communicator_metadata: Any):
        raise NotImplementedError("one-sided")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: Any) -> None:
        pass

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        raise NotImplementedError


def install() -> None:
    from ray.experimental.rdt.util import register_tensor_transport, transport_manager_info

    from dhp.stages.boundary import CudaIpcTransport

    if NAME not in transport_manager_info:
        register_tensor_transport(NAME, ["cpu"], BytesTransport, torch.Tensor)
    CudaIpcTransport.ray_transport = NAME
    CudaIpcTransport.check = lambda self, cfg: None


def main(ckpt: str, samples_path: str, out_path: str) -> None:
    import ray

    from dhp.dataflow.loader import GlobalBatch
    from dhp.stages.config import load_config
    from dhp.stages.trainer import Trainer
    from tests.test_parity import BASE, _microbatch, collect

    install()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,  # its own, not the session's
        runtime_env={"worker_process_setup_hook": "tests.rdt_on_cpu.install"},
    )
    samples = torch.load(samples_path, weights_only=False)
    longest = max(s["input_ids"].shape[0] for s in samples)
    out: dict[str, dict[str, Any]] = {}
    try:
        for boundary in ("host", "cuda_ipc"):  # the RDT path's actors are of another kind (`actor_kind`)
            trainer = None
            try:
                for name, (overrides, groups) in LAYOUTS.items():
                    cfg = load_config(
                        "tiny",
                        BASE
                        + overrides
                        + [
                            f"model.path={ckpt}",
                            f"data.microbatch_tokens={longest}",
                            f"data.max_seq_len={longest}",
                            "vision.num_cpus_per_actor=0.25",
                            "text.num_cpus_per_actor=0.25",
                            f"pipeline.boundary={boundary}",
                        ],
                    )
                    if trainer is None:
                        trainer = Trainer(cfg)
                    else:  # the same actors, each rank's model and optimizer built again from the checkpoint
                        trainer.reuse(cfg)
                    batches = [GlobalBatch([_microbatch([samples[i] for i in g], cfg) for g in groups], epoch=0)]
                    loss = trainer.accumulate(batches)
                    ray.get(trainer.vision.sync_grads() + trainer.text.sync_grads())
                    mb = batches[0].microbatches[0]
                    shards = trainer.vision.forward_eval(0, mb.vision)
                    evaluated = ray.get(trainer.text.forward_eval(0, mb.text, shards))
                    out[f"{name}/{boundary}"] = {"loss": loss, "eval": evaluated, "grads": collect(trainer, grads=True)}
            finally:
                if trainer is not None:
                    trainer.shutdown()
    finally:
        ray.shutdown()
    torch.save(out, out_path)


def build_parity_setup(root: Path) -> tuple[str, str]:
    """The checkpoint and the saved samples of conftest.py's `parity_setup`, built under `root`."""
    from tests.conftest import PARITY_IMAGE_A, PARITY_MAX_PIXELS, preprocessed_parity_setup, write_parity_data

    class Dirs:  # what preprocessed_parity_setup asks of pytest's tmp_path_factory
        @staticmethod
        def mktemp(name: str) -> Path:
            (root / name).mkdir(parents=True)
            return root / name

    data = write_parity_data(Dirs.mktemp("parity_data"), PARITY_IMAGE_A)
    _, ckpt, samples = preprocessed_parity_setup(Dirs, data, max_pixels=PARITY_MAX_PIXELS)
    torch.save(samples, root / "samples.pt")
    return str(ckpt), str(root / "samples.pt")


if __name__ == "__main__":
    if sys.argv[1] == "--build":
        main(*build_parity_setup(Path(sys.argv[2])), str(Path(sys.argv[2]) / "out.pt"))
    else:
        main(*sys.argv[1:4])
