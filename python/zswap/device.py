"""The compute device seam: where gathered params live while modules run, and how bytes get there and back.

Partitions stay on their offload tier (CPU memory or NVMe); a `Device` moves a partition's host bytes to the
compute device before a module runs (`Device.h2d`) and a gradient partition back into host memory after
backward (`Device.d2h`). Every transfer is a `Copy`: it holds its source until the copy has completed, so a
host buffer (an engine read buffer, a pooled NVMe buffer) goes back to its pool only then — the pool's
"nobody else holds it" check sees the `Copy`'s reference — and nothing needs ``record_stream``.

Implementations:

- `CpuDevice` (``device="cpu"``): compute on the CPU, today's path. ``passthrough`` is true: the fetch code
  uses the partition's memory directly and calls nothing here.
- `CudaDevice`: one dedicated copy stream per device. H2D: the destination is allocated on the compute
  (current) stream, an event recorded there tells the copy stream when that memory is free in compute order,
  the copy runs ``non_blocking`` on the copy stream and records a completion event; `wait` makes the compute
  stream wait on that event (never the host). Host memory is page-locked: engine buffers are registered with
  ``cudaHostRegister`` (`register_alloc`), gradient buffers come from torch's pinned allocator; a host tensor
  that is neither (registration refused, an unpinned CPU partition) goes through a pinned staging copy, with
  one `ZswapWarning` when registration was refused.
- `StandInDevice`: the CPU suite's model of a CUDA device. Copies are *deferred*: a destination is poisoned
  (NaN / 0x5A bytes) when the copy is issued and filled only when someone waits for, synchronises or queries
  that copy (copies complete in issue order, as on one stream). So reading a destination before waiting,
  waiting on an earlier copy's event, or changing / reusing a source before its copy completed all give
  wrong values, which the bitwise tests of the CPU suite catch.
"""

from __future__ import annotations

import sys
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .errors import ZswapError, ZswapWarning

Alloc = Callable[[Sequence[int], torch.dtype], torch.Tensor]
"""``alloc(shape, dtype) -> tensor`` in host memory (`zswap.SwapEngine.empty`'s shape)."""


@dataclass(eq=False)
class Copy:
    """One transfer issued on a device's copy stream. ``dst`` is usable on the compute stream after
    `Device.wait`. The device holds the source until the copy completed (`Device.reap` then drops it;
    the stand-in keeps it in ``src`` until it runs the copy)."""

    dst: torch.Tensor
    src: torch.Tensor | None
    event: Any = field(default=None, repr=False)
    done: bool = False


class UnsupportedDeviceError(ZswapError, NotImplementedError):
    """`zswap.initialize` was asked for a compute device zswap cannot run on (here)."""


class Device(Protocol):
    """What the fetch, release and gradient paths need from a compute device."""

    torch_device: torch.device
    passthrough: bool
    """True: compute reads host memory directly (the CPU path); `h2d`/`d2h` are never called."""

    def h2d(self, host: torch.Tensor) -> Copy:
        """Start copying the contiguous host tensor ``host`` to the compute device."""
        ...

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        """Start copying ``t`` (on the compute device, produced on the compute stream) into host ``out``."""
        ...

    def wait(self, copy: Copy) -> torch.Tensor:
        """Order the compute stream after ``copy``; returns its destination."""
        ...

    def synchronize(self, copy: Copy) -> torch.Tensor:
        """Block the host until ``copy`` completed (for results the host reads); returns its destination."""
        ...

    def query(self, copy: Copy) -> bool:
        """Whether ``copy`` completed (never blocks)."""
        ...

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer for a D2H copy (a plain CPU tensor where nothing needs pinning)."""
        ...

    def register_alloc(self, alloc: Alloc) -> Alloc:
        """``alloc`` whose buffers are registered with the device for one-hop DMA (until `close`)."""
        ...

    def reap(self) -> None:
        """Drop the sources of completed copies (they may go back to their pools)."""
        ...

    def retire(self, p: torch.Tensor) -> None:
        """``p``'s gathered data is about to be dropped: the compute stream's work queued so far is the last
        that uses it, so its memory may be refilled after that point (not after all later compute)."""
        ...

    def close(self) -> None:
        """Wait for every copy, unregister every host buffer."""
        ...

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the compute device since the last reset (``None`` on the CPU)."""
        ...

    def reset_peak(self) -> None: ...

    @property
    def registered_bytes(self) -> int: ...


