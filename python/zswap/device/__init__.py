"""The compute device seam: where gathered params live while modules run, and how bytes get there and back.

Partitions stay on their offload tier (CPU memory or NVMe); a `Device` moves a partition's host bytes to the
compute device before a module runs (`Device.h2d`) and a gradient partition back into host memory after
backward (`Device.d2h`). Every transfer is a `Copy`: it holds its source until the copy has completed, so a
host buffer (an engine read buffer, a pooled NVMe buffer) goes back to its pool only then — the pool's
"nobody else holds it" check sees the `Copy`'s reference — and nothing needs ``record_stream``.

Implementations:

The protocol and `Copy` are `zswap.device.protocol`; each implementation is its own module (`cpu`, `cuda`,
`standin`, and the host buffer pool `pool`); this face resolves a user's choice and places a model.

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

from collections.abc import Sequence
from typing import Any

import torch

from ..pool import _storage_uses
from .cpu import CpuDevice
from .cuda import CudaDevice
from .pool import ReusePool
from .protocol import Alloc, Copy, Device, UnsupportedDeviceError
from .standin import StandInDevice

__all__ = [
    "Alloc",
    "Copy",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "ReusePool",
    "StandInDevice",
    "UnsupportedDeviceError",
    "_storage_uses",
    "on_host",
    "place",
    "resolve",
    "stats",
    "unplace",
]


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
