"""Where the partition gradients of managed params live between backward and `Engine.step`.

`MemoryGrads` keeps each one as ``ParamState.grad`` (CPU memory; the param's device for tier "none").
`NvmeGrads` keeps them in a `SwapEngine` (the params' own, or one on ``offload_optimizer.nvme_path``) and is
used when the config puts the optimizer on NVMe, so a model larger than memory can train. A param's store is
``ParamState.grad_store`` (``None``: memory), set by `zswap.initialize` (`attach`) and reset on close.

NVMe writes never stall backward: a param's first gradient of a step is written asynchronously (the source
stays alive in the storage's bounded write queue); a later backward before the step reads the partition
back, adds in place (the op `MemoryGrads` uses, so values are the same) and writes it again. Each
backward's writes commit together at its end or not at all (`NvmeGrads`).

A step's first gradients are kept in memory instead, up to ``NvmeGrads.stash_cap`` bytes (the *stash*; the
Engine's ``grad_stash_bytes``, asked through `attach`): the step then reads them from memory. Gradients past
the cap are written as above.

Gradients `zswap.earlystep` applies in backward are, by default (``Engine.keep_applied_grads`` false), not
stored at all: the early step holds each one until its optimizer records are updated and then lets it go;
the store only notes that the param has a gradient (`NvmeGrads.applied`: `has` is true, so `Engine.step`
sees the same params with gradients). `load` of such a gradient (`full_grad`), and `add` onto it (a second
backward), raise `GradientsNotKeptError`: its value is gone, and the optimizer records do not give it back
(``m' = β₁m + (1-β₁)g`` rounds). With ``keep_applied_grads`` they are stored as any other gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

from .. import memory
from ..errors import ConfigError, GradientsNotKeptError
from ..parts.params import GradStore, NvmeStore, ParamState
from ..pool import BufferPool
from ..store.storage import Transaction, open_dir, storage_for


class MemoryGrads(GradStore):
    def __init__(self, widen: bool = False) -> None:
        self.widen = widen
        """`add` sums float16/bfloat16 gradients as `add_fp32` does (``grad_accum_dtype: fp32``)."""

    def add(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        if self.widen and part.dtype in LOW_PRECISION:
            return self.add_fp32(st, part, room)
        if st.tier != "none" and part.device.type != "cpu":
            part = part.to("cpu")
        if st.grad is None:
            # Autograd hands the gradient over (``p.grad`` was cleared), so the first one is kept as is.
            st.grad = part if part.is_contiguous() else part.contiguous()
        else:
            st.grad.add_(part)
        return st.grad

    def add_fp32(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        if part.dtype not in LOW_PRECISION:
            return self.add(st, part if part.is_contiguous() else part.contiguous())
        if st.grad is None:
            home = "cpu" if st.tier != "none" else part.device
            st.grad = part.to(home, torch.float32, copy=True)  # exact: every low-precision value is a float32
        else:
            st.grad.add_(part)  # float32 += float32(part): computed and rounded in float32
        return st.grad

    def has(self, st: ParamState) -> bool:
        return st.grad is not None

    def dtype(self, st: ParamState) -> torch.dtype | None:
        return None if st.grad is None else st.grad.dtype

    def load(self, st: ParamState) -> tuple[torch.Tensor, None]:
        if st.grad is None:
            raise KeyError(st.key)
        return st.grad, None

    def clear(self, sts: Iterable[ParamState]) -> None:
        for st in sts:
            st.grad = None


class _Alive:
    __slots__ = ("__weakref__",)


def _dead() -> None:
    return None


MEMORY = MemoryGrads()
NOT_KEPT = '(engine.keep_applied_grads is False, or "auto", the default, before they were first needed)'
"""Why applied gradients were let go, as the `GradientsNotKeptError` messages say it."""
RESTART = (
    "Params and optimizer states are as before this step: call engine.zero_grad() and run backward again. "
    'With engine.keep_applied_grads = "auto" (the default) applied gradients are kept from the next backward '
    "on, after this error; set engine.keep_applied_grads = True to keep them always (written or kept in "
    "memory), so that this falls back to the ordinary step"
)
"""How to go on after a `GradientsNotKeptError`; every raise of one also marks its gradients wanted, so
that ``"auto"`` keeps them from the next backward on."""
LOW_PRECISION = (torch.float16, torch.bfloat16)


def store_of(st: ParamState) -> GradStore:
    return MEMORY if st.grad_store is None else st.grad_store


class NvmeGrads(GradStore):
    """Partition gradients in a namespace (``g/<n>``) of a `zswap.storage.Storage`.

    Each backward's writes form one transaction (its *generation*), committed when the backward ends (an
    autograd final callback; outside a backward, at the next read): if any write failed, none of that
    backward's gradients count — every partition keeps what the earlier backwards accumulated — and
    ``loss.backward()`` raises the `SwapIOError`, naming the key. A backward that raised for any other
    reason (a failed param read) before its end counts for nothing either. Run the backward again once
    space is freed. An error that could not be raised there (gradients added outside a backward) is kept
    and raised by `wait_all`, `has`, `load` and `clear` (so by `Engine.step`, `full_grad` and
    `zero_grad`) until `clear`.
    """

    def __init__(
        self,
        engine: Any,
        *,
        owns_engine: bool = False,
        stash_cap: Callable[[], int] = lambda: 0,
        norms_wanted: Callable[[], bool] = lambda: False,
        widen: bool = False,
    ) -> None:
        self.widen = widen
        """`add` sums float16/bfloat16 gradients as `add_fp32` does (``data_types.grad_accum_dtype: fp32``):
        a partition's first gradient of a step in its own dtype, the sum in float32."""
        self.storage = storage_for(engine)
        self.owns_engine = owns_engine  # closing the namespace closes an engine zswap opened
        self.ns = self.storage.namespace("g")
        self._meta: dict[str, tuple[int, torch.dtype]] = {}  # committed: name -> (numel, dtype)
        self._gen: Transaction | None = None
        self._gen_task = -1  # the autograd graph task that opened it (-1: none)
        self._gen_alive: Callable[[], object] = _dead  # while that task runs (`_generation`)
        self._gen_meta: dict[str, tuple[int, torch.dtype]] = {}
        self._error: BaseException | None = None
        self._reported = False
        self._stash_cap = stash_cap  # asked at each gradient: the engine's `grad_stash_bytes`
        self._stash: dict[str, torch.Tensor] = {}  # committed, in memory: name -> gradient
        self._gen_stash: dict[str, torch.Tensor] = {}  # the open generation's
        self.stash_bytes = 0
        """Bytes the stash holds now (committed and open generation)."""
        self.stash_peak = 0
        """Most bytes it held at once since the store was made."""
        self.norms_wanted = norms_wanted
        """Whether the next step needs the gradients' norm (clipping, the fp16 check): then each stored
        value's norm is computed as it is stored, while in memory, and the step reads no gradient for it."""
        self._norms: dict[str, torch.Tensor] = {}
        self._gen_norms: dict[str, torch.Tensor] = {}
        self._gen_replaced = 0  # bytes of the stash the open generation's sums replace when it commits
        self._applied: set[str] = set()  # committed names whose gradient the early step applied, unkept
        self._gen_applied: set[str] = set()  # the open generation's
        self._loads: BufferPool | None = None  # `step_loads`' pool while one is open

    @property
    def engine(self) -> Any:
        return self.storage.engine

    @staticmethod
    def key(st: ParamState) -> str:
        return f"{id(st):x}"  # unique: the zswap Engine holds each st

    def physical(self, st: ParamState) -> str | None:
        """The engine key holding ``st``'s committed gradient (None: none)."""
        return self.ns._live.get(self.key(st))

    def applied(self, st: ParamState, grad: torch.Tensor, norm: bool = False) -> None:
        """Note that this backward gave ``st`` its first gradient ``grad``, which `zswap.earlystep` applies
        and does not keep (see the module docstring); its norm is noted as `add` notes it, for the step's
        overflow check and clipping, and always with ``norm`` (an update deferred to the step, which
        needs the norm of every gradient even where clipping is decided after backward, and cannot read
        this one). `unapply` takes the note back."""
        gen = self._generation()
        if gen._error is not None:
            return
        key = self.key(st)
        self._gen_meta[key] = (grad.numel(), grad.dtype)
        self._note_norm(key, grad, norm)
        self._gen_applied.add(key)

    def unapply(self, st: ParamState) -> None:
        """Undo `applied` (the early step gave up in backward and hands the gradient to `add` instead)."""
        key = self.key(st)
        if key in self._gen_applied:
            self._gen_applied.discard(key)
            self._gen_meta.pop(key, None)
        elif key in self._applied:  # this backward's generation already committed (its end came first)
            self._applied.discard(key)
            self._meta.pop(key, None)

    def not_kept(self, st: ParamState) -> bool:
        """Whether ``st``'s committed gradient was applied by the early step and not kept."""
        self._commit()
        return self.key(st) in self._applied

    def add(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        """Add ``part`` to ``st``'s gradient of this step; returns the sum now stored (kept or being
        written: read it, never change it), ``None`` if this backward's writes already failed. ``room``:
        bytes the stash may hold past ``stash_cap`` for it (the early step keeps the gradients a redone
        step may need, and earlier micro-batches', in memory: `zswap.earlystep`)."""
        if self._error is not None:
            return None  # gradients are lost until `clear`; `wait_all` (every step) raises the error
        key = self.key(st)
        if key in self._applied or key in self._gen_applied:
            self.wanted = True
            raise GradientsNotKeptError(
                f"a second gradient for param {st.key} before engine.step(): its gradient from an earlier "
                f"backward was applied to the optimizer by the early step and not kept {NOT_KEPT}, so "
                f"nothing can be added to it. {RESTART}"
            )
        widening = self.widen and part.dtype in LOW_PRECISION
        if widening and (self._gen_meta.get(key) or self._meta.get(key)) is not None:
            return self.add_fp32(st, part, room)  # (which adds a first gradient here: no loop)
        gen = self._generation()
        if gen._error is not None:
            return None  # this backward already failed: its end raises
        part = part.to("cpu") if part.device.type != "cpu" else part
        meta = self._gen_meta.get(key) or self._meta.get(key)
        kept = self._gen_stash.get(key)
        if kept is not None:  # a second gradient in one backward: this generation's own, added in place
            kept.add_(part)
            self._note_norm(key, kept)
            return kept
        old = self._committed(key)
        # Accumulation onto a kept gradient: kept again. Within ``room`` what counts is what the stash
        # holds once this backward commits (the sum replaces ``old``), not the moment both are held.
        if old is not None and (
            self._stash_room(old)
            or (room > 0 and self.stash_bytes - self._gen_replaced <= self.stash_cap + room)
        ):
            acc = old.clone()  # the earlier value stays as it is until this backward commits
            acc.add_(part)
            self._gen_replaced += old.nbytes
            self._gen_meta[key] = (acc.numel(), acc.dtype)
            self._gen_stash[key] = acc
            self._stash_grow(acc.nbytes)
            self._note_norm(key, acc)
            return acc
        if meta is not None:  # gradient accumulation: read, add, write back
            with memory.purpose("grads"):
                acc = self.engine.empty((meta[0],), meta[1])  # page-aligned: read without a bounce copy
            if not self._read(key, acc, gen):
                return None
            acc.add_(part)
            part = acc
        elif not part.is_contiguous():
            part = part.contiguous()
        self._gen_meta[key] = (part.numel(), part.dtype)
        self._note_norm(key, part)
        if meta is None and self._stash_room(part, room):
            if part.untyped_storage().nbytes() > part.nbytes:
                part = part.clone()  # a view of a larger buffer: keep only its own bytes alive
            self._gen_stash[key] = part  # a first gradient: kept in memory, never written (module docstring)
            self._stash_grow(part.nbytes)
            return part
        self.ns.put(key, part, gen)
        return part

    def _note_norm(self, key: str, value: torch.Tensor, always: bool = False) -> None:
        if always or self.norms_wanted():
            self._gen_norms[key] = torch.linalg.vector_norm(value, 2.0, dtype=torch.float32)
        else:
            self._gen_norms.pop(key, None)

    @property
    def stash_cap(self) -> int:
        """Bytes of partition gradients kept in memory rather than written (see the module docstring)."""
        return self._stash_cap()

    def _stash_room(self, part: torch.Tensor, room: int = 0) -> bool:
        return self.stash_bytes + part.nbytes <= self.stash_cap + room

    def _stash_grow(self, n: int) -> None:
        self.stash_bytes += n
        self.stash_peak = max(self.stash_peak, self.stash_bytes)

    def _committed(self, key: str) -> torch.Tensor | None:
        """``key``'s gradient in the stash as the last commit left it — ``None`` where this backward has a
        value of its own (its second gradient in one backward, a reentrant checkpoint's: added to that)."""
        return None if key in self._gen_meta else self._stash.get(key)

    def _read(self, key: str, out: torch.Tensor, gen: Transaction) -> bool:
        """Fill ``out`` with ``key``'s gradient so far (from the stash or the storage); False (and the
        generation failed) if the read failed."""
        kept = self._committed(key)
        if kept is not None:
            out.copy_(kept)
            return True
        try:
            self.ns.read(key, out, gen).wait()
        except Exception as exc:
            gen._error = gen._error or exc
            return False
        return True

    def add_fp32(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        """A partition's first gradient of a step is stored in its own dtype (its float32 value is the
        same, at half the bytes), as `add` stores it; accumulating into it widens it to float32 and adds:
        the float32 sum is kept in memory where the value it adds to was and ``room`` allows (as `add`
        keeps a sum), else written. `load` then returns float32 or the one low-precision gradient, the
        same values. Returns the value stored, as `add` does."""
        key = self.key(st)
        meta = self._gen_meta.get(key) or self._meta.get(key)
        if part.dtype not in LOW_PRECISION or meta is None or self._error is not None:
            return self.add(st, part, room)  # kept in the write queue until written: its buffer stays in use
        gen = self._generation()
        if gen._error is not None:
            return None
        own = self._gen_stash.pop(key, None)  # this generation's own gradient so far: summed in place
        old = None if own is not None else self._committed(key)  # read only until this commits
        if own is not None:
            self.stash_bytes -= own.nbytes
            stored = own
        elif old is not None:
            stored = old
        else:
            with memory.purpose("grads"):
                stored = self.engine.empty((meta[0],), meta[1])
            if not self._read(key, stored, gen):
                return None
        if stored.dtype == torch.float32 and old is None:
            acc = stored
        else:
            with memory.purpose("grads"):
                acc = self.engine.empty((meta[0],), torch.float32)
            acc.copy_(stored)
        acc.add_(part.to("cpu") if part.device.type != "cpu" else part)
        self._gen_meta[key] = (acc.numel(), torch.float32)
        # Kept in memory, as `add` keeps a sum, where the value it adds to was (a first gradient in the
        # stash) and within ``room``: counted is what the stash holds once this backward commits — each
        # sum in place of the value it replaces, kept or written (the commit lets those go) — so where
        # the float32 sums do not all fit, the later ones are kept. Else written (and, for a deferred
        # step or clipping, read back).
        self._gen_replaced += old.nbytes if old is not None else 0
        self._note_norm(key, acc)  # while in memory: the step reads no gradient for its norm
        if (own is not None or old is not None) and (
            self.stash_bytes - self._gen_replaced + acc.nbytes <= self.stash_cap + room
        ):
            self._gen_stash[key] = acc
            self._stash_grow(acc.nbytes)
            return acc
        self.ns.put(key, acc, gen)
        return acc

    def _generation(self) -> Transaction:
        task = torch._C._current_graph_task_id()
        if self._gen is not None and self._gen_task not in (-1, task):
            if self._gen_alive() is not None:
                return self._gen  # a backward inside the one that opened it (reentrant checkpointing)
            self._drop_unfinished()
        if self._gen is None:
            self._gen = Transaction()
            self._gen_task = task
            if task != -1:  # inside a backward: commit when it ends
                # Autograd holds the callback, and ``alive`` with it, until it drops the graph task (at
                # its end, or when it raised): while ``alive`` lives, another task's gradients are of a
                # backward run inside this one and belong to this generation.
                alive = _Alive()
                self._gen_alive = weakref.ref(alive)
                Variable._execution_engine.queue_callback(lambda: self._end_backward(alive))
        return self._gen

    def _drop_gen_stash(self) -> None:
        self.stash_bytes -= sum(t.nbytes for t in self._gen_stash.values())
        self._gen_stash = {}
        self._gen_replaced = 0

    def _drop_unfinished(self) -> None:
        """Abort the generation of a backward that raised before its end (its error went to the caller
        of that backward): none of its gradients count."""
        gen, self._gen, self._gen_meta, self._gen_norms = self._gen, None, {}, {}
        self._gen_applied = set()
        self._drop_gen_stash()
        if gen is not None:
            gen.abort()

    def _end_backward(self, alive: object = None) -> None:
        err = self._commit()
        if err is not None:
            # Raised from loss.backward(): that backward counted for nothing and the store is as before
            # it, so nothing is kept — the next backward runs as if the failed one never had.
            if self._error is err:
                self._error, self._reported = None, False
            raise err

    def _commit(self) -> BaseException | None:
        """Commit the open generation; keep and return its error (then it counted for nothing)."""
        if self._gen is not None and self._gen_task not in (-1, torch._C._current_graph_task_id()):
            if self._gen_alive() is not None:
                return None  # asked inside a backward run within the generation's: its end commits it
            self._drop_unfinished()  # its backward never reached its end
        gen, self._gen = self._gen, None
        if gen is None:
            return None
        meta, self._gen_meta = self._gen_meta, {}
        kept, self._gen_stash = self._gen_stash, {}
        norms, self._gen_norms = self._gen_norms, {}
        applied, self._gen_applied = self._gen_applied, set()
        self._gen_replaced = 0
        try:
            gen.commit()
        except Exception as exc:
            self.stash_bytes -= sum(t.nbytes for t in kept.values())
            if self._error is None:
                self._error, self._reported = exc, False
            return exc
        for key in meta:  # the new value (kept again, or written) replaces what the stash had
            old = self._stash.pop(key, None)
            if old is not None:
                self.stash_bytes -= old.nbytes
            self._norms.pop(key, None)
            self._applied.discard(key)
        self._applied |= applied
        self._stash.update(kept)
        self._norms.update(norms)
        self._meta.update(meta)
        return None

    def has(self, st: ParamState) -> bool:
        self._commit()
        self._check()
        return self.key(st) in self._meta

    def dtype(self, st: ParamState) -> torch.dtype | None:
        self._commit()
        self._check()
        meta = self._meta.get(self.key(st))
        return None if meta is None else meta[1]

    def norm(self, st: ParamState) -> torch.Tensor | None:
        self._commit()
        self._check()
        return self._norms.get(self.key(st))

    def load(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        self._commit()
        self._check()
        key = self.key(st)
        if key in self._applied:
            self.wanted = True
            raise GradientsNotKeptError(
                f"the gradient of param {st.key} was applied to the optimizer in backward by the early step "
                f"and not kept {NOT_KEPT}: it cannot be read before engine.step(). Set "
                "engine.keep_applied_grads = True before backward to read gradients between backward and "
                'step (with "auto", the default, they are kept from the next backward on, after this error)'
            )
        return self._committed_value(key)

    def earlier(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        # The committed value, without committing the generation of the backward running now (its end
        # does, and raises its errors); this key has nothing in that generation.
        key = self.key(st)
        if key in self._gen_meta or key in self._applied or key not in self._meta:
            raise KeyError(f"param {st.key} has no gradient of earlier backwards alone")
        self._check()
        return self._committed_value(key)

    def _committed_value(self, key: str) -> tuple[torch.Tensor, Any]:
        """``key``'s committed gradient: the kept tensor itself (as `MemoryGrads.load`), or a buffer being
        read (a `step_loads` pool's where one is open) and its handle."""
        numel, dtype = self._meta[key]
        kept = self._stash.get(key)
        if kept is not None:
            return kept, None
        buf = self._alloc(numel, dtype) if self._loads is None else self._loads.take(numel, dtype)[0]
        return buf, self.ns.read(key, buf)

    def _alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with memory.purpose("grads"):
            return self.engine.empty((numel,), dtype)  # page-aligned: read without a bounce copy

    @property
    def pooling(self) -> bool:
        """Whether a `step_loads` block is open."""
        return self._loads is not None

    @contextlib.contextmanager
    def step_loads(self) -> Iterator[None]:
        """Within: `load` reuses the buffers of gradients let go (`zswap.pool`'s peak rule), so an ordinary
        step's later chunks read into the pages earlier chunks mapped instead of mapping (and the kernel
        zeroing) new ones: that was about 40 % of the busy main-thread time (py-spy) of a 1 GiB fp32 step
        whose clipping bites, CPU time that a step bound by its CPU (two ranks on two cores) lacks. Unmapped
        at the end: nothing idles through the next forward and backward."""
        self._loads = BufferPool(self._alloc)
        try:
            yield
        finally:
            pool, self._loads = self._loads, None
            pool.clear()

    def clear(self, sts: Iterable[ParamState]) -> None:
        self._commit()
        for st in sts:
            key = self.key(st)
            self._norms.pop(key, None)
            self._applied.discard(key)
            if self._meta.pop(key, None) is not None:
                kept = self._stash.pop(key, None)
                if kept is not None:
                    self.stash_bytes -= kept.nbytes
                self.ns.free(key)
        if not self._meta:
            err, reported = self._error, self._reported
            self._error, self._reported = None, False
            if err is not None and not reported:
                raise err

    def wait_all(self) -> None:
        self._commit()
        self._check()

    def close(self) -> None:
        if self._gen is not None:
            self._gen.abort()
            self._gen = None
        self._drop_gen_stash()
        self._stash.clear()
        self._norms.clear()
        self._applied.clear()
        self._gen_applied.clear()
        self.stash_bytes = 0
        self.ns.close(give_back=True)

    def _check(self) -> None:
        if self._error is not None:
            self._reported = True
            raise self._error


def attach(
    items: Iterable[tuple[torch.Tensor, ParamState]],
    cfg: Any,
    *,
    stash_cap: Callable[[], int] = lambda: 0,
    norms_wanted: Callable[[], bool] = lambda: False,
    widen: bool = False,
) -> list[GradStore]:
    """Point each param's ``grad_store`` where the config wants its gradients: NVMe when
    ``offload_optimizer.device`` is "nvme" (the param store's engine when that is NVMe, else one new engine
    on ``offload_optimizer.nvme_path``), else memory. Returns the NVMe stores, to `detach` later. Each
    keeps up to ``stash_cap()`` bytes of gradients in memory (`NvmeGrads.stash_cap`) and computes their
    norms as it stores them while ``norms_wanted()`` (`NvmeGrads.norms_wanted`). ``widen``: every store
    sums float16/bfloat16 gradients in float32 (in memory: a store of these params' own)."""
    out: dict[int, NvmeGrads] = {}
    off = cfg.offload_optimizer
    if off.device != "nvme":
        if widen:
            mine = MemoryGrads(widen=True)
            for _, st in items:
                st.grad_store = mine  # (`detach` resets it; nothing to close)
        return []
    policy: dict[str, Any] = {"stash_cap": stash_cap, "norms_wanted": norms_wanted, "widen": widen}
    for _, st in items:
        if isinstance(st.store, NvmeStore):
            gs = out.get(id(st.store.storage)) or out.setdefault(
                id(st.store.storage), NvmeGrads(st.store.storage, **policy)
            )
        else:
            gs = out.get(0) or out.setdefault(0, _own(cfg, **policy))
        st.grad_store = gs
    return list(out.values())


def _own(cfg: Any, **policy: Any) -> NvmeGrads:
    paths = cfg.offload_optimizer.nvme_path
    if not paths:
        raise ConfigError("offload_optimizer.nvme_path is required when offload_optimizer.device is 'nvme'")
    store = open_dir(list(paths), cfg.aio, "offload_optimizer.nvme_path")  # shared by path
    return NvmeGrads(store, owns_engine=True, **policy)


def detach(items: Iterable[tuple[torch.Tensor, ParamState]], stores: Iterable[GradStore]) -> None:
    """Undo `attach` (gradients should be cleared first); closes engines built for gradients."""
    for _, st in items:
        st.grad_store = None
    for gs in stores:
        gs.close()
