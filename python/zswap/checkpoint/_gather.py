"""Whole values and local partitions of managed params, one param at a time."""

from __future__ import annotations

import torch

from ..parts.gather import fetch, no_torch_function, release
from ..parts.params import ParamState, Status


def full_copy(p: torch.Tensor, st: ParamState) -> torch.Tensor:
    """The full value of a managed param as a CPU tensor nobody else holds (gathered across ranks: every
    rank of its group must call this for the same params in the same order)."""
    with no_torch_function():
        if st.status is Status.AVAILABLE:
            return p.data.detach().to("cpu", copy=True)
        fetch([(p, st)], private=True)
        try:
            data = p.data
            # A swap-in lands in a pooled engine buffer and a device tensor is not a CPU one: copy those.
            # A private single-rank gather or an all-gather output is already a fresh tensor.
            if (st.tier == "nvme" and st.world_size == 1) or data.device.type != "cpu":
                return data.to("cpu", copy=True)
            return data
        finally:
            release([(p, st)], write_back=False)


def local_partition(p: torch.Tensor, st: ParamState | None) -> torch.Tensor:
    """This rank's partition of ``p`` as a contiguous 1-D CPU tensor (the whole param for an unmanaged
    one). May be the stored tensor itself or an engine buffer: read it, do not keep it."""
    with no_torch_function():
        if st is None:
            return p.detach().reshape(-1).to("cpu").contiguous()
        part, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        if handle is not None:
            handle.wait()
        return part.to("cpu").contiguous()
