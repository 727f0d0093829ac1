"""Engine memory (`_zswap.Buffer`) as a torch tensor, without a copy.

The extension is built against the stable ABI of CPython 3.10 (one abi3 wheel for 3.10+), whose limited
API has no buffer protocol (it arrived in 3.11), so the Buffer cannot export itself to
`torch.frombuffer`. NumPy's array interface takes a raw address instead: the array keeps the object that
described it as its `base`, and the tensor keeps the array, so the mapping lives as long as any view.
"""

from __future__ import annotations

from typing import Any

import numpy
import torch

from . import memory
from ._zswap import Buffer


class _Exported:
    """An address and a length in NumPy's array-interface form; holds the Buffer that owns them."""

    def __init__(self, buf: Buffer, nbytes: int) -> None:
        if not 0 < nbytes <= len(buf):
            raise ValueError(f"nbytes {nbytes} outside the buffer's 1..{len(buf)} bytes")
        self.buf = buf
        self.__array_interface__: dict[str, Any] = {
            "data": (buf.address, False),  # False: writable
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def tensor_over(buf: Buffer, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over the first `nbytes` bytes of `buf`, keeping `buf` alive; counted in
    `zswap.memory`'s ledger until the last view is gone."""
    exported = _Exported(buf, nbytes)
    memory.track(exported, buf.capacity)
    return torch.from_numpy(numpy.asarray(exported))
