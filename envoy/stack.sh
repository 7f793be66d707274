#!/usr/bin/env bash
# Local stack: pd-sim (optional), pd-control and Envoy with the pd-router filter.
#   envoy/stack.sh up FLEET [SIM=1] [PORT=10000] [PROFILE=debug]
#   envoy/stack.sh down
# `up` returns once Envoy is ready and every worker has loaded the first fleet snapshot.
# State (pids, logs, rendered config) lives in .run/; `down` stops exactly what `up` started.
# Environment: ADMIN_PORT CONTROL_PORT SIM_ADMIN_PORT CONCURRENCY REFRESH_MS (the filter's poll
# period; pd-control's scrape period too unless CONTROL_REFRESH_MS is set), SIM_ARGS (extra
# pd-sim flags, e.g. its timing model), SIM_TIMING (`zero`: a pd-sim that answers at once, no
# prefill, decode or KV-transfer time, so what is measured is the router), CARGO_TARGET_DIR
# (where the binaries and the .wasm are; default ./target), PD_WASM (another build of the filter, e.g. the `sections` one), and any
# AIBRIX_* variable for the filter.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=envoy/render.sh
source envoy/render.sh
RUN=.run
ADMIN_PORT=${ADMIN_PORT:-9901}
CONTROL_PORT=${CONTROL_PORT:-18081}
SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18082}
CONCURRENCY=${CONCURRENCY:-2}
REFRESH_MS=${REFRESH_MS:-50}

die() { echo "stack: $*" >&2; exit 1; }

wait_for_line() { # file pattern seconds name
  local deadline=$((SECONDS + $3))
  until grep -q "$2" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "$4 did not start; see $RUN/$4.log"
    sleep 0.05
  done
}

start() { # name command...
  local name=$1; shift
  "$@" > "$RUN/$name.out" 2> "$RUN/$name.log" &
  echo $! > "$RUN/$name.pid"
}

up() {
  local fleet=${1:?usage: stack.sh up FLEET [SIM] [PORT] [PROFILE]} sim=${2:-1} port=${3:-10000} profile=${4:-debug}
  [ -f "$fleet" ] || die "no fleet file $fleet"
  [ ! -f "$RUN/envoy.pid" ] || die "a stack is already up (make down first)"
  local target=${CARGO_TARGET_DIR:-$PWD/target}
  local bin=$target/$profile wasm=${PD_WASM:-$target/wasm32-wasip1/release/pd_router_filter.wasm} envoy=.venv/envoy
  for f in "$bin/pd-control" "$bin/pd-sim" "$wasm" "$envoy"; do [ -e "$f" ] || die "$f missing (make build)"; done
  mkdir -p "$RUN"
  if [ "$sim" = 1 ]; then
    local timing=
    case ${SIM_TIMING:-} in
      zero) timing="--prefill-base-ms 0 --prefill-us-per-token 0 --decode-ms-per-token 0
              --kv-pull-base-ms 0 --kv-pull-us-per-token 0 --prefill-concurrency 0 --batch-slowdown 0" ;;
      '') ;;
      *) die "SIM_TIMING=$SIM_TIMING: only 'zero' is known" ;;
    esac
    # shellcheck disable=SC2086 # SIM_ARGS is a list of pd-sim flags
    start pd-sim "$bin/pd-sim" --fleet "$fleet" --admin "127.0.0.1:$SIM_ADMIN_PORT" $timing ${SIM_ARGS:-}
    wait_for_line "$RUN/pd-sim.out" "pd-sim: serving" 30 pd-sim
  fi
  # The drop-in's retrying cluster reads the endpoint file pd-control writes.
  local eds
  eds=$(realpath "$RUN")/eds
  seed_eds "$eds"
  start pd-control "$bin/pd-control" --fleet "$fleet" --listen "127.0.0.1:$CONTROL_PORT" --refresh-interval "${CONTROL_REFRESH_MS:-$REFRESH_MS}ms" \
    --eds-file "$eds/pd-pods.json"
  wait_for_line "$RUN/pd-control.out" "pd-control: listening" 30 pd-control
  sed -e "s#@LISTEN_ADDR@#127.0.0.1#; s#@LISTEN_PORT@#$port#; s#@ADMIN_PORT@#$ADMIN_PORT#" \
      -e "s#@WASM_PATH@#$(realpath "$wasm")#; s#@CONTROL_ADDR@#127.0.0.1#; s#@CONTROL_PORT@#$CONTROL_PORT#" \
      -e "s#@REFRESH_MS@#$REFRESH_MS#; s#@ACCESS_LOG@#$RUN/access.log#; s#@EDS_DIR@#$eds#g" envoy/envoy.yaml.tmpl > "$RUN/envoy.yaml"
  start envoy "$envoy" -c "$RUN/envoy.yaml" --concurrency "$CONCURRENCY" --disable-hot-restart \
      --log-path "$RUN/envoy.log" --file-flush-interval-msec 200 -l info
  local deadline=$((SECONDS + 30)) want=$((CONCURRENCY + 1))
  until [ "$(curl -s "127.0.0.1:$ADMIN_PORT/stats?filter=^wasmcustom.pd_router_fleet_loaded_vms$" | awk '{print $2}')" -ge "$want" ] 2>/dev/null; do
    kill -0 "$(cat "$RUN/envoy.pid")" 2>/dev/null || die "envoy exited; see $RUN/envoy.log"
    [ $SECONDS -lt $deadline ] || die "envoy did not load the fleet; see $RUN/envoy.log"
    sleep 0.05
  done
  echo "stack up: gateway http://127.0.0.1:$port  admin http://127.0.0.1:$ADMIN_PORT  pd-control http://127.0.0.1:$CONTROL_PORT$([ "$sim" = 1 ] && echo "  pd-sim admin http://127.0.0.1:$SIM_ADMIN_PORT")"
}

down() {
  local name pid
  for name in envoy pd-control pd-sim; do
    [ -f "$RUN/$name.pid" ] || continue
    pid=$(cat "$RUN/$name.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$RUN/$name.pid"
  done
  echo "stack down"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  *) die "usage: stack.sh up FLEET [SIM] [PORT] [PROFILE] | down" ;;
esac
