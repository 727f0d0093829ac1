"""The one storage layer under param partitions, partition gradients and optimizer records.

A `Storage` wraps one `SwapEngine`; every user of a swap directory gets the same one (`open_dir` shares
by real path, `storage_for` wraps a caller's engine), so space freed by one kind of data is reused by the
others. Users see it through `Namespace`\\s — ``p/<n>`` for a param store, ``g/<n>`` for gradients,
``o/<n>`` for an optimizer, ``u/<n>`` for rollback copies — each a map from names to byte strings.

Copy-on-write names and their error policy are `zswap.store.namespaces`; the bound on writes in flight
(`INFLIGHT_WRITE_BYTES`, one queue per storage) is `zswap.store.queue`. This module keeps the limits, the
storages and the transactions (the old path ``zswap.storage`` is this module).

Transactions. Writes staged in a `Transaction` go to fresh versions too, but no name moves until `commit`
has seen every one of them complete; then all move at once (pure bookkeeping, nothing left to fail). A
failure anywhere — or `abort` — frees the staged versions, restores what the `UndoLog` saved and leaves
every name on its old value. Reads made with the transaction see its staged values. `step_transaction`
makes one the current transaction of the calling context, so nested steps (an optimizer stepped chunk by
chunk) join it. Memory state that a step changes in place is saved to the transaction's `UndoLog` first:
copies in memory up to `UNDO_MEMORY_BYTES`, beyond that written to a ``u/`` namespace of a storage taking
part (every fallible step has one); a copy is dropped only once its spill is durable, and its buffer
then takes a later copy (`UNDO_SPILL_BYTES` bound what is being spilled: with optimizer states in CPU
memory every record is saved each step, and a new buffer per copy faulted in the states' size of fresh
pages every step — 0.9 M faults, 2–3 s of a 1 GiB bf16 model's 3.6 s step; benches/README.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import inspect
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._interrupts import deferred
from ..errors import (
    NvmePathError,
    NvmePathMissing,
    NvmePathNotADirectory,
    NvmePathNotWritable,
    ZswapError,
    ZswapWarning,
)
from .namespaces import Namespace, _named
from .queue import WriteQueue, _Write, await_point

INFLIGHT_WRITE_BYTES = 64 << 20
"""Source bytes of queued writes a storage holds at most before `put` waits for the oldest: four times the
bytes an engine has in flight at its default queue depth (16 × 1 MiB), enough to keep the disk busy; a
deeper queue only raises the peak memory (this was 256 MiB)."""
UNDO_MEMORY_BYTES = 256 << 20
"""Bytes of rollback copies an `UndoLog` keeps in memory before it spills them to a storage."""
UNDO_SPILL_BYTES = 256 << 20
"""Bytes of rollback copies an `UndoLog` has being spilled at once (at least one copy): past them it waits
for the oldest to land, and takes the next copy into its buffer."""
SPILL_BUFFER_MIN = 1 << 20
"""Bytes from which a spilled copy is an engine buffer reused within the step (smaller: a new tensor)."""


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
        """The swap directories (real paths) `open_dir` opened it on; () for a caller's own engine."""
        self.settings: tuple[tuple[str, Any], ...] | None = None
        """The engine's settings as `open_dir` resolved them from an ``aio`` section; None for a caller's
        own engine."""

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

    def _released(self, give_back: bool = False) -> None:
        self._open -= 1
        if self._open <= 0 and self.owns_engine and not self.closed:
            self.queue.drain()
            self.engine.close()
        elif give_back and not self.closed and hasattr(self.engine, "trim"):
            # Another namespace (the params') keeps the engine: the space this one freed (an engine's
            # optimizer records, its gradients) goes back to the file system rather than staying reserved.
            try:
                self.engine.trim()
            except OSError as exc:  # a close goes on: the space stays the engine's until it closes
                warnings.warn(
                    f"the swap space freed at this close could not be given back to the file system ({exc}); "
                    "it stays allocated to the swap files until their engine closes",
                    ZswapWarning,
                    stacklevel=3,
                )

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
_BY_DIR: weakref.WeakValueDictionary[tuple[Any, ...], Storage] = weakref.WeakValueDictionary()


def settings(aio: Any) -> tuple[tuple[str, Any], ...]:
    """The engine settings ``aio`` (an `AioConfig` or None) asks for, as `Storage.settings` records them."""
    from ..swap import SwapEngine

    return _settings(SwapEngine, aio)


def _settings(engine: type, aio: Any) -> tuple[tuple[str, Any], ...]:
    """Every keyword of ``engine`` (`zswap.SwapEngine`) as ``aio`` sets it, its default where it does not:
    a config that gives the defaults asks for the same engine as one without an ``aio`` section."""
    defaults = {
        k: p.default for k, p in inspect.signature(engine).parameters.items() if p.default is not p.empty
    }
    return tuple(sorted({**defaults, **(aio.engine_kwargs() if aio is not None else {})}.items()))


def storage_for(engine: Any) -> Storage:
    """The storage over ``engine`` (one per engine; a `Storage` is returned as it is). A caller's engine
    is never closed by zswap."""
    if isinstance(engine, Storage):
        return engine
    s = _BY_ENGINE.get(id(engine))
    if s is None or s.engine is not engine:
        s = _BY_ENGINE[id(engine)] = Storage(engine, owns_engine=False)
    return s


