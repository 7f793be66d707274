#!/usr/bin/env bash
# Instructions per PD request in Envoy, counted by valgrind's callgrind: call counts exact and
# totals within ±1 % from run to run, where wall and CPU time on this box vary by ±15 %.
#
#   envoy/callgrind.sh            # probe, floor, router; then the report
#   envoy/callgrind.sh router     # one target again (the report reads every .out present)
#   BASE_WASM=old.wasm envoy/callgrind.sh compare   # A/B: base-1 router-1 base-2 router-2
#
# Each target is Envoy (two workers) under callgrind with instrumentation off; after WARMUP
# requests (eight clients) it is switched on for REQUESTS requests (one client, closed loop,
# 2 KB chat bodies, no stream) on a 1P1D zero-time pd-sim, then dumped. Targets:
#   probe   filter/examples/hostcall_probe.rs: every host call a distinct number of times per
#           request (local reply). Envoy's binary is stripped; the report names its host
#           functions by those counts.
#   floor   filter/examples/pd_floor.rs, the PD-hop floor.
#   router  pd-router (release .wasm), default policies, on envoy/stack.sh with REFRESH_MS=1000
#           and pd-control scraping once (no new snapshot while counting), so that timers and
#           snapshot adoption, which run on wall time while valgrind slows requests ~40×,
#           stay a small share.
#   base    the same with the build BASE_WASM names (an older commit's .wasm, say).
#   noretry the router with `connect_retry` off (no stand-in pod named; see
#           docs/OPERATOR.md "Stand-in pods"): with FLEET naming a roleset of two decode
#           pods, `noretry-1 router-1 noretry-2 router-2` counts what naming one costs.
#   compare base and router alternated ROUNDS times (2), as base-N and router-N: within an
#           afternoon the totals of one build move by more than ±1 % (Envoy's own work, the
#           other workers' prefix-ring reads), so builds are compared in one alternated
#           sitting, and the report's "wasm code" line (±0.3 %) is the figure for our code.
# Environment: FLEET (a fleet file instead of one 1P1D roleset; model demo-llm, port 18000),
# REQUESTS (300), WARMUP (200), BODY_BYTES (2048), MEASURED_SEED (2: prompts the
# warm-up did not send; 1: its prompts again), OUT (target/callgrind),
# PD_WASM (another build of the filter for `router`), BASE_WASM and ROUNDS (above), CG_ARGS (more valgrind flags: with
# `--separate-threads=yes` each thread gets its own profile, `<target>.out.1-NN`, which
# `envoy/callgrind-report.py --suffix .out.1-NN` reads; thread 01 is Envoy's main thread and
# the largest the worker that served the client), AIBRIX_* for the filter. Needs valgrind
# (installed with apt-get when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-300}
WARMUP=${WARMUP:-200}
BODY_BYTES=${BODY_BYTES:-2048}
# Seed of the counted requests' prompts: 2 makes each one new to the prefix index (as in
# `make bench`, where every prompt is unique); 1 repeats the warm-up's prompts (known prefixes,
# the index's cheapest path, and the figures of sessions 28-29).
MEASURED_SEED=${MEASURED_SEED:-2}
OUT=${OUT:-target/callgrind}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
export ADMIN_PORT=9961 CONTROL_PORT=18161 SIM_ADMIN_PORT=18162
PORT=10761
FLOOR_PORT=10762 FLOOR_ADMIN=9962
targets=${*:-probe floor router}
if [ "$targets" = compare ]; then
  targets=$(for r in $(seq "${ROUNDS:-2}"); do echo "base-$r router-$r"; done)
fi

command -v valgrind >/dev/null || (apt-get update -qq && apt-get install -y -qq valgrind)
mkdir -p "$OUT"
cargo build --release --target wasm32-wasip1 -p pd-router-filter --example pd_floor \
  --example hostcall_probe
cargo build --release --target wasm32-wasip1 -p pd-router-filter
cargo build --profile native -p pd-control -p pd-sim
# shellcheck source=envoy/render.sh
source envoy/render.sh
hold_measure_lock callgrind.sh

if [ -n "${FLEET:-}" ]; then cp "$FLEET" "$OUT/fleet.yaml"; else envoy/fleets/pd-fleet.sh 1 > "$OUT/fleet.yaml"; fi
trap 'envoy/stack.sh down >/dev/null 2>&1 || true' EXIT
REFRESH_MS=1000 CONTROL_REFRESH_MS=600000 SIM_TIMING=zero SIM_ARGS="--side-channel-host pod" \
  envoy/stack.sh up "$OUT/fleet.yaml" 1 "$PORT" native > /dev/null
