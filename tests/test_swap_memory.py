"""Memory the engine touches around a transfer: engine buffers are populated when allocated (no first-touch
fault inside a read), and a read into ordinary memory — prefaulted, huge-page advised, copied with
streaming stores — changes exactly the destination's bytes and nothing next to them."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from zswap import SwapEngine

from .test_swap import filled, same_bytes

MiB = 1 << 20


@pytest.fixture
def engine(backend: str, swap_dir: Path):
    # Zero-copy reads where the disk would bounce them by default: these tests cover that path.
    with SwapEngine(swap_dir, backend=backend, block_size=MiB, queue_depth=8, zero_copy_reads=True) as e:
        yield e


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of `t`'s page-aligned memory the kernel has backed, pages in all), from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    assert t.data_ptr() % page == 0
    npages = -(-t.numel() * t.element_size() // page)
    vec = (ctypes.c_ubyte * npages)()
    rc = libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(npages * page), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), npages


def test_engine_buffers_are_populated_and_zeroed_when_allocated(engine: SwapEngine) -> None:
    for n in (3 * 4096 + 1, 64 * MiB + 4096):  # small (4 KiB pages) and huge-page sized buffers
        buf = engine.empty(n, torch.uint8)
        resident, total = _resident_pages(buf)
        assert resident == total, f"{resident} of {total} pages backed right after engine.empty({n})"
        assert torch.count_nonzero(buf).item() == 0
    # The lazy alternative, for contrast: memory the engine did not allocate is not backed yet.
    plain = torch.empty(64 * MiB, dtype=torch.uint8)
    aligned = plain[(-plain.data_ptr()) % mmap.PAGESIZE :][: 32 * MiB]
    assert _resident_pages(aligned)[0] < _resident_pages(aligned)[1]


def test_read_into_a_fresh_engine_buffer_is_bitwise_and_zero_copy(engine: SwapEngine) -> None:
    n = 5 * MiB + 123
    src = filled(n, torch.uint8, seed=3)
    engine.write("k", src).wait()
    before = engine.stats()
    out = engine.empty(n, torch.uint8)
    engine.read("k", out).wait()
    after = engine.stats()
    assert same_bytes(out, src)
    assert after["bytes_read"] - before["bytes_read"] == n
    assert after["reads"] - before["reads"] == 1
    assert after["blocks"] - before["blocks"] == 6
    if engine.info["direct"]:  # whole engine blocks go straight to the kernel; only the padded tail bounces
        assert after["bounced_blocks"] - before["bounced_blocks"] == 1


@pytest.mark.parametrize("offset", [0, 1, 3, 17])
def test_read_into_fresh_ordinary_memory_changes_only_the_destination(
    engine: SwapEngine, offset: int
) -> None:
    # An 11 MiB destination spans whole huge pages (advised MADV_HUGEPAGE) and partial ones at both ends;
    # odd offsets and lengths take the streaming copy's unaligned head and tail.
    n = 11 * MiB + 5
    src = filled(n, torch.uint8, seed=offset)
    engine.write("k", src).wait()
    backing = torch.empty(n + 64, dtype=torch.uint8)  # fresh from torch's allocator, untouched
    backing[:offset] = 0x5A
    backing[offset + n :] = 0xA5
    out = backing[offset : offset + n]
    before = engine.stats()
    engine.read("k", out).wait()
    after = engine.stats()
    assert same_bytes(out, src)
    assert torch.all(backing[:offset] == 0x5A) and torch.all(backing[offset + n :] == 0xA5)
    assert after["bytes_read"] - before["bytes_read"] == n
    assert after["blocks"] - before["blocks"] == 12


@pytest.mark.parametrize("offset", [0, 5, 32])
def test_write_from_unaligned_ordinary_memory_is_bitwise(engine: SwapEngine, offset: int) -> None:
    n = 3 * MiB + 1000
    backing = filled(n + 64, torch.uint8, seed=10 + offset)
    src = backing[offset : offset + n]
    engine.write("k", src).wait()
    out = engine.empty(n, torch.uint8)
    engine.read("k", out).wait()
    assert same_bytes(out, src)
    again = torch.empty(n, dtype=torch.uint8)
    engine.read("k", again).wait()
    assert same_bytes(again, src)
