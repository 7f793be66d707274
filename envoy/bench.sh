#!/usr/bin/env bash
# make bench / make bench-quick: pd-router against a direct request, plain Envoy and the two Rust
# PD routers (sglang-router, vllm-router) on the same pd-sim pods, then routing-policy quality
# on a simulated cluster. Results: $BENCH_DIR/<scenario>/<target>.<rep>.json (pd-load reports),
# then pd-bench-report prints the tables and draws the SVG charts into $BENCH_DIR.
#
#   envoy/bench.sh [full|quick] [overhead|policy|stalls|all]
#
# Everything binds 127.0.0.1 / 127.0.33-36.x on ports 23000-24999. Targets alternate A B A B
# (REPS rounds of every target in turn) so machine drift spreads over all of them.
# Environment: BENCH_DIR (target/bench), CARGO_TARGET_DIR, REPS, SECONDS_PER_RUN, CLIENTS_MAX,
# BODIES ("2048 32768 262144"), OVERHEAD_TARGETS (names from the table in docs/BENCHMARKS.md),
# PD_WASM (another build of the filter, for A/B runs), ENVOY_WORKERS (2: every Envoy's --concurrency),
# POLICY_SECONDS, POLICY_PAIRS ("prefill:decode ..."), POLICY_LOADS ("60 90"), POLICY_PEERS (1:
# also run sglang-router and vllm-router in the policy phase, 0: pd-router pairs only),
# POLICY_REPS (1: rounds of the policy targets, round r on trace r; the report then gives the
# policy targets run by run), POLICY_CAPACITY_PAIR (least_request:least_request: the pair whose
# closed-loop throughput the loads are a share of), VENV (.venv). AIBRIX_* variables reach
# pd-router (AIBRIX_TOKEN_LOAD_REQUEST_COST also the report's dispatch bound).
set -euo pipefail
cd "$(dirname "$0")/.."
source envoy/render.sh
hold_measure_lock bench.sh
MODE=${1:-full}
PHASES=${2:-all}
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
BIN=$TARGET_DIR/native
WASM=$(realpath "${PD_WASM:-$TARGET_DIR/wasm32-wasip1/release/pd_router_filter.wasm}")
# The PD-hop floor: a filter that sends each request through one fixed prefill and decode pod
# with no routing work (filter/examples/pd_floor.rs).
FLOOR_WASM=$TARGET_DIR/wasm32-wasip1/release/examples/pd_floor.wasm
VENV=${VENV:-.venv}
OUT=${BENCH_DIR:-target/bench}
RUN=$OUT/run
ENVOY=$VENV/envoy
MODEL=bench-llm
POD_PORT=23001
BOOT_PORT=23998

if [ "$MODE" = quick ]; then
  REPS=${REPS:-1} SECS=${SECONDS_PER_RUN:-3} POLICY_SECS=${POLICY_SECONDS:-8}
  BODIES=${BODIES:-"2048 32768"}
  PAIRS=${POLICY_PAIRS:-"least_request:least_request token_load:least_request prefix_cache:load_balancing hybrid_cache_load:load_balancing"}
  LOADS=${POLICY_LOADS:-"90"}
else
  REPS=${REPS:-2} SECS=${SECONDS_PER_RUN:-6} POLICY_SECS=${POLICY_SECONDS:-15}
  BODIES=${BODIES:-"2048 32768 262144"}
  PAIRS=${POLICY_PAIRS:-}
  if [ -z "$PAIRS" ]; then
    for p in prefix_cache least_request conductor token_load hybrid_cache_load; do
      for d in load_balancing least_request conductor token_load; do PAIRS="$PAIRS $p:$d"; done
    done
  fi
  LOADS=${POLICY_LOADS:-"60 90"}
fi
CLIENTS_MAX=${CLIENTS_MAX:-32}
ENVOY_WORKERS=${ENVOY_WORKERS:-2}
POLICY_PEERS=${POLICY_PEERS:-1}
POLICY_REPS=${POLICY_REPS:-1}

