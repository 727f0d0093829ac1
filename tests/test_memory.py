"""The memory account: every engine buffer counted under its purpose and counted back when unmapped,
`Engine.stats()`'s ``mem_*`` lines adding up to what the engines hold, and glibc's mmap threshold fixed so
freed tensors leave the process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import buffers, memory
from zswap.storage import INFLIGHT_WRITE_BYTES
from zswap.swap import SwapEngine


def _engine(tmp_path: Path) -> SwapEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return SwapEngine(tmp_path)


def test_a_buffer_collected_inside_a_ledger_update_is_counted_back_without_deadlock(tmp_path):
    # The collector runs finalizers inside any allocation, also one made while the ledger's lock is
    # held (this hung the suite once): a buffer freed there must neither block nor be lost.
    eng = _engine(tmp_path)
    try:
        gc.collect()
        before = memory.live()
        cycle: list[Any] = [eng.empty(1 << 16, torch.uint8)]
        cycle.append(cycle)  # only the collector can free it
        del cycle
        done = threading.Event()

        def collect_while_busy() -> None:
            with memory._lock:
                gc.collect()
            done.set()

        worker = threading.Thread(target=collect_while_busy, daemon=True)
        worker.start()
        worker.join(30)
        assert done.is_set(), "a finalizer blocked on the ledger's lock"
        assert memory.live() == before
        assert eng.stats()["live_buffers"] == 0
    finally:
        eng.close()


def test_a_buffer_counts_under_its_purpose_until_its_last_view_goes(tmp_path):
    eng = _engine(tmp_path)
    try:
        gc.collect()
        before, count = memory.live(), memory.buffers()
        with memory.purpose("grads"):
            t = eng.empty(1000, torch.float32)
        u = eng.empty((3, 5), torch.float64)  # outside any purpose: "other"
        now = memory.live()
        assert eng.stats()["live_buffers"] == 2 == memory.buffers() - count
        grown = {k: now[k] - before[k] for k in now}
        page = os.sysconf("SC_PAGE_SIZE")
        assert grown["fetch"] == grown["optimizer"] == 0
        assert grown["grads"] >= 4000 and grown["grads"] % page == 0
        assert grown["other"] >= 120 and grown["other"] % page == 0
        view = t[10:20]
        del t
        gc.collect()
        assert memory.live()["grads"] == now["grads"]  # a view keeps the mapping: still counted
        del view
        gc.collect()
        assert memory.live()["grads"] == before["grads"]
        assert eng.stats()["live_buffers"] == 1 == memory.buffers() - count
        del u
        gc.collect()
        assert memory.live() == before and memory.buffers() == count
        assert eng.stats()["live_buffers"] == 0
    finally:
        eng.close()


def test_purposes_are_checked_and_peaks_reset_to_what_is_live(tmp_path):
    msg = "unknown buffer purpose 'cache'; one of fetch, grads, optimizer, early_step, other"
    with pytest.raises(ValueError, match=msg), memory.purpose("cache"):
        pass
    eng = _engine(tmp_path)
    try:
        gc.collect()
        memory.reset_peaks()
        base = memory.live()["fetch"]
        with memory.purpose("fetch"):
            a = eng.empty(1 << 16)
            high = memory.live()["fetch"]
            b = eng.empty(1 << 16)
            top = memory.live()["fetch"]
        del b
        gc.collect()
        assert memory.peaks()["fetch"] == top > high > base
        memory.reset_peaks()
        assert memory.peaks()["fetch"] == high == memory.live()["fetch"]
        assert memory.peaks()["total"] == sum(memory.live().values())
        del a
    finally:
        eng.close()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _config(tmp_path: Path) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 16384,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }


def _built(cfg: dict, make: type[nn.Module]) -> tuple[nn.Module, Any]:
    """``make()`` built under ``zswap.Init(cfg)`` and its CPU engine (zswap's fallback warnings muted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            net = make()
        return net, zswap.initialize(net, cfg, device="cpu")


def _mem(s: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in s.items() if k.startswith("mem_")}


def test_engine_stats_add_up_and_buffers_are_counted_back_on_close(tmp_path):
    gc.collect()
    start, start_count = memory.live(), memory.buffers()
    cfg = _config(tmp_path)
    torch.manual_seed(0)
    net, engine = _built(cfg, _Net)
    engine.grad_stash_bytes = 0  # gradients written and read back: grad buffers take part
    x = torch.randn(4, 64)
    for _ in range(2):
        net(x).square().sum().backward()
        engine.step()
    s = engine.stats()
    m = _mem(s)
    parts = ("mem_fetch_buffers", "mem_grad_buffers", "mem_optimizer_ring", "mem_early_step_buffers")
    parts += ("mem_other_buffers",)
    assert m["mem_engine_buffers"] == sum(m[k] for k in parts)
    # the ledger is the process's: buffers earlier tests' objects still hold count too
    assert m["mem_engine_buffers"] == sum(memory.live().values())
    assert m["mem_engine_buffers"] - sum(start.values()) > 0
    # every engine buffer this process maps is counted: the ledger's count is the Rust registry's
    swap = zswap.param_state(net.a.weight).store.engine  # type: ignore[union-attr]
    assert memory.buffers() - start_count == swap.stats()["live_buffers"]
    # the ring: three records (read ahead, in process, written behind) of the largest sub-group
    ring = engine.optimizer._store._ring
    assert len(ring) == 3 and m["mem_optimizer_ring"] >= sum(r.nbytes for r in ring)
    assert m["mem_peak_optimizer_ring"] >= m["mem_optimizer_ring"] > 0
    assert m["mem_peak_fetch_buffers"] >= m["mem_fetch_buffers"] > 0  # the fetch pool, kept for reuse
    # what may be live at once, and what the early step may hold (its param copies come from the pool)
    early = engine._early.cap if engine._early is not None else 0
    assert m["mem_fetch_pool_limit"] == (s["max_live_elements"] + s["persistent_elements"]) * 4 + early
    assert m["mem_peak_grad_buffers"] > 0  # gradient partitions read for the step
    assert m["mem_peak_engine_buffers"] <= sum(m[f"mem_peak_{k[4:]}"] for k in parts)
    assert m["mem_bounce"] == swap.info["bounce_bytes"]
    assert m["mem_write_queue_limit"] == INFLIGHT_WRITE_BYTES  # params, gradients and records: one queue
    assert 0 <= m["mem_write_queue"] <= m["mem_write_queue_limit"]
    assert m["mem_init_touched"] == 0 and m["mem_init_touched_limit"] == zswap.init.TOUCH_BUDGET_BYTES
    assert m["mem_rss"] > 0 and m["mem_heap_in_use"] > 0
    engine.stats(reset=True)
    after = _mem(engine.stats())
    assert after["mem_peak_engine_buffers"] == after["mem_engine_buffers"]  # peaks restart from what is live
    engine.close()
    del ring, s
    gc.collect()
    # closed: the pool and the ring are given back; only what the params still need stays (nothing here)
    assert memory.live() == start and memory.buffers() == start_count


def test_persistent_params_have_their_own_line_within_the_fetch_buffers(tmp_path):
    cfg = _config(tmp_path)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 256  # the three biases
    torch.manual_seed(0)
    net, engine = _built(cfg, _Net)
    biases = sum(zswap.param_state(m.bias).numel for m in (net.a, net.b, net.c))  # type: ignore[union-attr]
    for _ in range(2):
        s = engine.stats()
        assert s["persistent_elements"] == biases == 256 + 256 + 8
        # each buffer as mapped: a page at least (what the ledger counts, so the fetch lines add up)
        mapped = sum(buffers.capacity(4 * n) for n in (256, 256, 8))
        assert (
            s["mem_persistent_params"] == mapped == 3 * os.sysconf("SC_PAGE_SIZE") <= s["mem_fetch_buffers"]
        )
        net(torch.randn(4, 64)).square().sum().backward()
        engine.step()  # released and fetched again after the step
    engine.close()


def test_init_reports_touched_bytes_while_it_holds_them(tmp_path):
    cfg = _config(tmp_path)
    seen: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            net = _Net()
            assert zswap.init.touched_bytes() == 0
            nn.init.zeros_(net.b.weight)  # a write after partitioning: gathered and held until the next sync
            seen.append(zswap.init.touched_bytes())
    assert seen == [256 * 256 * 4]
    assert zswap.init.touched_bytes() == 0


_HEAP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from zswap import buffers, memory
    bounded = memory.bound_heap()
    a = memory.heap()["heap_mapped"]
    t = torch.empty(3 << 20, dtype=torch.uint8)
    t.fill_(1)
    b = memory.heap()["heap_mapped"]
    del t
    c = memory.heap()["heap_mapped"]
    # the dynamic threshold would now have risen to 3 MiB: a 2 MiB tensor would come from the heap
    u = torch.empty(2 << 20, dtype=torch.uint8)
    d = memory.heap()["heap_mapped"]
    print(json.dumps([bounded, a, b, c, d]))
    """
)


@pytest.mark.skipif(memory._LIBC is None, reason="glibc only")
@pytest.mark.parametrize("env", [{}, {"MALLOC_MMAP_THRESHOLD_": "67108864"}, {"ZSWAP_MALLOC_TUNING": "0"}])
def test_bound_heap_maps_large_tensors_by_themselves(env):
    import json

    clean = {
        k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "ZSWAP_MALLOC_TUNING")
    }
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_SCRIPT],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    bounded, a, b, c, d = json.loads(out.stdout)
    if env:
        assert bounded is False  # the user's own threshold (or the opt-out) is left alone
        if "MALLOC_MMAP_THRESHOLD_" in env:
            assert b == a  # 3 MiB < 64 MiB: from the heap
        else:
            assert d == c  # glibc's dynamic threshold rose past 2 MiB after the first free
        return
    assert bounded is True
    assert b - a >= 3 << 20 and c == a  # mapped by itself, unmapped on free
    assert d - c >= 2 << 20  # still mapped by itself: the threshold did not move


def test_the_demo_budgets_do_not_grow_with_the_model(tmp_path):
    from zswap import demo
    from zswap.optim._layout import default_sub_group_size

    small, big = demo.Shape.for_bytes(768 << 20), demo.Shape.for_bytes(6 << 30)
    caps = {"max_live": demo.MAX_LIVE, "sub_group": demo.SUB_GROUP}  # what demo.run passes
    z_small = demo.default_config(tmp_path, small, **caps)["zero_optimization"]
    z_big = demo.default_config(tmp_path, big, **caps)["zero_optimization"]
    uncapped = demo.default_config(tmp_path, big)["zero_optimization"]  # bench_gpu's call: as before
    assert uncapped["stage3_max_live_parameters"] == big.params // demo.LIVE_FRACTION
    assert "sub_group_size" not in uncapped
    assert z_small["stage3_max_live_parameters"] == small.params // demo.LIVE_FRACTION  # 1/6, under the cap
    assert z_big["stage3_max_live_parameters"] == demo.MAX_LIVE < big.params // demo.LIVE_FRACTION
    assert z_small["sub_group_size"] == default_sub_group_size(small.params) < demo.SUB_GROUP
    assert z_big["sub_group_size"] == demo.SUB_GROUP


class _Wide(nn.Module):
    """One weight of exactly 1 MiB (its early-step copy is an engine buffer), the rest under it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 512), nn.Linear(512, 512), nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_the_early_steps_copies_and_gradients_are_counted_while_held_and_counted_back(tmp_path):
    from zswap import earlystep

    gc.collect()
    start, start_held = memory.live(), memory.held()
    cfg = _config(tmp_path)
    torch.manual_seed(0)
    net, engine = _built(cfg, _Wide)
    early = engine._early
    assert early is not None
    x = torch.randn(4, 64)
    net(x).square().sum().backward()
    engine.step()  # the first step places the records: never early
    seen: list[tuple[dict[str, int], int, list[int], list[int]]] = []
    begin_record = early._ready

    def spy(sg: Any) -> None:  # a record's params are all in: what is held now, before it is written
        waiting = [c.numel() * c.element_size() for _, c, _, _ in early.ready.values() if c.numel()]
        seeds = [c.numel() * c.element_size() for _, c in early.seeds]  # written copies kept for forward
        writing = sum(small for _, small, _ in early.copies)  # small copies being written
        assert early.writing.nbytes == writing
        seen.append((_mem(engine.stats()), early.held, waiting, [*seeds, writing]))
        begin_record(sg)

    early._ready = spy  # type: ignore[method-assign]
    net(x).square().sum().backward()
    assert len(seen) == len(engine.optimizer._sub_groups) > 1
    for m, held, waiting, seeds_writing in seen:
        # each waiting param: its gradient (an ordinary tensor) and its copy (an engine buffer from 1 MiB);
        # each seed: its copy alone; each small copy being written: itself (not in ``held``: in ``copying``)
        *seeds, writing = seeds_writing
        assert held == 2 * sum(waiting) + sum(seeds)
        small = earlystep.ENGINE_COPY
        tensors = sum(2 * n if n < small else n for n in waiting) + sum(n for n in seeds if n < small)
        tensors += writing
        assert m["mem_early_step_tensors"] - start_held["early_step"] == tensors
        assert m["mem_peak_early_step_tensors"] >= m["mem_early_step_tensors"]
        assert m["mem_peak_early_step_buffers"] >= m["mem_early_step_buffers"]
        parts = ("fetch_buffers", "grad_buffers", "optimizer_ring", "early_step_buffers", "other_buffers")
        assert m["mem_engine_buffers"] == sum(m[f"mem_{k}"] for k in parts)
    # the 1 MiB weight's copy is an engine buffer from the params' fetch pool (counted in mem_fetch_buffers)
    # while it waits: it reuses the memory of gathered params let go, so no early-step buffer is made
    big = [m for m, _, waiting, _ in seen if 1 << 20 in waiting]
    assert big and all(m["mem_fetch_buffers"] - start["fetch"] >= 1 << 20 for m in big)
    assert all(m["mem_early_step_buffers"] == start["early_step"] for m, _, _, _ in seen)
    # backward's end wrote every record: the gradients are let go, only seeds' small copies stay
    seeds = sum(c.numel() * c.element_size() for _, c in early.seeds if c.numel() * 4 < earlystep.ENGINE_COPY)
    assert memory.held()["early_step"] - start_held["early_step"] == seeds
    engine.step()
    assert early.commits == 1
    with torch.no_grad():
        net(x)  # the next forward takes the copies kept as seeds, and lets them go after use
    gc.collect()
    after = engine.stats()
    assert after["mem_early_step_tensors"] == start_held["early_step"]
    assert after["mem_early_step_buffers"] == start["early_step"]  # committed and written: unmapped
    # an early step dropped midway (zero_grad after backward) gives back what it held too
    early._ready = begin_record  # type: ignore[method-assign]
    net(x).square().sum().backward()
    engine.zero_grad()
    gc.collect()
    assert memory.held() == start_held and memory.live()["early_step"] == start["early_step"]
    engine.close()


