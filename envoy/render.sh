# Envoy configurations of the baselines the measuring scripts (bench.sh, thread-cpu.sh,
# phases.sh) run beside pd-router, and how they start one; sourced, not run, from the
# repository root.

# One measuring script at a time: two sittings at once measure each other (session 31's full
# sitting ran beside a second one and its peers got a third of the CPU in half their runs).
# Takes a lock on target/measure.lock held until the calling script exits, or exits 1 naming
# the script that holds it.
#   hold_measure_lock SCRIPT_NAME
hold_measure_lock() {
  local dir=${CARGO_TARGET_DIR:-target} holder
  mkdir -p "$dir"
  exec 9>> "$dir/measure.lock"
  if ! flock -n 9; then
    holder=$(cat "$dir/measure.holder" 2>/dev/null || echo "another measuring script")
    echo "$1: $holder is measuring on this box; run one at a time (or stop it)" >&2
    exit 1
  fi
  echo "$1 (pid $$, since $(date +%T))" > "$dir/measure.holder"
}

# The drop-in's retrying cluster reads DIR/pd-pods.json, which pd-control rewrites when run
# with `--eds-file DIR/pd-pods.json`; Envoy refuses to start without the file, so a renderer
# seeds one listing no pod (kept if already there):
#   seed_eds DIR
seed_eds() {
  mkdir -p "$1"
  [ -f "$1/pd-pods.json" ] || printf '%s\n' \
    '{"version_info":"0","resources":[{"@type":"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment","cluster_name":"pd_pods_retry"}]}' \
    > "$1/pd-pods.json"
}

# The PD-hop floor filter (filter/examples/pd_floor.rs) between one prefill and one decode pod:
#   render_floor LISTEN_PORT ADMIN_PORT PREFILL_HOST:PORT DECODE_HOST:PORT FLOOR_WASM [BOOT_PORT]
# With BOOT_PORT the filter speaks SGLang (both legs at once, that bootstrap port), else vLLM.
render_floor() {
  local extra=
  [ -n "${6:-}" ] && extra=",\"protocol\":\"sglang\",\"bootstrap_port\":$6"
  local config="{\"prefill\":\"$3\",\"decode\":\"$4\",\"cluster\":\"pd_pods\",\"dst_header\":\"target-pod\"$extra}"
  # The floor names no stand-in: its retrying cluster stays empty.
  local eds="${TMPDIR:-/tmp}/pd-router-floor-eds"
  seed_eds "$eds"
  sed -e "s#@EDS_DIR@#$eds#g" -e "s#@LISTEN_ADDR@#127.0.0.1#; s#@LISTEN_PORT@#$1#; s#@ADMIN_PORT@#$2#" \
    -e "s#@WASM_PATH@#$(realpath "$5")#; s#@CONTROL_ADDR@#127.0.0.1#; s#@CONTROL_PORT@#1#" \
    -e "s#@REFRESH_MS@#50#; s#@ACCESS_LOG@#/dev/null#" \
    -e "s#value: '{\"control_cluster.*#value: '$config'#" envoy/envoy.yaml.tmpl
}

# Plain Envoy passing every request to one upstream:
#   render_plain LISTEN_PORT ADMIN_PORT UPSTREAM_ADDR UPSTREAM_PORT
render_plain() {
  sed -e "s#@LISTEN_PORT@#$1#; s#@ADMIN_PORT@#$2#; s#@UPSTREAM_ADDR@#$3#; s#@UPSTREAM_PORT@#$4#" \
    envoy/envoy-passthrough.yaml.tmpl
}

# Starts another Envoy (two workers) in the background and returns once its admin port says it
# is ready; its pid is left in ENVOY_PID. On failure prints its log and returns 1.
#   start_envoy_beside CONFIG LOG_FILE ADMIN_PORT
start_envoy_beside() {
  .venv/envoy -c "$1" --concurrency 2 --disable-hot-restart -l warn > "$2" 2>&1 &
  ENVOY_PID=$!
  local i
  for i in $(seq 300); do
    curl -sf "127.0.0.1:$3/ready" > /dev/null && return 0
    sleep 0.1
  done
  echo "Envoy on $1 did not start; its log:" >&2
  cat "$2" >&2
  return 1
}
