"""The `dhp` command.

    dhp train [--config PRESET_OR_YAML] [KEY=VALUE ...]
    dhp data synth --out DIR --num N --seed S [--eval-num M] [--video-fraction F]
    dhp data profile [PATH] [--config C] [--limit N] [--out FILE] [KEY=VALUE ...]  (the data's length mix, JSON)
    dhp data convert-coco --captions FILE --images DIR --out FILE        (COCO captions -> conversations)
    dhp data convert-laion-pop --in FILE --out FILE [--image-field K] [--caption-field K]
    dhp report RUN_DIR [--out DIR]                            (PNG plots of a run + a summary table)
    dhp config [--config PRESET_OR_YAML] [KEY=VALUE ...]     (print the resolved config)
    dhp plan [--config NAME|PATH] [KEY=VALUE ...] [--gpu-memory GiB] [--json PATH]   (memory per rank; fits?)
    dhp plan --time --gpu NAME|PROFILE.json --gpus N --image-patches P [...]          (predicted step time)
    dhp plan --time --gpu NAME --gpus N --video FRAMESxHxW [--image-patches P] [...]  (a sample with a video)
    dhp plan --search --gpu NAME --gpus N [--image-patches P] [--out YAML]           (best layouts that fit)
    dhp plan --time|--search ... --data-profile FILE          (predict with a `dhp data profile` length mix)
    dhp export-hf --checkpoint DIR --out DIR                  (dhp checkpoint -> Hugging Face dir)
    dhp bench layouts [--json PATH] [--quick]                 (vision layouts: comm / activation bytes)
    dhp bench pipeline [--json PATH] [--quick] [--steps N] [--microbatches M] [--scenario S]  (pipeline, pool sizes)
    dhp bench pipeline --mix long-tail [--json PATH] [--quick] [--steps N] [--scale F]  (data.balance off vs on)
    dhp bench recovery [--json PATH] [--quick] [--kinds K,..] (per fault kind: time to detect, to train again)
    dhp bench data [--json PATH] [--quick]                    (Ray Data preprocessing vs a plain loop; data wait)
    dhp bench memory --json PATH [--quick] [--no-measure]     (bytes per rank by shape/layout/precision; build RSS)
    dhp bench checkpointing [--json PATH] [--quick]           (activation checkpointing: bytes saved, time cost)
    dhp bench ops [--json PATH] [--quick]                     (op / collective / transfer rates: a time-model profile)
    dhp bench time-model [--json PATH] [--profile P] [--quick]  (the plan's step time against measured steps)
    dhp bench peers [--json PATH] [--quick] [--ranks N]       (vs DeepSpeed ZeRO-3 and uniform TP: speed, longest image)
    dhp bench fine-tuning [--json PATH] [--quick]             (frozen ViT, merger only, frozen LLM vs full: time, bytes)
    dhp bench one-gpu [--json PATH] [--quick] [--model M]     (dhp on one device vs stock and same-kernel loops)
    dhp bench boundary [--json PATH] [--quick]                (moving embeddings + gradients: tensor vs wire format)
    dhp bench rebalance [--json PATH] [--quick]               (a mix shifting mid-run: moved pools vs fixed layouts)

Configuration and usage errors exit with status 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from dhp.errors import DataError, one_line
from dhp.stages.config import ConfigError, load_config
from dhp.stages.preemption import PREEMPTED_EXIT, Preempted

# `dhp bench NAME`: each module declares its arguments (`add_parser`) and runs them (`main`); one line adds a bench.
BENCHES = {
    "layouts": "dhp.scripts.bench.layouts",
    "recovery": "dhp.scripts.bench.recovery",
    "pipeline": "dhp.scripts.bench.pipeline",
    "data": "dhp.scripts.bench.data",
    "memory": "dhp.scripts.bench.memory",
    "checkpointing": "dhp.scripts.bench.checkpointing",
    "ops": "dhp.scripts.bench.ops",
    "time-model": "dhp.scripts.bench.time_model",
    "peers": "dhp.scripts.bench.peers",
    "fine-tuning": "dhp.scripts.bench.fine_tuning",
    "one-gpu": "dhp.scripts.bench.one_gpu",
    "boundary": "dhp.scripts.bench.boundary",
    "rebalance": "dhp.scripts.bench.rebalance",
}


def _parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. A bench's module declares its arguments and imports what it measures (torch,
    transformers, seconds of CPU): only `dhp bench NAME`'s is imported, and all of them for `dhp bench` alone,
    its help or a name that is not a bench (whose error lists them); `argv` None: every bench's."""
    p = argparse.ArgumentParser(prog="dhp", description="Disaggregated hybrid parallel VLM training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train (default: tiny model, synthetic data, local Ray, CPU)")
    train.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path (default: tiny)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. training.steps=20")
    train.set_defaults(run=_train)

    show = sub.add_parser("config", help="print the resolved config as YAML")
    show.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path (default: tiny)")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. text.degree=4 (after the options)")
    show.set_defaults(run=_config)

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
    plan.add_argument(
        "--image-patches", type=int, default=None, help="patches of every image (default 1024, none with --video)"
    )
    plan.add_argument(
        "--video",
        action="append",
        metavar="FRAMESxHxW",
        help="--time/--search: a video of FRAMES sampled frames of H x W pixels in every sample (repeatable)",
    )
    plan.add_argument("--text-tokens", type=int, default=512, help="text tokens of every sample (default 512)")
    plan.add_argument("--gpu-set", action="append", metavar="FIELD=VALUE", help="replace a profile field (repeatable)")
    plan.add_argument(
        "--data-profile", default=None, metavar="FILE", help="--time/--search: the length mix `dhp data profile` wrote"
    )
    plan.add_argument("--top", type=int, default=10, help="--search: rows shown")
    plan.add_argument("--out", default="best_layout.yaml", help="--search: where the best layout's config goes")
    plan.set_defaults(run=_plan)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write the synthetic shapes captioning set")
    synth.add_argument("--out", required=True, help="directory for train.jsonl, val.jsonl and images/")
    synth.add_argument("--num", type=int, default=512, help="training records (default 512)")
    synth.add_argument("--eval-num", type=int, default=None, help="held-out records (default: max(16, num // 10))")
    synth.set_defaults(run=_synth)
    synth.add_argument("--seed", type=int, default=0, help="seed of the shapes, colours and captions (default 0)")
    synth.add_argument(
        "--video-fraction", type=float, default=0.1, help="records that are short videos (default 0.1, as dhp train)"
    )

    prof = data.add_parser("profile", help="the length mix of data.train through the real preprocessing (JSON)")
    prof.set_defaults(run=_profile)
    prof.add_argument("path", nargs="?", default=None, help="annotation files or shards (default: data.train)")
    prof.add_argument("--config", default="tiny", help="preset name or YAML path (its model and data settings)")
    prof.add_argument("--limit", type=int, default=2000, help="records to preprocess, at most (default 2000)")
    prof.add_argument("--out", default=None, help="JSON output (default: print the summary only)")
    prof.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")

    coco = data.add_parser("convert-coco", help="COCO captions JSON -> conversation-format JSONL")
    coco.set_defaults(run=_convert)
    coco.add_argument("--captions", required=True, help="captions_*.json (images + annotations)")
    coco.add_argument("--images", required=True, help="image directory (local or s3://); checked for each image")
    coco.add_argument("--out", required=True, help="output JSONL")
    coco.add_argument("--prompt", default=None, help="user turn (default: '<image>\\nDescribe this image.')")
    coco.add_argument("--all-captions", action="store_true", help="one record per caption (default: first)")
    laion = data.add_parser("convert-laion-pop", help="LAION-POP parquet/JSONL rows -> conversation-format JSONL")
    laion.set_defaults(run=_convert)
    laion.add_argument("--in", dest="src", required=True, help="input .parquet, .jsonl or .json")
    laion.add_argument("--out", required=True, help="output JSONL")
    laion.add_argument("--image-field", default=None, help="column with the image key/path/URL (default: auto)")
    laion.add_argument("--caption-field", default=None, help="column with the caption (default: auto)")
    laion.add_argument("--prompt", default=None, help="user turn (default: '<image>\\nDescribe this image.')")

    report = sub.add_parser("report", help="plots (PNG) and a summary table of a run directory")
    report.set_defaults(run=_report)
    report.add_argument("run_dir", help="RUN_DIR (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/report)")

    export = sub.add_parser("export-hf", help="dhp checkpoint (per-rank shards) -> Hugging Face directory")
    export.set_defaults(run=_export_hf)
    export.add_argument("--checkpoint", required=True, help="RUN_DIR/checkpoints/step_N")
    export.add_argument("--out", required=True, help="output directory (from_pretrained loads it)")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; MiB, bytes)")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, module in _benches_named(sys.argv[1:] if argv is None else argv).items():
        importlib.import_module(module).add_parser(bench)
        bench.choices[name].set_defaults(run=_bench(module))
    return p


