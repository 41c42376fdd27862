# Tether — build, run, test, bench. Every target installs what it needs first.
#
# CARGO_TARGET_DIR may point outside the clone (CI keeps it under ~/.cache so later runs reuse
# the RocksDB build); `make build` still leaves the binary at target/release/tether.

SHELL := /bin/bash
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
BIN := $(TARGET_DIR)/release/tether
DATA_DIR ?= data
BENCH_EVENTS ?= 1000000
BENCH_VALUE_BYTES ?= 128

.PHONY: run-cluster all deps build run test python test-python bench bench-quick profile fmt lint clean dist

all: build

# bindgen (run by the rocksdb crate's build) needs libclang and its headers.
deps:
	@if ! command -v $(CARGO) >/dev/null 2>&1; then \
	  echo "error: cargo is not installed (install Rust from rustup)"; exit 1; fi
	@if ! dpkg -s libclang1-14 libclang-common-14-dev >/dev/null 2>&1; then \
	  echo "installing libclang1-14 libclang-common-14-dev (needed to build RocksDB bindings)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends libclang1-14 libclang-common-14-dev >/dev/null; fi

build: deps
	$(CARGO) build --release --bin tether
	@if [ "$(BIN)" != "$(CURDIR)/target/release/tether" ]; then \
	  mkdir -p target/release && cp -f "$(BIN)" target/release/tether; fi

