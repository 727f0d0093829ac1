# The single entry point: CI (.ci/run), pre-commit habits and the README all call these targets.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PYTEST := $(PYTHON) -m pytest
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: install setup test test-rust test-python lint fmt bench bench-rust bench-python demo clean

## Install zswap (editable, release build of the Rust extension); `setup` adds the test tools.
install:
	$(PIP) install -q -e .

setup:
	$(PIP) install -q -e ".[test]"

## Everything CI runs: Rust unit and property tests, then the Python suite (not GPU tests).
test: setup test-rust test-python

test-rust:
	$(CARGO) test --release --lib

test-python:
	$(PYTEST) -q -m "not gpu"

## Lints the same way CI does.
lint: setup
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --features python -- -D warnings
	$(PYTHON) -m ruff check python tests benches
	$(PYTHON) -m ruff format --check python tests benches
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest zswap._zswap

fmt:
	$(CARGO) fmt
	$(PYTHON) -m ruff format python tests benches
	$(PYTHON) -m ruff check --fix python tests benches

## Benchmarks (not run in CI): Criterion for the engine, then the Python-level scripts.
bench: setup bench-rust bench-python

bench-rust:
	$(CARGO) bench --bench engine

bench-python:
	$(PYTHON) benches/bench_swap.py
	$(PYTHON) benches/bench_init.py
	$(PYTHON) benches/bench_runtime.py
	$(PYTHON) benches/bench_adam.py

## The main job on a fresh machine: set up, then run zswap's demo on a temp dir.
demo: install
	$(PYTHON) -m zswap.cli demo

clean:
	rm -rf target python/zswap/*.so .pytest_cache .hypothesis
