"""Where sub-group records live: in CPU memory, or on NVMe behind a `SwapEngine` with a pipelined walk.

Both stores offer the same operations:

- ``stream(sub_groups, fn, write=True, txn=None)``: calls ``fn(sg, record)`` for each sub-group in order
  with its record in memory, and keeps what `fn` changed — all of it or, when anything fails, none (the
  writes are staged in ``txn``, or in a transaction of the walk's own). The NVMe store reads sub-group
  i+1 and writes sub-group i-1 while `fn` runs on sub-group i, through a ring of at most three engine
  buffers.
- ``close()``: forgets every record.

A record never written reads as zeros.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ... import memory
from ...store.queue import _Write
from ...store.storage import Transaction, storage_for
from ._layout import SubGroup

if TYPE_CHECKING:
    from ..._zswap import Handle

Visit = Callable[[SubGroup, torch.Tensor], None]


class CpuStore:
    """Records as CPU tensors; `stream` hands out the stored tensor itself, so nothing is copied. Inside a
    transaction that can fail, each record is saved to its undo log before `fn` may change it."""

    tier = "cpu"
    prefix = "cpu"

    def __init__(self, *, pin_memory: bool = False) -> None:
        self._records: dict[str, torch.Tensor] = {}
        self._writes: dict[str, int] = {}  # walks that could change each record (`version`)
        # Page-locked records only help copies to and from a GPU; without CUDA there is nothing to pin for.
        self.pin = pin_memory and torch.cuda.is_available()

    def stream(
        self, sub_groups: Sequence[SubGroup], fn: Visit, *, write: bool = True, txn: Transaction | None = None
    ) -> None:
        for sg in sub_groups:
            rec = self._records.get(sg.key)
            if rec is None:
                rec = torch.zeros(sg.record_numel, dtype=torch.float32)
                if self.pin:
                    rec = rec.pin_memory()
                if write:
                    self._records[sg.key] = rec
                    if txn is not None:  # a failed step leaves no record it created
                        txn.on_abort(functools.partial(self._records.pop, sg.key, None))
            elif write and txn is not None:
                txn.save(rec)
            if write:
                self._writes[sg.key] = self._writes.get(sg.key, 0) + 1
            fn(sg, rec)

    def get(self, key: str) -> torch.Tensor | None:
        """The stored record of sub-group ``key`` itself (None: never written)."""
        return self._records.get(key)

    def version(self, key: str) -> tuple[torch.Tensor | None, int]:
        """What ``key``'s record is now: the stored tensor and how many walks could have written it, so
        a record changed in place (a step, a state loaded) or replaced compares different."""
        return self._records.get(key), self._writes.get(key, 0)

    def replace(self, key: str, record: torch.Tensor) -> None:
        """Make ``record`` sub-group ``key``'s record (the early step's updated copy, at its commit)."""
        self._records[key] = record
        self._writes[key] = self._writes.get(key, 0) + 1

    def close(self) -> None:
        self._records.clear()


class NvmeStore:
    """Records in a namespace (``o/<n>``) of a `zswap.storage.Storage`, each moved with one transfer into
    page-aligned engine memory; written copy-on-write, all of a walk in one transaction.

    Args:
        engine: the engine (or `Storage`) holding the records.
        owns_engine: the engine was built for this optimizer (it closes with the last namespace on it).
        read_ahead: read the next record while the current one is processed.
        write_behind: let the write of a processed record run on while the next one is processed.
    """

    tier = "nvme"

    def __init__(self, engine: Any, *, owns_engine: bool, read_ahead: bool, write_behind: bool):
        self.storage = storage_for(engine)
        self.ns = self.storage.namespace("o")
        self.owns_engine = owns_engine
        self.prefix = self.ns.prefix  # sub-group keys are "<prefix>/<n>": logical keys of the namespace
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self._ring: list[torch.Tensor] = []

    @property
    def engine(self) -> Any:
        return self.storage.engine

    def _name(self, sg: SubGroup) -> str:
        return sg.key[len(self.prefix) + 1 :]

    def physical(self, sg: SubGroup) -> str | None:
        """The engine key holding ``sg``'s committed record (None: never written)."""
        return self.ns._live.get(self._name(sg))

    @property
    def ring_size(self) -> int:
        """Buffers in the ring: one being processed, plus one read ahead, plus one being written."""
        return 1 + int(self.read_ahead) + int(self.write_behind)

    def _buffers(self, numel: int) -> list[torch.Tensor]:
        # Sized by the largest record of the walk, so a walk never runs short; grown when a larger
        # sub-group appears, and kept between steps so gigabytes are not re-mapped every step.
        if len(self._ring) != self.ring_size or self._ring[0].numel() < numel:
            self._ring = []  # unmap the old buffers before mapping the new ones
            with memory.purpose("optimizer"):
                self._ring = [self.engine.empty(numel, torch.float32) for _ in range(self.ring_size)]
        return self._ring

    def stream(
        self, sub_groups: Sequence[SubGroup], fn: Visit, *, write: bool = True, txn: Transaction | None = None
    ) -> None:
        """Calls `fn` on each record in order; with ``write=False`` nothing is written back (gathering).
        Writes are staged in ``txn`` (left for its owner to commit), else in a transaction of the walk's
        own, committed at its end: either every record of the walk changes, or none does."""
        if not sub_groups:
            return
        if write and txn is None:
            own = Transaction()
            try:
                self.stream(sub_groups, fn, write=True, txn=own)
            except BaseException:
                own.abort()
                raise
            own.commit()
            return
        if txn is not None:
            txn.uses(self.storage)
        free = deque(self._buffers(max(sg.record_numel for sg in sub_groups)))
        for buf in free:
            if txn is not None:
                txn.scratch(buf)
        reads: deque[tuple[SubGroup, torch.Tensor, torch.Tensor, Handle | None]] = deque()
        writes: deque[tuple[torch.Tensor, _Write]] = deque()
        todo = deque(sub_groups)

        def land_oldest() -> None:
            buf, w = writes.popleft()
            w.settle()
            free.append(buf)
            if txn is not None:
                txn.check()  # a failed write stops the walk: nothing after it can count

        def start_read() -> None:
            sg = todo.popleft()
            if not free:  # every buffer is busy: the oldest write must land before its buffer is reused
                land_oldest()
            buf = free.popleft()
            rec = buf[: sg.record_numel]
            if self.ns.has(self._name(sg), txn):
                reads.append((sg, buf, rec, self.ns.read(self._name(sg), rec, txn)))
            else:
                rec.zero_()
                reads.append((sg, buf, rec, None))

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
                writes.append((buf, self.ns.put(self._name(sg), rec, txn, held=0)))  # the ring counts it
                if not self.write_behind:
                    land_oldest()
            while writes:
                land_oldest()
        finally:
            # No transfer may outlive the walk (the ring is reused by the next one). Errors of writes
            # are the transaction's to raise; a read error propagates from its wait above.
            for *_, h in reads:
                _settle(h)
            for _, w in writes:
                w.settle()

    def close(self) -> None:
        """Frees the records and the ring (the engine closes with the last namespace of a storage zswap
        opened). Idempotent."""
        self._ring = []
        self.ns.close(give_back=True)


def _settle(h: Handle | None) -> Exception | None:
    if h is None:
        return None
    try:
        h.wait()
    except Exception as e:
        return e
    return None
