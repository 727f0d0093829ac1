"""Smoke run of `benches/bench_phases.py` at a tiny size: it runs, and its lines carry what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "bench_phases.py"
STEP = re.compile(
    r"^step (\d): ([\d.]+) s = forward ([\d.]+) \+ backward ([\d.]+) \+ step ([\d.]+) \| CPU user [\d.]+ s, "
    r"sys [\d.]+ s, \d+ minor faults, \d+ voluntary switches, loss ([\d.]+)$"
)
PHASE = re.compile(
    r"^    (forward |backward) \[us +\d+ sy +\d+ id +\d+ wa +\d+ st +\d+ \| disk r [\d.]+ w [\d.]+ GB/s"
)


@pytest.mark.parametrize("flags", [[], ["--plain"], ["--output-pool"], ["--clip", "0.5"]])
def test_bench_phases_prints_each_step_and_phase(tmp_path, flags):
    args = [sys.executable, str(SCRIPT), "--size", "8MiB", "--steps", "2", "--path", str(tmp_path)]
    out = subprocess.run(args + flags, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    steps = [m for m in map(STEP.match, lines) if m]
    assert [int(m.group(1)) for m in steps] == [0, 1]
    for m in steps:
        total, parts = float(m.group(2)), sum(float(m.group(i)) for i in (3, 4, 5))
        assert abs(total - parts) <= 0.02  # the three phases add up to the step (each rounded to 0.01)
    losses = [float(m.group(6)) for m in steps]
    assert losses[1] < losses[0]  # it trains
    assert sum(1 for line in lines if PHASE.match(line)) == 4
    steps_ran = [line.split("] ")[-1] for line in lines if line.startswith("    step     [")]
    assert len(steps_ran) == 2
    if "--clip" in flags:  # how each zswap step ran: the first makes the records (ordinary)
        assert steps_ran[0] == "0/0/0/1 b/d/r/o" and steps_ran[1].endswith(" b/d/r/o")
    assert lines[-1].startswith("VmHWM:")
    pool = re.fullmatch(r"output pool: (\d+) buffers made, (\d+) outputs reused", lines[-2])
    assert (pool is None) == (flags == ["--plain"])
    if not flags:  # off by default
        assert pool is not None and pool.groups() == ("0", "0")
