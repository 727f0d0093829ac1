#!/usr/bin/env bash
# Installs dist/'s wheel into a fresh venv of the given interpreter (default python3) and smoke-tests it
# with no Rust toolchain on PATH: what a user of the published wheel gets. Dependencies come as binary
# wheels only (--only-binary :all:), from pip's cache when an earlier install downloaded them.
#   .ci/wheel_smoke.sh [python]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-python3}
shopt -s nullglob
wheels=("$root"/dist/zswap-*-cp310-abi3-manylinux_*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "wheel_smoke: want exactly one abi3 manylinux wheel in dist/ (make wheel), found ${#wheels[@]}" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/zswap-smoke-XXXXXX")
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --only-binary :all: "${wheels[0]}"
# A PATH without cargo/rustc: the venv, plus /usr/bin:/bin unless a distribution toolchain lives there.
path="$work/venv/bin:/usr/bin:/bin"
if PATH=$path command -v cargo >/dev/null || PATH=$path command -v rustc >/dev/null; then
    path="$work/venv/bin"
fi
cd "$work"  # not the checkout: `import zswap` must find the installed wheel
env -u PYTHONPATH PATH="$path" HOME="$work" "$work/venv/bin/python" "$root/.ci/wheel_smoke.py" "${wheels[0]}"
