"""Shared fixtures: one local Ray per test session, small images and records on disk, a tiny model."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests import background

# One intra-op thread here and in every process the tests start (they inherit the variable; the stage actors set
# their own): the tests' models are tiny, which one thread computes as fast as two, and OpenMP's two threads
# spin-wait for each other, burning a core whenever another process holds the other one. A small backward loop
# beside one busy process: 8.5 s and 10.8 CPU-s on 2 threads, 2.0 s and 2.0 CPU-s on one (docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each Ray the tests start (the session's, and every `dhp train` or bench subprocess's own) would start workers as
# soon as its first driver connects, before anything asks for one; the tests' actors and tasks start their own, so
# those idle processes only import Ray and exit with it (2-3 per start, about 3.5 CPU-s each, docs/testing.md).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started as a background job of a non-interactive shell:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGINT still stops it, the session's Ray shut down


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray shared by the tests that need one; always shut down."""
    import ray

    # Logical CPUs: the parity layouts place up to 10 small actors on this 2-core machine, and the trainers kept
    # between tests (`TrainerCache`) hold theirs. address="local": always a new Ray of its own, never a `ray
    # start` head another run on this machine left as the latest cluster.
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        try:
            _TRAINERS.clear()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def quick_ops_profile(ray_session, tmp_path_factory):
    """`dhp bench ops --quick` of this machine, measured once per session (about 25 s) by the first test marked
    `measures_speed` that asks for it, after the background runs: the profile JSON's path (its run reuses the
    session's Ray and leaves it running)."""
    import argparse

    from dhp.scripts.bench.ops import main

    path = tmp_path_factory.mktemp("bench_ops") / "sub" / "profile.json"
    assert main(argparse.Namespace(json=str(path), quick=True)) == 0
    assert ray_session.is_initialized()
    return path