for f in "$BIN/pd-sim" "$BIN/pd-control" "$BIN/pd-load" "$BIN/pd-bench-report" "$WASM" "$FLOOR_WASM" "$ENVOY" \
         "$VENV/bin/sglang-router" "$VENV/bin/vllm-router"; do
  [ -e "$f" ] || { echo "bench: $f missing (make bench-setup build-native)" >&2; exit 1; }
done
mkdir -p "$RUN"
PIDS=()

log() { echo "[bench $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }

# Every descendant of a pid, then the pid (the sglang launcher forks the router).
tree() { # pid
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; done
  echo "$1"
}

stop() { # pid: the process and its descendants, each waited for (ports free again)
  local p all
  all=$(tree "$1")
  for p in $all; do kill "$p" 2>/dev/null || true; done
  for p in $all; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$p" 2>/dev/null || true
  done
}

cleanup() {
  local p
  for p in "${PIDS[@]}"; do stop "$p"; done
}
trap cleanup EXIT

start() { # name command... ; sets $LAST_PID
  local name=$1; shift
  "$@" > "$RUN/$name.out" 2> "$RUN/$name.log" &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# Ports 23000-24999 lie below Linux's ephemeral range (32768+), so no outgoing connection takes
# one (with 33xxx, vllm-router once failed to bind for a whole retry window). A server that
# still fails to bind (say, a previous run's socket) is started again, every 5 s for up to 80 s.
start_server() { # seconds name ready-command -- command...
  local secs=$1 name=$2 ready=() attempt deadline
  shift 2
  while [ "$1" != -- ]; do ready+=("$1"); shift; done
  shift
  for attempt in $(seq 16); do
    start "$name" "$@"
    deadline=$((SECONDS + secs))
    until "${ready[@]}" >/dev/null 2>&1; do
      if ! kill -0 "$LAST_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
        stop "$LAST_PID"
        if grep -q -i "address already in use" "$RUN/$name.log" "$RUN/$name.out" 2>/dev/null && [ "$attempt" -lt 16 ]; then
          log "$name: port taken, retrying"; sleep 5; continue 2
        fi
        echo "bench: $name did not come up (see $RUN)" >&2; exit 1
      fi
      sleep 0.1
    done
    return 0
  done
}

# --- fleets -----------------------------------------------------------------------------------
pod() { # name ip role roleset engine [config-json]
  cat <<EOF
- apiVersion: v1
  kind: Pod
  metadata:
    name: $1
    namespace: bench
    labels: {model.aibrix.ai/name: $MODEL, model.aibrix.ai/port: "$POD_PORT", model.aibrix.ai/engine: $5, role-name: $3, roleset-name: $4}
    annotations:
      model.aibrix.ai/sglang-bootstrap-port: "$BOOT_PORT"
      model.aibrix.ai/config: '${6:-{"profiles": {"default": {"routingStrategy": "pd"}}}}'
  status:
    podIP: $2
    conditions: [{type: Ready, status: "True"}]
EOF
}
fleet_head() { printf 'apiVersion: v1\nkind: List\nitems:\n'; }
rolesets() { # count net engine prefix
  local i
  for ((i = 0; i < $1; i++)); do
    pod "$4-prefill-$i" "127.0.$2.$((2 * i + 1))" prefill "$4-rs-$i" "$3"
    pod "$4-decode-$i" "127.0.$2.$((2 * i + 2))" decode "$4-rs-$i" "$3"
  done
}
combined() { # count net engine prefix first-host
  local i
  for ((i = 0; i < $1; i++)); do
    pod "$4-standard-$i" "127.0.$2.$(($5 + i))" standard standard "$3" \
      '{"profiles": {"default": {"routingStrategy": "pd", "routingConfig": {"combined": true}}}}'
  done
}
urls() { # count net role(prefill|decode) [bootstrap]
  local i off
  off=$([ "$3" = prefill ] && echo 1 || echo 2)
  for ((i = 0; i < $1; i++)); do
    echo -n " --$3 http://127.0.$2.$((2 * i + off)):$POD_PORT${4:+ $4}"
  done
}

# --- components -------------------------------------------------------------------------------
ZERO="--prefill-base-ms 0 --prefill-us-per-token 0 --decode-ms-per-token 0 --kv-pull-base-ms 0 --kv-pull-us-per-token 0 --prefill-concurrency 0 --batch-slowdown 0"

start_sim() { # name fleet admin-port args...
  local name=$1 fleet=$2 admin=$3; shift 3
  start_server 30 "$name" grep -q "pd-sim: serving" "$RUN/$name.out" -- \
    "$BIN/pd-sim" --fleet "$fleet" --admin "127.0.0.1:$admin" --side-channel-host pod "$@"
  SIM_PID=$LAST_PID
}

start_control() { # name fleet port
  seed_eds "$RUN/eds-$3"
  start_server 30 "$1" grep -q "pd-control: listening" "$RUN/$1.out" -- \
    "$BIN/pd-control" --fleet "$2" --listen "127.0.0.1:$3" --refresh-interval 50ms \
    --eds-file "$RUN/eds-$3/pd-pods.json"
}

loaded_vms() { # admin-port concurrency
  local n
  n=$(curl -s "127.0.0.1:$1/stats?filter=^wasmcustom.pd_router_fleet_loaded_vms$" | awk '{print $2}')
  [ "${n:-0}" -ge $(($2 + 1)) ]
}

start_envoy_pd() { # name listen admin control-port [env...]
  local name=$1 port=$2 admin=$3 control=$4; shift 4
  sed -e "s#@LISTEN_ADDR@#127.0.0.1#; s#@LISTEN_PORT@#$port#; s#@ADMIN_PORT@#$admin#" \
      -e "s#@WASM_PATH@#$WASM#; s#@CONTROL_ADDR@#127.0.0.1#; s#@CONTROL_PORT@#$control#" \
      -e "s#@REFRESH_MS@#50#; s#@ACCESS_LOG@#/dev/null#; s#@EDS_DIR@#$(realpath "$RUN/eds-$control")#g" \
      envoy/envoy.yaml.tmpl > "$RUN/$name.yaml"
  start_server 30 "$name" loaded_vms "$admin" "$ENVOY_WORKERS" -- env "$@" "$ENVOY" -c "$RUN/$name.yaml" \
    --concurrency "$ENVOY_WORKERS" --disable-hot-restart -l warn
  ENVOY_PID=$LAST_PID
}

start_envoy_floor() { # name listen admin prefill-ip decode-ip [sglang-bootstrap-port]
  render_floor "$2" "$3" "$4:$POD_PORT" "$5:$POD_PORT" "$FLOOR_WASM" "${6:-}" > "$RUN/$1.yaml"
  grep -q '"prefill"' "$RUN/$1.yaml" || { echo "bench: cannot configure the floor filter" >&2; exit 1; }
  start_server 30 "$1" curl -sf "127.0.0.1:$3/ready" -- "$ENVOY" -c "$RUN/$1.yaml" --concurrency "$ENVOY_WORKERS" \
    --disable-hot-restart -l warn
}

start_envoy_plain() { # name listen admin upstream-ip
  render_plain "$2" "$3" "$4" "$POD_PORT" > "$RUN/$1.yaml"
  start_server 30 "$1" curl -sf "127.0.0.1:$3/ready" -- "$ENVOY" -c "$RUN/$1.yaml" --concurrency "$ENVOY_WORKERS" \
    --disable-hot-restart -l warn
}

# A local tokenizer directory so neither peer ever looks a model up on the network.
tokenizer() {
  mkdir -p "$RUN/tok"
  cat > "$RUN/tok/tokenizer.json" <<'EOF'
{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":0,"content":"[UNK]","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1},"unk_token":"[UNK]"}}
EOF
  echo '{"model_type":"llama","architectures":["LlamaForCausalLM"]}' > "$RUN/tok/config.json"
  echo '{"model_max_length":1000000,"unk_token":"[UNK]"}' > "$RUN/tok/tokenizer_config.json"
}

