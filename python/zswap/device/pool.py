"""`ReusePool`: host buffers of one ``(numel, dtype)`` reused once nobody else holds them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .protocol import _storage_uses


class ReusePool:
    """Device buffers for gathered params, reused across fetches, each with the point on the compute stream
    after which it may be refilled.

    A buffer is free when nothing but the pool references its memory. `retire` (the scheduler releasing a
    param) records an event on the compute stream right then — if the param's data is its only other user —
    so the next copy into that buffer waits only for the compute queued before the release, and the H2D copy
    of module i+1 runs under module i's compute. A buffer that became free otherwise (an alias outlived the
    release: non-reentrant checkpointing) gets an event recorded when it is found free, after every use of
    it was queued: later than needed, never too early. Buffers beyond ``pool_bytes`` are not kept. No
    ``record_stream``: the pool owns the memory, so the caching allocator never sees a cross-stream free.
    """

    def __init__(self, alloc: Callable[[int, torch.dtype], torch.Tensor], record: Callable[[], Any]) -> None:
        self._alloc = alloc
        self._record = record
        self.pool_bytes = 0
        self._pooled = 0
        # (numel, dtype) -> [buffer, baseline storage uses, event after which it is free (or None)]
        self._free: dict[tuple[int, torch.dtype], list[list[Any]]] = {}
        self._by_ptr: dict[int, list[Any]] = {}
        self.reused = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """(a buffer of ``numel`` ``dtype`` elements, the event the copy into it must wait for)."""
        for entry in self._free.get((numel, dtype), []):
            buf, base, ev = entry
            if sys.getrefcount(buf) == 3 and _storage_uses(buf) == base:  # entry, loop variable, argument
                entry[2] = None  # the next retire sets it again
                self.reused += 1
                return buf, ev if ev is not None else self._record()
        nbytes = numel * dtype.itemsize
        if self._pooled + nbytes > self.pool_bytes:
            self._evict(self._pooled + nbytes - self.pool_bytes)  # the mix of sizes in use shifts
        buf = self._alloc(numel, dtype)
        if self._pooled + nbytes <= self.pool_bytes and (base := _storage_uses(buf)) >= 0:
            entry = [buf, base, None]
            self._free.setdefault((numel, dtype), []).append(entry)
            self._by_ptr[buf.data_ptr()] = entry
            self._pooled += nbytes
        return buf, self._record()  # fresh memory from the compute stream's pool: safe after "now"

    def _evict(self, nbytes: int) -> None:
        """Stop pooling free buffers until ``nbytes`` are gone, so idle pooled memory and fresh buffers of
        other sizes never add up beyond the budget. Their memory goes back to the compute stream's caching
        allocator, which orders any reuse after their last (compute-stream) use."""
        for (numel, dtype), entries in self._free.items():
            keep = []
            for entry in entries:
                buf, base = entry[0], entry[1]
                if nbytes > 0 and sys.getrefcount(buf) == 3 and _storage_uses(buf) == base:
                    nbytes -= numel * dtype.itemsize
                    self._pooled -= numel * dtype.itemsize
                    del self._by_ptr[buf.data_ptr()]
                else:
                    keep.append(entry)
            entries[:] = keep

    def retire(self, p: torch.Tensor) -> None:
        """``p`` (a param whose ``.data`` is about to be dropped) holds one of the pool's buffers."""
        with torch._C.DisableTorchFunction():
            entry = self._by_ptr.get(p.untyped_storage().data_ptr())
            if entry is not None and _storage_uses(entry[0]) == entry[1] + 1:  # the param alone uses it
                entry[2] = self._record()

    def clear(self) -> None:
        self._free.clear()
        self._by_ptr.clear()
        self._pooled = 0