class TrainerCache:
    """Trainers kept between tests, so that one of the same pool shape is rebuilt on the same actors
    (`Trainer.reuse`) instead of starting a process per rank (about 5 CPU-s of imports each on 2 cores).

    `with trainers.use(cfg) as trainer:` gives a trainer of `cfg` at step 0; a test that passes keeps it for the
    next, one that fails shuts it down (its state is not to be trusted). Kept trainers hold their pools'
    resources, so the oldest are shut down when a new one would not fit, and all of them before a test that
    does not ask for this fixture and is slow (`pytest_runtest_setup` below)."""

    # Each kept actor is an idle process of about 0.5 GB (torch, transformers, the tiny model).
    KEEP_ACTORS = 18
    # A new stage actor while it builds and trains a test's model, and what the test process and the other
    # processes beside it need on top: a new trainer is built only with that much memory available.
    ACTOR_BYTES = 800 * 2**20
    MEMORY_MARGIN = 2 * 2**30

    def __init__(self) -> None:
        self.kept: list = []
        self.reused = 0
        self.builds: collections.Counter = collections.Counter()  # pool shape -> trainers built of it
        # pool shape -> (the test that built it, why the last kept trainer of that shape went), per build
        self.history: dict = collections.defaultdict(list)
        self.let_go: dict = {}  # pool shape -> why its last kept trainer was shut down
        # test id -> actor kind -> the most (vision, text) actors the `pool_shape` cases from it on ask (`expect`)
        self.expected: dict = {}

    @property
    def built(self) -> int:
        return sum(self.builds.values())

    @contextlib.contextmanager
    def use(self, cfg, **kwargs):
        trainer = self.take(cfg, **kwargs)
        try:
            yield trainer
        except BaseException:
            self.give_back(trainer, ok=False)
            raise
        self.give_back(trainer, ok=True)

    def take(self, cfg, *args, grow: bool = True, **kwargs):
        """A trainer of `cfg` at step 0 (`Trainer`'s arguments): a kept one rebuilt for it (`Trainer.reuse`), of the
        same pool shape if there is one, else the smallest with enough actors of the same kind; else a new one.
        `dhp.stages.driver.train(cfg, trainers=...)` takes its trainers here too.

        `grow`: a new trainer starts as many actors per pool as the largest kept trainer of the same kind has
        (spares beyond `cfg`'s, `Trainer(spares=)`), which it replaces: the pools of a module's layouts grow to
        the largest any of them needs, and later layouts of any size take the same actors."""
        from dhp.stages.placement import data_cpus
        from dhp.stages.trainer import Trainer, actor_kind, pool_shape

        data = data_cpus(cfg) if args else 0.0  # with data paths: the streams' CPUs
        fitting = [t for t in self.kept if t.fits(cfg)]
        if fitting:
            exact = [t for t in fitting if pool_shape(t.cfg) == pool_shape(cfg)]
            trainer = exact[-1] if exact else min(fitting, key=lambda t: t.vision.capacity + t.text.capacity)
            self.kept.remove(trainer)
            self._make_room(data)
            try:
                trainer.reuse(cfg, *args, **kwargs)
            except BaseException:
                trainer.shutdown()
                raise
            self.reused += 1
            return trainer
        need = (cfg.vision.num_actors, cfg.text.num_actors)
        spares = (0, 0)
        if grow:
            same_kind = [t for t in self.kept if actor_kind(t.cfg) == actor_kind(cfg)]
            ahead = self.expected.get(_current_test(), {}).get(actor_kind(cfg), (0, 0))
            vision = max([need[0], ahead[0], *(t.vision.capacity for t in same_kind)])
            text = max([need[1], ahead[1], *(t.text.capacity for t in same_kind)])
            spares = (vision - need[0], text - need[1])
            for replaced in same_kind:
                self.kept.remove(replaced)
                self._shut(replaced, f"replaced by a larger one of its kind in {_current_test()}")
        per_actor = (cfg.vision.num_cpus_per_actor, cfg.text.num_cpus_per_actor)
        pools = sum((n + extra) * cpus for n, extra, cpus in zip(need, spares, per_actor))
        self._make_room(pools + data, actors=sum(need) + sum(spares))
        if spares != (0, 0) and not self._room(pools + data, sum(need) + sum(spares)):
            spares = (0, 0)  # the machine is short of memory for the spares: only what `cfg` needs
        self.builds[pool_shape(cfg)] += 1
        self.history[pool_shape(cfg)].append((_current_test(), self.let_go.get(pool_shape(cfg), "never kept")))
        return Trainer(cfg, *args, spares=spares, **kwargs)

    def take_alone(self, cfg, *args, **kwargs):
        """`take`, after shutting down every kept trainer of another pool shape: for a test that times steps, whose
        actors should have the cores to themselves (idle actors take CPU too)."""
        from dhp.stages.trainer import pool_shape

        for other in [t for t in self.kept if pool_shape(t.cfg) != pool_shape(cfg)]:
            self.kept.remove(other)
            self._shut(other, f"alone for {_current_test()}")
        return self.take(cfg, *args, grow=False, **kwargs)

    def give_back(self, trainer, ok: bool) -> None:
        """Keep `trainer` for a later test if it ended well; shut it down otherwise (its state is not trusted)."""
        if not ok:
            trainer.shutdown()
            return
        trainer.close_streams()  # idle streams would hold CPUs another test's data needs
        self.kept.append(trainer)
        while len(self.kept) > 1 and sum(t.vision.capacity + t.text.capacity for t in self.kept) > self.KEEP_ACTORS:
            self._shut(self.kept.pop(0), f"more than {self.KEEP_ACTORS} actors kept after {_current_test()}")

    def _make_room(self, cpus: float, actors: int = 0) -> None:
        """Shut kept trainers down, oldest first, until the shared Ray has `cpus` logical CPUs free (+ 1 for
        the driver's and the data's work) and the machine the memory of `actors` new stage actors
        (`ACTOR_BYTES` each, + `MEMORY_MARGIN`): the background runs beside the tests take memory too, and
        Ray kills workers at 95 % of it."""
        while self.kept and not self._room(cpus, actors):
            self._shut(self.kept.pop(0), f"room for {_current_test()}")
            # the killed actors' processes exit a moment later: wait for their memory before asking again
            deadline = time.monotonic() + 5.0
            while not self._room(cpus, actors) and time.monotonic() < deadline:
                time.sleep(0.25)

    def _room(self, cpus: float, actors: int) -> bool:
        import ray

        cpus_free = ray.available_resources().get("CPU", 0.0) >= cpus + 1.0
        return cpus_free and memory_available() >= actors * self.ACTOR_BYTES + self.MEMORY_MARGIN

    def expect(self, items: list) -> None:
        """Read the `pool_shape` marks of `items`, in the order they run (test_parity.py `by_pool_shape`): a trainer
        built for a test starts as many actors per pool as the largest marked case of its kind from that test on
        needs, so that the later cases take it over instead of building larger ones (test_parity.py's shapes,
        grown in the order of its cases, started 28 actors in four builds for the 12 its largest need)."""
        import ast

        ahead: dict = {}
        for item in reversed(items):
            marker = item.get_closest_marker("pool_shape")
            if marker is not None:
                (vision, text), kind = ast.literal_eval(marker.args[0])
                v, t = ahead.get(kind, (0, 0))
                ahead = {**ahead, kind: (max(v, vision), max(t, text))}
            self.expected[item.nodeid] = ahead

    def clear(self, why: str = "the end") -> None:
        while self.kept:
            self._shut(self.kept.pop(), why)

    def _shut(self, trainer, why: str) -> None:
        from dhp.stages.trainer import pool_shape

        self.let_go[pool_shape(trainer.cfg)] = why
        trainer.shutdown()


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def memory_available() -> int:
    """Bytes the kernel can give without swapping (/proc/meminfo's MemAvailable)."""
    from dhp.scripts.bench.ops import meminfo_bytes

    available = meminfo_bytes("MemAvailable")
    if available is None:
        raise RuntimeError("/proc/meminfo has no readable MemAvailable line")
    return available