def resolve(device: object) -> Device:
    """``None``: the current CUDA device when CUDA is available, else the CPU. ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, a `torch.device`, or a `Device` object (the CPU suite passes a `StandInDevice`)."""
    if device is None:
        return CudaDevice(torch.cuda.current_device()) if torch.cuda.is_available() else CpuDevice()
    if isinstance(device, CpuDevice | CudaDevice | StandInDevice):
        return device
    if isinstance(device, str | torch.device):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device={device!r} is not a device: {exc}") from None
        if dev.type == "cpu":
            return CpuDevice()
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise UnsupportedDeviceError(f"device={device!r}: CUDA is not available on this machine")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if not 0 <= index < torch.cuda.device_count():
                raise ValueError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
            return CudaDevice(index)
        raise UnsupportedDeviceError(
            f"device={device!r}: zswap computes on 'cpu' or 'cuda', not {dev.type!r}"
        )
    raise TypeError(
        f"device must be None, a str, a torch.device or a zswap Device, got {type(device).__name__}"
    )


def _storage_uses(t: torch.Tensor | torch.UntypedStorage) -> int:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
    return -1 if use_count is None else int(use_count(storage._cdata))


class CpuDevice:
    """Compute on the CPU: the fetch path hands out host memory itself (``passthrough``)."""

    torch_device = torch.device("cpu")
    passthrough = True
    registered_bytes = 0

    def h2d(self, host: torch.Tensor) -> Copy:
        return Copy(host, None, done=True)

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        out.copy_(t)
        return Copy(out, None, done=True)

    def wait(self, copy: Copy) -> torch.Tensor:
        return copy.dst

    synchronize = wait

    def query(self, copy: Copy) -> bool:
        return True

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def register_alloc(self, alloc: Alloc) -> Alloc:
        return alloc

    def reap(self) -> None:
        pass

    def retire(self, p: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass

    def max_memory_allocated(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass

    def __repr__(self) -> str:
        return "CpuDevice()"


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


class ReusePool:
    """Device buffers for gathered params, reused across fetches, each with the point on the compute stream
    after which it may be refilled.

    A buffer is free when nothing but the pool references its memory. `retire` (the scheduler releasing a
    param) records an event on the compute stream right then — if the param's data is its only other user —
    so the next copy into that buffer waits only for the compute queued before the release, and the H2D copy
    of module i+1 runs under module i's compute. A buffer that became free otherwise (an alias outlived the
    release: non-reentrant checkpointing) gets an event recorded when it is found free, after every use of
    it was queued: later than needed, never too early. Buffers beyond ``pool_bytes`` are not kept. No
    ``record_stream``: the pool owns the memory, so the caching allocator never sees a cross-stream free.
    """

    def __init__(self, alloc: Callable[[int, torch.dtype], torch.Tensor], record: Callable[[], Any]) -> None:
        self._alloc = alloc
        self._record = record
        self.pool_bytes = 0
        self._pooled = 0
        # (numel, dtype) -> [buffer, baseline storage uses, event after which it is free (or None)]
        self._free: dict[tuple[int, torch.dtype], list[list[Any]]] = {}
        self._by_ptr: dict[int, list[Any]] = {}
        self.reused = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """(a buffer of ``numel`` ``dtype`` elements, the event the copy into it must wait for)."""
        for entry in self._free.get((numel, dtype), []):
            buf, base, ev = entry
            if sys.getrefcount(buf) == 3 and _storage_uses(buf) == base:  # entry, loop variable, argument
                entry[2] = None  # the next retire sets it again
                self.reused += 1
                return buf, ev if ev is not None else self._record()
        nbytes = numel * dtype.itemsize
        if self._pooled + nbytes > self.pool_bytes:
            self._evict(self._pooled + nbytes - self.pool_bytes)  # the mix of sizes in use shifts
        buf = self._alloc(numel, dtype)
        if self._pooled + nbytes <= self.pool_bytes and (base := _storage_uses(buf)) >= 0:
            entry = [buf, base, None]
            self._free.setdefault((numel, dtype), []).append(entry)
            self._by_ptr[buf.data_ptr()] = entry
            self._pooled += nbytes
        return buf, self._record()  # fresh memory from the compute stream's pool: safe after "now"

    def _evict(self, nbytes: int) -> None:
        """Stop pooling free buffers until ``nbytes`` are gone, so idle pooled memory and fresh buffers of
        other sizes never add up beyond the budget. Their memory goes back to the compute stream's caching
        allocator, which orders any reuse after their last (compute-stream) use."""
        for (numel, dtype), entries in self._free.items():
            keep = []
            for entry in entries:
                buf, base = entry[0], entry[1]
                if nbytes > 0 and sys.getrefcount(buf) == 3 and _storage_uses(buf) == base:
                    nbytes -= numel * dtype.itemsize
                    self._pooled -= numel * dtype.itemsize
                    del self._by_ptr[buf.data_ptr()]
                else:
                    keep.append(entry)
            entries[:] = keep

    def retire(self, p: torch.Tensor) -> None:
        """``p`` (a param whose ``.data`` is about to be dropped) holds one of the pool's buffers."""
        with torch._C.DisableTorchFunction():
            entry = self._by_ptr.get(p.untyped_storage().data_ptr())
            if entry is not None and _storage_uses(entry[0]) == entry[1] + 1:  # the param alone uses it
                entry[2] = self._record()

    def clear(self) -> None:
        self._free.clear()
        self._by_ptr.clear()
        self._pooled = 0


class CudaDevice:
    """Compute on one CUDA device, with a dedicated copy stream for host↔device transfers."""

    passthrough = False

    def __init__(self, index: int) -> None:
        self.torch_device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.torch_device)
        # (completion event, source) of each copy issued, in issue order (one stream: completes in order).
        # Only the source is held here, never the destination: a released param's GPU memory is freed
        # when its last user lets go, whatever the copy queue holds.
        self._inflight: deque[tuple[Any, torch.Tensor]] = deque()
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
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
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
        return self._issue(src, dst, ready)

    def _issue(self, src: torch.Tensor, dst: torch.Tensor, ready: Any) -> Copy:
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._inflight.append((done, src))
        return Copy(dst, None, done)

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        self.reap()
        return self._issue(t, out, self._free_point())  # t was produced on the compute stream

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


def place(
    module: torch.nn.Module, items: Sequence[tuple[torch.Tensor, Any]], device: Device
) -> dict[int, Any]:
    """Point every managed param of ``module`` at ``device`` (where it is gathered; its partition stays on
    its tier) and move the module's buffers there. Returns what `unplace` needs to undo the first part."""
    if device.passthrough:
        return {}
    dev = device.torch_device
    homes: dict[int, Any] = {}
    with torch._C.DisableTorchFunction():
        for p, st in items:
            if st.device == dev or not on_host(st):
                continue  # a tier-"none" partition built on an accelerator is gathered where it lives
            homes[id(st)] = (p, st, st.device)
            st.device = dev
            if st.status.value == "not_available":
                p.data = torch.empty(0, dtype=st.dtype, device=dev)
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != dev:
                    m._buffers[name] = b.to(dev)
    return homes


def on_host(st: Any) -> bool:
    """Whether a param's partition lives in host memory (tiers cpu and nvme; tier "none" when built on the
    CPU), so it crosses to the compute device to be gathered and its gradient comes back."""
    if st.tier != "none":
        return True
    with torch._C.DisableTorchFunction():
        return bool(st.store.load(st.key, st.partition_numel, st.dtype)[0].device.type == "cpu")


def unplace(items: Sequence[tuple[torch.Tensor, Any]], homes: dict[int, Any]) -> None:
    """Undo `place` for the params (buffers stay on the compute device)."""
    with torch._C.DisableTorchFunction():
        for p, st, home in homes.values():
            st.device = home
            if st.status.value == "not_available":
                p.data = torch.empty(0, dtype=st.dtype, device=home)
    homes.clear()


def stats(device: Device, live_bytes: int, bucket_bytes: int) -> dict[str, Any]:
    """The device part of `zswap.Engine.stats`."""
    out: dict[str, Any] = {
        "device": str(device.torch_device),
        "registered_host_bytes": device.registered_bytes,
    }
    peak = device.max_memory_allocated()
    if peak is not None:
        out["gpu_max_memory_allocated"] = peak
        out["gpu_live_budget_bytes"] = live_bytes
        out["gpu_prefetch_bucket_bytes"] = bucket_bytes
    return out


def _poison(t: torch.Tensor) -> None:
    with torch._C.DisableTorchFunction():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0x5A) if t.is_contiguous() else t.fill_(0x5A)
