#!/usr/bin/env bash
# Soak: pd-load against a local stack (envoy/stack.sh: pd-sim, pd-control, Envoy with the
# filter) for SOAK_SECONDS at SOAK_RPS, while pd-sim faults rotate through the pods every
# SOAK_FAULT_SECONDS (crash, status 500, slow, hang before headers; each cleared before the
# next), then reports:
#   - pd-load's summary, errors grouped by status and x-error-* header;
#   - Envoy and pd-control RSS after the warm-up and at the end (flat = under 5 % growth);
#   - the filter's ledger gauges and outstanding prefill legs once the load has drained
#     (all must read exactly 0).
# Exit status 1 when a ledger gauge stays non-zero or memory grew by 5 % or more.
#
# Environment (defaults): SOAK_SECONDS (600), SOAK_RPS (32: ~80 % of the demo fleet's
# measured capacity, docs/OPERATOR.md "Soak"), SOAK_FAULT_SECONDS (10), SOAK_WARMUP_SECONDS
# (20), FLEET (envoy/fleets/demo.yaml), MODEL (demo-llm), PORT (10000), PROFILE (native),
# and stack.sh's ADMIN_PORT CONTROL_PORT SIM_ADMIN_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."

SOAK_SECONDS=${SOAK_SECONDS:-600}
SOAK_RPS=${SOAK_RPS:-32}
SOAK_FAULT_SECONDS=${SOAK_FAULT_SECONDS:-10}
SOAK_WARMUP_SECONDS=${SOAK_WARMUP_SECONDS:-20}
FLEET=${FLEET:-envoy/fleets/demo.yaml}
MODEL=${MODEL:-demo-llm}
PORT=${PORT:-10000}
PROFILE=${PROFILE:-native}
export ADMIN_PORT=${ADMIN_PORT:-9901} CONTROL_PORT=${CONTROL_PORT:-18081} SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18082}
# The soak stack uses the token-load policies: their ledger is what must drain to 0.
export AIBRIX_PREFILL_SCORE_POLICY=${AIBRIX_PREFILL_SCORE_POLICY:-token_load}
export AIBRIX_DECODE_SCORE_POLICY=${AIBRIX_DECODE_SCORE_POLICY:-token_load}
RUN=.run
target=${CARGO_TARGET_DIR:-$PWD/target}
load_bin=$target/$PROFILE/pd-load
[ -x "$load_bin" ] || { echo "soak: $load_bin missing (make build-native)" >&2; exit 1; }
(( SOAK_SECONDS > SOAK_WARMUP_SECONDS )) || { echo "soak: SOAK_SECONDS must exceed the warm-up" >&2; exit 1; }

sim_admin=http://127.0.0.1:$SIM_ADMIN_PORT
admin=http://127.0.0.1:$ADMIN_PORT
load_pid=

cleanup() {
  [ -z "$load_pid" ] || kill "$load_pid" 2>/dev/null || true
  curl -s -X DELETE "$sim_admin/sim/faults" >/dev/null 2>&1 || true
  envoy/stack.sh down >/dev/null 2>&1 || true
}
trap cleanup EXIT

envoy/stack.sh down >/dev/null 2>&1 || true
envoy/stack.sh up "$FLEET" 1 "$PORT" "$PROFILE"

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$(cat "$RUN/$1.pid")/status"; }
# Sum of the filter's ledger gauges and outstanding legs, one `name value` line each.
ledger_lines() {
  curl -s "$admin/stats/prometheus" \
    | grep -E '^(pd_token_load_[a-z_]+|gateway_prefill_outstanding_requests)[{ ]' || true
}
ledger_nonzero() { ledger_lines | awk '$NF != 0 {n++} END {print n+0}'; }

pods=$(curl -s "http://127.0.0.1:$CONTROL_PORT/v1/snapshot.json" \
  | python3 -c 'import json,sys; print(" ".join(p["name"] for m in json.load(sys.stdin)["models"] for p in m["pods"] if p["ready"]))')