_TRAINERS = TrainerCache()


@pytest.fixture
def trainers(ray_session) -> TrainerCache:
    """Trainers shared between the tests that ask for them (`TrainerCache`)."""
    return _TRAINERS


def pytest_terminal_summary(terminalreporter):
    jobs = background.timeline()
    if jobs:
        terminalreporter.write_line("background jobs, from the start of the tests (tests/background.py):")
        for line in jobs:
            terminalreporter.write_line(line)
    if _TRAINERS.built:
        terminalreporter.write_line(f"trainers: {_TRAINERS.built} built, {_TRAINERS.reused} reused (TrainerCache)")
        # a shape built again was let go in between: the order or the cache's size cost those builds
        for shape, n in _TRAINERS.builds.most_common():
            if n > 1:
                terminalreporter.write_line(f"  built {n} times: {shape}")
                for test, why in _TRAINERS.history[shape]:
                    terminalreporter.write_line(f"    by {test}; the last one kept went: {why}")


def pytest_runtest_setup(item):
    # Kept pools hold the shared Ray's resources (another trainer would wait for them) and memory (a subprocess
    # run or cluster of a slow test needs it); a quick test needs neither.
    if "trainers" not in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is not None:
        _TRAINERS.clear(f"a slow test without it: {item.nodeid}")