def _benches_named(argv: list[str]) -> dict[str, str]:
    """The benches whose arguments `argv` needs: none unless its command is `bench`; the one it names, or all."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] != ["bench"]:
        return {}
    if len(words) > 1 and words[1] in BENCHES:
        return {words[1]: BENCHES[words[1]]}
    return BENCHES


def _bench(module: str) -> Callable[[argparse.Namespace], int]:
    """A benchmark's `main`, imported when it runs."""
    return lambda args: importlib.import_module(module).main(args)


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config errors before the heavy imports
    from dhp.stages.auto_layout import kept_keys
    from dhp.stages.driver import train

    summary = train(cfg, kept_keys(args.overrides))
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped"}, indent=1))
    print(f"skipped records: {summary['skipped']['counts'] or 'none'}")
    return 0


def _config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False), end="")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from dhp.dataflow.synth import write_synthetic_dataset

    if args.num < 1 or (args.eval_num is not None and args.eval_num < 0):
        raise ConfigError(f"--num must be >= 1 and --eval-num >= 0 (got {args.num}, {args.eval_num})")
    if not 0 <= args.video_fraction <= 1:
        raise ConfigError(f"--video-fraction must be in [0, 1] (got {args.video_fraction})")
    s = write_synthetic_dataset(
        args.out, args.num, seed=args.seed, eval_num=args.eval_num, video_fraction=args.video_fraction
    )
    state = "already present" if s.reused else "written"
    print(
        f"{s.num_train} train + {s.num_val} eval records, {s.num_images} images, {s.num_videos} videos {state} in "
        f"{s.out_dir}"
    )
    return 0


