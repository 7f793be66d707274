#!/usr/bin/env bash
# Where a PD request's latency goes, from Envoy's own timestamps: pd-router and the PD-hop
# floor filter (filter/examples/pd_floor.rs, `make floor-wasm`) run side by side on one
# zero-time pd-sim, each with an access log of its request-phase durations
# (%COMMON_DURATION(...)%), under the same load (one request in flight by default),
# alternated ROUNDS times. Prints, per target, the median of each phase and pd-load's E2E p50,
# and what pd-router adds over the floor in each phase. The sections build
# (`make profile-sections`) says which callback the time is in; this says which part of the
# exchange it delays, whatever spends it (the filter, or Envoy working for it).
#
#   make build-native floor-wasm build && envoy/phases.sh [PD_LOAD_ARGS...]
# Environment: PD_WASM (another build of the filter), ENGINE (vllm, or sglang: both legs at
# once, the SGLang floor), ROUNDS (2), RPS (200), SECONDS_PER_RUN (8), BODY_BYTES (2048),
# PORT (10761; the floor takes PORT+10), ADMIN_PORT (9981; +10), PROFILE (native), PD_REFRESH_MS
# (pd-router's timer period, 50).
set -euo pipefail
cd "$(dirname "$0")/.."
source envoy/render.sh
hold_measure_lock phases.sh
export ADMIN_PORT=${ADMIN_PORT:-9981} CONTROL_PORT=${CONTROL_PORT:-18181}
export SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18182}
export SIM_TIMING=zero
PORT=${PORT:-10761}
PROFILE=${PROFILE:-native}
ENGINE=${ENGINE:-vllm}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
WASM=${PD_WASM:-$TARGET/wasm32-wasip1/release/pd_router_filter.wasm}
FLOOR=$TARGET/wasm32-wasip1/release/examples/pd_floor.wasm
for f in "$WASM" "$FLOOR" "$TARGET/$PROFILE/pd-load" .venv/envoy; do
  [ -e "$f" ] || { echo "phases: $f missing (make build-native floor-wasm build)" >&2; exit 1; }
done
# envoy/fleets/demo.yaml: roleset group-0 as pd-sim serves it (SGLang: its default bootstrap
# port, the demo fleet names none).
POD_PORT=18000 PREFILL=127.0.10.1:18000 DECODE=127.0.10.2:18000 BOOT_PORT=
work=$(mktemp -d)
fleet=envoy/fleets/demo.yaml
case $ENGINE in
  vllm) ;;
  sglang) sed 's/engine: vllm/engine: sglang/' envoy/fleets/demo.yaml > "$work/fleet.yaml"
          fleet=$work/fleet.yaml BOOT_PORT=8998 ;;
  *) echo "phases: ENGINE=$ENGINE: vllm or sglang" >&2; exit 2 ;;
esac
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  envoy/stack.sh down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# Stream-info timestamps of the client's stream, whose upstream is the decode leg: received
# (DS_RX), decode leg sent (US_TX), decode answer received (US_RX), answer sent (DS_TX).
PHASES="DS_RX_BEG:DS_RX_END DS_RX_END:US_TX_BEG US_TX_BEG:US_TX_END US_TX_END:US_RX_BEG US_RX_BEG:US_RX_END US_RX_END:DS_TX_END DS_RX_BEG:DS_TX_END"
format="PHASES"
for p in $PHASES; do format+=" %COMMON_DURATION($p:us)%"; done
# An Envoy config from the template, logging the phases to $2.
with_phase_log() { # config-in log-path
  sed -E "s#path: \"[^\"]*\"#path: \"$2\"#; s#inline_string: \".*\"#inline_string: \"$format\\\\n\"#" "$1"
}

envoy/stack.sh up "$fleet" 1 "$PORT" "$PROFILE" >/dev/null
# pd-router beside the stack's own Envoy (which stays idle), on the same pd-control.
sed -e "s#@LISTEN_ADDR@#127.0.0.1#; s#@LISTEN_PORT@#$((PORT + 1))#; s#@ADMIN_PORT@#$((ADMIN_PORT + 1))#" \
  -e "s#@WASM_PATH@#$(realpath "$WASM")#; s#@CONTROL_ADDR@#127.0.0.1#; s#@CONTROL_PORT@#$CONTROL_PORT#" \
  -e "s#@REFRESH_MS@#${PD_REFRESH_MS:-50}#; s#@ACCESS_LOG@#/dev/null#; s#@EDS_DIR@#$(realpath .run/eds)#g" \
  envoy/envoy.yaml.tmpl > "$work/pd.tmpl.yaml"
