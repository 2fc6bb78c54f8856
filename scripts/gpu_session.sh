#!/usr/bin/env bash
# The GPU machine's benchmarks and GPU tests in ONE command of at most 10 minutes (the machine's start, 1-2
# minutes, comes on top):
#
#   bash scripts/gpu_bundle.sh                  # here, once: .gpu_bundle/site.tar.xz
#   on the GPU machine, with .gpu_bundle beside the checkout, within 600 s:  bash scripts/gpu_session.sh all
#
# `all` runs the steps in STEPS in order of what they prove (the CUDA path, then dhp against the one-process
# loops on the 3B, then the peers), each under its own time limit cut from BUDGET_S (default 570 s from the
# script's start, setup included) so that a hang in one leaves time for the next; a step stopped at its limit is
# sent SIGINT (pytest prints its summary, the benches shut down) and the benches keep in their JSON what they
# finished (one-gpu its workloads, peers its systems). One step alone:
#
#                                        bash scripts/gpu_session.sh tests      # pytest -m gpu  (~3-5 min)
#                                        bash scripts/gpu_session.sh one-gpu    # 3B, dhp vs the loops, photos
#                                        bash scripts/gpu_session.sh peers      # dhp bench peers --ranks 1
#
# One Ray for the benches: started once before the first of them (`ray start --head --block` on 127.0.0.1, its
# own ports, temp dir and token, in its own process group) and ended with the script; each bench joins it
# through RAY_ADDRESS. Never `ray stop` between steps: a second Ray start after `ray stop --force` timed out
# ("GCS cannot find the node", "Failed to get node info") on H100 machines, 3 times
# of 3. A step's actors end with its driver (Ray kills a job's actors when the job's driver exits). The tests
# start their own Ray (`address="local"`), without RAY_ADDRESS.
#
# Knobs: BUDGET_S (all's seconds from the start, default 570), STEPS (all's steps, default "one_gpu peers"; the
# tests took ~300 s on an H100, so they are a command of their own: STEPS=tests or `tests`), TESTS_S (the tests'
# share in all, 240), MODEL (one-gpu's shape, default qwen2_5_vl_3b; `tiny` runs its quick CPU size and the
# peers' --quick one: how this script is checked without a GPU), PHOTOS (one-gpu: train the first N photos of
# the shard; default all 32, packed), SIDES (one-gpu: square noise images of these sides in px instead of the
# photos, e.g. 448,896,1792), BENCH_STEPS (one-gpu's measured steps per workload, default the bench's: 8 for the
# photos, 20 a side), BOUNDARIES (one-gpu: pipeline.boundary values, a dhp row each, e.g. host,cuda_ipc; default
# host), COMPILE (one-gpu: inductor compiles the blocks of dhp and of the loop of dhp's kernels; default none),
# PROFILE (one-gpu: this many profiled steps, after one warm-up, of each one-process loop and of dhp's
# actors; default 1; 0: none), RAY_CPUS (the Ray's CPUs, default 8: the peers ask for 8), LIMIT_S (one step
# alone: its limit, default 570; e.g. 220 for the tests as a second command on a warm machine), BUNDLE (`none`:
# no bundle to unpack or install; the python3 on PATH has dhp and its packages: how tests/test_bench_one_gpu.py
# runs this script on a CPU, with MODEL=tiny).
#
# Each step writes its log and JSON under $OUT (the folder that comes back from the GPU machine, at most 8
# files; runs/gpu/ elsewhere) together with versions.txt: the GPU, driver, torch/CUDA, transformers, Ray and
# DeepSpeed it ran with, and steps.txt: each step's exit status and seconds (124: stopped at its limit).
# Record what comes back in docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?usage: gpu_session.sh all|tests|one-gpu|peers}
for s in ${STEPS:-}; do  # before the setup: a misspelt step would be skipped in silence
  [[ " tests one_gpu peers " == *" $s "* ]] || { echo "unknown step $s in STEPS: tests one_gpu peers" >&2; exit 2; }
