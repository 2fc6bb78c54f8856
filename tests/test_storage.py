"""Object storage: s3:// on a real S3 HTTP endpoint (moto on 127.0.0.1) through the local-file code path.

The synthetic set is written to disk and uploaded; the same loader and the same training run over the
local copy and over s3:// must give identical batches and identical losses. A small proxy in front of
the endpoint injects the transient failures object stores really produce (503 SlowDown, 500, a request
that stalls) to show they are retried, and that they are not with `max_attempts=1`.
"""

from __future__ import annotations

import http.client
import json
import pickle
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import ray
import torch

from dhp.dataflow.loader import loader_actor
from dhp.dataflow.preprocess import PreprocessSettings
from dhp.dataflow.storage import filesystem, filesystem_of_all, resolve
from dhp.dataflow.synth import write_synthetic_dataset
from dhp.models.architectures import architecture_config
from dhp.stages import step_logs
from dhp.stages.config import ConfigError, StorageConfig, load_config
from dhp.stages.driver import train

BUCKET, PREFIX = "data", "synth"
MISSING = "images/not_there.png"
NUM, EVAL_NUM = 12, 4


class FlakyProxy:
    """HTTP proxy to an S3 endpoint that fails the first `failures` requests of each (method, path).

    A failure is `status` with an S3 error body, or, with `stall_s`, a response that never comes (the
    connection is closed after `stall_s`). `only`: fail just these paths (/bucket/key); `methods`: just
    these methods (pyarrow asks for an object's size with HEAD, then reads it with GET). It records the
    access key id of every signed request.
    """

    def __init__(
        self,
        upstream: str,
        failures: int,
        status: int = 503,
        code: str = "SlowDown",
        stall_s: float = 0,
        only: set[str] | None = None,
        methods: tuple[str, ...] = ("HEAD", "GET"),
    ):
        self.failures, self.failed, self.access_keys = failures, 0, set()
        self.seen: Counter[tuple[str, str]] = Counter()
        lock, proxy, target = threading.Lock(), self, upstream.split("://", 1)[1]
        error = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_one(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                auth = self.headers.get("Authorization", "")
                path = self.path.split("?")[0]
                with lock:
                    proxy.seen[self.command, path] += 1
                    fail = (
                        proxy.seen[self.command, path] <= proxy.failures
                        and self.command in methods
                        and (only is None or path in only)
                    )
                    proxy.failed += fail
                    if "Credential=" in auth:
                        proxy.access_keys.add(auth.split("Credential=", 1)[1].split("/", 1)[0])
                if fail and stall_s:
                    time.sleep(stall_s)
                    self.close_connection = True
                    return
                if fail:
                    self._reply(status, {"Content-Type": "application/xml"}, error, len(error))
                    return
                upstream_conn = http.client.HTTPConnection(target, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                upstream_conn.request(self.command, self.path, body=body, headers=headers)
                resp = upstream_conn.getresponse()
                data = resp.read()
                keep = {
                    k: v
                    for k, v in resp.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date")
                }
                length = int(resp.getheader("Content-Length") or 0) if self.command == "HEAD" else len(data)
                self._reply(resp.status, keep, data, length)
                upstream_conn.close()

            def _reply(self, code: int, headers: dict, data: bytes, length: int) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, s3_endpoint) -> Path:
    """The synthetic set plus `with_missing.jsonl` (one record whose image does not exist), local and in S3."""
    root = tmp_path_factory.mktemp("storage") / PREFIX
    synth = write_synthetic_dataset(root, NUM, seed=7, eval_num=EVAL_NUM)
    lines = synth.train_path.read_text().splitlines()
    missing = {
        "id": "missing",
        "image": MISSING,
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": "Nothing."},
        ],
    }
    (root / "with_missing.jsonl").write_text("\n".join(lines[:5] + [json.dumps(missing)] + lines[5:]) + "\n")
    s3_endpoint.upload(root, BUCKET, PREFIX)
    return root


