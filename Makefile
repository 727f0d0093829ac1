# The single entry point: CI (.ci/run), pre-commit habits and the README all call these targets.
#
# Interpreter: `PYTHON=/path/to/python make ...` uses that interpreter as it is (your venv, conda env...).
# Without PYTHON, a project venv in $(VENV) (default .venv) is created from $(BOOTSTRAP) (default
# python3) on first use and everything is installed there, so a distribution Python marked externally
# managed (PEP 668) is never pip-installed into.
VENV ?= .venv
BOOTSTRAP ?= python3
ifeq ($(origin PYTHON),undefined)
PYTHON := $(VENV)/bin/python
PY_DEP := $(VENV)/bin/python
else
PY_DEP :=
endif
PIP := $(PYTHON) -m pip
PYTEST := $(PYTHON) -m pytest
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

# Wheels: a separate build venv with maturin and zig (ziglang from PyPI), so the wheel links against
# glibc 2.28's symbols whatever this machine's glibc is; maturin refuses the build if a newer one slips in.
BUILD_VENV ?= .venv-build
MANYLINUX ?= manylinux_2_28

.PHONY: install setup test test-rust test-python lint fmt bench bench-rust bench-python demo wheel clean

define make_venv
	$(BOOTSTRAP) -m venv $(1) || { rm -rf $(1); echo "zswap: '$(BOOTSTRAP) -m venv $(1)' failed; on Debian/Ubuntu: apt install python3-venv, or pass PYTHON=/path/to/python" >&2; exit 1; }
endef

$(VENV)/bin/python:
	$(call make_venv,$(VENV))

## Install zswap (editable, release build of the Rust extension); `setup` adds the test tools.
install: $(PY_DEP)
	$(PIP) install -q -e .

setup: $(PY_DEP)
	$(PIP) install -q -e ".[test]"

## Everything CI runs: Rust unit and property tests, then the Python suite (not GPU tests).
test: setup test-rust test-python

test-rust:
	$(CARGO) test --release --lib

test-python: $(PY_DEP)
	$(PYTEST) -q -m "not gpu"

## Lints the same way CI does.
lint: setup
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --features python -- -D warnings
	$(PYTHON) -m ruff check python tests benches tools
	$(PYTHON) -m ruff format --check python tests benches tools
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest zswap._zswap
	# lint-imports: the layers contract in pyproject.toml ([tool.importlinter]); run on this tree's source
	PYTHONPATH=python $(PYTHON) -c "from importlinter.cli import lint_imports_command as lint_imports; lint_imports()"

fmt: $(PY_DEP)
	$(CARGO) fmt
	$(PYTHON) -m ruff format python tests benches tools
	$(PYTHON) -m ruff check --fix python tests benches tools

# An interpreter with DeepSpeed for bench_step_matrix.py's DeepSpeed rows (empty: $(PYTHON), if it has it).
DS_PYTHON ?=

## Benchmarks (not run in CI): Criterion for the engine, then the Python-level scripts.
bench: setup bench-rust bench-python

bench-rust:
	$(CARGO) bench --bench engine

bench-python: $(PY_DEP)
	$(PYTHON) benches/bench_swap.py
	$(PYTHON) benches/bench_init.py
	$(PYTHON) benches/bench_runtime.py
	$(PYTHON) benches/bench_adam.py
	$(PYTHON) benches/bench_checksum.py
	$(PYTHON) benches/bench_step_setups.py
	$(PYTHON) benches/bench_step_matrix.py $(if $(DS_PYTHON),--deepspeed-python $(DS_PYTHON))

## The main job on a fresh machine: set up, then run zswap's demo on a temp dir.
demo: install
	$(PYTHON) -m zswap demo

## dist/: one abi3 wheel (CPython 3.10+, $(MANYLINUX)) and the sdist (builds from source with cargo).
$(BUILD_VENV)/bin/maturin:
	$(call make_venv,$(BUILD_VENV))
	$(BUILD_VENV)/bin/python -m pip install -q "maturin>=1.7,<2" "ziglang>=0.13"

wheel: $(BUILD_VENV)/bin/maturin
	rm -f dist/zswap-*.whl dist/zswap-*.tar.gz
	PATH="$(abspath $(BUILD_VENV))/bin:$$PATH" $(BUILD_VENV)/bin/maturin build --release --locked --zig \
		--compatibility $(MANYLINUX) --out dist
	$(BUILD_VENV)/bin/maturin sdist --out dist

clean:
	rm -rf target dist python/zswap/*.so .pytest_cache .hypothesis

## wheelhouse/: the test tools benches/gpu_check.sh installs, where that machine lacks them, without an index (CPython
## $(GPU_PY), manylinux x86-64; torch is never bundled: it must be on that machine). With dist/ from
## `make wheel`, carry both along and run `bash benches/gpu_check.sh` there. GPU_BUNDLE_HF=0 leaves out
## transformers and its dependencies (~25 MB of the ~45 MB; the GPT-2 / Llama GPU tests then skip).
GPU_PY ?= 3.12
GPU_BUNDLE_HF ?= 1
GPU_BUNDLE := "pytest>=8" "hypothesis>=6.100" "pydantic>=2.7" "safetensors>=0.4" numpy $(if $(filter 1,$(GPU_BUNDLE_HF)),"transformers>=4.44")
.PHONY: gpu-check-bundle
gpu-check-bundle: $(PY_DEP)
	rm -rf wheelhouse
	$(PIP) download -q -d wheelhouse --only-binary=:all: --implementation cp --python-version $(GPU_PY) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any $(GPU_BUNDLE)
	@du -sh wheelhouse