read -r -a pods <<< "$pods"
[ ${#pods[@]} -gt 0 ] || { echo "soak: no pods in the snapshot" >&2; exit 1; }

echo "soak: ${SOAK_SECONDS}s at ${SOAK_RPS} rps on ${#pods[@]} pods, a fault every ${SOAK_FAULT_SECONDS}s"
"$load_bin" --url "http://127.0.0.1:$PORT" --model "$MODEL" --rps "$SOAK_RPS" \
  --duration "${SOAK_SECONDS}s" --stream-ratio 0.5 --chat-ratio 0.5 --prompt-tokens 64..2048 \
  --max-tokens 16 --timeout 90s --json "$RUN/soak.json" > "$RUN/soak-load.txt" 2>&1 &
load_pid=$!

kinds=('{"kind":"crash"}' '{"kind":"status","status":500}' '{"kind":"slow","delay_ms":500}' '{"kind":"hang_before_headers"}')
start=$SECONDS
rss_envoy_start= rss_control_start=
faults=0 i=0
while kill -0 "$load_pid" 2>/dev/null; do
  if [ -z "$rss_envoy_start" ] && (( SECONDS - start >= SOAK_WARMUP_SECONDS )); then
    rss_envoy_start=$(rss_kb envoy) rss_control_start=$(rss_kb pd-control)
    echo "soak: after warm-up: envoy ${rss_envoy_start} kB, pd-control ${rss_control_start} kB"
  fi
  # Faults stop one period before the end so the last hang is released before pd-load stops.
  if (( SECONDS - start < SOAK_SECONDS - SOAK_FAULT_SECONDS )); then
    curl -s -X DELETE "$sim_admin/sim/faults" >/dev/null
    kind=${kinds[$((i % ${#kinds[@]}))]}
    pod=${pods[$(( (i * 7 + 3) % ${#pods[@]} ))]}
    spec=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["pod"]=sys.argv[2]; print(json.dumps(d))' "$kind" "$pod")
    if curl -sf -X POST -H 'content-type: application/json' -d "$spec" "$sim_admin/sim/faults" >/dev/null; then
      faults=$((faults + 1))
      echo "soak: t=$((SECONDS - start))s fault $spec"
    fi
    i=$((i + 1))
  else
    curl -s -X DELETE "$sim_admin/sim/faults" >/dev/null
  fi
  for _ in $(seq $((SOAK_FAULT_SECONDS * 10))); do
    kill -0 "$load_pid" 2>/dev/null || break
    sleep 0.1
  done
done
wait "$load_pid" || true
load_pid=
curl -s -X DELETE "$sim_admin/sim/faults" >/dev/null

# Once every request ended, the charges must be released: poll (bounded) for exact zeros.
for _ in $(seq 300); do
  [ "$(ledger_nonzero)" = 0 ] && break
  sleep 0.1
done
rss_envoy_end=$(rss_kb envoy) rss_control_end=$(rss_kb pd-control)
rss_envoy_start=${rss_envoy_start:-$rss_envoy_end} rss_control_start=${rss_control_start:-$rss_control_end}

echo
echo "== pd-load"
cat "$RUN/soak-load.txt"
echo
echo "== faults armed: $faults (rotation: crash, status 500, slow 500 ms, hang before headers)"
growth() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", (b - a) * 100 / a}'; }
ge=$(growth "$rss_envoy_start" "$rss_envoy_end")
gc=$(growth "$rss_control_start" "$rss_control_end")
echo "== memory (RSS, kB, after warm-up -> end)"
echo "envoy:      $rss_envoy_start -> $rss_envoy_end ($ge %)"
echo "pd-control: $rss_control_start -> $rss_control_end ($gc %)"
echo "== ledger after the run (must all be 0)"
ledger_lines | sort
status=0
if [ "$(ledger_nonzero)" != 0 ]; then echo "soak: FAIL: ledger not back to 0"; status=1; fi
for g in "$ge" "$gc"; do
  if awk -v g="$g" 'BEGIN {exit !(g >= 5)}'; then echo "soak: FAIL: memory grew by $g %"; status=1; fi
done
[ $status = 0 ] && echo "soak: PASS (ledger 0, memory flat)"
exit $status
