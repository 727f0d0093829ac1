"""A storage's one write queue: the source bytes held by writes in flight, bounded.

``put`` never waits unless the bound (`zswap.store.storage.INFLIGHT_WRITE_BYTES`, given by the storage)
is exceeded, then for the oldest writes — never for the one it queued, so a write larger than the bound
still overlaps with its caller's next work. A source whose memory is counted elsewhere (a slot of the
optimizer's ring) is queued with ``held=0``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any


class _Write:
    """One write in flight: where it goes, what its source holds, and whom to tell when it lands."""

    __slots__ = ("error", "handle", "held", "name", "on_done", "physical", "queue", "settled")

    def __init__(
        self,
        handle: Any,
        held: int,
        physical: str,
        name: str,
        on_done: Callable[[_Write], None],
        queue: WriteQueue,
    ) -> None:
        self.handle, self.held, self.physical, self.name = handle, held, physical, name
        self.on_done, self.queue = on_done, queue
        self.error: BaseException | None = None
        self.settled = False

    def settle(self) -> None:
        self.queue.settle(self)

    def done(self) -> bool:
        return self.settled or bool(self.handle.done())


AwaitHook = Callable[[str], None]
_AWAIT_HOOK: list[AwaitHook] = []
"""Test seam: `await_point` calls these (tests raise KeyboardInterrupt from one to inject an interrupt at
every point where a step waits, instead of relying on timing)."""


def await_point(where: str) -> None:
    """Mark a point where the caller is about to wait for I/O (``"write"``: a queued write; ``"read"``: a
    read of a stored name; ``"commit"``: a transaction about to make its writes live). Nothing happens
    unless a test installed a hook."""
    for hook in _AWAIT_HOOK:
        hook(where)


class WriteQueue:
    """The bounded queue of a storage's writes, oldest first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._writes: deque[_Write] = deque()
        self.queued = 0

    def push(self, w: _Write) -> None:
        """Queue ``w``; past the limit, wait for the oldest writes — never for ``w`` itself, so one write
        larger than the limit still overlaps with what its caller does next (the next `push` waits for it)."""
        self._writes.append(w)
        self.queued += w.held
        while self._writes[0] is not w and (self.queued > self.limit or self._writes[0].done()):
            self.settle(self._writes[0])

    def settle(self, w: _Write) -> None:
        """Wait for ``w`` (and nothing else); record its outcome and tell its owner. Idempotent.

        ``w`` counts as settled only once its wait returned: a KeyboardInterrupt (any BaseException)
        during the wait leaves it queued and unsettled, so the next `push`, `settle` or `drain` waits for
        it again (marking it first made `push` spin forever on a settled head that was never removed)."""
        if w.settled:
            self._remove(w)
            return
        await_point("write")
        try:
            w.handle.wait()
        except Exception as exc:
            w.error = exc
        w.settled = True
        self._remove(w)
        w.handle = None  # the source tensor may go
        w.on_done(w)

    def _remove(self, w: _Write) -> None:
        with contextlib.suppress(ValueError):
            self._writes.remove(w)  # usually the head: O(1)
            self.queued -= w.held

    def drain(self) -> None:
        while self._writes:
            self.settle(self._writes[0])
