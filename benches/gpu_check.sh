#!/usr/bin/env bash
# The whole GPU check in one go, on a machine with a CUDA GPU, torch already installed, no Rust toolchain and
# possibly no internet: installs zswap's abi3 wheel (dist/, from `make wheel`) and the test tools from the
# wheelhouse (wheelhouse/, from `make gpu-check-bundle`) without touching an index, runs `pytest -m gpu`,
# then benches/bench_gpu.py. Everything it reports goes to $OUT (default ./gpu-check-out): gpu_check.log,
# pytest-gpu.xml, bench_gpu.txt, bench_gpu.json, summary.txt. Budget: under 8 minutes on one H200 (tests
# at most ZSWAP_GPU_TEST_TIMEOUT=200 s, benchmark at most ZSWAP_GPU_BENCH_TIMEOUT=280 s, install ~30 s).
#
#   bash benches/gpu_check.sh            # from the repository root
#
# Environment: PYTHON (default python3), OUT, ZSWAP_GPU_SWAP_DIR (swap folder for the benchmark; default a
# temp dir under /var/tmp), ZSWAP_GPU_BENCH_ARGS (extra bench_gpu.py arguments), ZSWAP_GPU_SKIP_BENCH=1.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
START=$(date +%s)
say() { echo "[gpu_check +$(($(date +%s) - START))s] $*"; }
fail() { say "STOP: $*"; echo "STOP: $*" >> "$OUT/summary.txt"; exit "${2:-1}"; }
: > "$OUT/summary.txt"

# 1. What this machine has. torch must already be here (it is never part of the bundle).
say "machine: $(uname -srm); $(nproc) cores; $($PY --version 2>&1)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! $PY -c "import torch" 2> /dev/null; then
    fail "torch is not installed for $PY on this machine; install a CUDA build of torch first" 3