# One GPU for both pools: one rank each with half of it (a multi-rank nccl group needs a GPU per rank)
ONE_GPU_POOLS = [
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "vision.num_gpus_per_actor=0.5",
    "text.parallelism=none",
    "text.num_actors=1",
    "text.degree=1",
    "text.num_gpus_per_actor=0.5",
]


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a spawned process group's rendezvous."""
    from dhp.scripts.local_head import free_ports

    return free_ports(1)[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (||a|| when b is zero); inf when the shapes differ."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach(), b.detach()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float(a.norm())


def perturbed_reference(model_cls: type, config) -> torch.nn.Module:
    """Seeded fp32 model whose norms and biases are non-trivial, so their gradients are tested too."""
    torch.manual_seed(0)
    model = model_cls(config).float().train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def write_image(path: Path, size: tuple[int, int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


# The parity samples' image a (420 x 476 px after smart_resize: 30 x 34 patches) and the pixels it may keep
PARITY_IMAGE_A, PARITY_MAX_PIXELS = (476, 420), 448 * 448


def write_parity_data(root: Path, size_a: tuple[int, int]) -> Path:
    """Image a of `size_a` px and a smaller image b: a two-image multi-turn conversation, a one-image and a
    text-only sample."""
    write_image(root / "images/a.png", size_a, seed=1)
    write_image(root / "images/b.png", (60, 90), seed=2)  # smaller: fewer patches than a window
    records = [
        {
            "id": "multi",
            "image": ["images/a.png", "images/b.png"],
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the first picture?"},
                {"from": "gpt", "value": "Noise, mostly."},
                {"from": "human", "value": "And here? <image>"},
                {"from": "gpt", "value": "Smaller noise.\nStill noise."},
            ],
        },
        {
            "id": "single",
            "image": "images/b.png",
            "conversations": [
                {"from": "human", "value": "<image>\nDescribe the image."},
                {"from": "gpt", "value": "A small patch of random colours."},
            ],
        },
        {
            "id": "text-only",
            "conversations": [
                {"from": "human", "value": "Name a colour."},
                {"from": "gpt", "value": "Teal."},
            ],
        },
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def preprocessed_parity_setup(tmp_path_factory, data: Path, max_pixels: int, model_name: str = "tiny"):
    """A seeded model of the named shape (its family's transformers class; default Qwen2.5-VL's `tiny`) saved as
    an HF checkpoint, and the samples of `data` preprocessed for it."""
    from dhp.dataflow.preprocess import Preprocessor, PreprocessSettings, decode_sample
    from dhp.models.architectures import architecture_config
    from dhp.models.family import family_of

    torch.manual_seed(1234)
    model_config = architecture_config(model_name)
    ref = family_of(model_config).hf_class(model_config).float().train()
    ckpt = tmp_path_factory.mktemp("ckpt")
    ref.save_pretrained(ckpt)
    settings = PreprocessSettings(str(data), min_pixels=56 * 56, max_pixels=max_pixels, max_seq_len=1024)
    pre = Preprocessor(settings, model_config)
    lines = (data / "train.jsonl").read_text().splitlines()
    samples = [decode_sample(pre({"source": "t", "record": line})["sample"]) for line in lines]
    return ref, ckpt, samples


@pytest.fixture(scope="session")
def parity_data(tmp_path_factory) -> Path:
    """The layouts' parity samples. A window of the vision encoder is 112 px (8 x 8 patches of 14 px). Image a is
    30 x 34 patches: 4 x 5 windows, the last row and column partial (6 and 2 patches), so that a missing inverse
    window permutation at the boundary (tokens left in window order) moves the first step's loss by 2.2e-5
    relative under sp2-tp2, 20x the parity tests' 1e-6 (an 8 x 10-patch image, two windows, moves it by 5e-6).
    Image b fits inside one window."""
    return write_parity_data(tmp_path_factory.mktemp("parity_data"), PARITY_IMAGE_A)


@pytest.fixture(scope="session")
def parity_setup(tmp_path_factory, parity_data):
    """The tiny model and the layouts' parity samples (`parity_data`)."""
    return preprocessed_parity_setup(tmp_path_factory, parity_data, max_pixels=PARITY_MAX_PIXELS)


@pytest.fixture(scope="session")
def qwen3_parity_setup(tmp_path_factory, parity_data):
    """The tiny Qwen3-VL (DeepStack on) and the layouts' parity samples, cut into its 16 px patches: image a is
    26 x 30 patches, image b 6 x 4 (the same images as `parity_setup`'s)."""
    return preprocessed_parity_setup(tmp_path_factory, parity_data, max_pixels=448 * 448, model_name="qwen3_vl_tiny")


@pytest.fixture(scope="session")
def small_qwen3_parity_setup(tmp_path_factory):
    """The tiny Qwen3-VL and samples whose image a is 6 x 10 patches of 16 px: one-process checks of its stages,
    where the reference's full-vocabulary logits over a short batch keep them quick."""
    data = write_parity_data(tmp_path_factory.mktemp("small_qwen3_parity_data"), (150, 100))
    return preprocessed_parity_setup(tmp_path_factory, data, max_pixels=224 * 224, model_name="qwen3_vl_tiny")


@pytest.fixture(scope="session")
def small_parity_setup(tmp_path_factory):
    """The tiny model and samples whose image a is 8 x 10 patches: for comparisons against another library's
    training (peft's LoRA), whose small factor gradients carry the summation order's rounding (a relative 3e-5 on
    `lora_A` at step 2 with 30 x 34 patches) rather than a layout's; the window order is checked by `parity_setup`."""
    data = write_parity_data(tmp_path_factory.mktemp("small_parity_data"), (150, 100))  # 112 x 140 px
    return preprocessed_parity_setup(tmp_path_factory, data, max_pixels=224 * 224)


@pytest.fixture(scope="session")
def plan_sample(tmp_path_factory) -> dict:
    """One preprocessed one-image sample of 2 048 patches (`dhp bench time-model`'s): one more step of it on the
    parity tests' trainers holds the memory plan to what their ranks keep (tests/test_plan_measured.py)."""
    from dhp.scripts.bench.time_model import IMAGE, deep_sample

    _, _, sample = deep_sample(tmp_path_factory.mktemp("plan_sample"), save=False)
    assert int(sample["image_grid_thw"].prod()) == IMAGE[0] * IMAGE[1] // 14**2
    return sample


class S3Endpoint:
    """A running S3 HTTP endpoint and the fake credentials the test process holds for it."""

    def __init__(self, url: str, access_key: str, secret_key: str):
        self.url, self.access_key, self.secret_key = url, access_key, secret_key

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1")

    def upload(self, local_dir: Path, bucket: str, prefix: str) -> None:
        """Every file under `local_dir` to s3://bucket/prefix/<relative path>."""
        client = self.client()
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local_dir).as_posix()}")


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1; random fake keys in this process's environment only.

    Module-scoped, so the keys are set after the session's `ray.init`: Ray workers never inherit them,
    and a read in a worker works only if the driver's credentials travel with the filesystem object.
    The user's own AWS files and variables are masked so they can neither leak in nor be used.
    """
    import secrets

    from moto.server import ThreadedMotoServer

    endpoint = S3Endpoint("", "AKIA" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        mp.setenv("AWS_ACCESS_KEY_ID", endpoint.access_key)
        mp.setenv("AWS_SECRET_ACCESS_KEY", endpoint.secret_key)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint.url = f"http://{host}:{port}"
            yield endpoint
        finally:
            server.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the shared Ray gets the stderr of the Ray worker processes that wrote any during
    it (a crashed actor's last words: a segfault, an abort, a Python error outside a task) and the machine's
    free memory appended to its report. With `log_to_driver=False` nothing else would show why an actor died."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item._dhp_started = call.start
    if not report.failed or call.when != "call" or "ray_session" not in getattr(item, "fixturenames", ()):
        return
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if not ray.is_initialized() or node is None:
        return
    logs = Path(node.get_logs_dir_path())
    started = getattr(item, "_dhp_started", call.start)
    recent = sorted(
        (p for p in logs.glob("*.err") if p.stat().st_size and p.stat().st_mtime >= started),
        key=lambda p: p.stat().st_mtime,
    )[-4:]
    parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in recent]
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        parts.append("--- /proc/meminfo\n" + "".join(meminfo.read_text().splitlines(True)[:3]))
    report.sections.append(("Ray worker stderr during this test", "\n".join(parts) or "(none written)"))


# The quick tier (`pytest -m "not slow"`) runs every module's own logic without a Ray cluster or a subprocess
# bench. A test that uses the shared Ray is slow by its fixtures; a module that starts its own declares
# `pytestmark = pytest.mark.slow`. The guard below makes a missing mark fail instead of slowing the quick tier.
SLOW_FIXTURES = {"ray_session", "quick_ops_profile"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items[:] = kept_trainers_together(items)
    # the modules that start runs in the background run last: those runs then have the whole session
    early = [i for i in items if hasattr(i.module, "start_early")]
    # ... and after them the tests that measure the machine's speed: by then the background runs are done, so the
    # cores are theirs (beside those runs a step-time check took 3.5x as long and measured contention, and the ops
    # profile once read a ZeRO-3 cost per unit of 0: its two medians' difference lost in the noise)
    timed = [i for i in items if i.get_closest_marker("measures_speed") is not None]
    items[:] = [i for i in items if i not in early and i not in timed] + early + timed
    _TRAINERS.expect(items)


def pytest_collection_finish(session):
    """Each chosen module with `start_early(out, fixtures)` starts its background runs now (tests/background.py)."""
    if session.config.option.collectonly:
        return
    fixtures: dict = {}
    for item in session.items:
        if hasattr(item.module, "start_early"):
            fixtures.setdefault(item.module, set()).update(getattr(item, "fixturenames", ()))
    # `BACKGROUND_FIRST`: a module whose jobs start before the others' (their queue runs in the order started)
    for module, names in sorted(fixtures.items(), key=lambda m: not getattr(m[0], "BACKGROUND_FIRST", False)):
        module.start_early(background.scratch_dir(module.__name__.rsplit(".", 1)[-1]), names)


def pytest_sessionfinish(session):
    background.stop_all()


def kept_trainers_together(items: list) -> list:
    """`items` with the modules whose tests take `trainers` run one after another, from the first one's place,
    and their slow tests that do not take it after all of them.

    A slow test without the fixture shuts the kept trainers down (`pytest_runtest_setup`), so in the plain
    file order every module rebuilt the pools the one before had kept (31 builds for 23 reuses). Each module's
    own tests keep their order; only modules and those clearing tests move.

    Why first: the background queue's heaviest jobs in memory come after the fault runs, and beside the trainers'
    kept pools (up to `KEEP_ACTORS` idle actors) a Ray Job's eight actors and head took the machine to 93 % of its
    24 GB, where Ray killed a test's workers; with the trainers' tests first, those jobs run beside the others."""

    def takes(item) -> bool:
        return "trainers" in getattr(item, "fixturenames", ())

    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    users = [m for m, its in modules.items() if any(takes(i) for i in its)]
    clearing = [i for m in users for i in modules[m] if not takes(i) and i.get_closest_marker("slow") is not None]
    out = []
    for module, its in modules.items():
        if module not in users:
            out += its
        elif module == users[0]:
            out += [i for m in users for i in shapes_together(modules[m]) if i not in clearing] + clearing
    return out


def shapes_together(items: list) -> list:
    """A module's `items` with those marked `pool_shape` (test_parity.py `by_pool_shape`) grouped by that shape, in
    the order the shapes first appear, in the places the marked items had; the others stay where they are.

    Why: the module's two parametrized parity tests (Qwen2.5-VL, Qwen3-VL) each ran their layouts grouped, but the
    second rebuilt the shapes the first had built and the cache had since let go (two builds, ~100 CPU-s)."""

    def shape(item):
        marker = item.get_closest_marker("pool_shape")
        return marker.args[0] if marker is not None else None

    marked = [i for i in items if shape(i) is not None]
    first: dict = {}
    for item in marked:
        first.setdefault(shape(item), len(first))
    grouped = iter(sorted(marked, key=lambda i: first[shape(i)]))
    return [next(grouped) if shape(i) is not None else i for i in items]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In a test not marked slow, `ray.init` fails with the fix (tests/README.md says which tier is which): from
    the setup of its fixtures, module-scoped ones included, to its teardown."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts Ray: mark it slow or use the ray_session fixture")

    real, ray.init = ray.init, refuse
    try:
        yield
    finally:
        ray.init = real