def _loader(annotation: str, image_root: str, storage=None):
    settings = PreprocessSettings(
        image_root, min_pixels=56 * 56, max_pixels=112 * 112, max_seq_len=1024, storage=storage
    )
    return loader_actor().remote(
        [annotation],
        settings,
        architecture_config("tiny"),
        global_batch_size=4,
        microbatch_tokens=600,
        seed=0,
        repeat=False,
    )


def _drain_together(loaders) -> list[list]:
    """Every batch of each loader; the loaders run concurrently."""
    out, live = [[] for _ in loaders], list(range(len(loaders)))
    while live:
        batches = ray.get([loaders[i].next_batch.remote() for i in live])
        for i, batch in zip(list(live), batches):
            if batch is None:
                live.remove(i)
            else:
                out[i].append(batch)
    return out


def _tensors(batches) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch's text tensors and each vision rank's part, fetched from the object store."""
    out = []
    for batch in batches:
        for mb in batch.microbatches:
            parts = ray.get(mb.vision)
            out.append({**ray.get(mb.text), **{f"vision{r}.{k}": v for r, p in enumerate(parts) for k, v in p.items()}})
    return out


def test_s3_loader_yields_the_local_batches_through_transient_errors(ray_session, s3_endpoint, dataset):
    """The first metadata request and the first read of the annotation file (read by a Ray Data task)
    and of an image (read by a preprocessing actor) fail with 503; those workers, started before these
    credentials were exported, retry and sign with the driver's keys; the batches equal the local ones."""
    first = json.loads((dataset / "train.jsonl").read_text().splitlines()[0])
    image = first["image"] if isinstance(first["image"], str) else first["image"][0]
    flaky = {f"/{BUCKET}/{PREFIX}/with_missing.jsonl", f"/{BUCKET}/{PREFIX}/{image}"}
    with FlakyProxy(s3_endpoint.url, failures=1, only=flaky) as proxy:
        storage = resolve(StorageConfig(endpoint_url=proxy.url, region="us-east-1"))  # read in this process
        local = _loader(str(dataset / "with_missing.jsonl"), str(dataset))
        remote = _loader(f"s3://{BUCKET}/{PREFIX}/with_missing.jsonl", f"s3://{BUCKET}/{PREFIX}", storage)
        local_batches, s3_batches = _drain_together([local, remote])
        local_report, s3_report = ray.get([local.skip_report.remote(), remote.skip_report.remote()])

    a, b = _tensors(local_batches), _tensors(s3_batches)
    assert len(a) == len(b) >= 3
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and {"input_ids", "labels", "vision0.pixel_values"} <= x.keys()
        assert all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])]
    assert local_report["good"] == s3_report["good"] == NUM
    assert local_report["counts"] == s3_report["counts"] == {"missing_image": 1}
    (skip,) = s3_report["examples"]
    assert skip["detail"] == f"s3://{BUCKET}/{PREFIX}/{MISSING}: not found"
    assert skip["source"] == f"s3://{BUCKET}/{PREFIX}/with_missing.jsonl:6"
    assert local_report["examples"][0]["detail"] == f"{dataset / MISSING}: not found"

    images = {path for (method, path) in proxy.seen if "/images/" in path}
    assert len(images) >= NUM + 1  # every image (and the missing one) was asked for through the proxy
    assert proxy.failed == 2 * len(flaky) == 4  # HEAD and GET of each failed once, then passed
    assert proxy.access_keys == {s3_endpoint.access_key}  # the driver's keys reached every worker


