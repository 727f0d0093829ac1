"""Where sub-group records live: in CPU memory, or on NVMe behind a `SwapEngine` with a pipelined walk.

Both stores offer the same operations:

- ``stream(sub_groups, fn, write=True)``: calls ``fn(sg, record)`` for each sub-group in order with its
  record in memory, and keeps what `fn` changed. The NVMe store reads sub-group i+1 and writes sub-group
  i-1 while `fn` runs on sub-group i, through a ring of at most three engine buffers.
- ``close()``: forgets every record.

A record never written reads as zeros.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ._layout import SubGroup

if TYPE_CHECKING:
    from .._zswap import Handle
    from ..swap import SwapEngine

Visit = Callable[[SubGroup, torch.Tensor], None]


class CpuStore:
    """Records as CPU tensors; `stream` hands out the stored tensor itself, so nothing is copied."""

    tier = "cpu"
    prefix = "cpu"

    def __init__(self, *, pin_memory: bool = False) -> None:
        self._records: dict[str, torch.Tensor] = {}
        # Page-locked records only help copies to and from a GPU; without CUDA there is nothing to pin for.
        self.pin = pin_memory and torch.cuda.is_available()

    def stream(self, sub_groups: Sequence[SubGroup], fn: Visit, *, write: bool = True) -> None:
        for sg in sub_groups:
            rec = self._records.get(sg.key)
            if rec is None:
                rec = torch.zeros(sg.record_numel, dtype=torch.float32)
                if self.pin:
                    rec = rec.pin_memory()
                if write:
                    self._records[sg.key] = rec
            fn(sg, rec)

    def close(self) -> None:
        self._records.clear()


class NvmeStore:
    """Records under keys of a `SwapEngine`, each moved with one transfer into page-aligned engine memory.

    Args:
        engine: the engine holding the records.
        owns_engine: close the engine in `close` (it was built for this optimizer).
        read_ahead: read the next record while the current one is processed.
        write_behind: let the write of a processed record run on while the next one is processed.
    """

    tier = "nvme"

    def __init__(self, engine: SwapEngine, *, owns_engine: bool, read_ahead: bool, write_behind: bool):
        self.engine = engine
        self.owns_engine = owns_engine
        self.prefix = f"optim-{uuid.uuid4().hex[:12]}"
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self._ring: list[torch.Tensor] = []
        self._keys: set[str] = set()

    @property
    def ring_size(self) -> int:
        """Buffers in the ring: one being processed, plus one read ahead, plus one being written."""
        return 1 + int(self.read_ahead) + int(self.write_behind)

    def _buffers(self, numel: int) -> list[torch.Tensor]:
        # Sized by the largest record of the walk, so a walk never runs short; grown when a larger
        # sub-group appears, and kept between steps so gigabytes are not re-mapped every step.
        if len(self._ring) != self.ring_size or self._ring[0].numel() < numel:
            self._ring = []  # unmap the old buffers before mapping the new ones
            self._ring = [self.engine.empty(numel, torch.float32) for _ in range(self.ring_size)]
        return self._ring

    def stream(self, sub_groups: Sequence[SubGroup], fn: Visit, *, write: bool = True) -> None:
        """Calls `fn` on each record in order; with ``write=False`` nothing is written back (gathering)."""
        if not sub_groups:
            return
        free = deque(self._buffers(max(sg.record_numel for sg in sub_groups)))
        reads: deque[tuple[SubGroup, torch.Tensor, torch.Tensor, Handle | None]] = deque()
        writes: deque[tuple[torch.Tensor, Handle]] = deque()
        todo = deque(sub_groups)

        def start_read() -> None:
            sg = todo.popleft()
            if not free:  # every buffer is busy: the oldest write must land before its buffer is reused
                buf, h = writes.popleft()
                h.wait()
                free.append(buf)
            buf = free.popleft()
            rec = buf[: sg.record_numel]
            if sg.key in self._keys:
                reads.append((sg, buf, rec, self.engine.read(sg.key, rec)))
            else:
                rec.zero_()
                reads.append((sg, buf, rec, None))

        finished = False
        try:
            while todo or reads:
                if not reads:
                    start_read()
                if self.read_ahead and todo:
                    start_read()
                sg, buf, rec, h = reads.popleft()
                if h is not None:
                    h.wait()
                fn(sg, rec)
                if not write:
                    free.append(buf)
                    continue
                self._keys.add(sg.key)
                writes.append((buf, self.engine.write(sg.key, rec)))
                if not self.write_behind:
                    buf, h = writes.popleft()
                    h.wait()
                    free.append(buf)
            finished = True
        finally:
            # No transfer may outlive the walk (the ring is reused by the next one). After an error the
            # rest are still waited for and that error propagates; else the first failure is raised here.
            errors = [_settle(h) for *_, h in reads] + [_settle(h) for _, h in writes]
            first = next((e for e in errors if e is not None), None)
            if finished and first is not None:
                raise first

    def close(self) -> None:
        """Frees the records and the ring; closes the engine if this store built it. Idempotent."""
        self._ring = []
        if self.owns_engine:
            self.engine.close()
        elif not self.engine.closed:
            for key in self._keys:
                if key in self.engine:
                    self.engine.free(key)
        self._keys.clear()


def _settle(h: Handle | None) -> Exception | None:
    if h is None:
        return None
    try:
        h.wait()
    except Exception as e:
        return e
    return None
