"""The `dhp` command.

    dhp train [--config PRESET_OR_YAML] [KEY=VALUE ...]
    dhp data synth --out DIR --num N --seed S [--eval-num M]
    dhp data convert-coco --captions FILE --images DIR --out FILE        (COCO captions -> conversations)
    dhp data convert-laion-pop --in FILE --out FILE [--image-field K] [--caption-field K]
    dhp report RUN_DIR [--out DIR]                            (PNG plots of a run + a summary table)
    dhp config [--config PRESET_OR_YAML] [KEY=VALUE ...]     (print the resolved config)
    dhp plan [--config NAME|PATH] [KEY=VALUE ...] [--gpu-memory GiB] [--json PATH]   (memory per rank; fits?)
    dhp plan --time --gpu NAME|PROFILE.json --gpus N --image-patches P [...]          (predicted step time)
    dhp plan --search --gpu NAME --gpus N [--image-patches P] [--out YAML]           (best layouts that fit)
    dhp export-hf --checkpoint DIR --out DIR                  (dhp checkpoint -> Hugging Face dir)
    dhp bench layouts [--json PATH] [--quick]                 (vision layouts: comm / activation bytes)
    dhp bench pipeline [--json PATH] [--quick] [--steps N] [--microbatches M] [--scenario S]  (pipeline, pool sizes)
    dhp bench recovery [--json PATH] [--quick] [--kinds K,..] (per fault kind: time to detect, to train again)
    dhp bench data [--json PATH] [--quick]                    (Ray Data preprocessing vs a plain loop; data wait)
    dhp bench memory --json PATH [--quick] [--no-measure]     (bytes per rank by shape/layout/precision; build RSS)
    dhp bench checkpointing [--json PATH] [--quick]           (activation checkpointing: bytes saved, time cost)
    dhp bench ops [--json PATH] [--quick]                     (op / collective / transfer rates: a time-model profile)
    dhp bench time-model [--json PATH] [--profile P] [--quick]  (the plan's step time against measured steps)
    dhp bench peers [--json PATH] [--quick] [--ranks N]       (vs DeepSpeed ZeRO-3 and uniform TP: speed, longest image)
    dhp bench fine-tuning [--json PATH] [--quick]             (frozen ViT, merger only, frozen LLM vs full: time, bytes)
    dhp bench one-gpu [--json PATH] [--quick] [--model M]     (dhp on one device vs a one-process transformers loop)
    dhp bench boundary [--json PATH] [--quick]                (moving embeddings + gradients: tensor vs wire format)

Configuration and usage errors exit with status 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import yaml

from dhp.stages.config import ConfigError, load_config
from dhp.stages.preemption import PREEMPTED_EXIT, Preempted


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhp", description="Disaggregated hybrid parallel VLM training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train (default: tiny model, synthetic data, local Ray, CPU)")
    train.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path (default: tiny)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. training.steps=20")

    show = sub.add_parser("config", help="print the resolved config as YAML")
    show.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path (default: tiny)")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. text.degree=4 (after the options)")

    plan = sub.add_parser("plan", help="memory per rank of each pool, against the GPU (no allocation)")
    plan.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path (default: tiny)")
    plan.add_argument("--gpu-memory", type=float, default=None, metavar="GiB", help="memory of one GPU")
    plan.add_argument("--json", default=None, help="write the rows here")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. text.degree=4 (after the options)")
    plan.add_argument("--time", action="store_true", help="predict the step time on --gpus x --gpu (time_model.py)")
    plan.add_argument("--search", action="store_true", help="rank the layouts that fit --gpus x --gpu; write the best")
    plan.add_argument("--gpu", default=None, help="h100-sxm | h200 | a100-80gb | l40s, or a `dhp bench ops` JSON")
    plan.add_argument("--gpus", type=int, default=None, help="GPUs of the job (default: what the layout implies)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (inter-node bandwidth)")
    plan.add_argument("--image-patches", type=int, default=1024, help="patches of every image (default 1024)")
    plan.add_argument("--text-tokens", type=int, default=512, help="text tokens of every sample (default 512)")
    plan.add_argument("--gpu-set", action="append", metavar="FIELD=VALUE", help="replace a profile field (repeatable)")
    plan.add_argument("--top", type=int, default=10, help="--search: rows shown")
    plan.add_argument("--out", default="best_layout.yaml", help="--search: where the best layout's config goes")

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write the synthetic shapes captioning set")
    synth.add_argument("--out", required=True, help="directory for train.jsonl, val.jsonl and images/")
    synth.add_argument("--num", type=int, default=512, help="training records (default 512)")
    synth.add_argument("--eval-num", type=int, default=None, help="held-out records (default: max(16, num // 10))")
    synth.add_argument("--seed", type=int, default=0, help="seed of the shapes, colours and captions (default 0)")

    coco = data.add_parser("convert-coco", help="COCO captions JSON -> conversation-format JSONL")
    coco.add_argument("--captions", required=True, help="captions_*.json (images + annotations)")
    coco.add_argument("--images", required=True, help="image directory (local or s3://); checked for each image")
    coco.add_argument("--out", required=True, help="output JSONL")
    coco.add_argument("--prompt", default=None, help="user turn (default: '<image>\\nDescribe this image.')")
    coco.add_argument("--all-captions", action="store_true", help="one record per caption (default: first)")
    laion = data.add_parser("convert-laion-pop", help="LAION-POP parquet/JSONL rows -> conversation-format JSONL")
    laion.add_argument("--in", dest="src", required=True, help="input .parquet, .jsonl or .json")
    laion.add_argument("--out", required=True, help="output JSONL")
    laion.add_argument("--image-field", default=None, help="column with the image key/path/URL (default: auto)")
    laion.add_argument("--caption-field", default=None, help="column with the caption (default: auto)")
    laion.add_argument("--prompt", default=None, help="user turn (default: '<image>\\nDescribe this image.')")

    report = sub.add_parser("report", help="plots (PNG) and a summary table of a run directory")
    report.add_argument("run_dir", help="RUN_DIR (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/report)")

    export = sub.add_parser("export-hf", help="dhp checkpoint (per-rank shards) -> Hugging Face directory")
    export.add_argument("--checkpoint", required=True, help="RUN_DIR/checkpoints/step_N")
    export.add_argument("--out", required=True, help="output directory (from_pretrained loads it)")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; MiB, bytes)")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    layouts = bench.add_parser("layouts", help="vision-encoder layouts: comm and activation bytes per rank")
    layouts.add_argument("--json", default=None, help="write the rows here")
    layouts.add_argument("--quick", action="store_true", help="a tiny measured set (for tests)")
    layouts.add_argument("--budget-gib", type=float, default=40.0, help="per-rank activation budget")
    layouts.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element, real-shape rows")
    layouts.add_argument("--plot", default=None, help="write the PNG here (default: the --json path with .png)")
    recovery = bench.add_parser("recovery", help="faults mid-run (actor, node, hang, preempt, save): recovery")
    recovery.add_argument("--json", default=None, help="write the row here")
    recovery.add_argument("--quick", action="store_true", help="8 steps (for tests)")
    recovery.add_argument("--kinds", default=None, help="comma-separated: actor,node,hang,preempt,save (default: all)")
    recovery.add_argument("--keep", default=None, help="write the runs here and keep them (default: a temp dir)")
    pipe = bench.add_parser("pipeline", help="pipelined vs serial micro-batch order: step time, bubble, overhead")
    pipe.add_argument("--json", default=None, help="write the rows here (traces beside it)")
    pipe.add_argument("--quick", action="store_true", help="a tiny measured set (for tests)")
    pipe.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 5)")
    pipe.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 12)")
    pipe.add_argument("--scenario", action="append", default=None,
                      choices=["balanced", "vision_heavy", "text_heavy", "vision_bound_scaling"],
                      help="run only this scenario (repeatable; default: all four)")
    bdata = bench.add_parser("data", help="Ray Data preprocessing vs a plain loop (local and s3://); data wait")
    bdata.add_argument("--json", default=None, help="write the row here")
    bdata.add_argument("--quick", action="store_true", help="a tiny set (for tests)")
    from dhp.scripts.bench.boundary import add_parser as add_boundary
    from dhp.scripts.bench.checkpointing import add_parser as add_checkpointing
    from dhp.scripts.bench.fine_tuning import add_parser as add_fine_tuning
    from dhp.scripts.bench.memory import add_parser as add_memory
    from dhp.scripts.bench.one_gpu import add_parser as add_one_gpu
    from dhp.scripts.bench.ops import add_parser as add_ops
    from dhp.scripts.bench.peers import add_parser as add_peers
    from dhp.scripts.bench.time_model import add_parser as add_time_model

    add_memory(bench)
    add_checkpointing(bench)
    add_ops(bench)
    add_time_model(bench)
    add_peers(bench)
    add_fine_tuning(bench)
    add_one_gpu(bench)
    add_boundary(bench)
    return p


def _plan(args: argparse.Namespace) -> int:
    """`dhp plan`: the table, the JSON rows; exit 0 when it fits (or there is nothing to compare), 1 when not."""
    from dhp.models.parallel.checks import check_layout
    from dhp.models.planning.memory_plan import advice, plan, table
    from dhp.stages.trainer import model_config_of

    if args.time or args.search:
        from dhp.scripts.plan_time import main as plan_time

        return plan_time(args)
    cfg = load_config(args.config, args.overrides)
    model_config = model_config_of(cfg)
    check_layout(cfg, model_config)
    result = plan(cfg, model_config, args.gpu_memory)
    print(table(result))
    if result["fits"] is False:
        print("what would fit: " + "; ".join(advice(cfg, result, model_config)))
    if args.json:
        rows = [{**r.row(), "per_device": result["per_device"], "device": result["device"], "fits": result["fits"]}
                for r in result["ranks"].values()]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if result["fits"] is False else 0


def main(argv: list[str] | None = None) -> int:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started as a background job of a non-interactive shell:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGINT still stops it, Ray shut down on the way
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)  # config errors before the heavy imports
            from dhp.stages.driver import train

            summary = train(cfg)
            print(json.dumps({k: v for k, v in summary.items() if k != "skipped"}, indent=1))
            print(f"skipped records: {summary['skipped']['counts'] or 'none'}")
        elif args.command == "config":
            print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False), end="")
        elif args.command == "plan":
            return _plan(args)
        elif args.command == "data" and args.data_command == "synth":
            from dhp.dataflow.synth import write_synthetic_dataset

            if args.num < 1 or (args.eval_num is not None and args.eval_num < 0):
                raise ConfigError(f"--num must be >= 1 and --eval-num >= 0 (got {args.num}, {args.eval_num})")
            s = write_synthetic_dataset(args.out, args.num, seed=args.seed, eval_num=args.eval_num)
            state = "already present" if s.reused else "written"
            print(f"{s.num_train} train + {s.num_val} eval records, {s.num_images} images {state} in {s.out_dir}")
        elif args.command == "data" and args.data_command in ("convert-coco", "convert-laion-pop"):
            from dhp.dataflow.convert import main as convert

            return convert(args)
        elif args.command == "report":
            from dhp.scripts.report import main as report

            return report(args)
        elif args.command == "export-hf":
            from dhp.models.weights.export import export_hf

            weight_map = export_hf(args.checkpoint, args.out, args.max_shard_size)
            print(f"{len(weight_map)} tensors written to {args.out}")
        elif args.command == "bench" and args.bench_command == "layouts":
            from dhp.scripts.bench.layouts import main as bench_layouts

            return bench_layouts(args)
        elif args.command == "bench" and args.bench_command == "recovery":
            from dhp.scripts.bench.recovery import main as bench_recovery

            return bench_recovery(args)
        elif args.command == "bench" and args.bench_command == "pipeline":
            from dhp.scripts.bench.pipeline import main as bench_pipeline

            return bench_pipeline(args)
        elif args.command == "bench" and args.bench_command == "checkpointing":
            from dhp.scripts.bench.checkpointing import main as bench_checkpointing

            return bench_checkpointing(args)
        elif args.command == "bench" and args.bench_command == "memory":
            from dhp.scripts.bench.memory import main as bench_memory

            return bench_memory(args)
        elif args.command == "bench" and args.bench_command == "ops":
            from dhp.scripts.bench.ops import main as bench_ops

            return bench_ops(args)
        elif args.command == "bench" and args.bench_command == "time-model":
            from dhp.scripts.bench.time_model import main as bench_time_model

            return bench_time_model(args)
        elif args.command == "bench" and args.bench_command == "fine-tuning":
            from dhp.scripts.bench.fine_tuning import main as bench_fine_tuning

            return bench_fine_tuning(args)
        elif args.command == "bench" and args.bench_command == "one-gpu":
            from dhp.scripts.bench.one_gpu import main as bench_one_gpu

            return bench_one_gpu(args)
        elif args.command == "bench" and args.bench_command == "boundary":
            from dhp.scripts.bench.boundary import main as bench_boundary

            return bench_boundary(args)
        elif args.command == "bench" and args.bench_command == "peers":
            from dhp.scripts.bench.peers import main as bench_peers

            return bench_peers(args)
        elif args.command == "bench" and args.bench_command == "data":
            from dhp.scripts.bench.data import main as bench_data

            return bench_data(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"dhp: error: {e}", file=sys.stderr)
        return 2
    except Preempted:
        return PREEMPTED_EXIT  # the driver printed `preempted at step N, checkpoint DIR`
    except RuntimeError as e:
        from dhp.stages.driver import TrainingFailed

        if not isinstance(e, TrainingFailed):
            raise
        print(f"dhp: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
