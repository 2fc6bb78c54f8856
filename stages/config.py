"""Typed run configuration: YAML presets in `configs/` plus `KEY=VALUE` overrides, checked up front.

Every key is a dataclass field with a type and a comment on its declaration: docs/configuration.md is
generated from these comments (scripts/config_reference.py). An unknown key, a wrong type or an
out-of-range value stops the run before Ray starts, with a message that names the key, the expected type
and the file the value came from.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import yaml

from dhp.errors import ConfigError, one_line
from dhp.stages.placement_modes import PlacementMode, placement_mode

if TYPE_CHECKING:
    from dhp.stages.boundary import Transport

# training.on_checkpoint_error -> whether a failed save stops the run (else it retries at the next interval)
CHECKPOINT_ERROR_STOPS = {"continue": False, "stop": True}
# plan.layout -> whether the run searches its layout before the pools are built (stages/auto_layout.py)
LAYOUT_SEARCHED = {"given": False, "auto": True}


@dataclass
class ModelConfig:
    # built-in shape, which picks the model family: tiny | qwen2_5_vl_3b | qwen2_5_vl_7b | qwen2_5_vl_32b |
    name: str = "tiny"  # qwen2_5_vl_72b (Qwen2.5-VL) | qwen3_vl_tiny (Qwen3-VL)
    path: str | None = None  # local HF checkpoint dir (config.json + *.safetensors); overrides `name`
    init_seed: int = 0  # seed of the random init when no `path` is given
    # exact: the single-process build's values in every layout (replayed on the CPU, the whole stage per rank);
    # per_part: each rank draws only its part on its device (same distribution, another stream:
    # models/weights/random_init.py)
    random_init: Literal["exact", "per_part"] = "exact"
    # attention kernel: sdpa has a flash kernel on CUDA; flash_attention_2 needs flash-attn installed (checked before
    # Ray starts)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype under fp32 precision (GPU autocast)
    precision: Literal["fp32", "bf16"] = "fp32"  # model states: fp32 master (16 B/param) or pure bf16 (8 B/param)
    tokenizer_path: str | None = None  # tokenizer dir; default: `path`, else the built-in Qwen2.5 BPE

    @property
    def tokenizer_dir(self) -> str | None:
        """The directory the tokenizer is read from: `tokenizer_path`, else `path`; None: the built-in BPE."""
        return self.tokenizer_path or self.path


@dataclass
class StageConfig:
    # layout of the pool (models/parallel/): vision none | sequence | tensor | zero3; text none | tensor | zero3
    parallelism: Literal["none", "sequence", "tensor", "zero3"] = "none"
    num_actors: int = 1  # actors in this pool (= dp x degree)
    degree: int = 1  # sequence- (vision) or tensor- (text) parallel group size
    num_cpus_per_actor: float = 1.0  # Ray CPU resource per actor (fractions allowed)
    num_gpus_per_actor: float = 0.0  # Ray GPU resource per actor (fractions share a GPU)
    torch_threads: int = 1  # intra-op threads per actor
    # Ray custom resources each actor also asks for, e.g. {vision_node: 1}: pins the pool to the nodes that offer
    # them (`ray start --resources`), e.g. to keep the pools on disjoint nodes
    resources: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0  # LR of the stage's main module (vision: patch embed + blocks; text: LM) = training.lr x this
    weight_decay: float | None = None  # the stage's main module (None: training.weight_decay)
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"  # recompute blocks in backward
    activation_checkpointing_every: int = 2  # every_n: blocks 0, N, 2N, ... recompute
    # torch.compile each block's forward: inductor (fused kernels; the first micro-batch compiles), aot_eager (traced,
    # not fused: a check that it compiles), none (models/compilation.py)
    compile: Literal["none", "inductor", "aot_eager"] = "none"


@dataclass
class VisionStageConfig(StageConfig):
    train: Literal["all", "merger", "none"] = "all"  # what trains: all, the merger only, or nothing (forward only)
    merger_lr_scale: float | None = None  # the merger's LR = training.lr x this (None: lr_scale)
    merger_weight_decay: float | None = None  # the merger's (None: vision.weight_decay)


@dataclass
class LoraConfig:
    rank: int = 16  # r: inner width of each adapter (A: [r, in], B: [out, r])
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input
    targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # decoder Linear names, comma-separated


@dataclass
class TextStageConfig(StageConfig):
    train: Literal["all", "lora", "none"] = "all"  # the language model; LoRA adapters on it (base frozen); nothing
    lora: LoraConfig = field(default_factory=LoraConfig)  # used when train is lora (models/lora.py)


@dataclass
class SynthConfig:
    dir: str = "data/synth"  # where `dhp train` writes the synthetic set if `data.train` is empty
    num: int = 512  # training records
    eval_num: int = 64  # held-out records
    seed: int = 0  # seed of the shapes, colours and captions
    video_fraction: float = 0.1  # records that are short videos of a moving shape (half MPEG-4 files, half frame lists)


@dataclass
class StorageConfig:
    endpoint_url: str | None = None  # S3-compatible endpoint (http(s)://host:port); None: AWS_ENDPOINT_URL(_S3) or AWS
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / the profile's region
    addressing_style: Literal["auto", "path", "virtual"] = "auto"  # path-style for most non-AWS endpoints
    profile: str | None = None  # AWS profile for credentials (None: AWS_PROFILE or the default chain)
    anonymous: bool = False  # unsigned requests (public buckets)
    max_attempts: int = 6  # tries per request; timeouts, 5xx and throttling are retried with backoff
    connect_timeout_s: float = 10.0  # seconds to open a connection to the endpoint
    request_timeout_s: float = 60.0  # seconds one request may take before it is retried


@dataclass
class WebDatasetConfig:
    # the user turn of every sample; holds <image> exactly once (a sample whose member is a video: <video> in its place)
    prompt: str = "<image>\nDescribe this image."
    caption: str = "txt"  # the reply: the `{key}.txt` member, or this field of `{key}.json` (e.g. cogvlm_caption)


@dataclass
class VideoConfig:
    fps: float = 2.0  # frames sampled per second of a video (transformers' Qwen2VLVideoProcessor policy)
    min_frames: int = 4  # at least this many frames per video (when it has them)
    max_frames: int = 16  # at most this many frames per video (2 frames make one temporal patch)
    min_pixels: int = 56 * 56  # smart_resize lower bound of one frame (pixels)
    max_pixels: int = 112 * 112  # smart_resize upper bound of one frame; every frame of a video gets one size
    frames_fps: float = 2.0  # frames per second that a video given as a list of frame files stands for


@dataclass
class DataConfig:
    # annotation files (JSON array or JSONL) or WebDataset shards (.tar), comma-separated; brace ranges
    # ({00000..01023}) and globs (*, ?) expand, local or s3://; empty = the synthetic set
    train: str = ""
    format: Literal["auto", "jsonl", "webdataset"] = "auto"  # auto: webdataset when every path ends in .tar
    eval: str = ""  # held-out annotation files or shards, as `train`; empty = none (or the synthetic val split)
    image_root: str = ""  # base of relative `image` paths; empty = the annotation file's folder
    min_pixels: int = 56 * 56  # smart_resize lower bound (pixels per image)
    max_pixels: int = 224 * 224  # smart_resize upper bound; larger images are resized down
    max_seq_len: int = 2048  # longest sample in tokens (vision + text); longer ones are skipped
    microbatch_tokens: int = 2048  # token budget of one micro-batch (batch x padded length; packed: total length)
    # pack each micro-batch's samples back to back into one sequence (no padding) whose text attention stays inside
    # each sample (flash-attn's varlen kernel if installed, else torch's on a GPU, else SDPA per sample); false:
    # right-pad to the longest
    packing: bool = False
    # group each global batch's samples into micro-batches even in predicted cost (text tokens + vision patches,
    # dataflow/balance.py), each within microbatch_tokens, the smallest at the ends so the pipeline fills and drains
    # fast, and deal them to the text replicas by the same cost; the same samples, each once, so the data position
    # is unchanged. false: grouped by tokens only (packing.pack)
    balance: bool = False
    preprocess_workers: int = 1  # Ray Data tasks at a time running decode/resize/patchify/tokenize
    preprocess_num_cpus: float = 0.25  # Ray CPU resource per preprocessing worker
    shuffle_seed: int | None = 0  # epoch e shuffles with seed + e; null: file order, no shuffle
    # a late global batch (first row, eval batch) whose streams read nothing for 2 x this many seconds means the data
    # pipeline stalled: a fault, like a hung rank (rebuild, resume); 0 = wait forever
    timeout_s: float = 600.0
    synthetic: SynthConfig = field(default_factory=SynthConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)  # how s3:// paths are reached (never credentials)
    webdataset: WebDatasetConfig = field(default_factory=WebDatasetConfig)  # img2dataset shards -> conversations
    video: VideoConfig = field(default_factory=VideoConfig)  # how videos are sampled and sized (docs/data.md#video)


@dataclass
class TrainingConfig:
    steps: int = 100  # optimizer steps
    gpu_memory_gib: float | None = None  # memory of one GPU for the plan; None: this machine's GPU, if any
    skip_memory_check: bool = False  # start even if the memory plan (dhp plan) says a GPU rank will not fit
    global_batch_size: int = 8  # samples per optimizer step (split into token-budget micro-batches)
    lr: float = 2e-3  # peak learning rate (each module scales it: vision.lr_scale, text.lr_scale)
    min_lr_ratio: float = 0.1  # cosine decays to lr x min_lr_ratio
    warmup_steps: int = 10  # linear warm-up from 0 to lr, then the cosine decay
    weight_decay: float = 0.0  # AdamW weight decay (each module may override it)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    # AdamW implementation (models/optimizer.py): fused (one in-place kernel), foreach (list ops over each group,
    # one moment-sized temporary per group), for_loop (tensor by tensor); auto: fused on CUDA, foreach on CPU
    optimizer: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    max_grad_norm: float = 1.0  # clip by the global norm over both stages; <= 0 disables
    eval_every: int = 50  # steps between eval passes; 0 = only at the end
    eval_batches: int = 4  # global batches per eval pass
    log_every: int = 1  # steps between metrics lines (the console prints every 10 x this off a terminal)
    checkpoint_every: int = 0  # steps between checkpoints (RUN_DIR/checkpoints/step_N); 0 = only at the end
    keep_last: int = 3  # checkpoints kept (older ones deleted); 0 = keep all
    max_restarts: int = 2  # times a run rebuilds its pools after a fault (a dead actor or node, a hang), then fails
    # seconds a step may take before its ranks are looked at; then a rank whose call stands still this long (no
    # block forward or backward, no gradient-sync bucket) is declared hung, one that moves never is
    # (stages/watchdog.py); 0 = auto: 10 x the median step so far x this batch's work (its patches and tokens as
    # FLOPs) over the median step's, at least step_timeout_min_s (the first step of an attempt: 1800 s, warm-up)
    step_timeout_s: float = 0.0
    step_timeout_min_s: float = 120.0  # the least automatic step_timeout_s, once step times are known
    preempt_grace_s: float = 30.0  # after SIGTERM/SIGINT: finish the step and checkpoint within this (warned if not)
    on_checkpoint_error: Literal["continue", "stop"] = "continue"  # a failed save: retry at the next interval, or stop
    rebuild_timeout_s: float = 300.0  # after a fault: how long to wait for the cluster to offer the pools' resources
    resume: str = "auto"  # auto: continue from the newest valid checkpoint of RUN_DIR if any; none; or a path

    @property
    def stops_on_checkpoint_error(self) -> bool:
        """The one reader of `on_checkpoint_error` (the driver asks this)."""
        return CHECKPOINT_ERROR_STOPS[self.on_checkpoint_error]


@dataclass
class RebalanceConfig:
    # move ranks from the idler pool to the busier one during a run, decided from the measured busy fractions
    # (stages/rebalance.py); off: the pools keep the sizes they were given
    enabled: bool = False
    measure_steps: int = 5  # steps measured in the present layout before deciding (their median busy fractions)
    threshold: float = 0.2  # the pools' busy fractions must differ by at least this to consider a move
    min_gain: float = 0.1  # a move must predict the busiest pool at least this fraction less busy than now
    cooldown_steps: int = 10  # steps after a move (or the start) before another is considered


@dataclass
class PipelineConfig:
    max_in_flight: int = 3  # vision forwards that may run ahead of the text stage (1 = serial, no overlap)
    placement: Literal["shared", "disjoint"] = "shared"  # shared: vision+text actors share bundles (GPUs)
    trace: bool = False  # write RUN_DIR/trace.json: every stage call on a timeline (chrome://tracing)
    boundary: Literal["host", "cuda_ipc"] = "host"  # how vision outputs / their gradients travel (stages/boundary.py)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)  # whether and when pools trade ranks

    @property
    def placement_mode(self) -> PlacementMode:
        """The `placement` string as the object everything asks (stages/placement_modes.py)."""
        return placement_mode(self.placement)

    @property
    def transport(self) -> Transport:
        """The `boundary` string as the object workers and pools ask (stages/boundary.py)."""
        # imported here: the boundary needs torch, which `dhp config` and the command line's parser do not
        from dhp.stages.boundary import transport_of

        return transport_of(self.boundary)

    @property
    def shared(self) -> bool:
        """Vision actor b and text actor b share one device and take turns on it (the time model and plan ask)."""
        return self.placement_mode.shares_devices


@dataclass
class PlanConfig:
    # given: train the layout this config sets; auto: before the pools are built, rank every layout of the devices
    # Ray reports as `dhp plan --search` does and train the fastest that fits (docs/planning.md, "Letting dhp choose
    # the layout"); a layout key also given on the command line (e.g. vision.parallelism=sequence) wins: only
    # the layouts that keep it are ranked
    layout: Literal["given", "auto"] = "given"
    # auto: the hardware to plan for: a datasheet name (h100-sxm, h200, a100-80gb, l40s) or a `dhp bench ops --json`
    # file; None: the datasheet of the GPU type Ray reports (a cluster without GPUs needs a `dhp bench ops` file)
    hardware: str | None = None
    # auto: the length mix (`dhp data profile --out FILE`) the layouts are ranked on; empty: one sample of the
    # config's own sizes (an image of data.max_pixels, data.max_seq_len tokens in all)
    data_profile: str = ""
    top: int = 5  # auto: rows of the ranking printed

    @property
    def searched(self) -> bool:
        """The one reader of `layout` (the driver asks this)."""
        return LAYOUT_SEARCHED[self.layout]


@dataclass
class RayConfig:
    address: str | None = None  # None: RAY_ADDRESS if set, else start a local Ray
    num_cpus: float | None = None  # CPUs of a locally started Ray (None: all)


@dataclass
class OutputConfig:
    dir: str = "runs"  # runs are written to dir/name
    name: str | None = None  # None: a timestamp
    save_final_checkpoint: bool = True  # RUN_DIR/checkpoint: the trained model as a Hugging Face dir
    max_shard_size: str = "5GB"  # largest safetensors file of that dir (and of `dhp export-hf`): GB, MiB, bytes
    tensorboard: bool = True  # write TensorBoard event files to RUN_DIR/tensorboard
    peak_tflops: float | None = None  # per-actor peak for the MFU estimate; None: known GPU table, or measured on CPU


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # which model: a built-in shape or a checkpoint, precision
    vision: VisionStageConfig = field(default_factory=VisionStageConfig)  # the vision pool: layout, actors, what trains
    text: TextStageConfig = field(default_factory=TextStageConfig)  # the text pool: layout, actors, what trains
    data: DataConfig = field(default_factory=DataConfig)  # what is read and how it becomes micro-batches
    training: TrainingConfig = field(default_factory=TrainingConfig)  # steps, optimizer, checkpoints, faults
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # how micro-batches flow between the pools
    plan: PlanConfig = field(default_factory=PlanConfig)  # whether dhp chooses the layout itself, and for what
    ray: RayConfig = field(default_factory=RayConfig)  # which Ray cluster
    output: OutputConfig = field(default_factory=OutputConfig)  # what a run writes to RUN_DIR

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS_PACKAGE = "dhp.configs"


def preset_path(name: str) -> Path:
    """`tiny` -> the packaged configs/tiny.yaml; a path is returned as is."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return Path(name)
    path = Path(str(resources.files(PRESETS_PACKAGE).joinpath(f"{name}.yaml")))
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no preset {name!r}; presets: {', '.join(known)} (or give a .yaml path)")
    return path


