"""The one storage layer under param partitions, partition gradients and optimizer records.

A `Storage` wraps one `SwapEngine`; every user of a swap directory gets the same one (`open_dir` shares
by real path, `storage_for` wraps a caller's engine), so space freed by one kind of data is reused by the
others. Users see it through `Namespace`\\s — ``p/<n>`` for a param store, ``g/<n>`` for gradients,
``o/<n>`` for an optimizer, ``u/<n>`` for rollback copies — each a map from names to byte strings.

Copy-on-write. A name's value lives under a physical key ``<namespace>/<name>@<version>``; a write always
goes to a fresh version, and the name moves to it only once the write completed (then the old version is
freed). A failed write frees its own version and leaves the previous value readable. The engine's own
overwrite semantics are never relied on.

One write queue per storage bounds the source bytes held by writes in flight (`INFLIGHT_WRITE_BYTES`):
``put`` never waits unless that is exceeded, then for the oldest writes — never for the one it queued, so
a write larger than the bound still overlaps with its caller's next work. A source whose memory is counted
elsewhere (a slot of the optimizer's ring) is queued with ``held=0``.

One error policy: the first failed write of a namespace is kept, named by its logical key
(``SwapIOError.key``), and raised by the next `Namespace.wait` (or by a read of that very name, which then
sees the previous value from the next read on). Writes inside a `Transaction` report to it instead, and
its `commit` raises.

Transactions. Writes staged in a `Transaction` go to fresh versions too, but no name moves until `commit`
has seen every one of them complete; then all move at once (pure bookkeeping, nothing left to fail). A
failure anywhere — or `abort` — frees the staged versions, restores what the `UndoLog` saved and leaves
every name on its old value. Reads made with the transaction see its staged values. `step_transaction`
makes one the current transaction of the calling context, so nested steps (an optimizer stepped chunk by
chunk) join it. Memory state that a step changes in place is saved to the transaction's `UndoLog` first:
copies in memory up to `UNDO_MEMORY_BYTES`, beyond that written to a ``u/`` namespace of a storage taking
part (every fallible step has one); a copy is dropped only once its spill is durable.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .errors import SwapIOError, UnknownKeyError, ZswapError

INFLIGHT_WRITE_BYTES = 64 << 20
"""Source bytes of queued writes a storage holds at most before `put` waits for the oldest: four times the
bytes an engine has in flight at its default queue depth (16 × 1 MiB), enough to keep the disk busy; a
deeper queue only raises the peak memory (this was 256 MiB)."""
UNDO_MEMORY_BYTES = 256 << 20
"""Bytes of rollback copies an `UndoLog` keeps in memory before it spills them to a storage."""


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


class Storage:
    """One engine and its write queue, shared by the namespaces on it. ``owns_engine``: close the engine
    when the last namespace closes (or when the storage is collected)."""

    def __init__(self, engine: Any, *, owns_engine: bool) -> None:
        self.engine = engine
        self.owns_engine = owns_engine
        self.queue = WriteQueue(INFLIGHT_WRITE_BYTES)
        self._ns_ids: dict[str, itertools.count[int]] = {}
        self._versions = itertools.count(1)
        self._open = 0
        self.paths: tuple[str, ...] = ()

    @property
    def closed(self) -> bool:
        return bool(getattr(self.engine, "closed", False))

    def namespace(self, kind: str) -> Namespace:
        """A new namespace ``<kind>/<n>`` on this storage."""
        n = next(self._ns_ids.setdefault(kind, itertools.count(1)))
        self._open += 1
        return Namespace(self, f"{kind}/{n}")

    def physical(self, prefix: str, name: str) -> str:
        return f"{prefix}/{name}@{next(self._versions)}"

    def _released(self) -> None:
        self._open -= 1
        if self._open <= 0 and self.owns_engine and not self.closed:
            self.queue.drain()
            self.engine.close()

    def close_if_unused(self) -> None:
        """Close an engine zswap opened that no namespace uses (a construction that failed half-way)."""
        if self._open <= 0 and self.owns_engine and not self.closed:
            self.engine.close()

    def free_quiet(self, physical: str) -> None:
        """Free a physical key if the engine still has it (a failed allocation left none)."""
        if self.closed:
            return
        with contextlib.suppress(KeyError, ZswapError):
            self.engine.free(physical)


_BY_ENGINE: weakref.WeakValueDictionary[int, Storage] = weakref.WeakValueDictionary()
_BY_DIR: weakref.WeakValueDictionary[tuple[str, ...], Storage] = weakref.WeakValueDictionary()


def storage_for(engine: Any) -> Storage:
    """The storage over ``engine`` (one per engine; a `Storage` is returned as it is). A caller's engine
    is never closed by zswap."""
    if isinstance(engine, Storage):
        return engine
    s = _BY_ENGINE.get(id(engine))
    if s is None or s.engine is not engine:
        s = _BY_ENGINE[id(engine)] = Storage(engine, owns_engine=False)
    return s


def open_dir(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], aio: Any = None) -> Storage:
    """The storage on swap directory ``paths`` (one, or several striped): the open one if any namespace
    still uses the same directories (its engine settings are kept), else one on a new engine built with
    ``aio`` (a config's `AioConfig`; None: engine defaults) that is closed with its last namespace."""
    from .swap import SwapEngine  # the native engine is loaded only when NVMe is used

    plist = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    key = tuple(os.path.realpath(os.fspath(p)) for p in plist)
    s = _BY_DIR.get(key)
    if s is not None and not s.closed:
        return s
    engine = SwapEngine.from_config(aio, [os.fspath(p) for p in plist]) if aio is not None else None
    if engine is None:
        engine = SwapEngine([os.fspath(p) for p in plist])
    s = Storage(engine, owns_engine=True)
    s.paths = key
    _BY_DIR[key] = s
    _BY_ENGINE[id(engine)] = s
    return s


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

    def close(self) -> None:
        """Wait for the writes, free every value, let go of the storage. Idempotent; raises nothing."""
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
        self.storage._released()

    def _check_open(self) -> None:
        if self._closed:
            raise ZswapError(f"storage namespace {self.prefix!r} is closed")


class Transaction:
    """Writes staged over any namespaces, made live all at once by `commit` or dropped by `abort`."""

    def __init__(self) -> None:
        self._staged: dict[tuple[int, str], tuple[Namespace, _Write]] = {}
        self._writes: list[_Write] = []
        self._error: BaseException | None = None
        self._on_commit: list[Callable[[], None]] = []
        self._on_abort: list[Callable[[], object]] = []
        self._storages: dict[int, Storage] = {}
        self.undo = UndoLog()
        self.volatile: set[int] = set()
        """Storage addresses of scratch buffers a step may change freely (`scratch`; never saved)."""
        self.state = "open"

    # -- taking part ---------------------------------------------------------------------------------

    def uses(self, storage: Storage) -> None:
        """Declare that the step does I/O on ``storage``: it can fail, so in-place changes need undo."""
        self._storages.setdefault(id(storage), storage)
        if self.undo.spill_to is None:
            self.undo.spill_to = storage

    @property
    def fallible(self) -> bool:
        """Whether any I/O takes part (else nothing can fail once the step's checks passed)."""
        return bool(self._storages)

    def save(self, t: torch.Tensor) -> None:
        """Save ``t``'s bytes before the step changes it in place (no-op when nothing can fail or
        ``t`` is a scratch buffer)."""
        if self.fallible and t.numel() and t.untyped_storage().data_ptr() not in self.volatile:
            self.undo.save(t)

    def scratch(self, t: torch.Tensor) -> None:
        """Mark ``t``'s memory as a scratch buffer of the step (never saved)."""
        self.volatile.add(t.untyped_storage().data_ptr())

    def on_commit(self, fn: Callable[[], None]) -> None:
        self._on_commit.append(fn)

    def on_abort(self, fn: Callable[[], object]) -> None:
        self._on_abort.append(fn)

    def put(self, ns: Namespace, name: str, tensor: torch.Tensor, *, held: int | None = None) -> _Write:
        self._check_open()
        self.uses(ns.storage)
        prev = self._staged.get((id(ns), name))
        w = ns._issue(name, tensor, self._landed, held)
        self._writes.append(w)
        self._staged[(id(ns), name)] = (ns, w)
        if prev is not None:
            prev[1].settle()
            ns.storage.free_quiet(prev[1].physical)  # superseded inside the transaction
        return w

    def _landed(self, w: _Write) -> None:
        if w.error is not None and self._error is None:
            self._error = _named(w.error, w.physical.rsplit("@", 1)[0])  # the logical key

    def staged(self, ns: Namespace, name: str) -> str | None:
        entry = self._staged.get((id(ns), name))
        return None if entry is None else entry[1].physical

    def check(self) -> None:
        """Raise the first failed staged write so far (the step should stop early)."""
        if self._error is not None:
            raise self._error

    # -- ending --------------------------------------------------------------------------------------

    def commit(self) -> None:
        """Wait for every staged write; if all landed, make them live at once, else `abort` and raise.
        An exception while waiting (a KeyboardInterrupt included) aborts: the step is all or nothing."""
        self._check_open()
        try:
            for w in self._writes:
                w.settle()
            self.undo.settle()
            await_point("commit")
        except BaseException:
            self.abort()
            raise
        if self._error is not None:
            err = self._error
            self.abort()
            raise err
        for ns, w in self._staged.values():
            ns.replace(w.name, w.physical)
        self.state = "committed"
        self.undo.discard()
        for fn in self._on_commit:
            fn()

    def abort(self) -> None:
        """Drop every staged write and restore the undo log. Idempotent."""
        if self.state != "open":
            return
        self.state = "aborted"
        # Every write must have landed before its version is freed and the undo log restored, even if an
        # interrupt arrives meanwhile: it is held back and raised once the state is whole again.
        held: BaseException | None = None
        for w in self._writes:
            while not w.settled:
                try:
                    w.settle()
                except BaseException as exc:  # an interrupt: wait for this write again
                    held = held or exc
        for ns, w in self._staged.values():
            ns.storage.free_quiet(w.physical)
        try:
            self.undo.restore()
        finally:
            for fn in reversed(self._on_abort):
                fn()
        if held is not None:
            raise held

    def _check_open(self) -> None:
        if self.state != "open":
            raise ZswapError(f"this storage transaction is {self.state}")


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` (same elements, ``dst`` flat and contiguous), as one single-threaded memcpy where
    both are contiguous: a torch copy would wake its OpenMP pool between two runs of the Adam kernel's
    threads, and the two pools spinning against each other made each copy ~50x slower (measured)."""
    if src.is_contiguous():
        np.copyto(dst.view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src.reshape(-1))


_ARENA = threading.local()
"""Per thread: ``buf``, a byte buffer reused by successive undo logs (grown to the most one step kept in
memory, at most `UNDO_MEMORY_BYTES`), and ``busy`` while a log uses it."""


def undo_arena_bytes() -> int:
    """Bytes of the calling thread's undo-log arena (kept between steps; 0 before a step saved anything)."""
    buf = _ARENA.__dict__.get("buf")
    return 0 if buf is None else int(buf.numel())


class UndoLog:
    """Old bytes of tensors a step changes in place, to put back on abort (see the module docstring)."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = UNDO_MEMORY_BYTES if budget is None else budget
        self.spill_to: Storage | None = None
        self._ns: Namespace | None = None
        self._entries: list[list[Any]] = []  # [target, copy or None, name or None, write or None]
        self._held = 0
        self._error: BaseException | None = None
        self._arena: dict[str, Any] | None = None  # the thread's arena, while this log holds it
        self._arena_used = 0

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        """A flat copy of ``t``: in the thread's arena while it has room (fresh pages cost a fault each,
        which is most of a copy's time), else a new tensor."""
        nbytes = t.numel() * t.element_size()
        arena = _ARENA.__dict__
        if self._arena is None and not arena.get("busy"):
            arena["busy"] = True
            self._arena = arena
        buf: torch.Tensor | None = None
        if self._arena is not None and self._held + nbytes <= self.budget:
            off = -(-self._arena_used // 64) * 64  # aligned for every dtype's view
            have = self._arena.get("buf")
            if have is None or have.numel() < off + nbytes:
                # A bigger arena for this and later steps; copies already taken keep the old one alive.
                size = min(max(off + nbytes, 2 * (0 if have is None else have.numel())), self.budget + 64)
                if have is not None and off:
                    off = 0
                    self._arena_used = 0
                size = max(size, nbytes)
                self._arena["buf"] = have = torch.empty(size, dtype=torch.uint8)
            buf = have[off : off + nbytes]
            self._arena_used = off + nbytes
        keep = torch.empty(t.numel(), dtype=t.dtype) if buf is None else buf.view(t.dtype)
        _memcpy(keep, t.detach())
        return keep

    def save(self, t: torch.Tensor) -> None:
        keep = self._copy(t)
        entry: list[Any] = [t, keep, None, None]
        self._entries.append(entry)
        self._held += keep.nbytes
        if self._held > self.budget and self.spill_to is not None and not self.spill_to.closed:
            if self._ns is None:
                self._ns = self.spill_to.namespace("u")
            name = str(len(self._entries))
            entry[2] = name

            def landed(w: _Write, entry: list[Any] = entry) -> None:
                if w.error is None:
                    assert self._ns is not None
                    self._ns.replace(w.name, w.physical)
                    self._held -= entry[1].nbytes
                    entry[1] = None  # durable: the memory copy may go
                elif self._error is None:
                    self._error = w.error  # the memory copy stays: rollback still works

            entry[3] = self._ns._issue(name, keep, landed)

    def settle(self) -> None:
        """Wait for the spills; raise the first that failed (the step must abort; copies are kept)."""
        for e in self._entries:
            if e[3] is not None:
                e[3].settle()
        if self._error is not None:
            raise self._error

    def restore(self) -> None:
        """Put every saved tensor back, newest first. A spill that cannot be read back raises a
        `ZswapError` saying the rollback is incomplete (a second fault)."""
        with contextlib.suppress(BaseException):
            self.settle()
        failed: BaseException | None = None
        for target, keep, name, _ in reversed(self._entries):
            if keep is None:
                assert self._ns is not None
                keep = torch.empty(target.numel(), dtype=target.dtype)
                try:
                    self._ns.read(name, keep).wait()
                except BaseException as exc:
                    failed = failed or exc
                    continue
            target.copy_(keep.view(target.shape))
        self.discard()
        if failed is not None:
            raise ZswapError(
                "a step failed and its rollback could not read back a saved copy; in-memory optimizer or "
                f"param state is partly from the failed step: {failed}"
            ) from failed

    def discard(self) -> None:
        self._entries.clear()
        self._held = 0
        if self._arena is not None:
            self._arena["busy"] = False
            self._arena, self._arena_used = None, 0
        if self._ns is not None:
            self._ns.close()
            self._ns = None


_CURRENT: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar("zswap_txn", default=None)


def current() -> Transaction | None:
    """The transaction of the step running in this context, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def step_transaction() -> Iterator[Transaction]:
    """The current transaction, or a new one made current for the block: committed when the block
    ends (its `commit` may raise), aborted when it raises. A joined transaction is left to its owner."""
    txn = _CURRENT.get()
    if txn is not None:
        yield txn
        return
    txn = Transaction()
    token = _CURRENT.set(txn)
    try:
        try:
            yield txn
        except BaseException:
            txn.abort()
            raise
        txn.commit()
    finally:
        _CURRENT.reset(token)
