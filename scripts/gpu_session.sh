#!/usr/bin/env bash
# The GPU work (tests, dhp against one process, the peers) on a GPU machine with no access to package
# registries. The machine is available for at most 15 minutes at a time (its start, 1-2 minutes, included) and
# runs one command for at most 10 minutes, so this script runs every step in ONE command:
#
#   bash scripts/gpu_bundle.sh                               # on a machine with registry access: .gpu_bundle/
#   on the GPU machine, with .gpu_bundle copied beside the checkout, at most 600 s:  bash scripts/gpu_session.sh all
#
# `all` runs the three steps below in order of what they prove (the CUDA path, then dhp against one process on
# the 3B, then the peers), each under its own time limit cut from BUDGET_S (default 570 s from the script's
# start, setup included) so that a hang in one leaves time for the next; a step stopped at its limit is sent
# SIGINT (pytest prints its summary, the benches shut Ray down) and the benches keep in their JSON what they
# finished (one-gpu its image sizes, peers its systems). One step alone:
#
#                                        bash scripts/gpu_session.sh tests      # pytest -m gpu  (~3 min)
#                                        bash scripts/gpu_session.sh one-gpu    # 3B, dhp vs one process
#                                        bash scripts/gpu_session.sh peers      # dhp bench peers --ranks 1
#
# Knobs: BUDGET_S (all's seconds from the start, default 570), STEPS (all's steps, default "tests one_gpu peers"),
# TESTS_S (the tests' share, 240: they took ~300 s on an H100, so once they have passed, run STEPS="one_gpu
# peers" and the tests as a second command), MODEL (one-gpu's shape, default
# qwen2_5_vl_3b; `tiny` runs its quick CPU size, which is how this script is checked without a GPU), SIDES
# (one-gpu's image sides in px, e.g. 896,1792; default the bench's 448,896,1792), BENCH_STEPS (one-gpu's measured
# steps per size, default 20), BOUNDARIES (one-gpu: pipeline.boundary values, a dhp row each, e.g. host,cuda_ipc;
# default host), PROFILE (one-gpu: this many profiled steps of the one-process loop, default 2),
# LIMIT_S (one step alone: its limit, default 570; e.g. 220 for the tests as a second command),
# STOP_RAY=0 (do not `ray stop --force` after each step; only
# for a machine where other Ray work runs).
#
# Each step writes its log and JSON under $OUT (default runs/gpu/; at most 8 files in all, so that the folder
# the GPU machine hands back holds them all) together with versions.txt: the GPU, driver, torch/CUDA,
# transformers, Ray and DeepSpeed it ran with, and steps.txt: each step's exit status and seconds (124: stopped
# at its limit). Record what comes back in docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?usage: gpu_session.sh all|tests|one-gpu|peers}
for s in ${STEPS:-}; do  # before the setup: a misspelt step would be skipped in silence
  [[ " tests one_gpu peers " == *" $s "* ]] || { echo "unknown step $s in STEPS: tests one_gpu peers" >&2; exit 2; }
