"""The single controller's parts: build the pools and loaders, run one step, evaluate, export.

Everything here schedules: it holds object references and scalars, never a tensor payload. Pixels go
loader -> vision pool, tokens loader -> text pool, embeddings vision -> text, gradients text -> vision.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import ray
from transformers import Qwen2_5_VLConfig

from dhp.dataflow.loader import BatchLoader, GlobalBatch
from dhp.dataflow.preprocess import PreprocessSettings
from dhp.models.architectures import architecture_config
from dhp.models.weights import write_index
from dhp.stages.config import Config
from dhp.stages.pools import TextPool, VisionPool, check_layout
from dhp.stages.stage_worker import clip_coefficient
from dhp.stages.text_worker import TextWorker
from dhp.stages.vision_worker import VisionWorker


def model_config_of(cfg: Config) -> Qwen2_5_VLConfig:
    if cfg.model.path:
        config = Qwen2_5_VLConfig.from_pretrained(cfg.model.path)
        config._attn_implementation = cfg.model.attn_implementation
        for sub in (config.vision_config, config.text_config):
            sub._attn_implementation = cfg.model.attn_implementation
        return config
    return architecture_config(cfg.model.name, cfg.model.attn_implementation)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        train_paths: list[str] | None = None,
        eval_paths: list[str] | None = None,
        image_root: str = "",
    ):
        check_layout(cfg)
        self.cfg = cfg
        self.model_config = model_config_of(cfg)
        d = cfg.data
        settings = PreprocessSettings(
            image_root=image_root,
            min_pixels=d.min_pixels,
            max_pixels=d.max_pixels,
            max_seq_len=d.max_seq_len,
            tokenizer_path=cfg.model.tokenizer_path or cfg.model.path,
        )
        loader_cls = ray.remote(num_cpus=0.1)(BatchLoader)
        common = dict(
            settings=settings,
            model_config=self.model_config,
            global_batch_size=cfg.training.global_batch_size,
            microbatch_tokens=d.microbatch_tokens,
            workers=d.preprocess_workers,
            num_cpus=d.preprocess_num_cpus,
        )
        self.loader = loader_cls.remote(train_paths, seed=d.shuffle_seed, **common) if train_paths else None
        self.eval_loader = loader_cls.remote(eval_paths, seed=None, repeat=False, **common) if eval_paths else None
        self.vision = self._pool("vision", VisionPool, VisionWorker)
        self.text = self._pool("text", TextPool, TextWorker)
        self._eval_batches: list[GlobalBatch] | None = None

    def _pool(self, stage: str, pool_cls: type, worker_cls: type):
        s = getattr(self.cfg, stage)
        return pool_cls(
            stage, worker_cls, s.num_actors, init_args=(self.cfg, self.model_config),
            num_cpus=s.num_cpus_per_actor, num_gpus=s.num_gpus_per_actor, torch_threads=s.torch_threads,
        )

    def next_batch(self) -> ray.ObjectRef:
        return self.loader.next_batch.remote()

    def accumulate(self, batch: GlobalBatch) -> float:
        """Forward + backward of every micro-batch; gradients accumulate in the actors. Returns the loss."""
        loss_scale = 1.0 / max(1, batch.label_tokens)  # mean over the global batch's label tokens
        losses = []
        for i, mb in enumerate(batch.microbatches):
            embeds = self.vision.forward(i, mb.vision)
            loss, embeds_grad = self.text.forward_backward(i, mb.text, embeds, loss_scale)
            self.vision.backward(i, embeds_grad)
            losses.append(loss)
        return sum(ray.get(losses))

    def optimizer_step(self) -> tuple[float, float]:
        """Clip by the global norm over both stages, step both pools. Returns (grad norm, lr used)."""
        grad_norm = math.sqrt(sum(ray.get(self.vision.grad_sq_norm() + self.text.grad_sq_norm())))
        coef = clip_coefficient(grad_norm, self.cfg.training.max_grad_norm)
        lr = ray.get(self.vision.optimizer_step(coef) + self.text.optimizer_step(coef))[-1]
        return grad_norm, lr

    def train_step(self, batch: GlobalBatch) -> dict[str, Any]:
        start = time.perf_counter()
        loss = self.accumulate(batch)
        grad_norm, lr = self.optimizer_step()
        elapsed = time.perf_counter() - start
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": batch.tokens,
            "label_tokens": batch.label_tokens,
            "microbatches": len(batch.microbatches),
            "step_time_s": elapsed,
            "tokens_per_s": batch.tokens / elapsed,
            "epoch": batch.epoch,
            "skipped": batch.skipped,
        }

    def evaluate(self) -> float | None:
        """Mean loss per label token over the first `training.eval_batches` held-out global batches."""
        if self.eval_loader is None:
            return None
        if self._eval_batches is None:  # the same held-out batches every time, fetched once
            self._eval_batches = []
            for _ in range(self.cfg.training.eval_batches):
                batch = ray.get(self.eval_loader.next_batch.remote())
                if batch is None:
                    break
                self._eval_batches.append(batch)
        sums, count = [], 0
        for batch in self._eval_batches:
            for mb in batch.microbatches:
                sums.append(self.text.forward_eval(mb.text, self.vision.forward_eval(mb.vision)))
                count += mb.meta.label_tokens
        return sum(ray.get(sums)) / max(1, count)

    def save_weights(self, out_dir: Path) -> None:
        """An HF checkpoint dir: one shard per stage, written by the actors, plus index and config."""
        weight_map: dict[str, str] = {}
        for shard in ray.get(self.vision.execute_all_async("save_weights", str(out_dir))
                             + self.text.execute_all_async("save_weights", str(out_dir))):
            weight_map.update(shard)
        write_index(out_dir, weight_map, self.model_config)

    def skip_report(self) -> dict[str, Any]:
        return ray.get(self.loader.skip_report.remote())

    def shutdown(self) -> None:
        for pool in (self.vision, self.text):
            pool.shutdown()
