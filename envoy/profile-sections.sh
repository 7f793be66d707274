#!/usr/bin/env bash
# Where a PD request's time goes inside the filter, in real Envoy: the `sections` build of the
# .wasm (feature `sections`, see filter/src/host/sections.rs) on the demo fleet with a
# zero-time pd-sim, one load per client count, then the per-request wall time of each
# callback and of the steps inside it, as every worker last logged it.
#
#   envoy/profile-sections.sh [CLIENTS...]      default: 1 32
# Environment: FLEET (envoy/fleets/demo.yaml; envoy/fleets/pd-fleet.sh writes bigger ones),
# SECONDS_PER_RUN (20), BODY_BYTES (2048), RPS (400 with one client, else 0 = closed loop),
# PROFILE (native), PORT (10731), ADMIN_PORT (9951), plus AIBRIX_* for the filter (policies).
# Wall time includes preemption on a loaded box: compare sections, and builds, in one sitting.
set -euo pipefail
cd "$(dirname "$0")/.."
export ADMIN_PORT=${ADMIN_PORT:-9951} CONTROL_PORT=${CONTROL_PORT:-18151}
export SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18152}
PORT=${PORT:-10731}
PROFILE=${PROFILE:-native}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-20}
BODY_BYTES=${BODY_BYTES:-2048}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
export PD_WASM=$TARGET/sections/wasm32-wasip1/release/pd_router_filter.wasm
export SIM_TIMING=zero

CARGO_TARGET_DIR=$TARGET/sections cargo build --release --target wasm32-wasip1 \
  -p pd-router-filter --features sections
trap 'envoy/stack.sh down >/dev/null 2>&1 || true' EXIT

for clients in ${@:-1 32}; do
  rps=${RPS:-$([ "$clients" = 1 ] && echo 400 || echo 0)}
  envoy/stack.sh up "${FLEET:-envoy/fleets/demo.yaml}" 1 "$PORT" "$PROFILE" >/dev/null
  "$TARGET/$PROFILE/pd-load" --url "http://127.0.0.1:$PORT" --model demo-llm --rps "$rps" \
    --clients "$clients" --duration "${SECONDS_PER_RUN}s" --workload fixed \
    --body-bytes "$BODY_BYTES" --stream-ratio 0 --max-tokens 1 --routing-strategy pd |
    grep -E '^pd-load:'
  # Envoy flushes its log file every few seconds: stopping it writes out the last reports.
  envoy/stack.sh down >/dev/null
  echo "µs of wall time per request, $clients client(s), ${BODY_BYTES}-byte bodies (xN: calls per request):"
  # The last report of each worker (Envoy's log line: [time][thread id][level][logger] ...).
  { grep 'sections over' .run/envoy.log || echo "  (no sections report: fewer than one report's worth of requests)" >&2; } |
    sed -E 's/^[^]]*\]\[([0-9]+)\].*sections over ([0-9]+) requests: /\1 \2 /' |
    awk '{ last[$1] = $0 } END { for (t in last) print last[t] }' |
    while read -r _ n rest; do
      echo "  one worker, last $n requests:"
      for kv in $rest; do printf '    %-36s %s\n' "${kv%%=*}" "${kv#*=}"; done
    done
done
