"""Resident params stepped in place: the NVMe params the scheduler keeps gathered between passes (the small
persistent ones and those ``offload_param.max_in_cpu`` keeps, `zswap.fetch.buffers.resident`) are updated
in their gathered copy instead of being read from the swap files for the step and again after it.

`take` (before the step drops what the scheduler holds) keeps a reference to each such copy's buffer, so
the fetch pool cannot hand it out again while it is released. `zswap.train.bridge.step_partitions` then
steps this rank's partition of it (`Held.host`) — for one rank the gathered param's flat data is the
partition; for several, it is this rank's slice of the all-gathered buffer, padding of the last partition
included, exactly the bytes the store holds — and writes it to the store in the step transaction, as any
other partition (write-through: the NVMe copy is the truth for every other reader — checkpoints, export,
`GatheredParameters`, a later fetch — the moment the step commits). `reinstall` gives the copies back to
the scheduler whatever happened: after a commit they hold the new values, after an abort the undo log
restored the old ones (they were saved before the step changed them). With several ranks `regather`
then refreshes the other ranks' slices with one all-gather, no read.

On a compute device the gathered copy lies there, not in host memory: the partition a step needs is
copied to the host at its first use (`Held.host`, a device-to-host copy instead of a read), and a copy
stepped is stale once the step commits — its param is gathered again from the host partition (`values`,
which `zswap.prefetch.Scheduler.fetch_persistent` copies to the device and all-gathers there); one the
step did not change, or a step that aborted, gives the device copy back as it was.

After the early step's commit (`refresh`) each held copy takes the partition the early step made live (it
kept its updated copies of these params for that); a skipped step gives them back unchanged. A
partition-aware optimizer drops what `take` returned: the copies are fetched again as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from .. import _dist
from ..fetch.prefetch import Slot
from ..parts.gather import install, no_torch_function
from ..parts.params import NvmeStore, Status

if TYPE_CHECKING:
    from ..device import Device
    from .runtime import Engine


@dataclass(eq=False)
class Held:
    """One resident param's gathered copy, held across the step."""

    slot: Slot
    view: torch.Tensor
    """The gathered ``p.data`` (the param's shape), to give back."""
    full: torch.Tensor
    """Its whole flat buffer: ``world × partition_numel`` elements (the partition itself for one rank)."""
    part: torch.Tensor | None
    """This rank's partition in host memory, stepped in place: a view of ``full`` on the host; on a
    compute device its copy, made by `host` (``None`` until then: the step has not touched it)."""
    device: Device | None = None
    """The compute device ``full`` lies on (``None``: host memory)."""

    def host(self) -> torch.Tensor:
        """This rank's partition in host memory (on a compute device copied there at the first call, into
        a load buffer of the param's store)."""
        if self.part is None:
            assert self.device is not None
            st = self.slot.st
            n = st.partition_numel
            buf = cast(NvmeStore, st.store).fresh(n, st.dtype)
            self.part = self.device.synchronize(
                self.device.d2h(self.full[st.rank * n : (st.rank + 1) * n], buf)
            )
        return self.part

    @property
    def stale(self) -> bool:
        """A device copy whose host partition was stepped: not given back after a commit (`values`)."""
        return self.device is not None and self.part is not None


def take(engine: Engine) -> dict[int, Held]:
    """``{id(p): Held}`` of the resident NVMe params gathered now by ``engine``'s scheduler whose copy can
    stand for their partition. Call it before `Scheduler.drop_all`; its references keep their buffers."""
    dev = engine.compute_device
    where = torch.device("cpu") if dev.passthrough else dev.torch_device
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
                view.device != where
                or view.dtype != st.dtype
                or view.shape != st.shape
                or not view.is_contiguous()
                or view.untyped_storage().nbytes()
                < (view.storage_offset() + n * st.world_size) * st.dtype.itemsize
            ):
                continue
            full = torch.empty(0, dtype=st.dtype, device=where).set_(
                view.untyped_storage(), view.storage_offset(), (n * st.world_size,), (1,)
            )
            if dev.passthrough:
                out[id(s.p)] = Held(s, view, full, full[st.rank * n : (st.rank + 1) * n])
            else:
                out[id(s.p)] = Held(s, view, full, None, dev)
    return out


def ids(engine: Engine) -> frozenset[int]:
    """ids of the params the scheduler keeps gathered between passes, whose committed partitions the
    early step keeps: `take` holds their gathered copies on the CPU, and on a compute device (where the
    gathered copy is not the host partition) they are gathered again from those partitions, no read
    (`Engine._finish_step`)."""
    return frozenset(
        id(s.p) for s in engine._slots.values() if s.persistent and isinstance(s.st.store, NvmeStore)
    )


def refresh(held: dict[int, Held], updated: dict[int, torch.Tensor]) -> None:
    """After the early step's commit: each held copy takes its param's new partition (those it updated;
    the others did not change), then goes back to its param (`reinstall`) and, over several ranks, the
    other ranks' slices are all-gathered (`regather`). A device copy's new partition stays in host
    memory, for `values`."""
    with no_torch_function():
        for key, h in held.items():
            new = updated.get(key)
            if new is None:
                continue
            n = h.slot.st.partition_numel
            if h.device is None:
                h.host().copy_(new[:n])
            else:
                h.part = new[:n]
    reinstall(held, committed=True)
    regather(held)


def reinstall(held: dict[int, Held], committed: bool = False) -> None:
    """Give each held copy back to its param, gathered and the scheduler's (no read); after a
    ``committed`` step, a `Held.stale` device copy is not (its param is gathered again from `values`)."""
    with no_torch_function():
        for h in held.values():
            if committed and h.stale:
                continue
            install(h.slot.p, h.slot.st, h.view)
            h.slot.ours = True


def regather(held: dict[int, Held]) -> None:
    """After a committed step over several ranks: refresh the other ranks' slices of each host copy (one
    all-gather per param, in the scheduler's order, the same on every rank). A device copy is gathered
    whole again where it is stale (`values`: every rank's the same, the params' order the same)."""
    with no_torch_function():
        for h in held.values():
            st = h.slot.st
            if st.world_size > 1 and h.device is None:
                _dist.all_gather_flat(h.full, h.host().clone(), st.group)


def values(held: dict[int, Held], updated: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """{id(param): its committed partition in host memory} for the persistent params a committed step left
    not gathered: the early step's kept copies (``updated``) and the stale device copies' host partitions."""
    out = dict(updated)
    out.update((key, h.host()) for key, h in held.items() if h.stale)
    return out