serves() { # url
  curl -sf -m 5 -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}" \
    "$1/v1/chat/completions"
}

start_sglang() { # name port net count prefill-policy decode-policy
  local name=$1 port=$2 net=$3 n=$4
  # shellcheck disable=SC2046 # urls expands to flag/value pairs
  start_server 60 "$name" serves "http://127.0.0.1:$port" -- \
    env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/sglang-router" launch \
    --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port $((port + 1)) \
    --pd-disaggregation $(urls "$n" "$net" prefill "$BOOT_PORT") $(urls "$n" "$net" decode) \
    --prefill-policy "$5" --decode-policy "$6" --model-path "$RUN/tok" --tokenizer-path "$RUN/tok" \
    --worker-startup-timeout-secs 30 --worker-startup-check-interval 1 --log-level warn
  PEER_PID=$LAST_PID
}

start_vllm() { # name port net count policy
  local name=$1 port=$2 net=$3 n=$4
  # shellcheck disable=SC2046
  start_server 60 "$name" serves "http://127.0.0.1:$port" -- \
    env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/vllm-router" \
    --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port $((port + 1)) \
    --vllm-pd-disaggregation $(urls "$n" "$net" prefill) $(urls "$n" "$net" decode) \
    --policy "$5" --log-level warning
  PEER_PID=$LAST_PID
}