def test_a_holding_counts_its_bytes_back_when_cleared_or_collected():
    msg = "unknown holder 'cache'; one of early_step"
    with pytest.raises(ValueError, match=msg):
        memory.Holding("cache")
    gc.collect()
    base = memory.held()["early_step"]
    memory.reset_peaks()
    h, k = memory.Holding("early_step"), memory.Holding("early_step")
    h.add(1000)
    k.add(24)
    assert memory.held()["early_step"] == base + 1024 == memory.held_peaks()["early_step"]
    h.add(-400)
    h.clear()
    assert h.nbytes == 0 and memory.held()["early_step"] == base + 24
    assert memory.held_peaks()["early_step"] == base + 1024
    memory.reset_peaks()
    assert memory.held_peaks()["early_step"] == base + 24
    del k  # collected with bytes on it
    gc.collect()
    assert memory.held()["early_step"] == base


@pytest.mark.parametrize("close", [True, False])
def test_a_dropped_engine_gives_back_every_buffer_closed_or_not(tmp_path, close):
    # The gradient hooks live on the params, in torch's C++ autograd state the collector cannot see
    # into: when they held the params (or the engine) strongly, an engine dropped without `close` kept
    # its fetch pool and optimizer ring mapped until the process exited.
    gc.collect()
    start, start_count = memory.live(), memory.buffers()

    def train_and_drop() -> None:
        cfg = _config(tmp_path)
        net, engine = _built(cfg, _Net)
        for _ in range(2):
            net(torch.randn(4, 64)).square().sum().backward()
            engine.step()
        assert memory.live()["fetch"] > start["fetch"] and memory.live()["optimizer"] > start["optimizer"]
        if close:
            engine.close()

    train_and_drop()
    gc.collect()
    assert memory.live() == start and memory.buffers() == start_count


