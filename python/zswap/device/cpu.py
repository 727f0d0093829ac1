"""`CpuDevice`: compute on the CPU. ``passthrough``: the fetch code uses the partition's memory directly."""

from __future__ import annotations

import torch

from .protocol import Alloc, Copy


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
