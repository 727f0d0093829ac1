"""Gathers and gradient reductions of ranks on one host through shared memory (`zswap._hostcomm`): bitwise
gloo's results, the fall back to gloo where a rank cannot map the others' memory, and a peer that exits or
never comes named instead of waited for: see `_hostcomm_dist_worker.py`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from zswap import _hostcomm

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_hostcomm_dist_worker.py")


def run_case(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int = 2) -> None:
    monkeypatch.setenv("ZSWAP_HOSTCOMM_CASE", case)
    run_ranks(WORKER, tmp_path, world=world, timeout=120)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_equal_gloo_bitwise_and_leave_nothing_in_dev_shm(world, tmp_path, monkeypatch):
    run_case("exchange", tmp_path, monkeypatch, world)


@pytest.mark.dist
@pytest.mark.parametrize(
    "case",
    [
        pytest.param("refused", id="a rank that cannot map the others keeps every rank on gloo, says why"),
        pytest.param("other_host", id="ranks on other hosts keep gloo without a word"),
        pytest.param("peer_exits", id="a peer that exits is named, and the channel breaks"),
        pytest.param("timeout", id="a peer that never comes times out"),
        pytest.param("stall", id="a long wait for a peer says so once, then goes on"),
    ],
)
def test_where_shared_memory_cannot_serve(case, tmp_path, monkeypatch):
    run_case(case, tmp_path, monkeypatch)


@pytest.mark.dist
@pytest.mark.parametrize("where", ["every rank", "one rank"])
def test_turned_off_by_the_environment(where, tmp_path, monkeypatch):
    if where == "every rank":
        monkeypatch.setenv("ZSWAP_HOST_COLLECTIVES", "0")
    else:
        monkeypatch.delenv("ZSWAP_HOST_COLLECTIVES", raising=False)  # the worker turns it off on rank 1
    run_case("off", tmp_path, monkeypatch)


@pytest.mark.dist
def test_a_rank_waiting_for_a_reduction_its_peer_never_runs_raises_at_once(tmp_path):
    """One rank reduces one gradient more than the other (a branch detached on one rank): the other went on
    to engine.step()'s check of the ranks, so the first waited in shared memory until the process group's
    30-minute timeout. It sees the peer parked in the check and raises `RanksDivergedError`."""
    run_ranks(Path(__file__).with_name("_diverged_dist_worker.py"), tmp_path, timeout=120)


def test_a_zombie_counts_as_exited():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert _hostcomm._alive(child.pid)
    deadline = time.monotonic() + 30
    while _hostcomm._alive(child.pid):  # it exits, and stays a zombie until waited for
        assert time.monotonic() < deadline, "a zombie was taken for a running process"
        time.sleep(0.05)
    assert child.poll() == 0  # reaped only now


def test_a_killed_ranks_segment_is_swept_by_the_next_one_made():
    """A rank killed while it waited for its peers to map its segment left it in /dev/shm for good; the next
    segment made removes it: only a gone process's, untouched for `STALE_AFTER`, named as zswap names it."""
    import os
    import secrets
    import subprocess
    import time

    from zswap import _hostcomm

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = gone.pid  # a pid that no longer runs
    paths = {
        kind: Path("/dev/shm") / f"zswap-{pid}-{secrets.token_hex(8)}"
        for kind, pid in (("stale", dead), ("alive", os.getpid()), ("fresh", dead))
    }
    other = Path("/dev/shm") / f"zswap-{dead}-not-ours"
    old = time.time() - _hostcomm.STALE_AFTER - 5
    for kind, path in [*paths.items(), ("other", other)]:
        path.write_bytes(b"x")
        if kind != "fresh":
            os.utime(path, (old, old))
    try:
        path, mm, _ = _hostcomm._create(1 << 16)
        mm.close()
        os.unlink(path)
        assert not paths["stale"].exists()
        assert paths["alive"].exists() and paths["fresh"].exists() and other.exists()
    finally:
        for p in [*paths.values(), other]:
            p.unlink(missing_ok=True)