@pytest.mark.parametrize("fault", ["503 SlowDown", "500 InternalError", "stalled request"])
def test_transient_errors_are_retried_and_fail_without_retries(s3_endpoint, fault):
    """Read through the filesystem object as a Ray worker gets it (pickled), with retries and without."""
    blob = bytes(range(256)) * 256
    client = s3_endpoint.client()
    if BUCKET not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="retry/blob.bin", Body=blob)
    status, code = (int(fault.split()[0]), fault.split()[1]) if fault[0].isdigit() else (0, "")
    # Stalls cost a timeout each: only the data read (GET) stalls.
    fault_args = {"status": status, "code": code} if status else {"stall_s": 3.0, "methods": ("GET",)}
    requests_failed = 2 if status else 1

    for attempts in (4, 1):
        with FlakyProxy(s3_endpoint.url, failures=1, **fault_args) as proxy:
            config = StorageConfig(endpoint_url=proxy.url, max_attempts=attempts, request_timeout_s=1.0)
            fs, path = filesystem(f"s3://{BUCKET}/retry/blob.bin", resolve(config))
            fs = pickle.loads(pickle.dumps(fs))
            if attempts == 1:
                with pytest.raises(OSError, match=f"HTTP status {status}" if status else "Timeout"):
                    fs.open_input_stream(path).read()
                assert proxy.failed == 1
            else:
                with fs.open_input_stream(path) as f:
                    assert f.read() == blob
                assert proxy.failed == requests_failed  # each failed once (HEAD and GET; a stall: GET)


def _train_cfg(tmp_path, name: str, train_uri: str, endpoint: str, eval_uri: str = "", *extra: str):
    return load_config(
        "tiny",
        [
            f"data.train={train_uri}",
            f"data.eval={eval_uri}",
            f"data.storage.endpoint_url={endpoint}",
            "data.max_pixels=12544",
            "training.steps=2",
            "training.global_batch_size=4",
            "training.eval_every=0",
            "training.eval_batches=1",
            "training.warmup_steps=1",
            "vision.parallelism=none",
            "vision.num_actors=1",
            "vision.degree=1",
            "text.parallelism=none",
            "text.num_actors=1",
            "text.degree=1",
            f"output.dir={tmp_path}/runs",
            f"output.name={name}",
            "output.save_final_checkpoint=false",
            *extra,
        ],
    )