# Release tarball: tether-VERSION/ with bin/tether, the example configuration, the systemd unit,
# the install guide (dist/), LICENSE, CHANGELOG.md, README.md and docs/*.md. The guide's links
# climb out of dist/ (../docs/operations.md); in the tarball it sits next to docs/, so they lose
# their ../ (tests/dist.rs checks they resolve in both places).
VERSION := $(shell sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
ARCH := $(shell uname -m)
DIST_TARBALL := $(TARGET_DIR)/dist/tether-$(VERSION)-$(ARCH)-linux.tar.gz

dist: build
	@set -e; stage="$(TARGET_DIR)/dist/stage"; root="$$stage/tether-$(VERSION)"; \
	rm -rf "$$stage"; mkdir -p "$$root/bin" "$$root/docs"; \
	install -m 0755 "$(BIN)" "$$root/bin/tether"; \
	install -m 0644 dist/tether.toml.example dist/tether.service LICENSE CHANGELOG.md README.md "$$root/"; \
	sed 's|](\.\./|](|g' dist/INSTALL.md > "$$root/INSTALL.md"; chmod 0644 "$$root/INSTALL.md"; \
	install -m 0644 docs/*.md "$$root/docs/"; \
	tar -C "$$stage" --sort=name --owner=0 --group=0 --numeric-owner -czf "$(DIST_TARBALL)" "tether-$(VERSION)"; \
	rm -rf "$$stage"; out="$(DIST_TARBALL)"; \
	if [ "$(DIST_TARBALL)" != "$(CURDIR)/target/dist/$(notdir $(DIST_TARBALL))" ]; then \
	  mkdir -p target/dist && cp -f "$(DIST_TARBALL)" target/dist/; out="target/dist/$(notdir $(DIST_TARBALL))"; fi; \
	echo "dist: $$out"

run: build
	target/release/tether server --data-dir $(DATA_DIR)

# A local three-node cluster (n1..n3 on 127.0.0.1:7401-7403) sharing one dev CA; Ctrl-C stops it.
run-cluster: build
	BIN=target/release/tether CLUSTER_DIR=$(DATA_DIR)/cluster scripts/run-cluster.sh

test: deps python
	$(CARGO) test --release --workspace
	TETHER_BIN="$(BIN)" "$(PY_VENV)/bin/python" -m pytest clients/python/tests -q
	$(MAKE) test-ui

# The Python client (clients/python, docs/python.md): a virtualenv with maturin and pytest, and
# the extension module built into it with `maturin develop` (quick when nothing changed). Its
# cargo build shares TARGET_DIR with the main one.
PY_VENV ?= $(TARGET_DIR)/python-venv

python:
	@if ! command -v $(CARGO) >/dev/null 2>&1; then \
	  echo "error: cargo is not installed (install Rust from rustup)"; exit 1; fi
	@if ! "$(PY_VENV)/bin/python" -c '' >/dev/null 2>&1; then \
	  rm -rf "$(PY_VENV)"; \
	  if ! python3 -m venv "$(PY_VENV)" >/dev/null 2>&1; then \
	    echo "installing python3-venv (needed for the Python client's virtualenv)"; \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; \
	    rm -rf "$(PY_VENV)"; python3 -m venv "$(PY_VENV)" || exit 1; fi; fi
	@if ! [ -x "$(PY_VENV)/bin/maturin" ] || ! "$(PY_VENV)/bin/python" -c 'import pytest' 2>/dev/null; then \
	  "$(PY_VENV)/bin/python" -m pip install -q 'maturin>=1.9.4,<2' 'pytest>=8'; fi
	cd clients/python && CARGO_TARGET_DIR="$(TARGET_DIR)" VIRTUAL_ENV="$(PY_VENV)" PATH="$(PY_VENV)/bin:$$PATH" \
	  maturin develop --release --quiet

# The Python client's tests (pytest) against the server binary `make build` leaves.
test-python: build python
	TETHER_BIN="$(CURDIR)/target/release/tether" "$(PY_VENV)/bin/python" -m pytest clients/python/tests -q

# The admin page's browser test (tests/ui/admin_page.mjs) against the binary `make build` leaves:
# headless Chromium from Debian's packages, driven by playwright-core from npm (pinned in
# tests/ui/package-lock.json and installed under TARGET_DIR, never in the clone). Screenshots go
# to $(UI_DIR).
UI_DIR ?= $(TARGET_DIR)/ui-test
CHROMIUM ?= /usr/bin/chromium

.PHONY: test-ui

test-ui: build
	@if ! [ -x "$(CHROMIUM)" ]; then \
	  echo "installing chromium (needed for the admin page's browser test)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; fi
	@if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then \
	  echo "error: node and npm are not installed (the admin page's browser test needs Node.js 20 or later)"; exit 1; fi
	@mkdir -p "$(UI_DIR)"
	@if ! cmp -s tests/ui/package-lock.json "$(UI_DIR)/package-lock.json" || \
	    ! [ -f "$(UI_DIR)/node_modules/playwright-core/package.json" ]; then \
	  echo "installing playwright-core into $(UI_DIR)"; \
	  cp -f tests/ui/package.json tests/ui/package-lock.json "$(UI_DIR)/" && \
	  (cd "$(UI_DIR)" && npm ci --no-audit --no-fund --loglevel=error) || exit 1; fi
	TETHER_BIN="$(CURDIR)/target/release/tether" CHROMIUM="$(CHROMIUM)" UI_DEPS_DIR="$(UI_DIR)" UI_OUT_DIR="$(UI_DIR)" \
	  node tests/ui/admin_page.mjs

# The replay benchmark with its NATS JetStream peer in the same run (scripts/bench.sh).
bench: deps
	EVENTS=$(BENCH_EVENTS) VALUE_BYTES=$(BENCH_VALUE_BYTES) scripts/bench.sh

# A reduced set (well under two minutes with everything built): smaller backlogs and
# idle-queue counts, shorter live-latency runs. The fan-out phase keeps `make bench`'s 100,000
# events: `publish_vs_nats_ratio` compares it with NATS's fill of the same count (with 10,000,
# a 30 ms phase, the ratio swung with the machine's noise).
bench-quick: deps
	EVENTS=100000 VALUE_BYTES=128 TETHER_BENCH_LIVE_SECS=2 \
	  TETHER_BENCH_MATRIX_EVENTS=10000,100000 TETHER_BENCH_FANOUT_EVENTS=100000 \
	  TETHER_BENCH_IDLE_QUEUES=1000 TETHER_BENCH_IDLE_WARM=200 \
	  TETHER_BENCH_CONN_CLIENTS=200 TETHER_BENCH_CONN_STALLED=20 scripts/bench.sh

# Flame graphs of the benchmark's publish, replay, live-while-draining and replicated-publish
# phases (scripts/profile.sh; perf and inferno installed when missing): bench-out/flame-*.svg.
profile: deps
	EVENTS=$(BENCH_EVENTS) scripts/profile.sh

fmt:
	$(CARGO) fmt --all

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

clean:
	rm -rf target

# Fuzzing (cargo-fuzz; nightly features through RUSTC_BOOTSTRAP=1 on stable). Each target runs
# FUZZ_SECS seconds from the seeds in fuzz/corpus/<target> (read only); new inputs go to
# fuzz/corpus-run/<target> and crashes to fuzz/artifacts/<target>. The fuzz build reuses the main
# build's RocksDB library when there is one (FUZZ_REUSE_ROCKSDB=0 builds it again).
FUZZ_SECS ?= 60
FUZZ_TARGETS ?= frame_decoder handshake session
FUZZ_SANITIZER ?= none
FUZZ_TARGET_DIR ?= $(HOME)/.cache/tether-fuzz-target
FUZZ_REUSE_ROCKSDB ?= 1
FUZZ_ROCKSDB_LIB := $(patsubst %/librocksdb.a,%,$(firstword $(wildcard $(TARGET_DIR)/release/build/librocksdb-sys-*/out/librocksdb.a)))
# Long crash-safety run: kill -9 rounds per sync mode (one node, then a three-node cluster), and
# the seed (printed to replay a failure).
CRASH_ROUNDS ?= 50
CLUSTER_CRASH_ROUNDS ?= 20
CRASH_SEED ?= $(shell date +%s)

