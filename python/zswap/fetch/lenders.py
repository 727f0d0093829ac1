"""Memory of the params' fetch pools held outside the scheduler, counted against its live budget.

A lower layer cannot import the early step, so the early step registers itself instead (`Lenders.add`,
through `zswap.fetch.prefetch.Scheduler.lend`) as a `Lender`: while its param copies wait for their record,
are kept as seeds or are being written, they hold fetch-pool buffers, and the prefetcher holds that much
less (`Scheduler.lent`); a demand that finds the budget full first has them let go of what only waits for a
write to land (`Scheduler.settle_lent`).
"""

from __future__ import annotations

import weakref
from typing import Protocol


class Lender(Protocol):
    """Who holds fetch-pool memory outside the scheduler."""

    def lent(self) -> int:
        """Bytes held now."""
        ...

    def settle(self) -> None:
        """Let go now of what only waits to be let go (writes landing), without raising."""
        ...


class Lenders:
    """The lenders of one scheduler, held weakly (each one's owner outlives the scheduler or drops both);
    ``itemsize``: bytes per element of what they hold (the params' widest dtype)."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
        self._refs: list[weakref.ref[Lender]] = []

    def add(self, lender: Lender) -> None:
        self._refs.append(weakref.ref(lender))

    def lent(self) -> int:
        """Elements the lenders hold now."""
        return sum(x.lent() for r in self._refs if (x := r()) is not None) // self.itemsize

    def settle(self) -> None:
        for r in self._refs:
            if (lender := r()) is not None:
                lender.settle()
