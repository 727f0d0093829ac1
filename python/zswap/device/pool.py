"""`ReusePool`: the compute device's buffers of one ``(numel, dtype)``, a `zswap.pool.BufferPool` whose
buffers each carry the point on the compute stream after which they may be refilled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..pool import BufferPool, _storage_uses


class ReusePool:
    """Device buffers for gathered params, reused across fetches, each with the point on the compute stream
    after which it may be refilled.

    A buffer is free by the pool's one test (`zswap.pool.is_free`). `retire` (the scheduler releasing a
    param) records an event on the compute stream right then — if the param's data is its only other user —
    so the next copy into that buffer waits only for the compute queued before the release, and the H2D copy
    of module i+1 runs under module i's compute. A buffer that became free otherwise (an alias outlived the
    release: non-reentrant checkpointing) gets an event recorded when it is found free, after every use of
    it was queued: later than needed, never too early. The pool keeps at most ``pool_bytes`` and follows the
    one peak rule (`zswap.pool`): idle buffers of other sizes are let go past the most bytes in use at once.
    Their memory goes back to the compute stream's caching allocator, which orders any reuse after their
    last (compute-stream) use. No ``record_stream``: the pool owns the memory, so the caching allocator
    never sees a cross-stream free.
    """

    def __init__(self, alloc: Callable[[int, torch.dtype], torch.Tensor], record: Callable[[], Any]) -> None:
        self._record = record
        self._alloc = alloc
        # data_ptr -> [pooled entry, event after which it is free (or None)]
        self._by_ptr: dict[int, list[Any]] = {}
        by_ptr = self._by_ptr  # (not self: the pool would hold its owner in a reference cycle)
        self._pool = BufferPool(alloc, 0, lambda entry: by_ptr.pop(entry[0].data_ptr(), None))

    @property
    def pool_bytes(self) -> int:
        """Most bytes kept (0: none); `zswap.initialize` sets it to its live budget (`keep`)."""
        return self._pool.limit or 0

    @pool_bytes.setter
    def pool_bytes(self, nbytes: int) -> None:
        self._pool.limit = nbytes

    def keep(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` of buffers for reuse from now on."""
        self._pool.limit = nbytes

    @property
    def _pooled(self) -> int:
        return self._pool.pooled

    @property
    def reused(self) -> int:
        return self._pool.reused

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """(a buffer of ``numel`` ``dtype`` elements, the event the copy into it must wait for)."""
        if numel == 0:  # no memory, so no address to key it by (every empty tensor's is 0): never pooled
            return self._alloc(0, dtype), self._record()
        entry = self._pool.find(numel, dtype)
        if entry is not None:
            mark = self._by_ptr[entry[0].data_ptr()]
            ev, mark[1] = mark[1], None  # the next retire sets it again
            return entry[0], ev if ev is not None else self._record()
        buf, entry = self._pool.make(numel, dtype)
        if entry is not None:
            self._by_ptr[buf.data_ptr()] = [entry, None]
        return buf, self._record()  # fresh memory from the compute stream's pool: safe after "now"

    def retire(self, p: torch.Tensor) -> None:
        """``p`` (a param whose ``.data`` is about to be dropped) holds one of the pool's buffers."""
        with torch._C.DisableTorchFunction():
            mark = self._by_ptr.get(p.untyped_storage().data_ptr())
            if mark is not None and _storage_uses(mark[0][0]) == mark[0][1] + 1:  # the param alone uses it
                mark[1] = self._record()

    def clear(self) -> None:
        self._pool.clear()
        self._by_ptr.clear()
