"""`zswap.pool.BufferPool`, the one pool of exact-size buffers under the fetch pool, the device pool and
backward's output pool: its free test, its peak rule, its limit, and what it tells its owner."""

from __future__ import annotations

import torch

from zswap.device import ReusePool
from zswap.pool import BufferPool

F32 = torch.float32


def _cpu(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def test_a_buffer_is_free_only_once_no_object_and_no_view_holds_it():
    pool = BufferPool(_cpu)
    a, _ = pool.take(16, F32)
    view = a[4:]
    a_ptr = a.data_ptr()
    del a
    b, _ = pool.take(16, F32)  # a's view still holds its storage
    assert b.data_ptr() != a_ptr and (pool.made, pool.reused) == (2, 0)
    del view
    c, entry = pool.take(16, F32)
    assert c.data_ptr() == a_ptr and entry is not None and entry[0] is c and pool.reused == 1
    assert pool.idle() == 0
    del b, c, entry
    assert pool.idle() == pool.pooled == 2 * 16 * 4


def test_a_miss_evicts_idle_buffers_only_past_the_peak_in_use():
    pool = BufferPool(_cpu)
    a, b = pool.take(16, F32)[0], pool.take(16, F32)[0]  # 128 bytes in use at once
    del a, b
    c = pool.take(8, F32)[0]  # 160 bytes would be mapped: one idle 64-byte buffer goes
    assert (pool.pooled, pool.peak_in_use) == (96, 128)
    d = pool.take(4, F32)[0]  # 112 bytes, under the peak: nothing goes
    assert pool.pooled == 112 and pool.idle() == 64
    del c, d
    pool.clear()
    assert (pool.pooled, pool.peak_in_use, pool.idle()) == (0, 0, 0)


def test_past_its_limit_a_new_buffer_is_handed_out_unpooled_and_released_buffers_are_reported():
    released: list[int] = []
    pool = BufferPool(_cpu, 64, lambda entry: released.append(entry[0].numel()))
    a = pool.take(16, F32)[0]
    b = pool.take(8, F32)[0]  # in use beside a: no room under the limit, not pooled
    assert pool.pooled == 64 and list(pool.bufs) == [(16, F32)] and b.numel() == 8
    assert pool.fill(1, F32) is None  # a prefill has no room either
    del a
    pool.take(4, F32)  # the idle 16-element buffer makes room
    assert released == [16] and pool.pooled == 16
    pool.clear()
    assert released == [16, 4]


def test_the_device_pool_follows_the_same_peak_rule():
    """The device pool keeps at most its peak in use, however large its budget (before the one pool, it
    kept idle buffers up to its budget)."""
    pool = ReusePool(_cpu, lambda: None)
    pool.pool_bytes = 1 << 20
    a, b = pool.take(16, F32)[0], pool.take(16, F32)[0]
    del a, b
    c = pool.take(8, F32)[0]
    assert pool._pooled == 96 and len(pool._by_ptr) == 2 and c.data_ptr() in pool._by_ptr