with_phase_log "$work/pd.tmpl.yaml" "$work/pd-router.log" > "$work/pd-router.yaml"
render_floor $((PORT + 10)) $((ADMIN_PORT + 10)) "$PREFILL" "$DECODE" "$FLOOR" $BOOT_PORT > "$work/floor.tmpl.yaml"
with_phase_log "$work/floor.tmpl.yaml" "$work/floor.log" > "$work/floor.yaml"

start_envoy() { # name admin-port
  start_envoy_beside "$work/$1.yaml" "$work/$1.envoy.log" "$2"
  pids+=("$ENVOY_PID")
}
start_envoy pd-router $((ADMIN_PORT + 1))
start_envoy floor $((ADMIN_PORT + 10))
# Every pd-router worker routes on the fleet before anything is timed.
until [ "$(curl -s "127.0.0.1:$((ADMIN_PORT + 1))/stats?filter=^wasmcustom.pd_router_fleet_loaded_vms$" | awk '{print $2}')" -ge 3 ] 2>/dev/null; do
  sleep 0.1
done

load() { # port duration json pd-load-args...
  "$TARGET/$PROFILE/pd-load" --url "http://127.0.0.1:$1" --model demo-llm \
    --rps "${RPS:-200}" --clients 1 --arrival fixed --concurrency-limit 1 --duration "$2" \
    --workload fixed --body-bytes "${BODY_BYTES:-2048}" --stream-ratio 0 --max-tokens 4 \
    --routing-strategy pd --json "$3" "${@:4}" > /dev/null
}
targets=("pd-router $((PORT + 1))" "floor $((PORT + 10))")
for t in "${targets[@]}"; do
  read -r name port <<< "$t"
  load "$port" 3s "$work/warmup.json" "$@"
done
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for t in "${targets[@]}"; do
    read -r name port <<< "$t"
    load "$port" "${SECONDS_PER_RUN:-8}s" "$work/$name.$round.json" "$@"
  done
done
# Stopping Envoy flushes its access log.
for p in "${pids[@]}"; do kill "$p"; wait "$p" 2>/dev/null || true; done
pids=()
# The measured requests are the last lines of each log (the warm-up's come first).
python3 - "$work" "${ROUNDS:-2}" $PHASES <<'PY'
import json, statistics, sys
work, rounds, phases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
names = {
    "DS_RX_BEG:DS_RX_END": "request received (headers callback)",
    "DS_RX_END:US_TX_BEG": "body end -> decode leg sent",
    "US_TX_BEG:US_TX_END": "decode leg sending",
    "US_TX_END:US_RX_BEG": "decode pod to first byte",
    "US_RX_BEG:US_RX_END": "decode answer received",
    "US_RX_END:DS_TX_END": "answer end -> sent to client",
    "DS_RX_BEG:DS_TX_END": "whole exchange in Envoy",
}
med = {}
for target in ("pd-router", "floor"):
    tokens = open(f"{work}/{target}.log").read().split()
    rows, i = [], 0
    while i < len(tokens):
        if tokens[i] == "PHASES":
            rows.append(tokens[i + 1 : i + 1 + len(phases)])
            i += 1 + len(phases)
        else:
            i += 1
    e2e = [json.load(open(f"{work}/{target}.{r}.json"))["summary"]["e2e_ms"]["p50"] for r in range(1, rounds + 1)]
    measured = sum(json.load(open(f"{work}/{target}.{r}.json"))["summary"]["requests"] for r in range(1, rounds + 1))
    rows = rows[-measured:] if measured else rows
    med[target] = [statistics.median([int(r[k]) for r in rows if r[k].isdigit()] or [0]) for k in range(len(phases))]
    print(f"{target}: {len(rows)} requests timed, pd-load E2E p50 " + " / ".join(f"{x:.3f}" for x in e2e) + " ms")
print()
print(f"{'phase (median µs)':42} {'pd-router':>10} {'floor':>8} {'added':>8}")
for k, p in enumerate(phases):
    a, b = med["pd-router"][k], med["floor"][k]
    print(f"{names.get(p, p):42} {a:>10.0f} {b:>8.0f} {a - b:>+8.0f}")
PY
