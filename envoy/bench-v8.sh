#!/usr/bin/env bash
# Selection cost inside Envoy's V8: for each fleet size, a fleet of unserved pods (rolesets of
# one prefill and one decode pod on distinct loopback IPs where nothing listens), a stack with
# the release .wasm, REQUESTS PD requests one after another, then the percentiles of the two
# selection histograms the filter records:
#   pd_router_selection_core_us  Steps 0-5 alone (pd::select_pd)
#   pd_router_selection_us       the whole CAS round: ledger read, select, charge, write back
# The prefill legs fail (nothing listens), which does not touch the timed region.
#
#   envoy/bench-v8.sh [PODS...]          default: 16 256 1024
# Environment: REQUESTS (600), WARMUP (50, sent first and left out of the figures),
# ADMIN_PORT (9931), CONTROL_PORT (18131), PORT (10631), PROFILE (native), POD_PORT (18999),
# BENCH_OUT (bench-v8.txt, one line per fleet size), plus anything stack.sh reads
# (CARGO_TARGET_DIR, AIBRIX_* for the filter).
set -euo pipefail
cd "$(dirname "$0")/.."
export ADMIN_PORT=${ADMIN_PORT:-9931} CONTROL_PORT=${CONTROL_PORT:-18131}
PORT=${PORT:-10631}
PROFILE=${PROFILE:-native}
REQUESTS=${REQUESTS:-600}
WARMUP=${WARMUP:-50}
POD_PORT=${POD_PORT:-18999}
OUT=${BENCH_OUT:-bench-v8.txt}
RUN=.run/bench-v8
mkdir -p "$RUN"

# A Kubernetes Pod list of `pods` pods of model bench-llm: pod 2k is the prefill and 2k+1 the
# decode pod of roleset rs-k; IPs 127.0.100.1 onwards, 250 per /24.
fleet() { # pods file
  local pods=$1 i role
  {
    echo "apiVersion: v1"
    echo "kind: List"
    echo "items:"
    for ((i = 0; i < pods; i++)); do
      role=$([ $((i % 2)) = 0 ] && echo prefill || echo decode)
      cat <<EOF
- apiVersion: v1
  kind: Pod
  metadata:
    name: bench-$role-$i
    namespace: bench
    labels: {model.aibrix.ai/name: bench-llm, model.aibrix.ai/port: "$POD_PORT", model.aibrix.ai/engine: vllm, role-name: $role, roleset-name: rs-$((i / 2))}
  status:
    podIP: 127.0.$((100 + i / 250)).$((1 + i % 250))
    conditions: [{type: Ready, status: "True"}]
EOF
    done
  } > "$2"
}

# One curl process, one keep-alive connection, `n` sequential PD requests.
send() { # n
  local n=$1 i cfg=$RUN/curl.cfg
  : > "$cfg"
  for ((i = 0; i < n; i++)); do
    [ "$i" = 0 ] || echo "next" >> "$cfg"
    cat >> "$cfg" <<EOF
url = "http://127.0.0.1:$PORT/v1/completions"
header = "content-type: application/json"
header = "routing-strategy: pd"
data = "{\"model\":\"bench-llm\",\"prompt\":\"selection benchmark prompt number $i with a few words\",\"max_tokens\":4}"
output = "/dev/null"
write-out = "%{http_code}\\n"
silent
EOF
  done
  curl --config "$cfg" | sort | uniq -c | sed 's/^/  status: /'
}

# The detailed buckets of a histogram as JSON (Envoy never resets histograms, so the figures
# come from the difference of two of these).
buckets() { # metric
  curl -s "127.0.0.1:$ADMIN_PORT/stats?filter=^wasmcustom\.$1\$&histogram_buckets=detailed&format=json"
}

# p50/p99 (nearest rank) of the samples recorded between two bucket dumps. The filter records
# whole microseconds (truncated), so a figure is the recorded value: the floor of the time.
percentiles() { # before.json after.json
  python3 - "$1" "$2" <<'PY'
import json, math, sys
def totals(path):
    text = open(path).read()
    stats = json.loads(text)["stats"] if text.strip() else []
    hist = next((s["histograms"] for s in stats if "histograms" in s), {})
    out = {}
    for d in hist.get("details", []):
        for b in d.get("totals", []):
            out[(b["lower_bound"], b["width"])] = out.get((b["lower_bound"], b["width"]), 0) + b["count"]
    return out
before, after = totals(sys.argv[1]), totals(sys.argv[2])
diff = sorted((k, after[k] - before.get(k, 0)) for k in after if after[k] > before.get(k, 0))
n = sum(c for _, c in diff)
def pct(q):
    rank, seen = max(1, math.ceil(q * n)), 0
    for (lower, width), c in diff:
        seen += c
        if seen >= rank:
            return "%g" % lower
    return "nan"
print("n=%d p50=%s p99=%s" % (n, pct(0.50), pct(0.99)))
PY
}

# Histograms reach the admin endpoint on Envoy's stats flush (stats_flush_interval: 1s); poll
# until every request's sample is there.
wait_flush() { # metric before.json count
  local deadline=$((SECONDS + 20))
  until buckets "$1" > "$RUN/after.json" &&
    [ "$(percentiles "$2" "$RUN/after.json" | sed 's/^n=\([0-9]*\).*/\1/')" -ge "$3" ]; do
    [ $SECONDS -lt $deadline ] || { echo "bench-v8: $1 did not reach $3 samples" >&2; return 1; }
    sleep 0.2
  done
}

envoy/stack.sh down >/dev/null 2>&1 || true
trap 'envoy/stack.sh down >/dev/null 2>&1 || true' EXIT
: > "$OUT"
for pods in "${@:-16 256 1024}"; do
  for p in $pods; do
    fleet "$p" "$RUN/fleet-$p.yaml"
    envoy/stack.sh up "$RUN/fleet-$p.yaml" 0 "$PORT" "$PROFILE" >/dev/null
    echo "== $p pods"
    send "$WARMUP" >/dev/null
    metrics="pd_router_selection_core_us pd_router_selection_us"
    for m in $metrics; do
      wait_flush "$m" /dev/null "$WARMUP" || true
      buckets "$m" > "$RUN/$m.before.json"
    done
    send "$REQUESTS"
    line="pods=$p"
    for m in $metrics; do
      wait_flush "$m" "$RUN/$m.before.json" "$REQUESTS"
      line="$line $m $(percentiles "$RUN/$m.before.json" "$RUN/after.json")"
    done
    echo "  $line"
    echo "$line" >> "$OUT"
    envoy/stack.sh down >/dev/null
  done
done
echo "written $OUT"
