"""The wheel's smoke test, run by wheel_smoke.sh inside the fresh venv: import, a bitwise SwapEngine round
trip, the command line (`--version`, `python -m zswap`, `env --json`, a 64 MiB demo), with no Rust toolchain
reachable."""

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

whl = Path(sys.argv[1])
assert shutil.which("cargo") is None and shutil.which("rustc") is None, "a Rust toolchain is on PATH"

import torch  # noqa: E402

import zswap  # noqa: E402
from zswap import envreport  # noqa: E402

version = whl.name.split("-")[1]
here = Path(zswap.__file__).resolve()
assert here.is_relative_to(Path(sys.prefix).resolve()), f"zswap imported from {here}, not the venv"
assert zswap.__version__ == version, (zswap.__version__, version)
print(f"import: zswap {zswap.__version__} from {here.parent}, Python {sys.version.split()[0]}, torch {torch.__version__}")

with tempfile.TemporaryDirectory() as d, zswap.SwapEngine(d) as eng:
    x = torch.randn(3 << 18, generator=torch.Generator().manual_seed(0))
    eng.write("x", x).wait()
    y = torch.empty_like(x)
    eng.read("x", y).wait()
    assert torch.equal(x.view(torch.int32), y.view(torch.int32)), "round trip through torch tensors"
    e = eng.empty(x.shape, torch.float32)
    eng.read("x", e).wait()
    assert torch.equal(x.view(torch.int32), e.view(torch.int32)), "round trip into engine memory"
    print(f"SwapEngine round trip: 3 MiB bitwise equal ({eng.info['backend']}, direct I/O {eng.info['direct']})")


def run(*args: str) -> str:
    t0 = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    print(f"{' '.join(args)}: ok in {time.perf_counter() - t0:.1f} s")
    return out.stdout


assert run("zswap", "--version") == f"zswap {version}\n"
assert run(sys.executable, "-m", "zswap", "--version") == f"zswap {version}\n"
report = json.loads(run("zswap", "env", "--json"))
assert list(report["checks"]) == list(envreport.CHECKS)
assert all(c["ok"] or c["reason"] for c in report["checks"].values())
demo = run("zswap", "demo", "--size", "64MiB", "--steps", "1")
assert "step 1: loss" in demo, demo
print("wheel smoke test passed")
