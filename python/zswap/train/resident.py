"""Resident params stepped in place: the NVMe params the scheduler keeps gathered between passes (the small
persistent ones and those ``offload_param.max_in_cpu`` keeps, `zswap.fetch.buffers.resident`) are updated
in their gathered copy instead of being read from the swap files for the step and again after it.

`take` (before the step drops what the scheduler holds) keeps a reference to each such copy's buffer, so
the fetch pool cannot hand it out again while it is released. `zswap.train.bridge.step_partitions` then
steps this rank's partition of it where it lies — for one rank the gathered param's flat data is the
partition; for several, it is this rank's slice of the all-gathered buffer, padding of the last partition
included, exactly the bytes the store holds — and writes it to the store in the step transaction, as any
other partition (write-through: the NVMe copy is the truth for every other reader — checkpoints, export,
`GatheredParameters`, a later fetch — the moment the step commits). `reinstall` gives the copies back to
the scheduler whatever happened: after a commit they hold the new values, after an abort the undo log
restored the old ones (they were saved before the step changed them). With several ranks `regather`
then refreshes the other ranks' slices with one all-gather, no read.

After the early step's commit (`refresh`) each held copy takes the partition the early step made live (it
kept its updated copies of these params for that); a skipped step gives them back unchanged. A
partition-aware optimizer drops what `take` returned: the copies are fetched again as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import _dist
from ..fetch.prefetch import Slot
from ..parts.gather import no_torch_function
from ..parts.params import NvmeStore, Status

if TYPE_CHECKING:
    from .runtime import Engine


@dataclass(eq=False)
class Held:
    """One resident param's gathered copy, held across the step."""

    slot: Slot
    view: torch.Tensor
    """The gathered ``p.data`` (the param's shape), to give back."""
    full: torch.Tensor
    """Its whole flat buffer: ``world × partition_numel`` elements (the partition itself for one rank)."""
    part: torch.Tensor
    """This rank's partition: a view of ``full``, stepped in place."""


def take(engine: Engine) -> dict[int, Held]:
    """``{id(p): Held}`` of the resident NVMe params gathered now by ``engine``'s scheduler whose copy can
    stand for their partition. Call it before `Scheduler.drop_all`; its references keep their buffers."""
    if not engine.compute_device.passthrough:
        return {}  # a device copy is not the host partition the optimizer steps
    out: dict[int, Held] = {}
    with no_torch_function():
        for s in engine._slots.values():
            st = s.st
            if not (s.persistent and s.ours and isinstance(st.store, NvmeStore)):
                continue
            if st.status is not Status.AVAILABLE or st.touched or st.gathered_by is not None:
                continue
            view = s.p.data
            n = st.partition_numel
            if (
                view.device.type != "cpu"
                or view.dtype != st.dtype
                or view.shape != st.shape
                or not view.is_contiguous()
                or view.untyped_storage().nbytes()
                < (view.storage_offset() + n * st.world_size) * st.dtype.itemsize
            ):
                continue
            full = torch.empty(0, dtype=st.dtype).set_(
                view.untyped_storage(), view.storage_offset(), (n * st.world_size,), (1,)
            )
            out[id(s.p)] = Held(s, view, full, full[st.rank * n : (st.rank + 1) * n])
    return out


def ids(engine: Engine) -> frozenset[int]:
    """ids of the params `take` could hold: the scheduler keeps them gathered between passes (none on a
    compute device, where the gathered copy is not the host partition)."""
    if not engine.compute_device.passthrough:
        return frozenset()
    return frozenset(
        id(s.p) for s in engine._slots.values() if s.persistent and isinstance(s.st.store, NvmeStore)
    )


def refresh(held: dict[int, Held], updated: dict[int, torch.Tensor]) -> None:
    """After the early step's commit: each held copy takes its param's new partition (those it updated;
    the others did not change), then goes back to its param (`reinstall`) and, over several ranks, the
    other ranks' slices are all-gathered (`regather`)."""
    with no_torch_function():
        for key, h in held.items():
            new = updated.get(key)
            if new is not None:
                h.part.copy_(new[: h.part.numel()])
    reinstall(held)
    regather(held)


def reinstall(held: dict[int, Held]) -> None:
    """Give each held copy back to its param, gathered and the scheduler's (no read)."""
    with no_torch_function():
        for h in held.values():
            h.slot.p.data = h.view
            h.slot.st.status = Status.AVAILABLE
            h.slot.ours = True


def regather(held: dict[int, Held]) -> None:
    """After a committed step over several ranks: refresh the other ranks' slices of each copy (one
    all-gather per param, in the scheduler's order, the same on every rank)."""
    with no_torch_function():
        for h in held.values():
            st = h.slot.st
            if st.world_size > 1:
                _dist.all_gather_flat(h.full, h.part.clone(), st.group)
