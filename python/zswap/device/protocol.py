"""What every compute device offers (`Device`), the `Copy` each transfer returns, and the host allocator
shape (`Alloc`). The implementations are the sibling modules; `zswap.device` resolves a user's choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import ZswapError

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