# The stack's Envoy makes way for the one under valgrind (same rendered configuration).
kill "$(cat .run/envoy.pid)" && rm -f .run/envoy.pid
while curl -sf "127.0.0.1:$ADMIN_PORT/ready" > /dev/null; do sleep 0.1; done

load() { # port requests clients seed
  "$TARGET/native/pd-load" --url "http://127.0.0.1:$1" --model demo-llm --workload fixed \
    --body-bytes "$BODY_BYTES" --rps 0 --clients "$3" --stream-ratio 0 --requests "$2" \
    --seed "$4" \
    --duration 600s || true # the probe's answers are not JSON: counted as errors
}

run() { # name config port admin
  local name=$1 config=$2 port=$3 admin=$4 pid i
  rm -f "$OUT/$name.out"*
  # shellcheck disable=SC2086 # CG_ARGS is a list of valgrind flags
  valgrind --tool=callgrind --instr-atstart=no --smc-check=all-non-file ${CG_ARGS:-} \
    --callgrind-out-file="$OUT/$name.out" .venv/envoy -c "$config" --concurrency 2 \
    --disable-hot-restart -l warn > "$OUT/$name.log" 2>&1 &
  pid=$!
  for i in $(seq 1200); do
    curl -sf "127.0.0.1:$admin/ready" > /dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$OUT/$name.log"; return 1; }
    sleep 0.1
  done
  if [ "$port" = "$PORT" ]; then # pd-router: every VM holds the first snapshot
    until [ "$(curl -s "127.0.0.1:$admin/stats?filter=^wasmcustom.pd_router_fleet_loaded_vms$" \
      | awk '{print $2}')" -ge 3 ] 2>/dev/null; do sleep 0.2; done
  fi
  # Eight connections warm both workers (V8 compiles a VM's code as it first runs, and a
  # worker catches up with the other's prefix events): the measured client may land on either.
  load "$port" "$WARMUP" 8 1 > "$OUT/$name.warmup"
  callgrind_control -i on "$pid" > /dev/null 2>&1
  load "$port" "$REQUESTS" 1 "$MEASURED_SEED" > "$OUT/$name.load"
  callgrind_control -d "$pid" > /dev/null 2>&1
  callgrind_control -i off "$pid" > /dev/null 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  grep -q "^status: 200=$REQUESTS\$" "$OUT/$name.load" || { echo "$name: not every request got 200:" >&2; cat "$OUT/$name.load" >&2; return 1; }
  echo "$name: $REQUESTS requests counted" >&2
}

for t in $targets; do
  case $t in
    probe | floor)
      wasm=$TARGET/wasm32-wasip1/release/examples/$([ "$t" = probe ] && echo hostcall_probe || echo pd_floor).wasm
      render_floor "$FLOOR_PORT" "$FLOOR_ADMIN" 127.0.40.1:18000 127.0.40.2:18000 "$wasm" > "$OUT/$t.yaml"
      run "$t" "$OUT/$t.yaml" "$FLOOR_PORT" "$FLOOR_ADMIN" ;;
    router | router-*) run "$t" .run/envoy.yaml "$PORT" "$ADMIN_PORT" ;;
    noretry | noretry-*)
      sed 's/"connect_retry":true,/"connect_retry":false,/' .run/envoy.yaml > "$OUT/noretry.yaml"
      run "$t" "$OUT/noretry.yaml" "$PORT" "$ADMIN_PORT" ;;
    base | base-*)
      [ -f "${BASE_WASM:-}" ] || { echo "base: set BASE_WASM to a built .wasm" >&2; exit 2; }
      sed -E "s#(code: \{local: \{filename: )\"[^\"]*\"#\1\"$(realpath "$BASE_WASM")\"#" \
        .run/envoy.yaml > "$OUT/base.yaml"
      run "$t" "$OUT/base.yaml" "$PORT" "$ADMIN_PORT" ;;
    *) echo "unknown target $t (probe, floor, router, base, noretry, compare)" >&2; exit 2 ;;
  esac
done
if compgen -G "$OUT/*.out.1" > /dev/null; then
  python3 envoy/callgrind-report.py --dir "$OUT" --requests "$REQUESTS"
else # --separate-threads=yes: one profile per thread
  echo "per-thread profiles in $OUT: envoy/callgrind-report.py --dir $OUT --suffix .out.1-NN"
fi
