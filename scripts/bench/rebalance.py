"""`dhp bench rebalance`: a run whose length mix shifts mid-run moves a rank to the pool that became the busy one
(`pipeline.rebalance`), and its steps after the move are compared with the best fixed layout's on the new mix.

The data, one epoch in file order (`data.shuffle_seed=null`): first `small` records of a small photo and a passage of
text (light on the vision pool), then `large` records of a photo at `MAX_PIXELS` and its short caption (the vision
pool's). The photos and captions are the real img2dataset shard's in tests/assets. The model: `tiny` with a vision
encoder of `VISION` (8 blocks of width 256: `tiny`'s own 4 of width 64 weigh less than the text model's 152 k-row
lm_head on any image), randomly initialised and saved as a checkpoint directory the runs load (`model.path`).
Three stage actors, one torch thread each, `pipeline.placement: shared`:
  moved        starts with vision 1 / text 2 replicas (the layout for the first part), `pipeline.rebalance` on;
               after the shift the text pool idles and gives a rank to vision (vision 2 / text 1)
  fixed v1/t2  the second part alone, vision 1 / text 2 replicas, no rebalancing
  fixed v2/t1  the same, vision 2 / text 1
Row fields (step times: `step_time_s` of RUN_DIR/metrics.jsonl, median, the first step of an attempt left out as
its warm-up):
  moved_after_step   the step the run checkpointed at to move; its new layout
  moved_large_s      the moved run's steps of the second part in the new layout
  before_move_s      its steps of the second part still in the old layout (the cost of not moving)
  fixed_s            per fixed layout, its steps on the second part
  after_over_best    moved_large_s / the fastest fixed layout's (goal: <= 1.15)
On 2 cores the three actors share the cores, but a pool that waits leaves its core to the other: the busy pool
gains from a second rank (docs/pipelining.md).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

GOAL = 1.15
SMALL_SIDE = 56  # px, the small photos' longer side: 16 patches
MAX_PIXELS = 336 * 336  # the large photos: 576 patches, 144 merged tokens
# One sample a micro-batch in both parts, so that two vision replicas can share a step's images: a budget below
# two large samples (at least ~165 tokens each) that holds one text-heavy sample. A small sample is its passage,
# its caption (up to 63 tokens in the first 16 photos) and ~38 of template, image and question: a passage of 240
# made the first record 324 tokens, a counted skip that moved a large photo into the first part.
MICROBATCH_TOKENS = 320
PASSAGE_TOKENS = 200
VISION = {"depth": 8, "vision_hidden": 256, "vision_inter": 1024, "text_inter": 176, "text_layers": 2}
GLOBAL_BATCH = 4  # two text replicas split it, then one
POOLS = {"v1/t2": (1, 2), "v2/t1": (2, 1)}
# records of each part, the steps `pipeline.rebalance` measures before it may move, and the steps from the start
# before it may (`cooldown_steps`): a move on a busy-fraction gap of 0.3 that it predicts to cut the busiest pool's
# time by 20 %. `fixed_steps`: the steps of each fixed layout's run (its first one a warm-up the median leaves out).
# The quick run decides first on the shift's first step: one step of the first part, measured on a loaded 2-core
# CI machine, once read vision-bound (busy 0.66 against text's 0.22) and moved a step early. Whether the policy
# stays put while the mix does not call for a move is the full run's result and stages/rebalance.py's tests'.
FULL = {"small": 16, "large": 40, "measure_steps": 2, "cooldown_steps": 2, "fixed_steps": 10}  # 4 steps, then 10
QUICK = {"small": 8, "large": 16, "measure_steps": 1, "cooldown_steps": 3, "fixed_steps": 2}  # 2, then 4; fixed 2
POLICY = {"threshold": 0.3, "min_gain": 0.2}


def write_mix(root: Path, small: int, large: int) -> tuple[Path, Path]:
    """The shifting set (`small` records of a small photo and a passage, then `large` ones of a large photo) and its
    second part alone."""
    from PIL import Image

    from dhp.scripts.bench.long_tail import shard_photos

    photos = shard_photos()
    passage = _passage([caption for _, _, caption in photos], PASSAGE_TOKENS)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(small + large):
        key, jpg, caption = photos[i % len(photos)]
        image = Image.open(io.BytesIO(jpg)).convert("RGB")
        if i < small:
            image.thumbnail((SMALL_SIDE, SMALL_SIDE))
            question = f"<image>\n{passage}\nWhich of these captions is this photo's?"
        else:
            question = "<image>\nDescribe the photo."  # resized to max_pixels by the preprocessing
        image.save(root / "images" / f"{i}.png")
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": caption}]
        lines.append(json.dumps({"id": f"{key}-{i}", "image": f"images/{i}.png", "conversations": turns}))
    shifting, second = root / "shifting.jsonl", root / "second_part.jsonl"
    shifting.write_text("\n".join(lines) + "\n")
    second.write_text("\n".join(lines[small:]) + "\n")
    return shifting, second


def _passage(captions: list[str], tokens: int) -> str:
    """The captions joined, as many as stay within `tokens` tokens."""
    from dhp.dataflow.tokenizer import load_tokenizer

    tokenizer, words = load_tokenizer(), []
    for caption in captions:
        if len(tokenizer(" ".join([*words, caption]))["input_ids"]) > tokens:
            break
        words.append(caption)
    return " ".join(words)


def write_model(root: Path) -> Path:
    """`tiny` with the vision encoder of `VISION`, seeded, as a checkpoint directory (with the tokenizer)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.dataflow.tokenizer import load_tokenizer
    from dhp.scripts.bench.pipeline import model_config

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(model_config(VISION, VISION["depth"], VISION["text_layers"]))
    model.save_pretrained(root / "model")
    load_tokenizer().save_pretrained(root / "model")
    return root / "model"