fi
# ZSWAP_GPU_CHECK_DRY_RUN=1: go on without CUDA (GPU tests skip, the bench stops): checks this script.
if ! $PY - << 'EOF'
import torch
print(f"torch {torch.__version__} from {torch.__file__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("torch here sees no CUDA device (CPU-only build, no driver, or CUDA_VISIBLE_DEVICES)")
print(f"device 0: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
EOF
then
    [ "${ZSWAP_GPU_CHECK_DRY_RUN:-0}" = 1 ] || fail "torch here cannot use a CUDA device" 3
    say "DRY RUN without CUDA: the GPU tests will skip and the benchmark stop; nothing here runs on a GPU"
    echo "DRY RUN: no CUDA device; no GPU test ran and no GPU figure was measured" >> "$OUT/summary.txt"
fi

# 2. Install, from files only. Only what this machine lacks comes from wheelhouse/: torch and whatever is
# already importable here (pytest, numpy, transformers... on an ML image) stay the machine's own, so the
# bundle never shadows the packages torch was installed with. Everything goes into a --target folder put
# first on PYTHONPATH (no venv: the machine's python may itself be a venv, whose packages a new
# --system-site-packages venv would not see).
WHEEL=$(ls "$ROOT"/dist/zswap-*abi3*.whl 2> /dev/null | head -n 1)
[ -n "$WHEEL" ] || fail "no abi3 wheel in dist/: run 'make wheel' on the build machine and carry dist/ along"
[ -d "$ROOT/wheelhouse" ] || fail "no wheelhouse/: run 'make gpu-check-bundle' on the build machine and carry it"
VENV=$(mktemp -d /tmp/zswap-gpu-check.XXXXXX)
SITE=$VENV/site
MISSING=$($PY - "$ROOT/wheelhouse" << 'EOF'
import importlib.metadata as md
import pathlib
import sys

for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        md.version(whl.name.split("-")[0])
    except md.PackageNotFoundError:
        print(whl)
EOF
) || fail "could not list what wheelhouse/ has that this machine lacks"
# shellcheck disable=SC2086
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" $MISSING \
    || fail "pip install --target of the wheel and the missing test tools from wheelhouse/ failed"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
VPY=$PY
say "from wheelhouse/: $(echo "$MISSING" | xargs -r -n1 basename | sed 's/-[0-9].*//' | tr '\n' ' ' \
    | grep . || echo "nothing (this machine has every test tool)")"
for mod in pytest hypothesis pydantic safetensors numpy; do
    $VPY -c "import $mod" 2> /dev/null || fail "$mod is neither on this machine nor in wheelhouse/"
done
$VPY -c "import transformers" 2> /dev/null || say "no transformers: the GPT-2 / Llama GPU tests will skip"
$VPY -c "import zswap, torch; print('zswap from', zswap.__file__, '; torch', torch.__version__, 'from', torch.__file__)" \
    || fail "zswap does not import from the installed wheel"
say "installed ($(du -sh "$ROOT/wheelhouse" | cut -f1) wheelhouse, $(basename "$WHEEL"))"

# The tests and the benchmark use this checkout's Python code with the wheel's compiled extension, so the
# check is of the tree it was carried from even when the wheel was built a little earlier.
EXT=$($VPY -c "import zswap._zswap as m; print(m.__file__)")
mkdir -p "$VENV/src" && cp -r "$ROOT/python/zswap" "$VENV/src/" && rm -f "$VENV"/src/zswap/_zswap*.so \
    && cp "$EXT" "$VENV/src/zswap/" || fail "could not overlay this checkout's python/zswap on the wheel"
export PYTHONPATH=$VENV/src${PYTHONPATH:+:$PYTHONPATH}
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the bitwise tests

# 3. The GPU tests: only the files that hold some (collecting the whole suite would import every test
# module's dependencies). No plugin autoloading: the machine's pytest plugins are not what is tested, and
# one built for another pytest could stop the run. Warnings are reported, not raised (the suite's
# "error" filter is for CI; here one run must say as much as it can).
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
say "pytest -m gpu: $GPU_TESTS"
# shellcheck disable=SC2086
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${ZSWAP_GPU_TEST_TIMEOUT:-200}" $VPY -m pytest -q -p no:cacheprovider \
    -m gpu -W default -rfEs --junitxml="$OUT/pytest-gpu.xml" $GPU_TESTS
PYTEST_RC=$?
echo "pytest -m gpu: exit $PYTEST_RC" >> "$OUT/summary.txt"
say "pytest -m gpu: exit $PYTEST_RC"

# 4. The benchmark.
if [ "${ZSWAP_GPU_SKIP_BENCH:-0}" != 1 ]; then
    say "benches/bench_gpu.py (fio: $(command -v fio || echo 'not installed; the engine raw loop stands in'))"
    ARGS=(--out "$OUT")
    [ -n "${ZSWAP_GPU_SWAP_DIR:-}" ] && ARGS+=(--path "$ZSWAP_GPU_SWAP_DIR")
    # shellcheck disable=SC2206
    timeout "${ZSWAP_GPU_BENCH_TIMEOUT:-280}" $VPY "$ROOT/benches/bench_gpu.py" "${ARGS[@]}" ${ZSWAP_GPU_BENCH_ARGS:-} | tee "$OUT/bench_gpu.txt"
    BENCH_RC=${PIPESTATUS[0]}
    [ "${ZSWAP_GPU_CHECK_DRY_RUN:-0}" = 1 ] && [ "$BENCH_RC" = 2 ] && BENCH_RC=0  # "no CUDA device here"
    echo "bench_gpu.py: exit $BENCH_RC" >> "$OUT/summary.txt"
    grep -E "^(fetch|train|  I/O|  peak)" "$OUT/bench_gpu.txt" >> "$OUT/summary.txt"
else
    BENCH_RC=0
fi

rm -rf "$VENV"
say "done: pytest $PYTEST_RC, bench $BENCH_RC (see $OUT/summary.txt)"
[ "$PYTEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
