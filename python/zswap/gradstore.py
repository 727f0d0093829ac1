"""Where the partition gradients of managed params live between backward and `Engine.step`.

`MemoryGrads` keeps each one as ``ParamState.grad`` (CPU memory; the param's device for tier "none").
`NvmeGrads` keeps them in a `SwapEngine` (the params' own, or one on ``offload_optimizer.nvme_path``) and is
used when the config puts the optimizer on NVMe, so a model larger than memory can train. A param's store is
``ParamState.grad_store`` (``None``: memory), set by `zswap.initialize` (`attach`) and reset on close.

NVMe writes never stall backward: a param's first gradient of a step is written asynchronously (the source
stays alive in the queue, whose bytes are bounded as in `NvmeStore`); a later backward before the step reads
the partition back, adds in place (the op `MemoryGrads` uses, so values are the same) and writes it again.
The first write error is kept (backward goes on, dropping gradients) and raised by every later
`wait_all`, `has` and `load` — so by `Engine.step` and `full_grad` — until `clear`, which raises it too
if nothing has yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from .errors import ConfigError, ZswapError
from .params import INFLIGHT_WRITE_BYTES, NvmeStore, ParamState


class GradStore:
    """One backend for partition gradients, keyed by `ParamState`."""

    def add(self, st: ParamState, part: torch.Tensor) -> None:
        """Accumulate one backward's local partition (the store may keep ``part``: callers hand it over)."""
        raise NotImplementedError

    def has(self, st: ParamState) -> bool:
        raise NotImplementedError

    def load(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        """(the partition gradient, or a buffer being filled with it; a handle to ``wait()`` on, or None).
        The tensor may be modified in place (clipping) but is not stored back."""
        raise NotImplementedError

    def clear(self, sts: Iterable[ParamState]) -> None:
        raise NotImplementedError

    def wait_all(self) -> None:
        """Every gradient written; raises the first write error."""

    def close(self) -> None:
        pass


class MemoryGrads(GradStore):
    def add(self, st: ParamState, part: torch.Tensor) -> None:
        if st.tier != "none" and part.device.type != "cpu":
            part = part.to("cpu")
        if st.grad is None:
            # Autograd hands the gradient over (``p.grad`` was cleared), so the first one is kept as is.
            st.grad = part if part.is_contiguous() else part.contiguous()
        else:
            st.grad.add_(part)

    def has(self, st: ParamState) -> bool:
        return st.grad is not None

    def load(self, st: ParamState) -> tuple[torch.Tensor, None]:
        if st.grad is None:
            raise KeyError(st.key)
        return st.grad, None

    def clear(self, sts: Iterable[ParamState]) -> None:
        for st in sts:
            st.grad = None


MEMORY = MemoryGrads()


def store_of(st: ParamState) -> GradStore:
    return MEMORY if st.grad_store is None else st.grad_store


class NvmeGrads(GradStore):
    def __init__(self, engine: Any, *, owns_engine: bool = False, inflight_bytes: int | None = None) -> None:
        self.engine = engine
        self.owns_engine = owns_engine
        self.inflight_bytes = INFLIGHT_WRITE_BYTES if inflight_bytes is None else inflight_bytes
        self._meta: dict[str, tuple[int, torch.dtype]] = {}  # key -> (numel, dtype) of what it holds
        self._writes: dict[str, tuple[Any, int]] = {}  # key -> (handle, bytes held), oldest first
        self._queued = 0
        self._error: BaseException | None = None
        self._reported = False

    @staticmethod
    def key(st: ParamState) -> str:
        return f"grad-{id(st):x}"  # unlike param keys; unique: the zswap Engine holds each st

    def add(self, st: ParamState, part: torch.Tensor) -> None:
        if self._error is not None:
            return  # gradients are lost until `clear`; `wait_all` (every step) raises the error
        key = self.key(st)
        part = part.to("cpu") if part.device.type != "cpu" else part
        if key in self._meta:  # gradient accumulation: read, add, write back
            self._settle(key)
            if self._error is not None:
                return
            acc, handle = self.load(st)
            handle.wait()
            acc.add_(part)
            part = acc
        elif not part.is_contiguous():
            part = part.contiguous()
        self._meta[key] = (part.numel(), part.dtype)
        held = part.untyped_storage().nbytes()  # a view keeps its whole base alive
        self._writes[key] = (self.engine.write(key, part), held)
        self._queued += held
        while self._writes and (self._queued > self.inflight_bytes or _first(self._writes)[0].done()):
            self._settle(next(iter(self._writes)))

    def has(self, st: ParamState) -> bool:
        self._check()
        return self.key(st) in self._meta

    def load(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        key = self.key(st)
        self._settle(key)
        self._check()
        numel, dtype = self._meta[key]
        buf = self.engine.empty((numel,), dtype)  # page-aligned: read without a bounce copy
        return buf, self.engine.read(key, buf)

    def clear(self, sts: Iterable[ParamState]) -> None:
        for st in sts:
            key = self.key(st)
            if key in self._meta:
                self._settle(key)
                del self._meta[key]
                with contextlib.suppress(KeyError, ZswapError):  # a failed write left nothing to free
                    self.engine.free(key)
        if not self._meta:
            self.wait_all_quiet()
            err, reported = self._error, self._reported
            self._error, self._reported = None, False
            if err is not None and not reported:
                raise err

    def wait_all(self) -> None:
        self.wait_all_quiet()
        self._check()

    def wait_all_quiet(self) -> None:
        while self._writes:
            self._settle(next(iter(self._writes)))

    def close(self) -> None:
        self.wait_all_quiet()
        if self.owns_engine:
            self.engine.close()

    def _settle(self, key: str) -> None:
        """Wait for ``key``'s write, if one is queued; keep its error."""
        entry = self._writes.pop(key, None)
        if entry is None:
            return
        self._queued -= entry[1]
        try:
            entry[0].wait()
        except Exception as exc:
            if self._error is None:
                self._error = exc

    def _check(self) -> None:
        if self._error is not None:
            self._reported = True
            raise self._error


def _first(d: dict[str, tuple[Any, int]]) -> tuple[Any, int]:
    return next(iter(d.values()))


def attach(items: Iterable[tuple[torch.Tensor, ParamState]], cfg: Any) -> list[GradStore]:
    """Point each param's ``grad_store`` where the config wants its gradients: NVMe when
    ``offload_optimizer.device`` is "nvme" (the param store's engine when that is NVMe, else one new engine
    on ``offload_optimizer.nvme_path``), else memory. Returns the NVMe stores, to `detach` later."""
    out: dict[int, NvmeGrads] = {}
    off = cfg.offload_optimizer
    if off.device != "nvme":
        return []
    for _, st in items:
        if isinstance(st.store, NvmeStore):
            gs = out.setdefault(id(st.store.engine), NvmeGrads(st.store.engine))
        else:
            gs = out.get(0) or out.setdefault(0, _own(cfg))
        st.grad_store = gs
    return list(out.values())


def _own(cfg: Any) -> NvmeGrads:
    paths = cfg.offload_optimizer.nvme_path
    if not paths:
        raise ConfigError("offload_optimizer.nvme_path is required when offload_optimizer.device is 'nvme'")
    from .swap import SwapEngine  # the native engine is loaded only when NVMe is used

    return NvmeGrads(SwapEngine.from_config(cfg.aio, list(paths)), owns_engine=True)


def detach(items: Iterable[tuple[torch.Tensor, ParamState]], stores: Iterable[GradStore]) -> None:
    """Undo `attach` (gradients should be cleared first); closes engines built for gradients."""
    for _, st in items:
        st.grad_store = None
    for gs in stores:
        gs.close()
