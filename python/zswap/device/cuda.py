"""`CudaDevice`: one copy stream per device, page-locked host memory (see `zswap.device`)."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ZswapError, ZswapWarning
from ..pool import _storage_uses
from .pool import ReusePool
from .protocol import Alloc, Copy


class _Registrations:
    """Host buffers registered with a device, each kept alive by a storage reference until only that
    reference is left (then unregistered at the next sweep) or `unregister_all`. Registration never outlives
    the memory: the reference is what keeps the engine buffer mapped."""

    def __init__(self, register: Callable[[int, int], bool], unregister: Callable[[int], None]) -> None:
        self._register = register
        self._unregister = unregister
        self._live: dict[int, torch.UntypedStorage] = {}
        self.nbytes = 0
        self.refused: str | None = None

    def wrap(self, alloc: Alloc) -> Alloc:
        def registered(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            self.sweep()
            t = alloc(shape, dtype)
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            fresh = nbytes and self.refused is None and ptr not in self._live
            if fresh and self._register(ptr, nbytes):
                self._live[ptr] = storage
                self.nbytes += nbytes
            return t

        return registered

    def covers(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._live

    def sweep(self) -> None:
        for ptr, storage in list(self._live.items()):
            if _storage_uses(storage) == 1:  # only ours: the buffer is dead everywhere else
                self._drop(ptr)

    def unregister_all(self) -> None:
        for ptr in list(self._live):
            self._drop(ptr)

    def _drop(self, ptr: int) -> None:
        storage = self._live.pop(ptr)
        self.nbytes -= storage.nbytes()
        self._unregister(ptr)


class CudaDevice:
    """Compute on one CUDA device, with a dedicated copy stream for host↔device transfers."""

    passthrough = False

    def __init__(self, index: int) -> None:
        self.torch_device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.torch_device)
        # (completion event, what it must keep alive) of each copy issued, in issue order (one stream:
        # completes in order): its source, and for a copy to the host its destination too (the DMA writes
        # it until the event: dropped early, its pool would hand it out, or the sweep unregister it, under
        # the copy). The destination of a copy to the device is never held: a released param's GPU memory
        # is freed when its last user lets go, whatever the copy queue holds.
        self._inflight: deque[tuple[Any, tuple[torch.Tensor, ...]]] = deque()
        self._regs = _Registrations(self._register, self._unregister)
        self.pool = ReusePool(
            lambda numel, dtype: torch.empty(numel, dtype=dtype, device=self.torch_device), self._free_point
        )
        """GPU buffers of gathered params; `zswap.initialize` sizes ``pool.pool_bytes`` to its live budget."""
        self.staged_copies = 0
        """H2D copies that went through a pinned staging buffer (the source was neither pinned nor
        registered)."""

    # -- registration ------------------------------------------------------------------------------

    def _register(self, ptr: int, nbytes: int) -> bool:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1 = cudaHostRegisterPortable
        if err != 0:
            _clear_last_error(cudart)
            self._regs.refused = f"cudaHostRegister({nbytes} bytes) failed with cudaError {err}"
            warnings.warn(
                f"{self._regs.refused}: engine buffers are not page-locked for the GPU, so every fetch goes "
                "through a pinned staging copy (one extra host memcpy)",
                ZswapWarning,
                stacklevel=4,
            )
            return False
        return True

    def _unregister(self, ptr: int) -> None:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostUnregister(ptr))
        if err != 0:
            _clear_last_error(cudart)
            raise ZswapError(f"cudaHostUnregister of host buffer 0x{ptr:x} failed with cudaError {err}")

    def register_alloc(self, alloc: Alloc) -> Alloc:
        return self._regs.wrap(alloc)

    @property
    def registered_bytes(self) -> int:
        return self._regs.nbytes

    # -- copies ------------------------------------------------------------------------------------

    def _free_point(self) -> Any:
        """An event on the compute stream now: memory the compute stream freed before it is safe to write."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.torch_device))
        return ev

    def h2d(self, host: torch.Tensor) -> Copy:
        self.reap()
        src = host
        if not (self._regs.covers(host) or host.is_pinned()):
            src = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            src.copy_(host)
            self.staged_copies += 1
        if host.dim() == 1:
            dst, ready = self.pool.take(host.numel(), host.dtype)
        else:
            dst = torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)
            ready = self._free_point()
        return self._issue(src, dst, ready, (src,))

    def _issue(
        self, src: torch.Tensor, dst: torch.Tensor, ready: Any, keep: tuple[torch.Tensor, ...]
    ) -> Copy:
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._inflight.append((done, keep))
        return Copy(dst, None, done)

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        self.reap()
        return self._issue(t, out, self._free_point(), (t, out))  # t was produced on the compute stream

    def wait(self, copy: Copy) -> torch.Tensor:
        if not copy.done:
            torch.cuda.current_stream(self.torch_device).wait_event(copy.event)
        return copy.dst

    def synchronize(self, copy: Copy) -> torch.Tensor:
        if not copy.done:
            copy.event.synchronize()
            copy.done = True
        return copy.dst

    def query(self, copy: Copy) -> bool:
        if not copy.done and copy.event.query():
            copy.done = True
        return copy.done

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def reap(self) -> None:
        while self._inflight and self._inflight[0][0].query():
            self._inflight.popleft()  # the source may go back to its pool now
        self._regs.sweep()

    def retire(self, p: torch.Tensor) -> None:
        self.pool.retire(p)

    def close(self) -> None:
        self.copy_stream.synchronize()
        self._inflight.clear()
        self.pool.clear()
        self._regs.unregister_all()

    def max_memory_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def __repr__(self) -> str:
        return f"CudaDevice({self.torch_device})"


def _clear_last_error(cudart: Any) -> None:
    """Reset the CUDA runtime's last error after a call that failed and was handled here: torch checks
    ``cudaGetLastError`` after each kernel launch, so a refused ``cudaHostRegister`` left behind would
    raise at some later, unrelated op. torch's runtime module may not bind the call: the runtime library
    torch loaded is asked directly then."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    import ctypes
    import os

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        lib.cudaGetLastError()
        return