def test_a_fetch_pool_miss_first_unmaps_idle_buffers_of_other_sizes(tmp_path):
    """Idle pooled buffers never add to the peak: at the pool's peak in use, a buffer of a new size takes
    the place of idle ones."""
    from zswap.params import NvmeStore

    store = NvmeStore(SwapEngine(str(tmp_path)))
    store.pool_bytes = 1 << 30  # far more than is used: only idleness decides
    a = store._buffer(1 << 18, torch.float32)
    del a  # idle in the pool now
    assert store._pooled == 1 << 20
    b = store._buffer(1 << 17, torch.float32)  # a miss: the idle 1 MiB buffer goes first
    assert store._pooled == 1 << 19 and store._pool[(1 << 17, torch.float32)][0][0] is b
    assert not store._pool.get((1 << 18, torch.float32))
    b_ptr = b.data_ptr()
    c = store._buffer(1 << 17, torch.float32)  # b in use: c is new, and pooled too
    assert c.data_ptr() != b_ptr and store._pooled == 1 << 20  # (it may take a's freed address)
    del b
    assert store._buffer(1 << 17, torch.float32).data_ptr() == b_ptr  # idle again: reused
    store.trim()


def test_below_its_peak_in_use_the_fetch_pool_keeps_idle_buffers_of_other_sizes(tmp_path):
    """The pool maps at most the most bytes it had in use at once: a miss unmaps idle buffers only past
    that, so an idle buffer the peak leaves room for is there for its size's next fetch."""
    from zswap.params import NvmeStore

    mib = 1 << 18  # float32 elements
    store = NvmeStore(SwapEngine(str(tmp_path)))
    store.pool_bytes = 1 << 30
    a, b = store._buffer(mib, torch.float32), store._buffer(mib, torch.float32)
    b_ptr = b.data_ptr()
    del a, b  # 2 MiB were in use at once; both idle now
    c = store._buffer(mib // 2, torch.float32)  # 2.5 MiB would be mapped: one idle 1 MiB buffer goes
    assert store._pooled == 3 << 19 and store._peak_in_use == 2 << 20
    d = store._buffer(mib // 4, torch.float32)  # 1.75 MiB mapped, under the peak: nothing unmapped
    assert store._pooled == 7 << 18 and store._idle() == 1 << 20
    assert store._buffer(mib, torch.float32).data_ptr() == b_ptr  # the idle 1 MiB buffer, reused
    del c, d
    store.trim()


class _Stack(nn.Module):
    """Six 1 MiB weights (each early-step copy an engine buffer from the fetch pool) and small biases."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


WEIGHT = 512 * 512  # elements of one of _Stack's weights: 1 MiB of fp32


def _lent_config(path: Path) -> dict[str, Any]:
    """Three 1 MiB weights' live budget, where the early step's copies must fit beside gathered params."""
    path.mkdir()
    cfg = _config(path)
    cfg["zero_optimization"].update(
        stage3_max_live_parameters=3 * WEIGHT,
        stage3_prefetch_bucket_size=2 * WEIGHT,
        stage3_param_persistence_threshold=512,  # the biases: gathered for good, no step of their own
        sub_group_size=2 * WEIGHT,  # a record spans two weights: the later one's copy waits for the other
    )
    return cfg


def test_the_early_steps_pool_copies_and_seeds_count_in_the_live_budget(tmp_path):
    """In backward the early step holds param copies from the params' fetch pool (waiting for the rest of
    their optimizer record, or kept as seeds for the next forward): the scheduler counts them in its live
    budget (`Scheduler.lent`), so gathered params, prefetches in flight and those copies together never
    exceed it, the fetch ledger stays within the pool, and every copy is counted back once written or
    used; results are bitwise the ordinary step's."""
    from zswap.optim import OffloadedAdamW

    cfg_of = _lent_config

    cfg, ref_cfg = cfg_of(tmp_path / "early"), cfg_of(tmp_path / "ref")
    torch.manual_seed(0)
    net, engine = _built(cfg, _Stack)
    torch.manual_seed(0)
    ref, ref_engine = _built(ref_cfg, _Stack)
    ref_engine.early_step = False
    early, sched = engine._early, engine._sched
    assert early is not None and isinstance(engine.optimizer, OffloadedAdamW)
    pool = engine.stats()["mem_fetch_pool_limit"]
    seen: list[tuple[int, int]] = []  # (gathered + in flight, lent) at each of the scheduler's changes
    note = sched._note_live

    def spy() -> None:
        assert sched.lent() == (early.pooled() + early.in_flight()) // 4 == early.lent() // 4
        seen.append((sched.live, sched.lent()))
        note()

    sched._note_live = spy  # type: ignore[method-assign]
    x = torch.randn(4, 512)
    for it in range(4):
        gc.collect()
        memory.reset_peaks()
        seen.clear()
        for m, e in ((net, engine), (ref, ref_engine)):
            m(x).square().sum().backward()
            e.step()
        peak_fetch = memory.peaks()["fetch"]
        assert all(live + lent <= 3 * WEIGHT for live, lent in seen), (it, max(a + b for a, b in seen))
        if it:  # from the second step on the early step runs: copies were lent, the budget held them
            assert early.commits == it
            assert max(lent for _, lent in seen) >= WEIGHT
            assert max(live + lent for live, lent in seen) == 3 * WEIGHT  # the budget, exactly, not past it
        # the fetch buffers: the pool and what the write queue still held of copies being written
        assert peak_fetch <= pool + INFLIGHT_WRITE_BYTES
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            with zswap.GatheredParameters([p, q]):
                assert torch.equal(p.data, q.data), it
    seeded = _mem(engine.stats())
    assert seeded["mem_fetch_seeds"] >= 4 * WEIGHT  # committed copies waiting for the next pass: a line
    with torch.no_grad():
        net(x)  # takes the seeds
    gc.collect()
    assert early.pooled() == 0 and early.in_flight() == 0 and sched.lent() == 0  # every copy counted back
    assert _mem(engine.stats())["mem_fetch_seeds"] == 0
    s = engine.stats()
    assert s["peak_live_lent_elements"] <= 3 * WEIGHT
    engine.close()
    ref_engine.close()


FETCH_LINES = ("mem_fetch_live", "mem_persistent_params", "mem_early_step_copies", "mem_early_step_writing")
FETCH_LINES += ("mem_fetch_seeds", "mem_fetch_pool_idle", "mem_fetch_elsewhere")


def _own(m: dict[str, int]) -> int:
    return sum(m[k] for k in FETCH_LINES if k != "mem_fetch_elsewhere")


@pytest.mark.parametrize(("threshold", "max_in_cpu"), [(64, 0), (0, 1000)])
def test_on_a_compute_device_no_fetch_line_is_negative(threshold, max_in_cpu, tmp_path):
    """On a compute device the gathered copies of persistent (or ``max_in_cpu``) params are the device's,
    so they are not counted as host fetch buffers (``mem_fetch_elsewhere`` went negative by as much)."""
    from zswap.device import StandInDevice

    cfg = {
        "zero_optimization": {
            "stage3_param_persistence_threshold": threshold,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": max_in_cpu},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with zswap.Init(cfg):
        m = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    with zswap.initialize(m, cfg, device=StandInDevice()) as engine:
        for _ in range(2):
            engine.backward(m(torch.randn(2, 8)).sum())
            engine.step()
            lines = _mem(engine.stats())
            assert all(v >= 0 for v in lines.values()), lines
            assert sum(lines[k] for k in FETCH_LINES) == lines["mem_fetch_buffers"]


def test_the_fetch_buffers_add_up_by_holder_and_a_written_copy_is_counted_back_as_idle(tmp_path):
    """``mem_fetch_buffers`` split by who holds each buffer (`zswap.buffers.fetch_lines`): the lines add up
    at every moment; between passes an engine's own buffers are all on its lines (what is elsewhere is the
    other engine's); a copy whose write the early step lands leaves ``mem_early_step_writing`` (and the
    live budget's ``lent``) and is back in the pool as idle, byte for byte; results are bitwise the
    ordinary step's."""
    cfg_of = _lent_config

    gc.collect()
    base = memory.live()["fetch"]  # what earlier tests' objects still map
    torch.manual_seed(0)
    net, engine = _built(cfg_of(tmp_path / "early"), _Stack)
    torch.manual_seed(0)
    ref, ref_engine = _built(cfg_of(tmp_path / "ref"), _Stack)
    ref_engine.early_step = False
    early = engine._early
    assert early is not None
    # No seeds: the last record's copies are then written, not kept, and their writes are still unsettled
    # when backward's end lands them (nothing pushes a write after them), so landing is seen every step.
    early.seed_numel = 0
    landed: list[tuple[dict[str, int], dict[str, int]]] = []
    land = early._land_copies

    def spy(limit: int) -> None:
        before = _mem(engine.stats())
        land(limit)
        landed.append((before, _mem(engine.stats())))

    early._land_copies = spy  # type: ignore[method-assign]
    x = torch.randn(4, 512)
    for it in range(3):
        gc.disable()  # no buffer of an unrelated cycle unmapped between a landing's two snapshots
        try:
            for m, e in ((net, engine), (ref, ref_engine)):
                m(x).square().sum().backward()
                e.step()
        finally:
            gc.enable()
        gc.collect()
        mine, theirs = _mem(engine.stats()), _mem(ref_engine.stats())
        for a, b in ((mine, theirs), (theirs, mine)):
            assert sum(a[k] for k in FETCH_LINES) == a["mem_fetch_buffers"]
            assert a["mem_fetch_elsewhere"] == base + _own(b)  # nothing of its own is elsewhere
            assert a["mem_early_step_copies"] == a["mem_early_step_writing"] == 0
            assert a["mem_fetch_live"] > 0 and a["mem_persistent_params"] == 6 * buffers.capacity(512 * 4)
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            with zswap.GatheredParameters([p, q]):
                assert torch.equal(p.data, q.data), it
    assert early.commits == 2
    moved = 0
    for before, after in landed:
        for m in (before, after):
            assert sum(m[k] for k in FETCH_LINES) == m["mem_fetch_buffers"]
        gone = before["mem_early_step_writing"] - after["mem_early_step_writing"]
        assert gone >= 0
        # the copies landed go back to the pool, idle: nothing unmapped, nothing counted twice
        assert after["mem_fetch_buffers"] == before["mem_fetch_buffers"]
        assert after["mem_fetch_pool_idle"] - before["mem_fetch_pool_idle"] == gone
        moved += gone
    assert moved >= 2 * 4 * WEIGHT  # a 1 MiB copy landed while its write was counted, in each early step
    engine.close()
    ref_engine.close()
