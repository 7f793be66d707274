#!/usr/bin/env bash
# Envoy CPU per request, per thread: the demo stack (zero-time pd-sim) under a fixed load, and
# each Envoy thread's CPU over the run (from /proc/<envoy>/task/*/stat) divided by the
# requests answered. Shows what the threads that serve nothing (the main thread, an idle
# worker) spend on a request, which the whole-process figure hides; compare builds with
# PD_WASM, policies with AIBRIX_*. With BASELINES=1, two more Envoys run beside it on the same
# pd-sim and are measured in turn, ROUNDS times: the PD-hop floor filter (filter/examples/
# pd_floor.rs, `make floor-wasm`) on the first roleset, and plain Envoy passing requests to the
# standard pod.
#
#   make build-native && envoy/thread-cpu.sh [PD_LOAD_ARGS...]
#   e.g. envoy/thread-cpu.sh --arrival fixed --concurrency-limit 1   (one in flight: one worker
#        serves everything)
# Environment: PD_WASM (another build of the filter), BASELINES (0), ROUNDS (2 with
# BASELINES, else 1), RPS (200), SECONDS_PER_RUN (10), WARMUP_S (3), BODY_BYTES (2048),
# PORT (10751; the floor and plain Envoys take PORT+10 and PORT+20), ADMIN_PORT (9971; +10,
# +20), PROFILE (native).
# Resolution: clock ticks of 10 ms, so ≈ 5 µs per request at 200 rps over 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
source envoy/render.sh
hold_measure_lock thread-cpu.sh
export ADMIN_PORT=${ADMIN_PORT:-9971} CONTROL_PORT=${CONTROL_PORT:-18171}
export SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18172}
export SIM_TIMING=zero
PORT=${PORT:-10751}
PROFILE=${PROFILE:-native}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
# envoy/fleets/demo.yaml: roleset group-0 and the standard pod, as pd-sim serves them.
POD_PORT=18000 STANDARD=127.0.10.5
PREFILL=127.0.10.1:$POD_PORT DECODE=127.0.10.2:$POD_PORT
work=$(mktemp -d)
baselines=()
cleanup() {
  local p
  for p in "${baselines[@]}"; do kill "$p" 2>/dev/null || true; done
  envoy/stack.sh down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

envoy/stack.sh up envoy/fleets/demo.yaml 1 "$PORT" "$PROFILE" >/dev/null
targets=("pd-router $PORT $(cat .run/envoy.pid)")

# An Envoy beside the stack's: name, listen port, admin port, config file.
start_envoy() {
  start_envoy_beside "$4" "$work/$1.log" "$3"
  baselines+=("$ENVOY_PID")
  targets+=("$1 $2 $ENVOY_PID")
}

if [ "${BASELINES:-0}" = 1 ]; then
  floor=$TARGET/wasm32-wasip1/release/examples/pd_floor.wasm
  [ -e "$floor" ] || { echo "thread-cpu: $floor missing (make floor-wasm)" >&2; exit 1; }
  render_floor $((PORT + 10)) $((ADMIN_PORT + 10)) "$PREFILL" "$DECODE" "$floor" > "$work/floor.yaml"
  start_envoy floor $((PORT + 10)) $((ADMIN_PORT + 10)) "$work/floor.yaml"
  render_plain $((PORT + 20)) $((ADMIN_PORT + 20)) "$STANDARD" "$POD_PORT" > "$work/plain.yaml"
  start_envoy plain $((PORT + 20)) $((ADMIN_PORT + 20)) "$work/plain.yaml"
fi

load() { # port duration pd-load-args...
  "$TARGET/$PROFILE/pd-load" --url "http://127.0.0.1:$1" --model demo-llm \
    --rps "${RPS:-200}" --duration "$2" --workload fixed --body-bytes "${BODY_BYTES:-2048}" \
    --stream-ratio 0 --max-tokens 1 --routing-strategy pd "${@:3}"
}
# "<tid> <thread name> <utime + stime in ticks>" for every thread of process $1.
threads() {
  local t stat
  for t in /proc/"$1"/task/*; do
    read -r stat < "$t/stat"
    # Fields after the parenthesised name: state is 3rd, utime the 14th, stime the 15th.
    set -- ${stat##*) }
    echo "${t##*/} $(tr ' ' _ < "$t/comm") $(( ${12} + ${13} ))"
  done | sort
}
hz=$(getconf CLK_TCK)
for ((round = 1; round <= ${ROUNDS:-$([ "${BASELINES:-0}" = 1 ] && echo 2 || echo 1)}; round++)); do
  for t in "${targets[@]}"; do
    read -r name port pid <<< "$t"
    load "$port" "${WARMUP_S:-3}s" "$@" > /dev/null
    threads "$pid" > "$work/before"
    load "$port" "${SECONDS_PER_RUN:-10}s" "$@" > "$work/load"
    threads "$pid" > "$work/after"
    answered=$(sed -nE 's/^pd-load: ([0-9]+) requests.*/\1/p' "$work/load")
    [ "${answered:-0}" -gt 0 ] || { echo "thread-cpu: $name answered no request" >&2; exit 1; }
    echo "$name: $(grep -E '^pd-load:' "$work/load")"
    # Threads that ran at all ("envoy" is the main thread, "wrk:worker_N" the workers).
    echo "Envoy CPU per request, by thread (µs):"
    join "$work/before" "$work/after" | awk -v n="$answered" -v hz="$hz" '
      { us = ($5 - $3) * 1e6 / hz / n; total += us; if (us > 0) printf "  %-16s %6.0f\n", $2, us }
      END { printf "  %-16s %6.0f\n", "all threads", total }'
  done
done
