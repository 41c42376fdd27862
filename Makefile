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

.PHONY: all deps build run test bench bench-quick fmt lint clean

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

run: build
	target/release/tether server --data-dir $(DATA_DIR)

test: deps
	$(CARGO) test --release --workspace

bench: deps
	TETHER_BENCH_EVENTS=$(BENCH_EVENTS) TETHER_BENCH_VALUE_BYTES=$(BENCH_VALUE_BYTES) $(CARGO) bench --bench replay

bench-quick: deps
	TETHER_BENCH_EVENTS=100000 TETHER_BENCH_VALUE_BYTES=128 $(CARGO) bench --bench replay

fmt:
	$(CARGO) fmt --all

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

clean:
	rm -rf target