.PHONY: fuzz fuzz-deps crash-test

fuzz-deps: deps
	@command -v cargo-fuzz >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked

fuzz: fuzz-deps
	@set -e; \
	if [ "$(FUZZ_REUSE_ROCKSDB)" = 1 ] && [ -n "$(FUZZ_ROCKSDB_LIB)" ]; then \
	  export ROCKSDB_LIB_DIR="$(FUZZ_ROCKSDB_LIB)" ROCKSDB_STATIC=1; fi; \
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus-run/$$t; \
	  echo "== fuzz $$t for $(FUZZ_SECS) s"; \
	  RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$(FUZZ_TARGET_DIR)" $(CARGO) fuzz run -a -s $(FUZZ_SANITIZER) $$t \
	    fuzz/corpus-run/$$t fuzz/corpus/$$t -- -max_total_time=$(FUZZ_SECS) -max_len=4096 -timeout=10; \
	done

crash-test: deps
	TETHER_CRASH_ROUNDS=$(CRASH_ROUNDS) TETHER_CRASH_SEED=$(CRASH_SEED) \
	  $(CARGO) test --release --test crash_safety -- --nocapture
	TETHER_CLUSTER_CRASH_ROUNDS=$(CLUSTER_CRASH_ROUNDS) TETHER_CRASH_SEED=$(CRASH_SEED) RUST_LOG=$${RUST_LOG:-error} \
	  $(CARGO) test --release --test cluster_crash_safety -- --nocapture

# Many seeds of the deterministic simulations (`make test` runs 1,000 of the replication
# simulation, 1,000 of the whole-cluster one and 2,000 of the forwarding one): `make sim
# SEEDS=20000`. A failing seed is
# printed with the command that replays it (TETHER_SIM_TRACE=1 prints the cluster's events).
SEEDS ?= 5000

.PHONY: sim

sim: deps
	TETHER_SIM_SEEDS=$(SEEDS) $(CARGO) test --release --test replication_sim replication_sim
	TETHER_CLUSTER_SIM_SEEDS=$(SEEDS) TETHER_SIM_STATS=1 $(CARGO) test --release --test cluster_sim cluster_sim -- --nocapture
	TETHER_FORWARD_SIM_SEEDS=$(SEEDS) TETHER_SIM_STATS=1 $(CARGO) test --release --test forward_sim forward_sim -- --nocapture

# Soak run (bounded, not part of `make test`): durable clients connecting, consuming, closing,
# crashing and coming back against `tether server` processes while publishers run; checks
# nothing is lost and every redelivery is flagged, and reports the servers' memory over time.
# `make soak` runs one node; `make soak-cluster` three with redundancy 1, killing nodes (-9)
# during the run. The seed is printed (SOAK_SEED replays a run).
SOAK_SECS ?= 300
SOAK_CLIENTS ?= 1000
SOAK_SEED ?=
SOAK_NODE_KILLS ?= 4

.PHONY: soak soak-cluster

soak: deps
	TETHER_SOAK_SECS=$(SOAK_SECS) TETHER_SOAK_CLIENTS=$(SOAK_CLIENTS) $(if $(SOAK_SEED),TETHER_SOAK_SEED=$(SOAK_SEED)) \
	  $(CARGO) bench --bench soak

soak-cluster: deps
	TETHER_SOAK_SECS=$(SOAK_SECS) TETHER_SOAK_CLIENTS=$(SOAK_CLIENTS) $(if $(SOAK_SEED),TETHER_SOAK_SEED=$(SOAK_SEED)) \
	  TETHER_SOAK_NODES=3 TETHER_SOAK_NODE_KILLS=$(SOAK_NODE_KILLS) RUST_LOG=$${RUST_LOG:-error} $(CARGO) bench --bench soak