pids_of() { tree "$1" | sed 's/^/--cpu-pid /' | tr '\n' ' '; }
# Every live process this script started (pd-load leaves the target's own out): their CPU is
# the sitting's, so pd-load counts only strangers' as what the rest of the box took.
side_pids() {
  local p
  for p in "${PIDS[@]}"; do if kill -0 "$p" 2>/dev/null; then tree "$p"; fi; done | sed 's/^/--side-pid /' | tr '\n' ' '
}

load() { # scenario target rep url cpu-pid args...
  local scenario=$1 target=$2 rep=$3 url=$4 cpu=$5; shift 5
  mkdir -p "$OUT/$scenario"
  # shellcheck disable=SC2046
  "$BIN/pd-load" --url "$url" --model "$MODEL" --seed "$rep" $([ -n "$cpu" ] && pids_of "$cpu") $(side_pids) \
    --json "$OUT/$scenario/$target.$rep.json" "$@" > "$RUN/last-load.txt" 2>&1 || true
  log "$scenario $target #$rep: $(grep -E '^pd-load:' "$RUN/last-load.txt" | head -1)"
}

# A phase's run replaces that phase's results (and charts): the report reads every result file
# under $OUT, so an earlier run's targets, reps or bodies would otherwise show beside this one's.
clear_results() { # name patterns...
  local p
  for p in "$@"; do find "$OUT" -maxdepth 1 -name "$p" -exec rm -rf {} +; done
}

