"""`StandInDevice`: the CPU suite's model of a CUDA device, with deferred copies (see `zswap.device`)."""

from __future__ import annotations

from collections import deque

import torch

from ..errors import ZswapError
from .cuda import _Registrations
from .pool import ReusePool
from .protocol import Alloc, Copy


class StandInDevice:
    """A CPU model of `CudaDevice` for the CPU suite: one in-order copy queue whose copies run only when
    their completion is observed (`wait`, `synchronize`, `query`, `close`); destinations are poisoned
    until then. ``registrations`` counts buffers registered through `register_alloc` and not yet
    unregistered, like `CudaDevice`'s."""

    torch_device = torch.device("cpu")
    passthrough = False

    def __init__(self) -> None:
        self._queue: deque[Copy] = deque()
        self._regs = _Registrations(lambda ptr, nbytes: True, lambda ptr: None)
        self.copies = 0
        self.staged_copies = 0
        self.waits = 0
        self.retired = 0
        self.events = 0
        self.pool = ReusePool(lambda numel, dtype: torch.empty(numel, dtype=dtype), self._event)
        """Reused destination buffers, as `CudaDevice`'s (its events are counters here)."""

    def _event(self) -> int:
        self.events += 1
        return self.events

    def register_alloc(self, alloc: Alloc) -> Alloc:
        return self._regs.wrap(alloc)

    @property
    def registered_bytes(self) -> int:
        return self._regs.nbytes

    def _issue(self, src: torch.Tensor, dst: torch.Tensor) -> Copy:
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ZswapError(f"copy of {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
        _poison(dst)
        copy = Copy(dst, src)
        self._queue.append(copy)
        self.copies += 1
        return copy

    def h2d(self, host: torch.Tensor) -> Copy:
        self.reap()
        if host.dim() == 1:
            dst, _ = self.pool.take(host.numel(), host.dtype)
        else:
            dst = torch.empty_like(host, memory_format=torch.contiguous_format)
        return self._issue(host, dst)

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        self.reap()
        return self._issue(t, out)

    def _run_through(self, copy: Copy) -> None:
        if copy.done:
            return
        if copy not in self._queue:
            raise ZswapError("waited on a copy this device never issued")
        while True:
            head = self._queue.popleft()
            assert head.src is not None
            with torch._C.DisableTorchFunction():
                head.dst.copy_(head.src)
            head.done, head.src = True, None
            if head is copy:
                return

    def wait(self, copy: Copy) -> torch.Tensor:
        self.waits += 1
        self._run_through(copy)
        return copy.dst

    synchronize = wait

    def query(self, copy: Copy) -> bool:
        # Completion is only ever observed lazily: a copy nobody asked about stays pending, so a source
        # changed or reused before its copy was waited for shows up in the result.
        return copy.done

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def reap(self) -> None:
        self._regs.sweep()

    def retire(self, p: torch.Tensor) -> None:
        self.retired += 1
        self.pool.retire(p)

    def close(self) -> None:
        while self._queue:
            self._run_through(self._queue[-1])
        self.pool.clear()
        self._regs.unregister_all()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def max_memory_allocated(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass

    def __repr__(self) -> str:
        return "StandInDevice()"


def _poison(t: torch.Tensor) -> None:
    with torch._C.DisableTorchFunction():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0x5A) if t.is_contiguous() else t.fill_(0x5A)
