#!/usr/bin/env bash
# Envoy CPU per request, per thread: the demo stack (zero-time pd-sim) under a fixed load, and
# each Envoy thread's CPU over the run (from /proc/<envoy>/task/*/stat) divided by the
# requests answered. Shows what the threads that serve nothing (the main thread, an idle
# worker) spend on a request, which the whole-process figure hides; compare builds with
# PD_WASM, policies with AIBRIX_*.
#
#   make build-native && envoy/thread-cpu.sh [PD_LOAD_ARGS...]
#   e.g. envoy/thread-cpu.sh --arrival fixed --concurrency-limit 1   (one in flight: one worker
#        serves everything)
# Environment: PD_WASM (another build of the filter), RPS (200), SECONDS_PER_RUN (10),
# WARMUP_S (3), BODY_BYTES (2048), PORT (10751), ADMIN_PORT (9971), PROFILE (native).
# Resolution: clock ticks of 10 ms, so ≈ 5 µs per request at 200 rps over 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
export ADMIN_PORT=${ADMIN_PORT:-9971} CONTROL_PORT=${CONTROL_PORT:-18171}
export SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18172}
export SIM_TIMING=zero
PORT=${PORT:-10751}
PROFILE=${PROFILE:-native}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
work=$(mktemp -d)
trap 'envoy/stack.sh down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

envoy/stack.sh up envoy/fleets/demo.yaml 1 "$PORT" "$PROFILE" >/dev/null
pid=$(cat .run/envoy.pid)
load() {
  "$TARGET/$PROFILE/pd-load" --url "http://127.0.0.1:$PORT" --model demo-llm \
    --rps "${RPS:-200}" --duration "$1" --workload fixed --body-bytes "${BODY_BYTES:-2048}" \
    --stream-ratio 0 --max-tokens 1 --routing-strategy pd "${@:2}"
}
# "<tid> <thread name> <utime + stime in ticks>" for every thread of Envoy.
threads() {
  for t in /proc/"$pid"/task/*; do
    read -r stat < "$t/stat"
    # Fields after the parenthesised name: state is 3rd, utime the 14th, stime the 15th.
    set -- ${stat##*) }
    echo "${t##*/} $(cat "$t/comm") $(( ${12} + ${13} ))"
  done | sort
}
load "${WARMUP_S:-3}s" "$@" > /dev/null
threads > "$work/before"
load "${SECONDS_PER_RUN:-10}s" "$@" | tee "$work/load" | grep -E '^pd-load:'
threads > "$work/after"
answered=$(sed -nE 's/^pd-load: ([0-9]+) requests.*/\1/p' "$work/load")
[ "${answered:-0}" -gt 0 ] || { echo "thread-cpu: no request answered" >&2; exit 1; }
hz=$(getconf CLK_TCK)
# Threads that ran at all ("envoy" is the main thread, "wrk:worker_N" the workers).
echo "Envoy CPU per request, by thread (µs):"
join "$work/before" "$work/after" | awk -v n="$answered" -v hz="$hz" '
  { us = ($5 - $3) * 1e6 / hz / n; total += us; if (us > 0) printf "  %-16s %6.0f\n", $2, us }
  END { printf "  %-16s %6.0f\n", "all threads", total }'