done
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
[ -f .gpu_bundle/site.tar.xz ] || { echo "no .gpu_bundle/site.tar.xz: run scripts/gpu_bundle.sh and carry .gpu_bundle" >&2; exit 2; }
# A warm machine keeps /tmp/site between calls: unpack again only if this bundle is not the one unpacked there.
bundle=$(cksum < .gpu_bundle/site.tar.xz)
if [ "$(cat /tmp/site/.dhp-unpacked 2>/dev/null)" != "$bundle" ]; then
  rm -rf /tmp/site && mkdir -p /tmp/site && tar -xJf .gpu_bundle/site.tar.xz -C /tmp/site
  echo "$bundle" > /tmp/site/.dhp-unpacked
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .  # a few seconds; this checkout's path
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
# Each step logs to a file only (no pipe: a pipe's reader would get the time limit's SIGINT too); its tail is
# printed after it, which is what the command's output shows.
tests()   { python3 -m pytest -m gpu tests/ -q -rs --durations=5 > "$OUT/pytest_gpu.log" 2>&1; }
one_gpu() {  # MODEL=tiny: the tiny shape (how this script is checked on a CPU)
  local model=(--model "${MODEL:-qwen2_5_vl_3b}")
  [ "${MODEL:-}" = tiny ] && model=(--quick)
  [ -n "${SIDES:-}" ] && model+=(--sides "$SIDES")
  [ -n "${BENCH_STEPS:-}" ] && model+=(--steps "$BENCH_STEPS")
  [ -n "${BOUNDARIES:-}" ] && model+=(--boundaries "$BOUNDARIES")
  python3 -m dhp.stages.cli bench one-gpu "${model[@]}" --profile "${PROFILE:-2}" --json "$OUT/one_gpu.json" \
    > "$OUT/one_gpu.log" 2>&1
}
peers()   { python3 -m dhp.stages.cli bench peers --ranks 1 --json "$OUT/peers_gpu.json" > "$OUT/peers_gpu.log" 2>&1; }
export -f tests one_gpu peers
export OUT
declare -A LOG=([tests]=pytest_gpu.log [one_gpu]=one_gpu.log [peers]=peers_gpu.log)

# step NAME LIMIT_S: one step under a time limit (SIGINT to its process group, SIGKILL 15 s later); a limit
# under 30 s skips it. Records how it ended in steps.txt and prints its log's tail.
step() {
  local began rc=0
  if (( $2 < 30 )); then
    echo "$1 skipped: $2 s left" | tee -a "$OUT/steps.txt"
    return 0
  fi
  began=$(date +%s)
  timeout --signal=INT --kill-after=15 "$2" bash -c "$1" || rc=$?
  # a step killed before it shut its Ray down would leave actors holding the GPU for the next one (STOP_RAY=0
  # where other Ray work shares the machine: this stops every Ray process of the user)
  if [ "${STOP_RAY:-1}" != 0 ]; then
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
    # until Ray's daemons are gone: the peers' Ray start once timed out ("Failed to get node info") right after
    # the one-gpu step's stop
    for _ in $(seq 30); do pgrep -f 'ray/core/src/ray/(gcs/gcs_server|raylet/raylet)' >/dev/null || break; sleep 1; done
  fi
  echo "== $1: rc=$rc (124: stopped at its limit) in $(( $(date +%s) - began )) s of $2" | tee -a "$OUT/steps.txt"
  tail -n 30 "$OUT/${LOG[$1]}"
  return 0
}

case "$STEP" in
  tests)   step tests "${LIMIT_S:-570}" ;;  # + 15 s to die + Ray's stop: inside a command's 600 s
  one-gpu) step one_gpu "${LIMIT_S:-570}" ;;
  peers)   step peers "${LIMIT_S:-570}" ;;
  all)
    # counted from the script's start (the unpack and install included); a step may overrun its limit by ~20 s
    # (SIGKILL 15 s after SIGINT, then Ray's stop), so each limit leaves that much of the budget
    budget=${BUDGET_S:-570}
    left() { echo $(( budget - SECONDS )); }
    steps=" ${STEPS:-tests one_gpu peers} "
    tests_s=${TESTS_S:-240}
    [[ $steps == *" tests "* ]] && step tests $(( tests_s < $(left) - 20 ? tests_s : $(left) - 20 ))
    [[ $steps == *" peers "* ]] && keep=$(( 90 + 20 )) || keep=0  # the peers keep at least 90 s
    [[ $steps == *" one_gpu "* ]] && step one_gpu $(( $(left) - 20 - keep ))
    [[ $steps == *" peers "* ]] && step peers $(( $(left) - 20 ))
    cat "$OUT/steps.txt" ;;
  *)       echo "unknown step $STEP: all | tests | one-gpu | peers" >&2; exit 2 ;;
esac
