"""Where zswap's host memory is, and keeping glibc from holding on to what torch frees.

**The ledger.** Every engine buffer (`zswap.SwapEngine.empty`: page-aligned, on huge pages when large) is
created by `zswap._memview.tensor_over`, which calls `track`: its bytes are counted under the *purpose*
current at that moment (`purpose`, a context variable: ``"fetch"`` for param fetch buffers, ``"grads"`` for
gradient partitions read or accumulated, ``"optimizer"`` for the sub-group ring, ``"early_step"`` for the
early step's param copies of 1 MiB or more, ``"other"`` for the rest —
weights being loaded, a user's own ``empty``) and given back when the buffer is unmapped (a finalizer on
the object NumPy's array keeps as its base, which lives exactly as long as the last tensor view). The
totals therefore always add up: ``sum(live().values())`` is every engine buffer mapped by this process,
the same set the Rust registry counts (``SwapEngine.stats()["live_buffers"]``).

**Held tensors.** Some ordinary torch tensors outlive their use because zswap keeps them: the early step
(`zswap.earlystep`) holds each param's gradient, and its copy when under 1 MiB, until the rest of the
param's optimizer record is complete. A `Holding` counts them (`held`, by holder in `HOLDERS`), so that
with the engine buffers every byte zswap keeps is on one line or another and on one only.

**glibc's heap.** torch allocates CPU tensors with ``posix_memalign``. glibc serves a request of at least
``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap``, unmapped on ``free``; but each such
``free`` raises the threshold to the freed size (the dynamic threshold, up to 32 MiB on 64-bit), so later
tensors of that size come from the heap, and a freed heap chunk is only returned to the kernel when it
borders the top. Under ``zswap.Init`` a model's weights are built, written out and freed one after the
other, interleaved with small allocations: measured on the 753 MiB demo, the heap grew by 32 MiB per block
with 435 MiB of it free but kept. `bound_heap` fixes the threshold at `MMAP_THRESHOLD` (setting it
explicitly turns the dynamic raise off), so every tensor of 256 KiB or more is its own mapping and goes
back to the kernel on ``free``. 256 KiB, not 1 MiB: what stays on the heap must not fragment it with depth.
A checkpointed transformer keeps each block's input (512 KiB at the demo's 2 × 64 tokens × 1024) through
forward, between the block's freed temporaries of the same size; at a 1 MiB threshold those were heap
chunks, and the free holes between the kept ones grew with the layer count (peak ``heap_free`` 38 MiB at
15 layers, 110 MiB at 63, all resident); at 256 KiB they are mappings (``heap_free`` 1 MiB at 15 layers),
and no step-time cost showed beyond the ±20 % noise of a loaded 2-core VM (benches/README.md, "Memory").
`trim` (``malloc_trim(0)``, which also releases whole free pages inside the heap) runs at Init's exit and
after each optimizer step. Both are no-ops off glibc, and `bound_heap`
leaves a threshold set by the user (``MALLOC_MMAP_THRESHOLD_`` in the environment) alone.
``ZSWAP_MALLOC_TUNING=0`` turns both off.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import ctypes
import ctypes.util
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PURPOSES = ("fetch", "grads", "optimizer", "early_step", "other")
"""What an engine buffer is for, as counted by the ledger."""

HOLDERS = ("early_step",)
"""Who keeps ordinary torch tensors (not engine buffers) past their own use, as counted by `Holding`."""

ENGINE_COPY = 1 << 20
"""Bytes from which the early step's param copy is an engine buffer (purpose "early_step"); smaller ones
are ordinary tensors."""


@dataclass(frozen=True)
class Allowances:
    """What each holder of host memory beside the gathered params may keep: sized once per engine from its
    live budget (`zswap.train.sizing.size`) and handed to each holder as it is built, so one object says
    what may be held and the ledger (`live`, `held`) only reports where it is.

    The gradient stash is not among them: it is 0 unless a user sets ``Engine.grad_stash_bytes``, which
    the gradient stores ask for directly."""

    live: int
    """Bytes of the live budget: ``max_live`` plus the persistent elements, at the params' widest dtype;
    also the room the early step keeps gradients in where a step may need them (none once
    ``Engine.grad_stash_bytes`` is set, which then bounds them)."""
    fetch_pool: int
    """Bytes of load buffers each NVMe param store keeps for reuse (`zswap.parts.params.NvmeStore.pool`):
    ``offload_param.buffer_count × buffer_size`` where the config sets them, else `live`. The compute
    device's pool of gathered params' buffers and the gradients' landing pool get the same."""
    early_step: int
    """Bytes of param copies and gradients the early step may hold (`live` +
    `zswap.step.earlystep.CAP_EXTRA`). Its copies of
    `ENGINE_COPY` bytes or more are fetch-pool buffers, so each param store's pool grows by this much
    when an early step is built (`zswap.parts.params.NvmeStore.widen_pool`)."""
    seeds: int
    """Elements of updated params the early step keeps for the next pass: ``max_live``, within which the
    next-pass cache takes them (`zswap.fetch.nextpass`)."""


MMAP_THRESHOLD = 256 << 10
"""Bytes from which glibc maps (and on free unmaps) an allocation by itself, once `bound_heap` ran."""

_M_MMAP_THRESHOLD = -3  # <malloc.h>

