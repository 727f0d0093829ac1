"""One rank of tests/test_hostcomm.py: ``python _hostcomm_dist_worker.py RANK WORLD INIT_FILE TMP``; the case
to run is ``ZSWAP_HOSTCOMM_CASE``."""

from __future__ import annotations

import datetime
import glob
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zswap import ZswapError, ZswapWarning, _dist, _hostcomm

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def sizes(dtype: torch.dtype, world: int) -> list[int]:
    """Elements per rank: none, one, odd, and past one slot (several rounds, the last one partial)."""
    one_slot = _hostcomm.SLOT // (world * torch.empty((), dtype=dtype).element_size())
    return [0, 1, 7, 1000, 2 * one_slot + 3]


def values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=g)
    return torch.randn(n, generator=g).to(dtype)


def exchange(rank: int, world: int) -> None:
    """Gathers and reduce-scatters through the channel equal gloo's, bitwise, every size and dtype; the sum
    goes in rank order; nothing of the channel stays in /dev/shm."""
    ch = _dist.host_channel(None)
    assert ch is not None and ch.world == world and ch.rank == rank
    assert _dist.host_channel(None) is ch  # opened once per group
    assert not glob.glob(f"/dev/shm/zswap-{os.getpid()}-*"), "the segment was left in /dev/shm"
    for dtype in DTYPES:
        for n in sizes(dtype, world):
            local = values(n, dtype, seed=10 * rank + n)
            out = torch.full((world * n,), 7, dtype=dtype)
            before = ch.rounds
            _dist.all_gather_flat(out, local, None)
            assert ch.rounds - before == -(-n * out.element_size() // _hostcomm.SLOT), (dtype, n)
            want = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(want, local)
            assert torch.equal(out, want), ("gather", dtype, n)

            flat = values(world * n, dtype, seed=100 + 10 * rank + n)
            got = torch.full((n,), 7, dtype=dtype)
            ch.sum_slices(got, flat)
            every = [torch.empty(world * n, dtype=dtype) for _ in range(world)]
            dist.all_gather(every, flat)
            slices = [f[rank * n : (rank + 1) * n] for f in every]
            expect = slices[0] + slices[1]
            for s in slices[2:]:
                expect = expect + s
            assert torch.equal(got, expect), ("reduce", dtype, n)


def opened_with_warnings(rank: int, world: int) -> tuple[_hostcomm.Channel | None, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ch = _dist.host_channel(None)
    return ch, [str(w.message) for w in seen if issubclass(w.category, ZswapWarning)]


def gather_through_gloo(rank: int, world: int) -> None:
    out, local = torch.empty(world * 3), torch.full((3,), float(rank))
    _dist.all_gather_flat(out, local, None)
    assert out.tolist() == [float(r) for r in range(world) for _ in range(3)]


def refused(rank: int, world: int) -> None:
    """One rank that cannot map a peer's segment: every rank keeps gloo, says why once, and gathers work."""
    if rank == 1:

        def no(*args: object) -> None:
            raise PermissionError("not allowed here")

        _hostcomm._attach = no  # type: ignore[assignment]
    ch, said = opened_with_warnings(rank, world)
    assert ch is None
    assert len(said) == 1 and said[0].startswith(
        f"the {world} ranks of this process group share one host but not memory (rank 1: cannot map another "
        "rank's segment: not allowed here): gloo carries"
    ), said
    gather_through_gloo(rank, world)


def other_host(rank: int, world: int) -> None:
    """Ranks on different hosts keep gloo, and nothing is said: that is how it has to be."""
    if rank == 1:
        _hostcomm._host = lambda: "elsewhere"
    ch, said = opened_with_warnings(rank, world)
    assert ch is None and said == [], said
    assert not glob.glob(f"/dev/shm/zswap-{os.getpid()}-*"), "the segment was left in /dev/shm"
    gather_through_gloo(rank, world)


def off(rank: int, world: int) -> None:
    """``ZSWAP_HOST_COLLECTIVES=0`` on every rank, or on one only: no channel on any, and nothing said."""
    if os.environ.get("ZSWAP_HOST_COLLECTIVES") is None and rank == 1:
        os.environ["ZSWAP_HOST_COLLECTIVES"] = "0"
    assert _hostcomm.enabled() == (os.environ.get("ZSWAP_HOST_COLLECTIVES") != "0")
    ch, said = opened_with_warnings(rank, world)
    assert ch is None and said == [], said
    gather_through_gloo(rank, world)


def peer_exits(rank: int, world: int) -> None:
    """A peer that exits mid-collective is named within seconds; the channel then refuses every use."""
    ch = _dist.host_channel(None)
    assert ch is not None
    dist.barrier()
    if rank == 1:
        os._exit(0)  # exits instead of joining the gather (its parent reaps it only later: a zombie)
    start = time.monotonic()
    try:
        ch.all_gather(torch.empty(2 * world), torch.ones(2))
    except ZswapError as e:
        assert f"rank 1 (pid {ch._pids[1]}) exited while rank 0 waited for it in a gather" in str(e), e
    else:
        raise AssertionError("the gather went on without rank 1")
    assert time.monotonic() - start < 10
    try:
        ch.sum_slices(torch.empty(2), torch.ones(2 * world))
    except ZswapError as e:
        assert "broke earlier (a gather, round 1, was interrupted: ZswapError" in str(e), e
    else:
        raise AssertionError("a broken channel was used again")


def timeout(rank: int, world: int) -> None:
    """A peer alive but not coming: the wait gives up at the process group's timeout (as gloo's would; not
    torch's 30-minute default)."""
    ch = _dist.host_channel(None)
    assert ch is not None
    dist.barrier()
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    dist.set_timeout(datetime.timedelta(seconds=2))  # (init_process_group's timeout= sets the same)
    try:
        ch.all_gather(torch.empty(2 * world), torch.ones(2))
    except ZswapError as e:
        said = r"rank 0 waited \d+ s for rank 1 in a gather \(shared-memory round 1\), past the process"
        assert re.search(said + r" group's timeout of 2 s", str(e)), e
    else:
        raise AssertionError("the gather went on without rank 1")


def stall(rank: int, world: int) -> None:
    """A peer late past `STALL_WARNING`: the wait says so once (where a collective was called on some ranks
    only, the group's timeout is half an hour away), then goes on when the peer comes."""
    ch = _dist.host_channel(None)
    assert ch is not None
    dist.barrier()
    _hostcomm.STALL_WARNING = 1.0
    if rank == 1:
        time.sleep(3.5)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = torch.empty(2 * world)
        ch.all_gather(out, torch.full((2,), float(rank)))
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
    said = [str(w.message) for w in got if issubclass(w.category, ZswapWarning)]
    if rank == 0:
        assert len(said) == 1 and re.match(r"rank 0 has waited \d+ s for rank 1 in a gather", said[0]), said
        assert "call it on every rank: zswap's state_dict()" in said[0], said
    else:
        assert not said, said


CASES = {f.__name__: f for f in (exchange, refused, other_host, off, peer_exits, timeout, stall)}


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    CASES[os.environ["ZSWAP_HOSTCOMM_CASE"]](rank, world)
    if os.environ["ZSWAP_HOSTCOMM_CASE"] not in ("peer_exits", "timeout"):
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