def load_config(source: str = "tiny", overrides: list[str] | None = None) -> Config:
    """Preset name or YAML path, then `a.b=value` overrides (values parsed as YAML scalars)."""
    path = preset_path(source)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    config = _build(Config, raw, prefix="", origin=str(path))
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"command line: override {item!r} is not KEY=VALUE (e.g. training.steps=20)")
        _apply_override(config, key.strip(), text, item)
    validate(config)
    return config


def _parse_override(tp: Any, text: str, item: str) -> Any:
    """Override text -> value. Strings stay verbatim (`output.name=2024` is a name, not a number)."""
    args = typing.get_args(tp)
    if tp is str or (str in args and not any(a in args for a in (int, float, bool))):
        return None if text.strip() in ("", "null", "~") and type(None) in args else text
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"command line: override {item!r}: value is not valid YAML: {one_line(e)}") from None


def _build(cls: type, raw: dict[str, Any], prefix: str, origin: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{origin}: unknown key {full!r}; {_known(cls, prefix)}")
        kwargs[key] = _coerce(hints[key], value, full, origin)
    return cls(**kwargs)


def _known(cls: type, prefix: str) -> str:
    return "known keys here: " + ", ".join(prefix + f.name for f in dataclasses.fields(cls))


def _coerce(tp: Any, value: Any, key: str, origin: str) -> Any:
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: {key!r} must be a mapping (section), got {value!r}")
        return _build(tp, value, prefix=key + ".", origin=origin)
    origin_tp = typing.get_origin(tp)
    if origin_tp in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key, origin)
            except ConfigError:
                continue
        raise ConfigError(f"{origin}: {key!r} expects {_type_name(tp)}, got {value!r}")
    if origin_tp is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{origin}: {key!r} expects one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if origin_tp is dict:  # custom resources: {name: amount}
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: {key!r} must be a mapping, got {value!r}")
        return {
            _coerce(key_tp, k, f"{key}.{k}", origin): _coerce(value_tp, v, f"{key}.{k}", origin)
            for k, v in value.items()
        }
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            got = f"{value!r} ({type(value).__name__})"
            raise ConfigError(f"{origin}: {key!r} expects {tp.__name__}, got {got}")
        return value
    raise ConfigError(f"{origin}: {key!r} has an unsupported type {tp}")  # a bug in this file


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp)]
    return " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)