_purpose: contextvars.ContextVar[str] = contextvars.ContextVar("zswap_buffer_purpose", default="other")
_lock = threading.Lock()
# Finalizers run wherever the garbage collector runs — inside any allocation, also one made while `_lock`
# is held by the same thread — so `_gone` never takes the lock: it queues (deque.append is atomic) and
# whoever holds the lock next applies the queue (`_settle`). An entry is (purpose, bytes, buffers): a
# buffer unmapped is (kind, n, 1); a `Holding` collected while it still held bytes is (holder, n, 0).
_returned: collections.deque[tuple[str, int, int]] = collections.deque()
_live = dict.fromkeys(PURPOSES, 0)
_count = dict.fromkeys(PURPOSES, 0)
_peak = dict.fromkeys(PURPOSES, 0)
_peak_total = 0
_held = dict.fromkeys(HOLDERS, 0)
_held_peak = dict.fromkeys(HOLDERS, 0)


@contextlib.contextmanager
def purpose(name: str) -> Iterator[None]:
    """Engine buffers created inside count under ``name`` (one of `PURPOSES`)."""
    if name not in PURPOSES:
        raise ValueError(f"unknown buffer purpose {name!r}; one of {', '.join(PURPOSES)}")
    token = _purpose.set(name)
    try:
        yield
    finally:
        _purpose.reset(token)


def track(owner: object, nbytes: int) -> None:
    """Count ``nbytes`` of a new engine buffer under the current purpose until ``owner`` is collected."""
    global _peak_total
    kind = _purpose.get()
    with _lock:
        _settle()
        _live[kind] += nbytes
        _count[kind] += 1
        _peak[kind] = max(_peak[kind], _live[kind])
        _peak_total = max(_peak_total, sum(_live.values()))
    weakref.finalize(owner, _gone, kind, nbytes).atexit = False


def _gone(kind: str, nbytes: int) -> None:
    _returned.append((kind, nbytes, 1))


def _settle() -> None:
    """Apply the buffers (and holdings) given back since; the caller holds `_lock`."""
    while True:
        try:
            kind, nbytes, n = _returned.popleft()
        except IndexError:
            return
        if n:
            _live[kind] -= nbytes
            _count[kind] -= n
        else:
            _held[kind] -= nbytes


class Holding:
    """Bytes of ordinary torch tensors one zswap object keeps past their own use (``holder``: one of
    `HOLDERS`) — the early step's gradients and small param copies, say, which wait in backward for the
    rest of their record. The owner calls `add` when it takes some and ``add(-n)`` / `clear` when it lets
    go; `held` sums every holding of a kind. A holding collected with bytes still on it gives them back."""

    def __init__(self, holder: str) -> None:
        if holder not in HOLDERS:
            raise ValueError(f"unknown holder {holder!r}; one of {', '.join(HOLDERS)}")
        self.holder = holder
        self._box = [0]  # shared with the finalizer, which must not reference self
        weakref.finalize(self, _let_go, holder, self._box).atexit = False

    @property
    def nbytes(self) -> int:
        return self._box[0]

    def add(self, nbytes: int) -> None:
        with _lock:
            _settle()
            self._box[0] += nbytes
            _held[self.holder] += nbytes
            _held_peak[self.holder] = max(_held_peak[self.holder], _held[self.holder])

    def clear(self) -> None:
        if self._box[0]:
            self.add(-self._box[0])


def _let_go(holder: str, box: list[int]) -> None:
    if box[0]:
        _returned.append((holder, box[0], 0))
        box[0] = 0


def held() -> dict[str, int]:
    """Bytes of ordinary tensors held now (every `Holding`), by holder."""
    with _lock:
        _settle()
        return dict(_held)


def held_peaks() -> dict[str, int]:
    """Most bytes of ordinary tensors held at once since the last `reset_peaks`, by holder."""
    with _lock:
        _settle()
        return dict(_held_peak)


def live() -> dict[str, int]:
    """Bytes of engine buffers mapped now, by purpose."""
    with _lock:
        _settle()
        return dict(_live)


def buffers() -> int:
    """How many engine buffers are mapped now (all purposes)."""
    with _lock:
        _settle()
        return sum(_count.values())


def peaks() -> dict[str, int]:
    """Most bytes of engine buffers mapped at once since the last `reset_peaks`, by purpose, and under
    ``"total"`` the most of all purposes together (at most the sum of the others)."""
    with _lock:
        _settle()
        return {**_peak, "total": _peak_total}


def reset_peaks() -> None:
    global _peak_total
    with _lock:
        _settle()
        _peak.update(_live)
        _peak_total = sum(_live.values())
        _held_peak.update(_held)


# -- glibc -------------------------------------------------------------------------------------------


_MALLINFO2: tuple[str, ...] = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
_MALLINFO2 += ("uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]  # struct mallinfo2, glibc 2.33+


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim, libc.mallopt  # noqa: B018 — present on glibc only
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()
_bounded = False


def _tuning() -> bool:
    return _LIBC is not None and os.environ.get("ZSWAP_MALLOC_TUNING", "1") != "0"


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` (once per process; see the module docstring).
    Returns whether the threshold is now fixed by zswap."""
    global _bounded
    if _bounded or not _tuning() or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _bounded
    _bounded = bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _bounded


def trim() -> None:
    """Give the heap's free pages back to the kernel (``malloc_trim(0)``); nothing off glibc."""
    if _tuning():
        _LIBC.malloc_trim(0)


def heap() -> dict[str, int]:
    """glibc's own account (``mallinfo2``, all arenas): ``heap_in_use`` (allocated from the heaps),
    ``heap_free`` (free but kept by the heaps), ``heap_mapped`` (allocations mapped by themselves). All 0
    off glibc."""
    if _LIBC is None:
        return {"heap_in_use": 0, "heap_free": 0, "heap_mapped": 0}
    m = _LIBC.mallinfo2()
    return {"heap_in_use": int(m.uordblks), "heap_free": int(m.fordblks), "heap_mapped": int(m.hblkhd)}


def rss() -> int:
    """Resident bytes of this process now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