def open_dir(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    aio: Any = None,
    config_key: str = "nvme_path",
) -> Storage:
    """The storage on swap directory ``paths`` (one, or several striped) with ``aio``'s engine settings (a
    config's `AioConfig`; None: engine defaults): the open one if any namespace still uses the same
    directories with the same settings, else one on a new engine, closed with its last namespace (two
    models on one directory with different ``aio`` sections each get their own engine and swap files). A
    path that cannot hold swap files raises an `NvmePathError` naming ``config_key``."""
    from ..swap import SwapEngine  # the native engine is loaded only when NVMe is used

    plist = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    dirs = tuple(os.path.realpath(os.fspath(p)) for p in plist)
    key = (dirs, settings(aio))
    s = _BY_DIR.get(key)
    if s is not None and not s.closed:
        return s
    for path in plist:
        # OSError's str() appends the path: "[Errno 2] offload_param.nvme_path does not exist ...: '/x'".
        name = os.fspath(path)
        if not os.path.exists(path):
            raise NvmePathMissing(errno.ENOENT, f"{config_key} does not exist (zswap never creates it)", name)
        if not os.path.isdir(path):
            raise NvmePathNotADirectory(errno.ENOTDIR, f"{config_key} is not a directory", name)
        if not os.access(path, os.W_OK | os.X_OK):
            if os.statvfs(path).f_flag & os.ST_RDONLY:  # access() says EACCES; the kernel's reason is EROFS
                raise NvmePathNotWritable(errno.EROFS, f"{config_key} is on a read-only file system", name)
            raise NvmePathNotWritable(errno.EACCES, f"{config_key} is not writable", name)
    try:
        engine = SwapEngine.from_config(aio, [os.fspath(p) for p in plist]) if aio is not None else None
        if engine is None:
            engine = SwapEngine([os.fspath(p) for p in plist])
    except NvmePathError as e:  # every path is a writable directory (above): the file system refused a file
        code = int(getattr(e, "errno", 0) or 0)
        raise NvmePathNotWritable(
            code,
            f"{config_key} is a directory, but its file system refused a new file in it "
            f"({os.strerror(code)}; /proc and /sys, for instance, take none)",
            getattr(e, "filename", None),
        ) from e
    s = Storage(engine, owns_engine=True)
    s.paths, s.settings = dirs, key[1]
    _BY_DIR[key] = s
    _BY_ENGINE[id(engine)] = s
    return s


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
        with deferred(critical=True):  # live all at once: no interrupt between two names or the counters
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
        self._spare: list[torch.Tensor] = []  # (uint8) buffers of spills that landed: free for the next
        self._spilling = 0  # bytes of copies being spilled (not landed yet)

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
        if buf is None and self._spills() and nbytes >= SPILL_BUFFER_MIN:
            buf = self._spill_buffer(nbytes)
        keep = torch.empty(t.numel(), dtype=t.dtype) if buf is None else buf.view(t.dtype)
        _memcpy(keep, t.detach())
        return keep

    def _spills(self) -> bool:
        """Whether the next copy past the memory budget is spilled (a storage takes part)."""
        return self.spill_to is not None and not self.spill_to.closed

    def _spill_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer for a copy that will be spilled: a landed spill's (the smallest that holds it), else,
        after waiting for the oldest spills while `UNDO_SPILL_BYTES` are being spilled, a landed one's or a
        new engine buffer (page-aligned: written with no bounce copy)."""
        pending = (e for e in self._entries if e[3] is not None and not e[3].settled)
        while not self._fits(nbytes) and self._spilling and (oldest := next(pending, None)) is not None:
            oldest[3].settle()  # (a failed spill keeps its copy: `_error` says so at `settle`)
        fits = [k for k, b in enumerate(self._spare) if b.numel() >= nbytes]
        if fits:
            return self._spare.pop(min(fits, key=lambda k: self._spare[k].numel()))[:nbytes]
        assert self.spill_to is not None
        new: torch.Tensor = self.spill_to.engine.empty(nbytes, torch.uint8)
        return new

    def _fits(self, nbytes: int) -> bool:
        return any(b.numel() >= nbytes for b in self._spare) or self._spilling + nbytes <= UNDO_SPILL_BYTES

    def save(self, t: torch.Tensor) -> None:
        keep = self._copy(t)
        entry: list[Any] = [t, keep, None, None]
        self._entries.append(entry)
        self._held += keep.nbytes
        if self._held > self.budget and self._spills():
            assert self.spill_to is not None
            if self._ns is None:
                self._ns = self.spill_to.namespace("u")
            name = str(len(self._entries))
            entry[2] = name
            self._spilling += keep.nbytes

            def landed(w: _Write, entry: list[Any] = entry) -> None:
                self._spilling -= entry[1].nbytes
                if w.error is None:
                    assert self._ns is not None
                    self._ns.replace(w.name, w.physical)
                    self._held -= entry[1].nbytes
                    if entry[1].nbytes >= SPILL_BUFFER_MIN:  # (a `_spill_buffer`'s, whole)
                        self._spare.append(_bytes_of(entry[1]))  # landed: the engine reads it no more
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
        self._spare.clear()
        self._spilling = 0
        if self._arena is not None:
            self._arena["busy"] = False
            self._arena, self._arena_used = None, 0
        if self._ns is not None:
            self._ns.close()
            self._ns = None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer under ``t`` as bytes."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


_CURRENT: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar("zswap_txn", default=None)


def current() -> Transaction | None:
    """The transaction of the step running in this context, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def within(txn: Transaction) -> Iterator[Transaction]:
    """Make ``txn`` current for the block: a `step_transaction` inside it joins ``txn``, whose owner
    commits or aborts it."""
    token = _CURRENT.set(txn)
    try:
        yield txn
    finally:
        _CURRENT.reset(token)


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