def _apply_override(config: Config, key: str, text: str, item: str) -> None:
    *path, last = key.split(".")
    target: Any = config
    for i, part in enumerate(path):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise ConfigError(f"command line: override {item!r}: unknown key {'.'.join(path[: i + 1])!r}")
        target = getattr(target, part)
    if not dataclasses.is_dataclass(target) or last not in {f.name for f in dataclasses.fields(target)}:
        prefix = ".".join(path) + "." if path else ""
        known = "; " + _known(type(target), prefix) if dataclasses.is_dataclass(target) else ""
        raise ConfigError(f"command line: override {item!r}: unknown key {key!r}{known}")
    tp = typing.get_type_hints(type(target))[last]
    if dataclasses.is_dataclass(tp):
        value = _parse_override(dict, text, item)
        if not isinstance(value, dict):
            raise ConfigError(f"command line: {key!r} is a section: override its keys ({key}.KEY=VALUE)")
        merged = dataclasses.asdict(getattr(target, last)) | value  # a partial section keeps the rest
        setattr(target, last, _coerce(tp, merged, key, "command line"))
        return
    setattr(target, last, _coerce(tp, _parse_override(tp, text, item), key, "command line"))


def validate(config: Config) -> None:
    """Value checks that types alone cannot express."""
    t, d = config.training, config.data
    checks = [
        (t.steps >= 1, "training.steps must be >= 1"),
        (t.global_batch_size >= 1, "training.global_batch_size must be >= 1"),
        (t.lr > 0, "training.lr must be > 0"),
        (0 <= t.min_lr_ratio <= 1, "training.min_lr_ratio must be in [0, 1]"),
        (t.warmup_steps >= 0, "training.warmup_steps must be >= 0"),
        (d.min_pixels <= d.max_pixels, "data.min_pixels must be <= data.max_pixels"),
        (d.video.min_pixels <= d.video.max_pixels, "data.video.min_pixels must be <= data.video.max_pixels"),
        (0 <= d.synthetic.video_fraction <= 1, "data.synthetic.video_fraction must be in [0, 1]"),
        (
            d.video.fps > 0 and d.video.frames_fps > 0 and 1 <= d.video.min_frames <= d.video.max_frames,
            "data.video: fps and frames_fps must be > 0 and 1 <= min_frames <= max_frames",
        ),
        (d.max_seq_len <= d.microbatch_tokens, "data.max_seq_len must be <= data.microbatch_tokens"),
        (d.preprocess_workers >= 1, "data.preprocess_workers must be >= 1"),
        (d.timeout_s >= 0, "data.timeout_s must be >= 0 (0 = no deadline)"),
        (
            d.webdataset.prompt.count("<image>") == 1,
            "data.webdataset.prompt must hold <image> exactly once (where the photo goes), "
            f"got {d.webdataset.prompt!r}",
        ),
        (bool(d.webdataset.caption.strip()), "data.webdataset.caption must name `txt` or a field of the .json member"),
        (
            min(t.checkpoint_every, t.keep_last, t.max_restarts) >= 0,
            "training.checkpoint_every, keep_last and max_restarts must be >= 0",
        ),
        (
            min(t.step_timeout_s, t.step_timeout_min_s, t.preempt_grace_s, t.rebuild_timeout_s) >= 0,
            "training.step_timeout_s, step_timeout_min_s, preempt_grace_s and rebuild_timeout_s must be >= 0",
        ),
        (config.pipeline.max_in_flight >= 1, "pipeline.max_in_flight must be >= 1 (1 = serial order)"),
        (config.plan.top >= 1, "plan.top must be >= 1"),
        (
            config.pipeline.rebalance.measure_steps >= 1 and config.pipeline.rebalance.cooldown_steps >= 0,
            "pipeline.rebalance.measure_steps must be >= 1 and cooldown_steps >= 0",
        ),
        (
            0 <= config.pipeline.rebalance.threshold <= 1 and 0 <= config.pipeline.rebalance.min_gain < 1,
            "pipeline.rebalance.threshold must be in [0, 1] and min_gain in [0, 1)",
        ),
    ]
    for stage in ("vision", "text"):
        s: StageConfig = getattr(config, stage)
        checks += [
            (s.num_actors >= 1, f"{stage}.num_actors must be >= 1"),
            (
                s.degree >= 1 and s.num_actors % s.degree == 0,
                f"{stage}.num_actors must be a multiple of {stage}.degree",
            ),
            (
                s.num_cpus_per_actor >= 0 and s.num_gpus_per_actor >= 0 and min(s.resources.values(), default=0) >= 0,
                f"{stage} resources must be >= 0",
            ),
            (s.activation_checkpointing_every >= 1, f"{stage}.activation_checkpointing_every must be >= 1"),
        ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    from dhp.models.weights.shard_size import parse_size

    try:
        parse_size(config.output.max_shard_size)
    except ValueError as e:
        raise ConfigError(f"output.max_shard_size: {e}") from None


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