def config(
    root: Path,
    name: str,
    data: Path,
    steps: int,
    pools: tuple[int, int],
    measure_steps: int = 0,
    cooldown_steps: int = 0,
) -> Any:
    """`tiny` on `data` in file order, `pools` = (vision, text) one-rank replicas; `measure_steps` > 0: with
    `pipeline.rebalance` on, `measure_steps` and `cooldown_steps` its own."""
    from dhp.stages.config import load_config

    overrides = [
        f"model.path={root / 'model'}",
        f"data.max_pixels={MAX_PIXELS}",
        f"data.microbatch_tokens={MICROBATCH_TOKENS}",
        f"data.max_seq_len={MICROBATCH_TOKENS}",
        f"data.train={data}",
        "data.eval=",
        "data.shuffle_seed=null",
        f"training.steps={steps}",
        f"training.global_batch_size={GLOBAL_BATCH}",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        "training.keep_last=0",
        f"output.dir={root}/runs",
        f"output.name={name}",
        "output.save_final_checkpoint=false",
        "output.tensorboard=false",
        *(f"{s}.{k}" for s in ("vision", "text") for k in ("parallelism=none", "degree=1", "num_cpus_per_actor=0.25")),
        f"vision.num_actors={pools[0]}",
        f"text.num_actors={pools[1]}",
    ]
    if measure_steps:
        overrides += ["pipeline.rebalance.enabled=true", f"pipeline.rebalance.measure_steps={measure_steps}"]
        overrides += [f"pipeline.rebalance.cooldown_steps={cooldown_steps}"]
        overrides += [f"pipeline.rebalance.{k}={v}" for k, v in POLICY.items()]
    return load_config("tiny", overrides)


def _median(rows: list[dict[str, Any]]) -> float | None:
    return statistics.median(r["step_time_s"] for r in rows) if rows else None


def run(sizes: dict[str, int], root: Path, trainers: Any = None) -> dict[str, Any]:
    """The three runs on the set written under `root`; `trainers`: where the runs' trainers come from (the
    driver's `train` argument; default: new ones)."""
    from dhp.stages.driver import train
    from dhp.stages.step_logs import read

    shifting, second = write_mix(root, sizes["small"], sizes["large"])
    write_model(root)
    small_steps, large_steps = sizes["small"] // GLOBAL_BATCH, sizes["large"] // GLOBAL_BATCH
    policy = {k: sizes[k] for k in ("measure_steps", "cooldown_steps")}
    cfg = config(root, "moved", shifting, small_steps + large_steps, POOLS["v1/t2"], **policy)
    summary = train(cfg, trainers=trainers)
    moved = read(root / "runs" / "moved")
    after = [m["after_step"] for m in summary["rebalanced"]]
    row: dict[str, Any] = {
        "records": {"first_part": sizes["small"], "second_part": sizes["large"]},
        "measure_steps": sizes["measure_steps"],
        "global_batch_size": GLOBAL_BATCH,
        "first_part_steps": small_steps,
        "moves": summary["rebalanced"],
        "moved_after_step": after[0] if after else None,
    }
    if after:
        # the first step after the resume builds its graphs and caches anew: a warm-up, as each run's first step
        row["moved_large_s"] = _median([r for r in moved if r["step"] > after[0] + 1 and r["step"] > small_steps])
        row["before_move_s"] = _median([r for r in moved if small_steps + 1 < r["step"] <= after[0]])
    row["fixed_s"] = {}
    for name, pools in POOLS.items():
        label = "fixed-" + name.replace("/", "-")
        train(config(root, label, second, sizes["fixed_steps"], pools), trainers=trainers)
        row["fixed_s"][name] = _median(read(root / "runs" / label)[1:])
    best = min(row["fixed_s"], key=row["fixed_s"].get)
    row["best_fixed"] = best
    if row.get("moved_large_s"):
        row["after_over_best"] = row["moved_large_s"] / row["fixed_s"][best]
    row["goal"] = GOAL
    row["busy"] = [{k: r[k] for k in ("step", "vision_busy", "text_busy", "step_time_s")} for r in moved]
    return row


def table(row: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    moves = "; ".join(m["line"] for m in row["moves"]) or "none"
    lines = [
        f"shifting mix: {row['first_part_steps']} steps of small photos, then large ones; moves: {moves}",
        "| run | second part's step s (median) |",
        "|---|---:|",
        f"| moved, before its move | {s(row.get('before_move_s'))} |",
        f"| moved, after its move | {s(row.get('moved_large_s'))} |",
        *(f"| fixed {name} | {s(v)} |" for name, v in row["fixed_s"].items()),
        f"after the move / best fixed ({row['best_fixed']}): {s(row.get('after_over_best'))} (goal <= {GOAL})",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import ray

    from dhp.scripts.results import write_json

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="dhp-bench-rebalance-") as tmp:
            row = run(QUICK if args.quick else FULL, Path(tmp))
    finally:
        if started:
            ray.shutdown()
    print(table(row))
    if args.json:
        write_json(args.json, row)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("rebalance", help="a mix that shifts mid-run: pools that move vs fixed layouts")
    p.add_argument("--json", default=None, help="write the row here")
    p.add_argument("--quick", action="store_true", help="2 + 4 steps, the fixed layouts 2 (for tests)")
