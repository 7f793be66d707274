# Envoy configurations of the baselines the measuring scripts (bench.sh, thread-cpu.sh) run
# beside pd-router; sourced, not run, from the repository root.

# The PD-hop floor filter (filter/examples/pd_floor.rs) between one prefill and one decode pod:
#   render_floor LISTEN_PORT ADMIN_PORT PREFILL_HOST:PORT DECODE_HOST:PORT FLOOR_WASM [BOOT_PORT]
# With BOOT_PORT the filter speaks SGLang (both legs at once, that bootstrap port), else vLLM.
render_floor() {
  local extra=
  [ -n "${6:-}" ] && extra=",\"protocol\":\"sglang\",\"bootstrap_port\":$6"
  local config="{\"prefill\":\"$3\",\"decode\":\"$4\",\"cluster\":\"pd_pods\",\"dst_header\":\"target-pod\"$extra}"
  sed -e "s#@LISTEN_ADDR@#127.0.0.1#; s#@LISTEN_PORT@#$1#; s#@ADMIN_PORT@#$2#" \
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