def _profile(args: argparse.Namespace) -> int:
    """`dhp data profile`: the summary table; the samples and the summary as JSON with --out."""
    from dhp.dataflow.length_profile import table, write
    from dhp.stages.data_profile import data_profile

    if args.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (got {args.limit})")
    cfg = load_config(args.config, [*args.overrides, *([f"data.train={args.path}"] if args.path else [])])
    result = data_profile(cfg, args.limit)
    print(table(result))
    if args.out:
        write(result, args.out)
        print(f"profile: {args.out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from dhp.dataflow.convert import main as convert

    return convert(args)


def _report(args: argparse.Namespace) -> int:
    from dhp.scripts.report import main as report

    return report(args)


def _export_hf(args: argparse.Namespace) -> int:
    from dhp.models.weights.export import export_hf

    weight_map = export_hf(args.checkpoint, args.out, args.max_shard_size)
    print(f"{len(weight_map)} tensors written to {args.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`dhp plan`: the table, the JSON rows; exit 0 when it fits (or there is nothing to compare), 1 when not."""
    from dhp.models.parallel.checks import check_layout
    from dhp.models.planning.memory_plan import advice, plan, table
    from dhp.stages.trainer import model_config_of

    if args.data_profile and not (args.time or args.search):
        raise ConfigError(
            "--data-profile goes with --time or --search (the memory plan alone takes data.microbatch_tokens)"
        )
    if args.video and not (args.time or args.search):
        raise ConfigError("--video goes with --time or --search (the memory plan alone takes data.microbatch_tokens)")
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
        rows = [
            {**r.row(), "per_device": result["per_device"], "device": result["device"], "fits": result["fits"]}
            for r in result["ranks"].values()
        ]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if result["fits"] is False else 0


def main(argv: list[str] | None = None) -> int:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started as a background job of a non-interactive shell:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGINT still stops it, Ray shut down on the way
    args = _parser(argv).parse_args(argv)
    try:
        return args.run(args) or 0
    except (ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"dhp: error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # from a loader actor: Ray's wrapper, whose text is the actor's traceback
        print(f"dhp: error: {one_line(getattr(e, 'cause', e))}", file=sys.stderr)
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