done
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${BUNDLE:-}" != none ]; then
  [ -f .gpu_bundle/site.tar.xz ] || { echo "no .gpu_bundle/site.tar.xz: run scripts/gpu_bundle.sh and carry .gpu_bundle" >&2; exit 2; }
  # A warm machine keeps /tmp/site between calls: unpack again only if this bundle is not the one unpacked there.
  bundle=$(cksum < .gpu_bundle/site.tar.xz)
  if [ "$(cat /tmp/site/.dhp-unpacked 2>/dev/null)" != "$bundle" ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site && tar -xJf .gpu_bundle/site.tar.xz -C /tmp/site
    echo "$bundle" > /tmp/site/.dhp-unpacked
  fi
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .  # a few seconds; this checkout's path
fi
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
# printed after it, which is what comes back of the command's output.
tests()   {  # their own Ray, as in CI
  env -u RAY_ADDRESS -u RAY_AUTH_MODE -u RAY_AUTH_TOKEN_PATH -u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER \
    python3 -m pytest -m gpu ${TESTS_K:+-k "$TESTS_K"} tests/ -q -rs --durations=5 > "$OUT/pytest_gpu.log" 2>&1
}
one_gpu() {  # the photos, packed, unless SIDES; MODEL=tiny: the tiny shape (how this script is checked on a CPU)
  local model=(--model "${MODEL:-qwen2_5_vl_3b}")
  [ "${MODEL:-}" = tiny ] && model=(--quick)
  [ -n "${PHOTOS:-}" ] && model+=(--photos "$PHOTOS")
  [ -n "${SIDES:-}" ] && model+=(--sides "$SIDES")
  [ -n "${BENCH_STEPS:-}" ] && model+=(--steps "$BENCH_STEPS")
  [ -n "${BOUNDARIES:-}" ] && model+=(--boundaries "$BOUNDARIES")
  [ -n "${COMPILE:-}" ] && model+=(--compile "$COMPILE")
  python3 -m dhp.stages.cli bench one-gpu "${model[@]}" --profile "${PROFILE:-1}" --json "$OUT/one_gpu.json" \
    > "$OUT/one_gpu.log" 2>&1
}
peers() {  # MODEL=tiny: its quick sizes too
  local quick=()
  [ "${MODEL:-}" = tiny ] && quick=(--quick)
  python3 -m dhp.stages.cli bench peers --ranks 1 "${quick[@]}" --json "$OUT/peers_gpu.json" > "$OUT/peers_gpu.log" 2>&1
}
export -f tests one_gpu peers
export OUT
declare -A LOG=([tests]=pytest_gpu.log [one_gpu]=one_gpu.log [peers]=peers_gpu.log)

# The benches' Ray: `ray start --head --block` in a session and process group of its own (its daemons and
# workers stay in it), bound to 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's single-machine mode, as
# scripts/local_head.py explains) with free ports, token auth with a token of its own, and ended with the script
# by its process id: no `ray stop`, which stops every Ray of the machine's user.
RAY_PID=
start_ray() {
  [ -n "$RAY_PID" ] && kill -0 "$RAY_PID" 2>/dev/null && return 0  # running (started before an earlier step)
  RAY_DIR=$(mktemp -d /tmp/dhp-ray-XXXXXX)  # short: Ray's unix sockets go under it (107 bytes at most)
  python3 -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_DIR/token" && chmod 600 "$RAY_DIR/token"
  local ports
  read -r -a ports < <(python3 -c 'from dhp.scripts.local_head import free_ports; print(*free_ports(10))')
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RAY_DIR/token" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 AUTOSCALER_METRIC_PORT="${ports[8]}" DASHBOARD_METRIC_PORT="${ports[9]}"
  python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
    python3 -m ray.scripts.scripts start --head --block --node-ip-address=127.0.0.1 --temp-dir="$RAY_DIR/ray" \
    --num-cpus="${RAY_CPUS:-8}" --include-dashboard=false --disable-usage-stats --port="${ports[0]}" \
    --ray-client-server-port="${ports[1]}" --node-manager-port="${ports[2]}" --object-manager-port="${ports[3]}" \
    --dashboard-agent-listen-port="${ports[4]}" --dashboard-agent-grpc-port="${ports[5]}" \
    --runtime-env-agent-port="${ports[6]}" --metrics-export-port="${ports[7]}" \
    > "$RAY_DIR/head.log" 2>&1 < /dev/null &
  RAY_PID=$!  # the session's leader: its process group's id
  export RAY_ADDRESS="127.0.0.1:${ports[0]}"
  local began=$SECONDS
  until grep -q "Ray runtime started" "$RAY_DIR/head.log"; do
    if ! kill -0 "$RAY_PID" 2>/dev/null || (( SECONDS - began > 90 )); then
      echo "Ray's head did not start in $(( SECONDS - began )) s:" | tee -a "$OUT/steps.txt"
      tail -n 20 "$RAY_DIR/head.log" | tee -a "$OUT/steps.txt"
      return 1
    fi
    sleep 0.5
  done
  echo "Ray started at $RAY_ADDRESS in $(( SECONDS - began )) s" | tee -a "$OUT/steps.txt"
}
stop_ray() {
  [ -n "$RAY_PID" ] || return 0
  kill -TERM "$RAY_PID" 2>/dev/null || true  # `ray start --block` ends its node
  for _ in $(seq 30); do pgrep -g "$RAY_PID" >/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$RAY_PID" 2>/dev/null || true  # what outlived that, in its process group
  rm -rf "$RAY_DIR"
  RAY_PID=
}
trap stop_ray EXIT

# step NAME LIMIT_S: one step under a time limit (SIGINT to its process group, SIGKILL 15 s later); a limit
# under 30 s skips it. Records how it ended in steps.txt and prints its log's tail.
step() {
  local began rc=0
  if (( $2 < 30 )); then
    echo "$1 skipped: $2 s left" | tee -a "$OUT/steps.txt"
    return 0
  fi
  began=$(date +%s)
  if [ "$1" != tests ] && ! start_ray; then
    rc=3
  else
    timeout --signal=INT --kill-after=15 "$2" bash -c "$1" || rc=$?
  fi
  # a step's actors die with its driver; until their GPU memory is back (no compute process left), at most 30 s
  for _ in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
    sleep 1
  done
  echo "== $1: rc=$rc (124: stopped at its limit; 3: no Ray) in $(( $(date +%s) - began )) s of $2" \
    | tee -a "$OUT/steps.txt"
  tail -n 30 "$OUT/${LOG[$1]}" 2>/dev/null || true
  return 0
}

case "$STEP" in
  tests)   step tests "${LIMIT_S:-570}" ;;  # + 15 s to die: inside a command's 600 s
  one-gpu) step one_gpu "${LIMIT_S:-570}" ;;
  peers)   step peers "${LIMIT_S:-570}" ;;
  all)
    # counted from the script's start (the unpack and install included); a step may overrun its limit by ~20 s
    # (SIGKILL 15 s after SIGINT, then the wait for the GPU), so each limit leaves that much of the budget
    budget=${BUDGET_S:-570}
    left() { echo $(( budget - SECONDS )); }
    steps=" ${STEPS:-one_gpu peers} "
    tests_s=${TESTS_S:-240}
    [[ $steps == *" tests "* ]] && step tests $(( tests_s < $(left) - 20 ? tests_s : $(left) - 20 ))
    [[ $steps == *" peers "* ]] && keep=$(( 90 + 20 )) || keep=0  # the peers keep at least 90 s
    [[ $steps == *" one_gpu "* ]] && step one_gpu $(( $(left) - 20 - keep ))
    [[ $steps == *" peers "* ]] && step peers $(( $(left) - 20 ))
    cat "$OUT/steps.txt" ;;
  *)       echo "unknown step $STEP: all | tests | one-gpu | peers" >&2; exit 2 ;;
esac
