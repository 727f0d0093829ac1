"""Smoke runs of the benchmark scripts that have no test of their own, at tiny sizes: they run, and their
lines and snapshots carry what they say (a bench that reads a renamed internal must fail here, not print
stale figures)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import zswap

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


def test_bench_step_matrix_reads_how_the_steps_ran(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_step_matrix

    assert bench_step_matrix.early_counts({}, {"bytes_read": 7}) == {}
    before = {"steps_in_backward": 2, "steps_deferred": 0, "steps_redone": 1, "steps_ordinary": 1}
    after = {
        "steps_in_backward": 5,
        "steps_deferred": 1,
        "steps_redone": 1,
        "steps_ordinary": 3,
        "steps_ordinary_reason": "engine.early_step is False",
    }
    got = bench_step_matrix.early_counts(before, after)
    assert [got[k] for k in bench_step_matrix.STEP_KEYS] == [3, 1, 0, 2]
    assert got["reason"] == "engine.early_step is False"
    assert (
        bench_step_matrix.early_counts({"steps_ordinary": 9}, {"steps_ordinary": 4})["ordinary"] == 4
    )  # reset
    part = "the copies … exceed the early step's cap of 9 bytes: 1 of 2 params updated in backward"
    assert bench_step_matrix.early_counts({}, {**after, "steps_partly_reason": part})["part"] == part


@pytest.mark.parametrize("tiers", [("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "cpu")])
def test_bench_step_matrix_puts_params_and_states_where_asked(tiers, tmp_path, monkeypatch):
    """``--params`` / ``--states``: the row's config (zswap's and DeepSpeed's) keeps them there."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_step_matrix

    monkeypatch.setattr(bench_step_matrix, "TIERS", dict(zip(bench_step_matrix.TIERS, tiers, strict=True)))
    cfg = zswap.load_config(bench_step_matrix.row_config(tmp_path, 1 << 20, 1.0, "bf16"))
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == tiers
    assert cfg.gradient_clipping == 1.0


MATRIX_ROWS = ["cpu/1r/clip-off/fp32", "cpu/1r/clip-1/bf16", "cpu/2r/clip-1/fp32"]
NUMBER = re.compile(r"\d+\.\d\d")


@pytest.mark.slow
@pytest.mark.dist
def test_bench_step_matrix_prints_every_row_with_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_step_matrix

    rows = MATRIX_ROWS  # both clippings and dtypes on one rank, and a row of two
    args = ["--size", "4MiB", "--steps", "3", "--rows", ",".join(rows), "--path", str(tmp_path)]
    assert bench_step_matrix.main([*args, "--no-deepspeed", "--timeout", "300"]) == 0
    out = capsys.readouterr().out
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "/" in line[:12]]
    assert [cells[0][2:] for cells in table] == rows
    for cells in table:
        name, per_rank = cells[0][2:], 2 if "/2r/" in cells[0] else 1
        assert len(cells) == len(bench_step_matrix.COLUMNS), cells
        for read_or_written in cells[1:3]:  # one figure per rank
            assert [bool(NUMBER.fullmatch(x)) for x in read_or_written.split("/")] == [True] * per_rank, name
        assert all(NUMBER.fullmatch(x) for x in cells[3:8]), (name, cells[3:8])
        assert float(cells[1].split("/")[0]) > 0 and float(cells[2].split("/")[0]) > 0, name
        assert cells[8] == "DeepSpeed: not run (--no-deepspeed)"
        assert re.fullmatch(r"\d+/\d+/\d+/\d+ \|", cells[-1]), cells[-1]  # steps b/d/r/o
    assert list(tmp_path.iterdir()) == []  # swap files, logs and the rate file removed


def test_bench_step_setups_prints_every_setup_at_the_fast_path_bound(tmp_path, monkeypatch, capsys):
    """Every setup of issue 29's table moves at most the fast path's 2 R / 3 W per optimizer step (with
    accumulation on the stand-in device too: the second micro-batch's first params are seeded from host
    copies of the first's; 2 ranks: half of it per rank; bf16: 6 R / 7 W of the bf16 bytes, the float32
    sums of accumulation kept within the live budget's elements), less than its ordinary step; bytes are
    deterministic. The lr set at the last step only is redone there: that once, the ordinary step's bytes."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_step_setups

    assert bench_step_setups.main(["--path", str(tmp_path), "--steps", "3"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [r[0][2:] for r in rows] == list(bench_step_setups.SETUPS)
    for r in rows:
        read, written, ord_read, ord_written = map(float, r[1:5])
        if "last step only" in r[0]:  # ran in backward, its params redone at the step: the ordinary
            # step's bytes and the committed params read back (the ordinary step seeds part of the
            # forward after it: it reads less there)
            assert (read, written, r[5]) == (5.0, 4.0, "1/0/0 |") and read <= ord_read + 1.02, r
            continue
        if "first micro-batch only" in r[0]:  # the third layer arrives at backward's end with its sum, its
            # partition read then (the ordinary step before); the branch also moves the prefetch trace
            assert r[5] == "1/0/0 |" and read <= 3.5 and written <= 3.0 and read < ord_read - 4, r
            continue
        share = 0.5 if r[0].startswith("| 2 ranks") else 1.0  # per rank: its half of the model
        if "bf16" in r[0]:  # of the bf16 bytes, fp32 masters in the records: 6 R / 7 W
            assert (read, written) == (6.0, 7.0) and written < ord_written, r
            continue
        assert read <= 2.0 * share and written <= 3.0 * share, r
        # Less than the ordinary step, but where that reads nothing either (states in memory with the
        # params there or resident: only the params' one write-through, if any, moves).
        as_ordinary = (read, written) == (ord_read, ord_written)
        assert read + written < ord_read + ord_written or (as_ordinary and read == 0), r
        if "max_in_cpu" in r[0] and "states in CPU memory" in r[0]:  # on the stand-in device too
            assert (read, written, ord_read) == (0.0, 1.0, 0.0), r
    assert list(tmp_path.iterdir()) == []
