"""`BufferPool`: buffers of exact ``(numel, dtype)`` sizes, reused once nobody else holds them.

One mechanism for every pool of same-shape buffers: the fetch pool (`zswap.parts.params.NvmeStore`, whose
buffers the early step's copies also come from), the compute device's buffers of gathered params
(`zswap.device.ReusePool`, also the gradient landing buffers), backward's matmul outputs
(`zswap.fetch.outputs.OutputPool`) and an ordinary step's gradient reads (`NvmeGrads.step_loads`). Each
user keeps its own pool, its own allocator and its own stats.

**The free test** (`is_free`): a buffer is free when nothing but the pool references the tensor object and
no other tensor shares its storage (the storage's use count is the one it had when made). A view handed out
holds the storage, not the object; a param whose ``.data`` is the buffer holds the object.

**The peak rule**: the pool maps at most the most bytes it ever had in use at once (``peak_in_use``), and
never more than ``limit``. A miss maps a new buffer; if that would take the pooled bytes past the rule, idle
buffers (of other sizes: the mix in use shifts) are unmapped first, only as many as needed. Below its peak
an idle buffer stays for the sizes that follow: with an unmap on every miss, about 40 % of the fetches and
copies of a 2 GiB model's step mapped, zeroed and unmapped a new buffer (benches/README.md, "Step time");
with no rule at all, idle memory adds to the process's peak (the 6 GiB demo's memory bound has no margin
for it). A new buffer beyond ``limit`` is handed out without being pooled (its last user frees it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

Entry = list[Any]
"""``[buffer, its storage's use count when made]``: one pooled buffer."""


def _storage_uses(t: torch.Tensor | torch.UntypedStorage) -> int:
    """References to ``t``'s storage (≥ 0), or -1 when torch cannot say (then nothing is pooled)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
    return -1 if use_count is None else int(use_count(storage._cdata))


def is_free(buf: torch.Tensor, uses: int, held: int = 1) -> bool:
    """Whether ``buf`` (made with storage use count ``uses``) is free: the ``held`` references the caller
    knows of (the pool's entry, 1; a loop variable of the caller's, one more) are the only ones besides this
    parameter and getrefcount's argument, and no other tensor shares its storage."""
    return sys.getrefcount(buf) == held + 2 and _storage_uses(buf) == uses


class BufferPool:
    """Buffers from ``alloc(numel, dtype)``, reused once free, within the peak rule and ``limit`` bytes
    (``None``: the peak rule alone). ``on_release(entry)`` is called for each buffer the pool stops
    holding (evicted or cleared)."""

    def __init__(
        self,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        limit: int | None = None,
        on_release: Callable[[Entry], object] | None = None,
    ) -> None:
        self._alloc = alloc
        self.limit = limit
        self._on_release = on_release
        self.bufs: dict[tuple[int, torch.dtype], list[Entry]] = {}
        """(numel, dtype) -> its pooled buffers, in use or idle."""
        self.pooled = 0
        """Bytes of the buffers the pool keeps (in use or idle)."""
        self.peak_in_use = 0
        """Most bytes of pooled buffers in use at once (a new one counted as in use), since `clear`."""
        self.peak_pooled = 0
        """Most bytes pooled at once since the last `reset_peak`."""
        self.made = 0
        """Buffers mapped anew by `take` (counters since the pool was made)."""
        self.reused = 0
        """Buffers `take` served from the pool."""

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.pooled + nbytes <= self.limit

    def find(self, numel: int, dtype: torch.dtype) -> Entry | None:
        """A free pooled buffer's entry of exactly this size (counted as reused), else ``None``."""
        for entry in self.bufs.get((numel, dtype), ()):
            if is_free(entry[0], entry[1]):
                self.reused += 1
                return entry
        return None

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Entry | None]:
        """(a buffer nothing else uses, its entry while pooled): a free pooled one, else a new one."""
        entry = self.find(numel, dtype)
        if entry is not None:
            return entry[0], entry
        return self.make(numel, dtype)

    def make(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Entry | None]:
        """A new buffer, pooled if the rule leaves room for it, after unmapping idle ones past the rule."""
        nbytes = numel * dtype.itemsize
        cap = self.note_use(nbytes)
        if self.limit is not None:
            cap = min(cap, self.limit)
        if self.pooled + nbytes > cap:
            self.evict(self.pooled + nbytes - cap)
        buf = self._alloc(numel, dtype)
        self.made += 1
        uses = _storage_uses(buf)
        if uses < 0 or not self._fits(nbytes):  # no way to tell when it is free again, or no room
            return buf, None
        return buf, self._keep(buf, uses, nbytes)

    def fill(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new pooled buffer the caller holds (so each call makes one: a prefill of what a pass will
        want), counted as in use; ``None`` once ``limit`` leaves no room for it."""
        nbytes = numel * dtype.itemsize
        if not self._fits(nbytes):
            return None
        self.note_use(nbytes)
        buf = self._alloc(numel, dtype)
        uses = _storage_uses(buf)
        if uses < 0:
            return None
        self._keep(buf, uses, nbytes)
        return buf

    def _keep(self, buf: torch.Tensor, uses: int, nbytes: int) -> Entry:
        entry = [buf, uses]
        self.bufs.setdefault((buf.numel(), buf.dtype), []).append(entry)
        self.pooled += nbytes
        self.peak_pooled = max(self.peak_pooled, self.pooled)
        return entry

    def note_use(self, nbytes: int) -> int:
        """`peak_in_use` once a new buffer of ``nbytes`` is in use too (pooled ones in use, and it)."""
        self.peak_in_use = max(self.peak_in_use, self.pooled - self.idle() + nbytes)
        return self.peak_in_use

    def idle_sizes(self) -> Iterator[tuple[int, torch.dtype]]:
        """``(numel, dtype)`` of each pooled buffer nothing uses now."""
        for (numel, dtype), entries in self.bufs.items():
            for entry in entries:
                if is_free(entry[0], entry[1]):
                    yield numel, dtype

    def idle(self) -> int:
        """Bytes of pooled buffers nothing uses now."""
        return sum(numel * dtype.itemsize for numel, dtype in self.idle_sizes())

    def evict(self, nbytes: int) -> None:
        """Stop pooling idle buffers until ``nbytes`` are gone (their memory goes back with the pool's
        reference; a buffer in use stays)."""
        for (numel, dtype), entries in self.bufs.items():
            keep = []
            for entry in entries:
                if nbytes > 0 and is_free(entry[0], entry[1]):
                    nbytes -= numel * dtype.itemsize
                    self.pooled -= numel * dtype.itemsize
                    if self._on_release is not None:
                        self._on_release(entry)
                else:
                    keep.append(entry)
            entries[:] = keep

    def clear(self) -> None:
        """Forget every buffer (one still in use is freed by its last user) and the peak in use."""
        if self._on_release is not None:
            for entries in self.bufs.values():
                for entry in entries:
                    self._on_release(entry)
        self.bufs.clear()
        self.pooled = 0
        self.peak_in_use = 0

    def reset_peak(self) -> None:
        self.peak_pooled = self.pooled