def test_training_from_s3_equals_local_and_keeps_credentials_out(trainers, s3_endpoint, dataset, tmp_path, capfd):
    s3 = f"s3://{BUCKET}/{PREFIX}"
    runs = {}
    for name, base in (("local", str(dataset)), ("s3", s3)):
        train(_train_cfg(tmp_path, name, f"{base}/train.jsonl", s3_endpoint.url), trainers=trainers)
        run = tmp_path / "runs" / name
        runs[name] = step_logs.read(run)
    assert [r["step"] for r in runs["s3"]] == [1, 2]
    assert [r["loss"] for r in runs["s3"]] == [r["loss"] for r in runs["local"]]  # exactly
    assert [r["tokens"] for r in runs["s3"]] == [r["tokens"] for r in runs["local"]]

    # Nothing the run wrote or printed holds a key: run dir (config.yaml, metrics, checkpoint),
    # this process's output and the Ray session's logs.
    secrets = (s3_endpoint.access_key.encode(), s3_endpoint.secret_key.encode())
    run = tmp_path / "runs" / "s3"
    written = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any(p.suffix == ".safetensors" for p in written)
    assert s3_endpoint.url in (run / "config.yaml").read_text()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    for path in written + [p for p in logs.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert not any(s in data for s in secrets), path
    out, err = capfd.readouterr()
    assert not any(s.decode() in out + err for s in secrets)


def test_a_stalled_read_is_a_data_fault_the_run_recovers_from(trainers, s3_endpoint, dataset, tmp_path, capsys):
    """The annotation object's first GET never answers (the connection hangs 200 s, past the detection): the
    stream's start misses `data.timeout_s` twice without reading a record, the run reports where the stream
    stood, rebuilds and trains to the end.

    The rebuilt stream's healthy cold start (its loader's and Ray Data's worker processes and their imports) must
    fit in the same 2 x `data.timeout_s` while the background runs load the 2-core machine: with 12 s the test
    failed once in a full run, with 20 s once on CI. 30 s costs the test 20 s more. In that CI run the first
    stream's loader had not answered its probe at either look (a process still importing, while a background
    job's runs shared the cores equally, tests/background.py), so the report may say that instead of the
    position: both are what the driver knew."""
    annotation = f"/{BUCKET}/{PREFIX}/train.jsonl"
    with FlakyProxy(s3_endpoint.url, failures=1, stall_s=200, only={annotation}, methods=("GET",)) as proxy:
        summary = train(
            _train_cfg(
                tmp_path,
                "stall",
                f"s3:/{annotation}",
                proxy.url,
                "",
                "data.timeout_s=30",
                "data.storage.max_attempts=1",
                "data.storage.request_timeout_s=300",
                "training.max_restarts=1",
            ),
            trainers=trainers,
        )
        assert proxy.failed == 1
    (fault,) = summary["restarts"]
    assert fault["kind"] == "the data pipeline stalled"
    assert "the data streams' start" in fault["error"] and "data.timeout_s=30 s" in fault["error"]
    position = "stream 0: epoch 0, 0 records into it, no record read yet"
    silent = "stream 0: its loader did not answer within 5 s"
    assert position in fault["error"] or silent in fault["error"], fault["error"]
    assert summary["steps"] == 2
    assert "fault (the data pipeline stalled)" in capsys.readouterr().out


@pytest.mark.parametrize("uri", [f"s3://{BUCKET}/{PREFIX}/nope.jsonl", "s3://no-such-bucket/train.jsonl"])
def test_missing_annotation_object_stops_the_run_at_start(s3_endpoint, dataset, tmp_path, uri):
    good = f"s3://{BUCKET}/{PREFIX}/train.jsonl"
    for train_uri, eval_uri in ((uri, ""), (good, uri)):
        cfg = _train_cfg(tmp_path, "missing", train_uri, s3_endpoint.url, eval_uri)
        with pytest.raises(FileNotFoundError) as info:
            train(cfg)
        assert str(info.value) == f"annotation file not found: {uri}"
        assert s3_endpoint.secret_key not in str(info.value)


def test_credentials_from_profile_or_environment_are_never_shown(tmp_path, monkeypatch):
    (tmp_path / "credentials").write_text("[team]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = s3cr3t\n")
    (tmp_path / "config").write_text("[profile team]\nregion = eu-west-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envs3cr3t")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)

    from_profile = resolve(StorageConfig(profile="team"))  # a configured profile beats the variables
    assert (from_profile.credentials.access_key, from_profile.region) == ("AKIAPROFILE", "eu-west-1")
    from_env = resolve(StorageConfig())
    assert from_env.credentials.access_key == "AKIAENV" and from_env.credentials.source == "environment"
    monkeypatch.setenv("AWS_PROFILE", "team")
    assert resolve(StorageConfig()).credentials.access_key == "AKIAENV"  # variables beat AWS_PROFILE
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert resolve(StorageConfig()).credentials.access_key == "AKIAPROFILE"
    assert resolve(StorageConfig(anonymous=True)).credentials is None

    settings = PreprocessSettings("s3://b/images", 1, 2, 3, storage=from_profile)
    shown = " ".join([repr(from_profile), str(from_profile.credentials), repr(settings), str(settings)])
    assert "s3cr3t" not in shown and "AKIAPROFILE" not in shown and "profile team" in shown

    with pytest.raises(ConfigError, match="data.storage.profile='nobody'"):
        resolve(StorageConfig(profile="nobody"))
    with pytest.raises(ConfigError, match="without credentials") as info:
        resolve(StorageConfig(endpoint_url="http://me:pw@127.0.0.1:9000"))
    assert "pw" not in str(info.value)
    with pytest.raises(ConfigError, match="mixes storage kinds"):
        filesystem_of_all(["/data/a.jsonl", "s3://b/b.jsonl"])
