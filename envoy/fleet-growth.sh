#!/usr/bin/env bash
# Request latency while the fleet grows: the demo stack (zero-time pd-sim) under a steady load
# of one client, and part way through, the fleet file gains N pods of another model (in the
# router's fleet, not served). What a fleet change costs the requests in flight shows as the
# tail and the maximum; compare builds with PD_WASM.
#
#   make build-native && envoy/fleet-growth.sh [N]        default 512 pods
# Environment: PD_WASM (another build of the filter), RPS (200), SECONDS_PER_RUN (16),
# GROW_AFTER_S (5), CONTROL_REFRESH_MS (1000: pd-control scraping hundreds of pods every 50 ms
# would saturate a 2-core box by itself), PORT (10741), ADMIN_PORT (9961), PROFILE (native).
set -euo pipefail
cd "$(dirname "$0")/.."
pods=${1:-512}
export ADMIN_PORT=${ADMIN_PORT:-9961} CONTROL_PORT=${CONTROL_PORT:-18161}
export SIM_ADMIN_PORT=${SIM_ADMIN_PORT:-18162} CONTROL_REFRESH_MS=${CONTROL_REFRESH_MS:-1000}
export SIM_TIMING=zero
PORT=${PORT:-10741}
PROFILE=${PROFILE:-native}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
work=$(mktemp -d)
trap 'envoy/stack.sh down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

cp envoy/fleets/demo.yaml "$work/fleet.yaml"
{ cat envoy/fleets/demo.yaml
  envoy/fleets/pd-fleet.sh $(((pods + 1) / 2)) | sed 's/demo-llm/grown-llm/; s/name: vllm-/name: grown-/' | tail -n +4
} > "$work/grown.yaml"
envoy/stack.sh up "$work/fleet.yaml" 1 "$PORT" "$PROFILE" >/dev/null
# pd-control rereads the file by content; a rename makes the change atomic.
( sleep "${GROW_AFTER_S:-5}"; cp "$work/grown.yaml" "$work/next.yaml"; mv "$work/next.yaml" "$work/fleet.yaml" ) &
"$TARGET/$PROFILE/pd-load" --url "http://127.0.0.1:$PORT" --model demo-llm --rps "${RPS:-200}" \
  --arrival fixed --concurrency-limit 1 --duration "${SECONDS_PER_RUN:-16}s" --workload fixed \
  --body-bytes 2048 --stream-ratio 0 --max-tokens 1 --routing-strategy pd --json "$work/load.json" |
  grep -E '^pd-load:'
wait
echo "ledger gauge series at the end: $(curl -s "127.0.0.1:$ADMIN_PORT/stats?filter=pd_token_load_kv_tokens" | grep -c pod_name)"
python3 - "$work/load.json" "${GROW_AFTER_S:-5}" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
grow_ms = float(sys.argv[2]) * 1000
e2e = sorted(r["e2e_ms"] or 0.0 for r in results)
pick = lambda q: e2e[min(len(e2e) - 1, int(len(e2e) * q))]
print("E2E ms: p50 %.2f  p99 %.2f  p99.9 %.2f  max %.1f" % (pick(0.5), pick(0.99), pick(0.999), e2e[-1]))
slow = [(r["start_ms"] - grow_ms, r["e2e_ms"]) for r in results if (r["e2e_ms"] or 0) > 100]
print("requests over 100 ms (start relative to the growth, E2E):",
      ", ".join("%+.0f ms: %.0f ms" % s for s in slow) or "none")
PY