# --- 1. overhead ------------------------------------------------------------------------------
overhead() {
  log "overhead: pods, Envoy (plain, pd-router 1P1D and 4P4D), sglang-router, vllm-router"
  clear_results 'lat1-*' 'lat1i-*' 'lat16-*' 'stream16-*' 'max-*'
  # The direct and plain-Envoy baselines go to a standard (combined) pod: a vLLM decode pod
  # refuses a request that carries no kv_transfer_params.
  { fleet_head; rolesets 4 33 vllm v; combined 1 33 vllm v 9; rolesets 4 34 sglang s; } > "$RUN/pods-overhead.yaml"
  { fleet_head; rolesets 1 33 vllm v; } > "$RUN/fleet-1p1d.yaml"
  { fleet_head; rolesets 4 33 vllm v; } > "$RUN/fleet-4p4d.yaml"
  # The SGLang roleset sglang-router uses: the same protocol (both legs at once) for both.
  { fleet_head; rolesets 1 34 sglang s; } > "$RUN/fleet-1p1d-sglang.yaml"
  # shellcheck disable=SC2086
  start_sim sim-overhead "$RUN/pods-overhead.yaml" 23090 $ZERO
  start_control control-1p1d "$RUN/fleet-1p1d.yaml" 23101
  start_control control-4p4d "$RUN/fleet-4p4d.yaml" 23111
  start_control control-1p1d-sglang "$RUN/fleet-1p1d-sglang.yaml" 23116
  start_envoy_pd envoy-1p1d 23100 23102 23101; local e1=$ENVOY_PID
  start_envoy_pd envoy-4p4d 23110 23112 23111; local e4=$ENVOY_PID
  # The same 1P1D stack with policies that never hash the prompt: what the prefix index costs.
  start_envoy_pd envoy-1p1d-lr 23105 23107 23101 \
    AIBRIX_PREFILL_SCORE_POLICY=least_request AIBRIX_DECODE_SCORE_POLICY=least_request
  local elr=$ENVOY_PID
  start_envoy_pd envoy-1p1d-sglang 23115 23117 23116; local esg=$ENVOY_PID
  start_envoy_plain envoy-plain 23120 23122 127.0.33.9; local ep=$LAST_PID
  start_envoy_floor envoy-floor 23125 23127 127.0.33.1 127.0.33.2; local ef=$LAST_PID
  start_envoy_floor envoy-floor-sglang 23128 23129 127.0.34.1 127.0.34.2 "$BOOT_PORT"
  local efs=$LAST_PID
  tokenizer
  start_sglang sglang-1p1d 23130 34 1 round_robin round_robin; local sg=$PEER_PID
  start_vllm vllm-1p1d 23140 33 1 round_robin; local vl=$PEER_PID
  # target name, URL, process whose CPU counts
  local targets=("direct http://127.0.33.9:$POD_PORT -" "envoy-plain http://127.0.0.1:23120 $ep"
    "pd-floor-1p1d http://127.0.0.1:23125 $ef" "pd-floor-1p1d-sglang http://127.0.0.1:23128 $efs"
    "pd-router-1p1d http://127.0.0.1:23100 $e1" "pd-router-1p1d-lr http://127.0.0.1:23105 $elr"
    "pd-router-4p4d http://127.0.0.1:23110 $e4" "pd-router-1p1d-sglang http://127.0.0.1:23115 $esg"
    "sglang-router http://127.0.0.1:23130 $sg" "vllm-router http://127.0.0.1:23140 $vl")
  local t name url cpu rep bytes common
  if [ -n "${OVERHEAD_TARGETS:-}" ]; then # e.g. "direct pd-router-1p1d sglang-router"
    local keep=()
    for t in "${targets[@]}"; do
      [[ " $OVERHEAD_TARGETS " == *" ${t%% *} "* ]] && keep+=("$t")
    done
    targets=("${keep[@]}")
  fi
  for t in "${targets[@]}"; do # warm-up: connections, VMs, JIT
    read -r name url cpu <<< "$t"
    "$BIN/pd-load" --url "$url" --model "$MODEL" --rps 0 --clients 4 --requests 400 \
      --workload fixed --body-bytes 2048 --stream-ratio 0 > /dev/null 2>&1 || true
  done
  common="--workload fixed --stream-ratio 0 --max-tokens 4 --duration ${SECS}s --timeout 20s"
  # lat1i-2k: the 1-in-flight latency again, every target in one run, dealt request by
  # request (pd-load --target, sim/src/interleave.rs): one request at a time, 200 a second in
  # all, so each target's distribution comes from the same moments of the box (run by run,
  # the p50 of one target moves by 2x here). No CPU figure: see lat1-2k for that.
  local dealt=()
  for t in "${targets[@]}"; do
    read -r name url cpu <<< "$t"
    dealt+=(--target "$name=$url")
  done
  for ((rep = 1; rep <= REPS; rep++)); do
    mkdir -p "$OUT/lat1i-2k"
    # shellcheck disable=SC2046
    "$BIN/pd-load" --model "$MODEL" --seed "$rep" "${dealt[@]}" --json-dir "$OUT/lat1i-2k" $(side_pids) \
      --workload fixed --stream-ratio 0 --max-tokens 4 --timeout 20s --body-bytes 2048 \
      --duration "$((SECS * ${#targets[@]}))s" --rps 200 --arrival fixed --concurrency-limit 1 \
      > "$RUN/last-load.txt" 2>&1 || true
    log "lat1i-2k #$rep: $(grep -c '^\[' "$RUN/last-load.txt") targets dealt one run"
    # Every other round in reverse (A B C, C B A, ...): with a fixed order a drift of the box
    # over the sitting would favour the targets run first in every round.
    local order=("${targets[@]}") i
    if ((rep % 2 == 0)); then
      order=()
      for ((i = ${#targets[@]} - 1; i >= 0; i--)); do order+=("${targets[$i]}"); done
    fi
    for t in "${order[@]}"; do
      read -r name url cpu <<< "$t"
      [ "$cpu" = - ] && cpu=
      # shellcheck disable=SC2086
      load lat1-2k "$name" "$rep" "$url" "$cpu" $common --body-bytes 2048 --rps 200 --arrival fixed --concurrency-limit 1
      # shellcheck disable=SC2086
      load lat16-2k "$name" "$rep" "$url" "$cpu" $common --body-bytes 2048 --rps 500 --concurrency-limit 16
      # The floors send the client's body as the prefill leg with only the protocol's fields
      # added (no stream or max_tokens rewrite), and a streamed vLLM prefill answer carries no
      # kv_transfer_params to copy: they have no figure for streams.
      # shellcheck disable=SC2086
      [[ "$name" = pd-floor-* ]] ||
        load stream16-2k "$name" "$rep" "$url" "$cpu" --workload fixed --stream-ratio 1 --max-tokens 32 \
          --duration ${SECS}s --timeout 20s --body-bytes 2048 --rps 200 --concurrency-limit 16
      for bytes in $BODIES; do
        local clients=$CLIENTS_MAX
        [ "$bytes" -gt 100000 ] && clients=8
        # shellcheck disable=SC2086
        load "max-$((bytes / 1024))k" "$name" "$rep" "$url" "$cpu" $common --body-bytes "$bytes" --rps 0 --clients "$clients"
      done
    done
  done
  local p
  for p in "$sg" "$vl" "$ep" "$ef" "$efs" "$e4" "$elr" "$esg" "$e1"; do stop "$p"; done
  cleanup; PIDS=()
}

# --- 3. policy quality ------------------------------------------------------------------------
# 4 rolesets + 2 combined pods with pd-sim's default timing (prefill 2 ms + 20 us/token, one
# prefill at a time per pod, decode 2 ms/token with batch slowdown) under the mixed trace.
# Every run starts from cold caches: pd-sim and the router are restarted for each.
POLICY_SIM="--kv-capacity-tokens 30000"
MIXED="--workload mixed --mixed-entries 4000 --stream-ratio 1 --max-tokens 16 --timeout 30s"

policy_run() { # scenario target rps rep url-kind policy-args...
  local scenario=$1 target=$2 rps=$3 rep=$4 kind=$5; shift 5
  # shellcheck disable=SC2086
  start_sim sim-policy "$RUN/pods-policy.yaml" 23091 $POLICY_SIM
  local sim=$SIM_PID router url
  case $kind in
    pd) start_envoy_pd envoy-policy 23150 23152 23151 \
          "AIBRIX_PREFILL_SCORE_POLICY=$1" "AIBRIX_DECODE_SCORE_POLICY=$2"
        router=$ENVOY_PID url=http://127.0.0.1:23150 ;;
    sglang) start_sglang sglang-policy 23160 36 4 "$1" "$2"; router=$PEER_PID url=http://127.0.0.1:23160 ;;
    vllm) start_vllm vllm-policy 23170 35 4 "$1"; router=$PEER_PID url=http://127.0.0.1:23170 ;;
  esac
  local args=(--rps "$rps" --concurrency-limit 2048 --duration "${POLICY_SECS}s" --sim-admin http://127.0.0.1:23091)
  [ "$rps" = 0 ] && args=(--rps 0 --clients 48 --duration "${POLICY_SECS}s" --sim-admin http://127.0.0.1:23091)
  # shellcheck disable=SC2086
  load "$scenario" "$target" "$rep" "$url" "$router" $MIXED "${args[@]}"
  stop "$router"; stop "$sim"
}

policy() {
  log "policy: 4 rolesets + 2 combined pods (vLLM) and 4 rolesets (SGLang), mixed trace"
  clear_results 'policy-*'
  { fleet_head; rolesets 4 35 vllm pv; combined 2 35 vllm pv 9; rolesets 4 36 sglang ps; } > "$RUN/pods-policy.yaml"
  { fleet_head; rolesets 4 35 vllm pv; combined 2 35 vllm pv 9; } > "$RUN/fleet-policy.yaml"
  start_control control-policy "$RUN/fleet-policy.yaml" 23151
  tokenizer
  # Capacity is measured under least_request on both sides, the token_load target's baseline:
  # under prefix_cache (the default until session 35) the cache hits raise it by ≈ 8 %, so
  # "90 %" was ≈ 97 % of what the cache-blind policies sustain and every one of them queued
  # without bound (TTFT p50 140-175 ms, rising and falling with the trace's rate).
  local cap_pair=${POLICY_CAPACITY_PAIR:-least_request:least_request}
  policy_run policy-capacity pd-router 0 1 pd "${cap_pair%%:*}" "${cap_pair##*:}"
  local cap
  cap=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['completed_rps'])" \
    "$OUT/policy-capacity/pd-router.1.json")
  log "capacity (closed loop, 48 clients, ${cap_pair/:/ + }): $cap rps"
  local load rps pair rep
  for load in $LOADS; do
    rps=$(python3 -c "print(round($cap * $load / 100, 1))")
    # Repetition r runs every target on trace r (pd-load's seed), targets alternated, so the
    # report can compare two policies run by run on the same trace.
    for rep in $(seq 1 "$POLICY_REPS"); do
      for pair in $PAIRS; do
        policy_run "policy-$load" "${pair/:/+}" "$rps" "$rep" pd "${pair%%:*}" "${pair##*:}"
      done
      if [ "$POLICY_PEERS" = 1 ]; then
        policy_run "policy-$load" sglang-cache_aware "$rps" "$rep" sglang cache_aware power_of_two
        policy_run "policy-$load" vllm-router "$rps" "$rep" vllm round_robin
      fi
    done
  done
  cleanup; PIDS=()
}

# --- 4. stalls --------------------------------------------------------------------------------
# The target "streamed responses show no stalls (p99 of time between chunks at the gateway ≈ the
# engine's)" needs an engine that has a gap of its own: the overhead phase's zero-time engine
# sends a whole answer in about one read. Here every pod takes 2 ms per token and nothing else
# (no prefill time, no batch slowdown), so a stream's chunks come 2 ms apart at the engine, and
# every target is dealt the same moments request by request (one run, pd-load --target): what a
# router adds to the longest gap of a stream, or to its time per token, is its own.
STALL_SIM="--prefill-base-ms 0 --prefill-us-per-token 0 --decode-ms-per-token 2 --kv-pull-base-ms 0 --kv-pull-us-per-token 0 --prefill-concurrency 0 --batch-slowdown 0"

stalls() {
  log "stalls: streams on a 2 ms/token engine, direct, plain Envoy, pd-router, sglang-router, vllm-router"
  clear_results 'stream-timed*'
  { fleet_head; rolesets 1 37 vllm t; combined 1 37 vllm t 9; rolesets 1 38 sglang u; } > "$RUN/pods-stall.yaml"
  { fleet_head; rolesets 1 37 vllm t; } > "$RUN/fleet-stall.yaml"
  { fleet_head; rolesets 1 38 sglang u; } > "$RUN/fleet-stall-sglang.yaml"
  # shellcheck disable=SC2086
  start_sim sim-stall "$RUN/pods-stall.yaml" 23092 $STALL_SIM
  start_control control-stall "$RUN/fleet-stall.yaml" 23181
  start_control control-stall-sglang "$RUN/fleet-stall-sglang.yaml" 23186
  start_envoy_pd envoy-stall 23180 23182 23181
  start_envoy_pd envoy-stall-sglang 23185 23187 23186
  start_envoy_plain envoy-plain-stall 23190 23192 127.0.37.9
  tokenizer
  start_sglang sglang-stall 23194 38 1 round_robin round_robin
  start_vllm vllm-stall 23196 37 1 round_robin
  local targets=(--target "direct=http://127.0.37.9:$POD_PORT" --target "envoy-plain=http://127.0.0.1:23190"
    --target "pd-router-1p1d=http://127.0.0.1:23180" --target "pd-router-1p1d-sglang=http://127.0.0.1:23185"
    --target "sglang-router=http://127.0.0.1:23194" --target "vllm-router=http://127.0.0.1:23196")
  local t
  for ((t = 2; t <= ${#targets[@]}; t += 2)); do # warm-up: connections, VMs, JIT
    "$BIN/pd-load" --url "${targets[$((t - 1))]#*=}" --model "$MODEL" --rps 0 --clients 4 --requests 200 \
      --workload fixed --body-bytes 2048 --stream-ratio 0 --max-tokens 1 > /dev/null 2>&1 || true
  done
  local rep
  for ((rep = 1; rep <= REPS; rep++)); do
    mkdir -p "$OUT/stream-timed-2k"
    # 64 tokens (≈ 130 ms a stream), 60 streams a second in all: ≈ 8 streams in flight, a
    # moderate load on this box, so a gap is the router's and not a saturated core's.
    # shellcheck disable=SC2046
    "$BIN/pd-load" --model "$MODEL" --seed "$rep" "${targets[@]}" --json-dir "$OUT/stream-timed-2k" $(side_pids) \
      --workload fixed --stream-ratio 1 --max-tokens 64 --timeout 20s --body-bytes 2048 \
      --duration "$((SECS * 6))s" --rps 60 --concurrency-limit 64 > "$RUN/last-load.txt" 2>&1 || true
    log "stream-timed-2k #$rep: $(grep -c '^\[' "$RUN/last-load.txt") targets dealt one run"
  done
  cleanup; PIDS=()
}

case $PHASES in
  overhead) overhead ;;
  policy) policy ;;
  stalls) stalls ;;
  # Quick sittings leave the stall phase out (the issue's five minutes): `bench.sh quick stalls`.
  all) overhead; policy; [ "$MODE" = quick ] || stalls ;;
  *) echo "usage: bench.sh [full|quick] [overhead|policy|stalls|all]" >&2; exit 2 ;;
esac
"$BIN/pd-bench-report" --dir "$OUT" --charts "$OUT" \
  --bound-request-cost "${AIBRIX_TOKEN_LOAD_REQUEST_COST:-3500}"
