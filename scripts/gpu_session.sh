#!/usr/bin/env bash
# The GPU work of issues 14 and 17, one step per device call (a call runs at most 10 minutes; a machine stays
# warm only 30 s after one, so every step unpacks the bundle again if it has to).
#
#   bash scripts/gpu_bundle.sh                               # here, once: .gpu_bundle/site.tar.xz
#   device run, carry [".gpu_bundle"]:  bash scripts/gpu_session.sh tests      # pytest -m gpu  (~3 min)
#                                        bash scripts/gpu_session.sh one-gpu    # 3B, dhp vs one process
#                                        bash scripts/gpu_session.sh peers      # dhp bench peers --ranks 1
#
# Each step writes its log and JSON under $OUT (the device tool's folder that comes back; runs/gpu/ elsewhere)
# together with versions.txt: the GPU, driver, torch/CUDA, transformers, Ray and DeepSpeed it ran with.
# Record what comes back in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?usage: gpu_session.sh tests|one-gpu|peers}
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if [ ! -f /tmp/site/.dhp-unpacked ]; then
  [ -f .gpu_bundle/site.tar.xz ] || { echo "no .gpu_bundle/site.tar.xz: run scripts/gpu_bundle.sh and carry .gpu_bundle" >&2; exit 2; }
  mkdir -p /tmp/site && tar -xJf .gpu_bundle/site.tar.xz -C /tmp/site && touch /tmp/site/.dhp-unpacked
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip show dhp >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 - <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for name in ("transformers", "ray", "deepspeed"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")
PY
} > "$OUT/versions.txt" 2>&1
case "$STEP" in
  tests)   python3 -m pytest -m gpu tests/ -q -rs 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 40 ;;
  one-gpu) python3 -m dhp.stages.cli bench one-gpu --model "${MODEL:-qwen2_5_vl_3b}" --json "$OUT/one_gpu.json" \
             2>&1 | tee "$OUT/one_gpu.log" | tail -n 40 ;;
  peers)   python3 -m dhp.stages.cli bench peers --ranks 1 --json "$OUT/peers_gpu.json" \
             2>&1 | tee "$OUT/peers_gpu.log" | tail -n 40 ;;
  *)       echo "unknown step $STEP: tests | one-gpu | peers" >&2; exit 2 ;;
esac
