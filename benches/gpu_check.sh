#!/usr/bin/env bash
# The whole GPU check in one go, on a machine with a CUDA GPU, torch already installed, no Rust toolchain and
# possibly no internet: installs zswap's abi3 wheel (dist/, from `make wheel`) and the test tools from the
# wheelhouse (wheelhouse/, from `make gpu-check-bundle`) without touching an index, runs `pytest -m gpu`,
# then benches/bench_gpu.py. Everything it reports goes to $OUT (default ./gpu-check-out): gpu_check.log,
# pytest-gpu.xml, bench_gpu.json, summary.txt. Budget: well under 8 minutes on one H200.
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
$PY - << 'EOF' || [ "${ZSWAP_GPU_CHECK_DRY_RUN:-0}" = 1 ] || fail "torch here cannot use a CUDA device" 3
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
assert torch.cuda.is_available()
print(f"device 0: {torch.cuda.get_device_name(0)}")
EOF

# 2. Install, from files only.
WHEEL=$(ls "$ROOT"/dist/zswap-*abi3*.whl 2> /dev/null | head -n 1)
[ -n "$WHEEL" ] || fail "no abi3 wheel in dist/: run 'make wheel' on the build machine and carry dist/ along"
[ -d "$ROOT/wheelhouse" ] || fail "no wheelhouse/: run 'make gpu-check-bundle' on the build machine and carry it"
VENV=$(mktemp -d /tmp/zswap-gpu-venv.XXXXXX)
if $PY -m venv --system-site-packages "$VENV" > /dev/null 2>&1 && "$VENV/bin/python" -c "import torch" 2> /dev/null
then
    VPY=$VENV/bin/python  # sees the machine's torch; pip installs only what is missing
    $VPY -m pip install -q --no-index --find-links "$ROOT/wheelhouse" "$WHEEL" pytest \
        || fail "pip install of the wheel and the test tools from wheelhouse/ failed"
    $VPY -m pip install -q --no-index --find-links "$ROOT/wheelhouse" transformers \
        || say "transformers not installable from wheelhouse/: the GPT-2 / Llama GPU tests will skip"
else  # no venv module, or torch lives in a venv of its own: a target folder, every wheel, no resolution
    VPY=$PY
    SITE=$VENV/site
    $PY -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL" "$ROOT"/wheelhouse/*.whl \
        || fail "pip install --target of the wheel and wheelhouse/ failed"
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
$VPY -c "import zswap, torch; print('zswap from', zswap.__file__, '; torch', torch.__version__)" \
    || fail "zswap does not import from the installed wheel"
say "installed ($(du -sh "$ROOT/wheelhouse" | cut -f1) wheelhouse, $(basename "$WHEEL"))"

# The tests and the benchmark use this checkout's Python code with the wheel's compiled extension, so the
# check is of the tree it was carried from even when the wheel was built a little earlier.
EXT=$($VPY -c "import zswap._zswap as m; print(m.__file__)")
mkdir -p "$VENV/src" && cp -r "$ROOT/python/zswap" "$VENV/src/" && rm -f "$VENV"/src/zswap/_zswap*.so \
    && cp "$EXT" "$VENV/src/zswap/" || fail "could not overlay this checkout's python/zswap on the wheel"
export PYTHONPATH=$VENV/src${PYTHONPATH:+:$PYTHONPATH}
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the bitwise tests

# 3. The GPU tests.
say "pytest -m gpu"
timeout 300 $VPY -m pytest -q -p no:cacheprovider -m gpu --junitxml="$OUT/pytest-gpu.xml" tests
PYTEST_RC=$?
echo "pytest -m gpu: exit $PYTEST_RC" >> "$OUT/summary.txt"
say "pytest -m gpu: exit $PYTEST_RC"

# 4. The benchmark.
if [ "${ZSWAP_GPU_SKIP_BENCH:-0}" != 1 ]; then
    say "benches/bench_gpu.py (fio: $(command -v fio || echo 'not installed; the engine raw loop stands in'))"
    ARGS=(--out "$OUT")
    [ -n "${ZSWAP_GPU_SWAP_DIR:-}" ] && ARGS+=(--path "$ZSWAP_GPU_SWAP_DIR")
    # shellcheck disable=SC2206
    timeout 300 $VPY "$ROOT/benches/bench_gpu.py" "${ARGS[@]}" ${ZSWAP_GPU_BENCH_ARGS:-} | tee "$OUT/bench_gpu.txt"
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
