"""Names to values on one storage, copy-on-write: `Namespace`.

A name's value lives under a physical key ``<namespace>/<name>@<version>``; a write always goes to a
fresh version, and the name moves to it only once the write completed (then the old version is freed). A
failed write frees its own version and leaves the previous value readable. The engine's own overwrite
semantics are never relied on.

One error policy: the first failed write of a namespace is kept, named by its logical key
(``SwapIOError.key``), and raised by the next `Namespace.wait` (or by a read of that very name, which then
sees the previous value from the next read on). Writes inside a transaction
(`zswap.store.storage.Transaction`) report to it instead, and its ``commit`` raises.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SwapIOError, UnknownKeyError, ZswapError
from .queue import _Write, await_point

if TYPE_CHECKING:
    from .storage import Storage, Transaction


def _named(exc: BaseException, key: str) -> BaseException:
    """``exc`` naming the logical ``key`` instead of the physical one (a copy; the cause is kept)."""
    if isinstance(exc, SwapIOError):
        named = copy.copy(exc)
        named.key = key
        named.__cause__ = exc
        return named
    return exc


class _Read:
    """An engine read whose error names the logical key."""

    __slots__ = ("handle", "key")

    def __init__(self, handle: Any, key: str) -> None:
        self.handle, self.key = handle, key

    def done(self) -> bool:
        return bool(self.handle.done())

    def wait(self) -> None:
        await_point("read")
        try:
            self.handle.wait()
        except SwapIOError as exc:
            raise _named(exc, self.key) from exc


class Namespace:
    """Names to values on one storage, copy-on-write (see the module docstring). Not thread-safe: each
    namespace is used by one thread at a time, as zswap's stores are."""

    def __init__(self, storage: Storage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self._live: dict[str, str] = {}  # name -> physical key of its value
        self._pending: dict[str, _Write] = {}  # name -> its newest write outside transactions
        self._error: BaseException | None = None
        self._failed: dict[str, BaseException] = {}  # names whose last write failed, error not yet raised
        self._dropped: list[_Write] = []  # writes in flight of freed names
        self._closed = False

    def key(self, name: str) -> str:
        """The logical key of ``name`` (what errors carry)."""
        return f"{self.prefix}/{name}"

    # -- writing -----------------------------------------------------------------------------------

    def put(
        self, name: str, tensor: torch.Tensor, txn: Transaction | None = None, *, held: int | None = None
    ) -> _Write:
        """Start writing ``tensor`` as the new value of ``name`` (staged in ``txn`` when given). The
        caller must not modify ``tensor`` until the returned write is settled (`settle`). ``held``: the
        bytes the write queue counts for it (default the tensor's storage; 0 for a buffer that outlives the
        write anyway, such as a slot of the optimizer's ring, whose memory is counted once, as the ring)."""
        self._check_open()
        if txn is not None:
            return txn.put(self, name, tensor, held=held)
        old = self._pending.get(name)
        if old is not None:
            self.storage.queue.settle(old)  # writes of one name land in order
        w = self._issue(name, tensor, self._landed, held)
        if not w.settled:
            self._pending[name] = w
        return w

    def _issue(
        self, name: str, tensor: torch.Tensor, on_done: Callable[[_Write], None], held: int | None = None
    ) -> _Write:
        if tensor.device.type != "cpu":
            tensor, held = tensor.to("cpu"), None  # the copy lives as long as the write
        physical = self.storage.physical(self.prefix, name)
        handle = self.storage.engine.write(physical, tensor)
        nbytes = tensor.untyped_storage().nbytes() if held is None else held
        w = _Write(handle, nbytes, physical, name, on_done, self.storage.queue)
        self.storage.queue.push(w)
        return w

    def _landed(self, w: _Write) -> None:
        if self._pending.get(w.name) is w:
            del self._pending[w.name]
        if w.error is not None:
            self.storage.free_quiet(w.physical)
            err = _named(w.error, self.key(w.name))
            self._failed[w.name] = err
            if self._error is None:
                self._error = err
            return
        self._failed.pop(w.name, None)
        self.replace(w.name, w.physical)

    def _landed_freed(self, w: _Write) -> None:
        with contextlib.suppress(ValueError):
            self._dropped.remove(w)
        self.storage.free_quiet(w.physical)
        if w.error is not None and self._error is None:
            self._error = _named(w.error, self.key(w.name))  # the device failed: say so at `wait`

    def replace(self, name: str, physical: str) -> None:
        """Make ``physical`` (a completed write) the value of ``name``; free the old value."""
        old = self._live.get(name)
        self._live[name] = physical
        if old is not None and old != physical:
            self.storage.free_quiet(old)

    def settle(self, w: _Write) -> None:
        self.storage.queue.settle(w)

    def wait(self) -> None:
        """Wait for every write of this namespace; raise the first error since the last `wait` (once)."""
        for w in [*self._pending.values(), *self._dropped]:
            w.settle()
        err, self._error = self._error, None
        self._failed.clear()
        if err is not None:
            raise err

    def error(self) -> BaseException | None:
        """The kept error, without raising or clearing it."""
        return self._error

    def clear_error(self) -> BaseException | None:
        err, self._error = self._error, None
        self._failed.clear()
        return err

    # -- reading -----------------------------------------------------------------------------------

    def physical(self, name: str, txn: Transaction | None = None) -> str | None:
        """The physical key ``name`` reads from (``txn``'s staged value first), or None."""
        if txn is not None:
            staged = txn.staged(self, name)
            if staged is not None:
                return staged
        w = self._pending.get(name)
        if w is not None:
            self.storage.queue.settle(w)
        failed = self._failed.pop(name, None)
        if failed is not None:
            if self._error is failed:
                self._error = None
            raise failed  # the newest value is lost: say so once; the previous one reads from now on
        return self._live.get(name)

    def version(self, name: str, txn: Transaction | None = None) -> str | None:
        """The physical key ``name`` reads from now, or None while that is not settled — a write of it
        staged in ``txn``, in flight, or failed and not yet reported (`physical` would wait or raise);
        never waits or raises. A read issued at version v still holds ``name``'s value while `version`
        returns v: every write goes to a new physical key."""
        if (txn is not None and txn.staged(self, name) is not None) or name in self._pending:
            return None
        if name in self._failed:
            return None
        return self._live.get(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._live or name in self._pending)

    def has(self, name: str, txn: Transaction | None = None) -> bool:
        return (txn is not None and txn.staged(self, name) is not None) or name in self

    def read(self, name: str, out: torch.Tensor, txn: Transaction | None = None) -> Any:
        """Start reading ``name`` into ``out``; returns the engine's handle (``wait()`` it)."""
        self._check_open()
        physical = self.physical(name, txn)
        if physical is None:
            raise UnknownKeyError(f"{self.key(name)!r} was never written (or was freed)")
        try:
            return _Read(self.storage.engine.read(physical, out), self.key(name))
        except SwapIOError as exc:
            raise _named(exc, self.key(name)) from exc

    def names(self) -> list[str]:
        return [*self._live, *(n for n in self._pending if n not in self._live)]

    # -- freeing -----------------------------------------------------------------------------------

    def free(self, name: str) -> None:
        """Forget ``name`` without waiting (a write in flight frees its space when it lands). Unknown
        names are ignored."""
        w = self._pending.pop(name, None)
        if w is not None:  # not waited for: its space is freed when it lands; a failure is still kept
            w.on_done = self._landed_freed
            self._dropped.append(w)
        self._failed.pop(name, None)
        physical = self._live.pop(name, None)
        if physical is not None:
            self.storage.free_quiet(physical)

    def close(self, give_back: bool = False) -> None:
        """Wait for the writes, free every value, let go of the storage. Idempotent; raises nothing.
        ``give_back``: return the storage's free space to the file system now (a namespace that lived as
        long as an engine: its optimizer records, its gradients), not keep it for reuse."""
        if self._closed:
            return
        for w in [*self._pending.values(), *self._dropped]:
            w.settle()
        for physical in self._live.values():
            self.storage.free_quiet(physical)
        self._live.clear()
        self._error = None
        self._failed.clear()
        self._closed = True
        self.storage._released(give_back)

    def _check_open(self) -> None:
        if self._closed:
            raise ZswapError(f"storage namespace {self.prefix!r} is closed")
