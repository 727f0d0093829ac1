"""Smoke runs of the benchmark scripts that have no test of their own, at tiny sizes: they run, and their
lines and snapshots carry what they say (a bench that reads a renamed internal must fail here, not print
stale figures)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"
ROUND = re.compile(r"round (\d): zswap [\d.]+ s/step, plain [\d.]+ s/step, step/max\(I/O, compute\) [\d.]+×")


def test_bench_step_bytes_rounds_alternate_and_pair(tmp_path):
    args = [sys.executable, str(BENCHES / "bench_step_bytes.py"), "--size", "8MiB", "--steps", "2"]
    args += ["--path", str(tmp_path), "--rounds", "2", "--no-variants", "--no-deepspeed", "--output-pool"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    done = [line.strip() for line in lines if line.strip().endswith(": done")]
    assert done == ["zswap: done", "plain PyTorch in RAM: done"] * 2  # alternating, back to back
    rounds = [line for line in lines if line.startswith("round ")]
    assert [m.group(1) for m in map(ROUND.fullmatch, rounds) if m] == ["1", "2"] and len(rounds) == 2
    zswap = next(line for line in lines if line.startswith("zswap "))
    assert zswap.split()[1] != "failed" and "× (median)" in zswap
    assert not any(line.startswith("zswap, ") for line in lines)  # --no-variants
    assert "median of 2 rounds" in lines[-2]


def test_bench_step_bytes_refuses_zero_rounds():
    args = [sys.executable, str(BENCHES / "bench_step_bytes.py"), "--rounds", "0"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--rounds must be at least 1, got 0" in out.stderr


def test_bench_memory_snapshots_the_engine_at_its_peak(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_memory

    r = bench_memory._child_demo(str(tmp_path), 32 << 20, 1, output_pool=True)
    peak = r["at_peak"]
    assert "error" not in peak, peak["error"]
    assert peak["phase"].startswith(("between passes", "a pass", "backward"))
    for key in ("fetch", "persistent", "output_pool", "output_pool_idle", "held", "heap_mapped"):
        assert key in peak
    assert "no snapshot" not in bench_memory._at_peak(r, 0)
