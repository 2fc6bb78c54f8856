"""`dhp train` submitted as a Ray Job with docs/training.md's `ray job submit` command, to a real Ray head.

The head is started here (scripts/local_head.py): bound to 127.0.0.1 with its own ports, temp dir and
token (token auth on), and at the end exactly that head is stopped, never `ray stop` (which would stop
every Ray on the machine). The first job trains the hybrid layout (vision SP2 x DP2, text TP2 x DP2, disjoint
placement, traced) for two steps through the real loader (per-rank patch shards) and exports; its config
file exists only in the shipped working dir. A second job, one vision and one text actor and no evaluation stream
(what it checks does not depend on the layout), is stopped with `ray job stop` mid-run: it must checkpoint and say
where (preemption). Both run in the background when the session's tests are chosen (tests/background.py), with
their checks; the test raises what they raised and checks the head's end.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from ray.job_submission import JobStatus, JobSubmissionClient
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.scripts.local_head import Listener, LocalHead, alive, start_head
from dhp.stages import step_logs
from dhp.stages.checkpoint_files import verify
from dhp.stages.config import preset_path
from tests import background
from tests.background import scratch_dir

pytestmark = pytest.mark.slow  # subprocess runs of dhp or its own Ray cluster (tests/README.md)

RAY = str(Path(sys.executable).with_name("ray"))
# sp2 vision x dp2, tp2 text x dp2 on their own placement groups: 8 stage actors of a quarter CPU
HYBRID = [
    "vision.parallelism=sequence",
    "vision.num_actors=4",
    "vision.degree=2",
    "vision.num_cpus_per_actor=0.25",
    "text.parallelism=tensor",
    "text.num_actors=4",
    "text.degree=2",
    "text.num_cpus_per_actor=0.25",
    "pipeline.placement=disjoint",
    "pipeline.trace=true",
]
ONE_PER_POOL = [
    "vision.parallelism=none",
    "vision.num_actors=1",
    "vision.degree=1",
    "text.parallelism=none",
    "text.num_actors=1",
    "text.degree=1",
]
STEPS = 2  # per step: every stage call of both pools in the trace, an optimizer step per actor
# In the background at nice 10 beside the other tests on a 2-core machine; a job alone takes about a minute
JOB_TIMEOUT_S = 600
HEAD_TIMEOUT_S = 240
# what a busy head answers before the job exists; a new submission may then succeed
TRANSIENT = ("ConnectionError", "please try again later")
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


def _http_status(url: str, headers: dict[str, str]) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _submit(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, str]:
    """`ray job submit --no-wait --submission-id ID ARGS`: (the command's outcome, ID). Tried up to six times, a
    little longer apart each time (about 1.5 min in all), while the head's dashboard drops the connection before the
    job exists (it did uploading the working dir while the 2-core machine was saturated, and once refused three tries
    5 s apart) or answers that it has no agent yet ("please try again later", once); each try has its own ID, so a
    retry never meets a half-made job."""
    for attempt in range(6):
        sid = "dhp-test-" + secrets.token_hex(4)
        proc = _ray(["job", "submit", "--no-wait", "--submission-id", sid, *args], env, cwd)
        said = proc.stderr + proc.stdout
        if proc.returncode == 0 or not any(transient in said for transient in TRANSIENT):
            break
        time.sleep(5 * (attempt + 1))
    return proc, sid


def _ray(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def start_early(out: Path, fixtures: set[str]) -> None:
    """Both jobs run in the background from the start of the session (tests/background.py), their checks with
    them; the test reads the outcome."""
    if "ray_jobs" in fixtures:
        background.start("ray job: a head and two jobs", lambda: _two_jobs(out))


def _two_jobs(out: Path) -> tuple[LocalHead, set[Listener], list]:
    # logical CPUs: 8 stage actors, 3 loaders and the job's driver on this 2-core machine
    head = start_head(out / "rh", num_cpus=4, resources={"trainer_host": 1}, timeout_s=HEAD_TIMEOUT_S)
    try:
        seen_listening = _submit_and_check(head, out)
        _stop_and_check(head, out)
    finally:
        forced = head.stop()
    return head, seen_listening, forced


@pytest.fixture(scope="module")
def ray_jobs() -> tuple[LocalHead, set[Listener], list]:
    return background.result("ray job: a head and two jobs", lambda: start_early(scratch_dir("ray_job"), {"ray_jobs"}))


def test_ray_job_submit_trains_on_a_loopback_head(ray_jobs):
    head, seen_listening, forced = ray_jobs
    assert not alive(head.seen), f"processes of the head still running: {alive(head.seen)}"
    assert not forced, f"needed SIGKILL after `ray start` was sent SIGTERM: {forced}"
    # Nothing the head or its job started listens beyond the loopback interface (GCS, raylet, object
    # manager, dashboard and its agent, runtime-env agent, Ray Client server, workers, the pools' stores).
    exposed = sorted({(x.host, x.port, x.name) for x in seen_listening if not x.loopback})
    assert not exposed, f"listening on a non-loopback address (host, port, process): {exposed}"
    ports = {x.port for x in seen_listening}
    assert {head.ports["gcs"], head.ports["dashboard"], head.ports["node_manager"]} <= ports  # the check saw them


def _submit_and_check(head: LocalHead, tmp_path: Path) -> set[Listener]:
    jobs_url = f"{head.dashboard_url}/api/jobs/"
    assert _http_status(jobs_url, {}) == 401  # auth is on: no token, no entry
    assert _http_status(jobs_url, {"Authorization": "Bearer " + "0" * 64}) == 403

    job_dir = tmp_path / "job"  # what --working-dir ships: the run's config, not the dhp checkout
    job_dir.mkdir()
    shutil.copy(preset_path("tiny"), job_dir / "my_run.yaml")
    secret = "dhp-test-" + secrets.token_hex(12)  # stands in for a real key: must never reach logs or the run dir
    runtime_env = {
        "env_vars": {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "AWS_ACCESS_KEY_ID": "AKIADHPTEST",
            "AWS_SECRET_ACCESS_KEY": secret,
        }
    }
    run_dir = tmp_path / "runs" / "job"
    overrides = [
        *HYBRID,
        f"training.steps={STEPS}",
        "training.eval_every=0",
        "training.eval_batches=1",
        "data.synthetic.num=64",
        "data.synthetic.eval_num=8",
        f"data.synthetic.dir={tmp_path}/synth",
        f"output.dir={tmp_path}/runs",
        "output.name=job",
    ]
    env = head.client_env()  # RAY_ADDRESS=http://127.0.0.1:PORT, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH
    submit, sid = _submit(
        [
            "--working-dir",
            str(job_dir),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--entrypoint-num-cpus",
            "0.5",
            "--entrypoint-resources",
            json.dumps({"trainer_host": 1}),
            "--",
            "dhp",
            "train",
            "--config",
            "my_run.yaml",
            *overrides,
        ],
        env,
        tmp_path,
    )
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]

    client = JobSubmissionClient(head.dashboard_url, headers={"Authorization": f"Bearer {head.token()}"})
    listening: set[Listener] = set()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (status := client.get_job_status(sid)) not in TERMINAL and time.monotonic() < deadline:
        listening |= set(head.listeners())  # sampled while the job's driver, actors and Ray Data workers exist
        time.sleep(1.0)
    logs = _ray(["job", "logs", sid], env, tmp_path)
    text = logs.stdout
    if status not in TERMINAL:
        _ray(["job", "stop", sid], env, tmp_path)
    assert status == JobStatus.SUCCEEDED, f"job {sid}: {status} after {JOB_TIMEOUT_S} s or less\n{text[-4000:]}"
    assert logs.returncode == 0, logs.stderr[-2000:]
    listening |= set(head.listeners())

    # The driver joined this head through the RAY_ADDRESS Ray gave it (no Ray of its own), and on a pipe it
    # prints progress lines, not a bar, then the summary.
    assert head.gcs_address in text, text[-3000:]
    assert "placement: disjoint" in text and text.count("vision rank") == 4
    assert f"step {STEPS}/{STEPS} loss" in text and '"final_loss"' in text, text[-3000:]

    records = step_logs.read(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["training"]["steps"] == STEPS and saved["vision"]["parallelism"] == "sequence"
    _check_hybrid_run(run_dir, records)

    info = client.get_job_info(sid)
    # What docs/training.md warns about: env_vars are stored with the job, readable by anyone holding the token...
    assert info.runtime_env["env_vars"]["AWS_SECRET_ACCESS_KEY"] == secret
    # ...but neither they nor the token end up in the job's output or the run directory.
    texts = [p for p in run_dir.rglob("*") if p.suffix in (".json", ".jsonl", ".yaml", ".txt", ".log")]
    assert len(texts) >= 3
    for where, content in [("job logs", text), *((str(p), p.read_text(errors="replace")) for p in texts)]:
        assert secret not in content and head.token() not in content, f"a credential leaked into {where}"

    # The client must say RAY_AUTH_MODE=token: holding the token is not enough.
    no_mode = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    refused = _ray(["job", "status", sid], no_mode, tmp_path)
    assert refused.returncode != 0 and "Authentication" in refused.stdout + refused.stderr
    return listening


def _check_hybrid_run(run_dir: Path, records: list[dict]) -> None:
    """The hybrid job's outputs: the final eval, the export gathered from both tensor-parallel shards, and a
    Chrome trace with every stage call of both pools."""
    assert math.isfinite(records[-1]["eval_loss"])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(run_dir / "checkpoint")
    assert model.lm_head.weight.shape == (151936, 64)
    # 4 vision forwards and backwards and 4 text forward_backwards per micro-batch (2 replicas x 2 ranks), one
    # optimizer step per actor per step.
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    calls = [e for e in trace if e["ph"] == "X"]
    names = {(e["cat"], e["name"]) for e in calls}
    assert {("vision", "forward"), ("vision", "backward"), ("text", "forward_backward")} <= names
    assert sum(e["name"] == "optimizer_step" for e in calls) == STEPS * 8
    mbs = sum(r["microbatches"] for r in records)
    assert sum(e["name"] == "forward_backward" for e in calls) == 2 * mbs  # each text rank of the replica
    # Ray's argument transfers (ray.timeline(), matched by worker and time) as slices before the calls.
    assert sum(e["name"] == "receive" and e["args"]["call"] == "forward_backward" for e in calls) == 2 * mbs


def _stop_and_check(head: LocalHead, tmp_path: Path) -> None:
    """`ray job stop` preempts the run: the driver gets SIGTERM, finishes its step, checkpoints, says so."""
    job_dir = tmp_path / "job2"
    job_dir.mkdir()
    shutil.copy(preset_path("tiny"), job_dir / "my_run.yaml")
    # Ray's job supervisor waits 3 s between SIGTERM and SIGKILL unless told otherwise (docs/training.md).
    # One actor per pool: the preemption is the driver's (stages/preemption.py), whatever the layout.
    runtime_env = {
        "env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_JOB_STOP_WAIT_TIME_S": "120"}
    }
    run_dir = tmp_path / "runs" / "stopped"
    overrides = [
        *ONE_PER_POOL,
        "training.steps=200",
        "training.global_batch_size=4",
        "training.eval_every=0",
        "data.synthetic.num=32",
        "data.synthetic.eval_num=0",  # no evaluation stream: a preempted run never evaluates
        f"data.synthetic.dir={tmp_path}/synth",
        f"output.dir={tmp_path}/runs",
        "output.name=stopped",
    ]
    env = head.client_env()
    submit, sid = _submit(
        [
            "--working-dir",
            str(job_dir),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--entrypoint-num-cpus",
            "0.5",
            "--",
            "dhp",
            "train",
            "--config",
            "my_run.yaml",
            *overrides,
        ],
        env,
        tmp_path,
    )
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.5)
    stop = _ray(["job", "stop", sid], env, tmp_path)
    client = JobSubmissionClient(head.dashboard_url, headers={"Authorization": f"Bearer {head.token()}"})
    while (status := client.get_job_status(sid)) not in TERMINAL and time.monotonic() < deadline + 120:
        time.sleep(0.5)
    text = _ray(["job", "logs", sid], env, tmp_path).stdout
    assert stop.returncode == 0 and status == JobStatus.STOPPED, f"{status}\n{stop.stderr[-2000:]}\n{text[-3000:]}"
    assert "SIGTERM received: finishing the current step, then a checkpoint" in text, text[-3000:]
    m = re.search(r"^preempted at step (\d+), checkpoint (\S+)$", text, re.M)
    assert m, text[-3000:]
    ckpt = Path(m.group(2))
    assert ckpt == run_dir / "checkpoints" / f"step_{int(m.group(1)):06d}" and verify(ckpt) is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] == {"step": int(m.group(1)), "checkpoint": str(ckpt), "signal": "SIGTERM"}
