"""Moving a param between its partitioned and its gathered form, and `GatheredParameters`.

`manage` partitions a param for the first time, `offload` (re-)partitions its current ``.data``, `fetch`
gathers full data back (swap-in of the local partition, then all-gather across ranks; `start_fetch` and
`finish_fetch` are its two halves, so swap-ins can run ahead of use), `release` drops it.
All of them do their own tensor work with torch-function handling disabled, so `zswap.Init`'s access hook
never sees zswap's own traffic. Collectives run in the order of the list given, which every rank must agree
on.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from .. import _dist
from ..device import Copy, Device
from ..errors import ZswapError, ZswapWarning
from .params import (
    Item,
    NvmeStore,
    ParamState,
    Status,
    Store,
    local_slice,
    param_state,
    partition_numel,
    register,
)
from .runners import open_runners

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

no_torch_function = torch._C.DisableTorchFunction


@dataclass(frozen=True)
class Placement:
    """Where `manage` puts new partitions: a store, a process group, and the dtype params are kept in."""

    store: Store
    group: ProcessGroup | None
    rank: int
    world_size: int
    dtype: torch.dtype | None


def manage(p: torch.Tensor, where: Placement) -> ParamState:
    """Partition an unmanaged, materialised param: register it and move its data to the store."""
    with no_torch_function():
        data = p.data
        if where.dtype is not None and data.is_floating_point() and data.dtype != where.dtype:
            p.data = data = data.to(where.dtype)
        st = ParamState(
            shape=data.shape,
            dtype=data.dtype,
            status=Status.AVAILABLE,
            tier=where.store.tier,
            partition_numel=partition_numel(data.numel(), where.world_size),
            rank=where.rank,
            world_size=where.world_size,
            group=where.group,
            device=data.device,
            store=where.store,
            key=where.store.new_key(),
        )
        register(p, st)
        offload(p, st, from_first_rank=True)
    return st


def offload(p: torch.Tensor, st: ParamState, *, from_first_rank: bool = False) -> None:
    """(Re-)partition ``p.data`` as it is now — shape and dtype included — and leave ``p.data`` empty.

    ``from_first_rank`` (a param built or written under `zswap.Init`): every rank stores its slice of rank
    0's data, so ranks whose random generators differ (``manual_seed(seed + rank)``) still hold one param,
    as DeepSpeed's ``zero.Init`` broadcasts from rank 0; a collective, so every rank offloads the same
    params in the same order. Otherwise each rank keeps its slice of its own data (already the same
    everywhere: a broadcast write-back, a cast)."""
    with no_torch_function():
        data = p.data
        st.shape, st.dtype, st.device = data.shape, data.dtype, data.device
        st.partition_numel = partition_numel(data.numel(), st.world_size)
        if from_first_rank and st.world_size > 1:
            part = _dist.first_ranks_slice(data.reshape(-1), st.rank, st.partition_numel, st.group)
        else:
            part = local_slice(data.reshape(-1), st.rank, st.partition_numel)
        st.store.put(st.key, part)
        p.data = torch.empty(0, dtype=st.dtype, device=st.device)
        st.status = Status.NOT_AVAILABLE
        st.touched = False


@dataclass(eq=False)
class Loading:
    """Swap-ins issued by `start_fetch`, not yet waited for: end it with `finish_fetch` or `cancel_fetch`.

    Its params are `Status.INFLIGHT` meanwhile; the buffers being filled belong to the engine's reads until
    waited for, so a `Loading` must never just be dropped.
    """

    items: list[Item]
    loads: list[tuple[torch.Tensor, Any]]
    copies: list[Copy | None] = field(default_factory=list)
    """With a compute `Device`: each partition's host-to-device copy, once started (`advance`)."""


def start_fetch(items: Sequence[Item], values: Mapping[int, torch.Tensor] | None = None) -> Loading:
    """Issue the swap-in of each param's local partition (no wait, no collective); status `INFLIGHT`.
    ``values``: {id(param): its local partition in host memory}, taken instead of a read (the value
    *is* the stored partition: the caller says so)."""
    values = values or {}
    with no_torch_function():
        loading = Loading(list(items), [])
        try:
            for p, st in loading.items:
                st.status = Status.INFLIGHT
                value = values.get(id(p))
                if value is not None:
                    loading.loads.append((value[: st.partition_numel], None))
                    continue
                loading.loads.append(st.store.load(st.key, st.partition_numel, st.dtype))
        except BaseException:
            loading.items = loading.items[: len(loading.loads)]
            _abort(loading, list(items))
            raise
        return loading


def advance(loading: Loading, device: Device) -> None:
    """Start the host-to-device copy of each partition whose swap-in has completed (never blocks), so the
    copy of a prefetched module overlaps the compute of the one running."""
    if device.passthrough:
        return
    with no_torch_function():
        if not loading.copies:
            loading.copies = [None] * len(loading.loads)
        for i, (local, handle) in enumerate(loading.loads):
            if loading.copies[i] is None and _to_device(local, device) and (handle is None or handle.done()):
                loading.copies[i] = device.h2d(local)  # a failed read raises at its wait in finish_fetch


def _to_device(local: torch.Tensor, device: Device | None) -> bool:
    # A tier-"none" partition already on an accelerator is gathered there as before.
    return device is not None and not device.passthrough and local.device.type == "cpu"


def finish_fetch(loading: Loading, *, private: bool, device: Device | None = None) -> None:
    """Wait for `loading`'s swap-ins, all-gather across ranks in item order, make each ``.data`` full.

    With a compute ``device`` each partition crosses to it first (one copy on its copy stream, which the
    compute stream then waits for), and the all-gather runs there."""
    with no_torch_function():
        try:
            for i, ((p, st), (local, handle)) in enumerate(zip(loading.items, loading.loads, strict=True)):
                if handle is not None:
                    handle.wait()
                copied = False
                if device is not None and _to_device(local, device):
                    copy = loading.copies[i] if i < len(loading.copies) else None
                    local = device.wait(copy if copy is not None else device.h2d(local))
                    copied = True
                if st.world_size > 1:
                    _dist.note(st.group, st.key, 0)
                    pooled = host_buffers(st)
                    numel = st.partition_numel * st.world_size
                    full = (
                        pooled(numel, st.dtype)
                        if pooled
                        else torch.empty(numel, dtype=st.dtype, device=st.device)
                    )
                    _dist.all_gather_flat(full, local, st.group, pooled)
                elif local.device != st.device:
                    full = local.to(st.device)
                else:
                    full = local.clone() if private and handle is None and not copied else local
                install(p, st, full[: st.numel].view(st.shape))
        except BaseException:
            _abort(loading, loading.items, device)
            raise
        finally:
            loading.loads, loading.copies = [], []


def host_buffers(st: ParamState) -> Any:
    """``alloc(numel, dtype)`` for a collective's host buffers of ``st`` (its gathered full tensor, the
    all-to-alls' scratch): the fetch pool of its NVMe store, reused once nothing holds them (within the
    pool's limit), instead of new pages faulted in and zeroed at every collective (`zswap.memory`'s fixed
    mmap threshold); ``None`` for a param gathered on a device or kept in CPU memory (new tensors)."""
    store = st.store
    if st.device.type != "cpu" or not isinstance(store, NvmeStore):
        return None
    return store._buffer


def cancel_fetch(loading: Loading, device: Device | None = None) -> None:
    """Drop `loading`: wait for its reads to stop using their buffers, leave its params not gathered."""
    _abort(loading, loading.items, device)
    loading.loads, loading.copies = [], []


def _abort(loading: Loading, items: list[Item], device: Device | None = None) -> None:
    for _, handle in loading.loads:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.wait()  # engine buffers must not be dropped under a running read
    for copy in loading.copies:
        if copy is not None and device is not None:
            device.wait(copy)  # its destination is freed on the compute stream: order that after the copy
    release([(p, st) for p, st in items if st.status is not Status.NOT_AVAILABLE], write_back=False)


def fetch(items: Sequence[Item], *, private: bool) -> None:
    """Make each param's ``.data`` its full tensor. All swap-ins are issued before the first wait.

    ``private``: the gathered tensor never aliases the stored partition (so changes can be dropped); without
    it a single-rank in-memory partition is handed out zero-copy and changes land in place.
    """
    finish_fetch(start_fetch(items), private=private)


def release(
    items: Iterable[Item], *, write_back: bool, from_first_rank: bool = False, warn: bool = False
) -> None:
    """Leave each param partitioned; ``write_back`` stores its current data first (rank 0's with
    ``from_first_rank``, see `offload`), else drops it (``warn``: saying so where it was written in place
    since it was gathered, `warn_if_written`)."""
    with no_torch_function():
        for p, st in items:
            if write_back:
                offload(p, st, from_first_rank=from_first_rank)
            else:
                if warn:
                    warn_if_written(p, st)
                p.data = torch.empty(0, dtype=st.dtype, device=st.device)
                st.status = Status.NOT_AVAILABLE
                st.touched = False


def install(p: torch.Tensor, st: ParamState, data: torch.Tensor) -> None:
    """``data``, the param's full value as stored, becomes ``p``'s gathered data."""
    p.data = data
    st.status = Status.AVAILABLE
    note_gathered(p, st)


def note_gathered(p: torch.Tensor, st: ParamState) -> None:
    """``p``'s data is now its gathered value, as stored: note its version counter (`changed_in_place`)."""
    st.gathered_version = p._version


def changed_in_place(p: torch.Tensor, st: ParamState) -> bool:
    """Whether ``p`` was written in place (``p.div_(2)`` under ``no_grad``) since its gathered data was
    installed. A write through ``p.data`` has a counter of its own and is not seen."""
    return st.status is Status.AVAILABLE and p._version != st.gathered_version


def warn_if_written(p: torch.Tensor, st: ParamState) -> None:
    """Say so where the gathered copy an engine is about to drop was written in place (a model that changes
    its own weights in its forward, under ``no_grad``): the change is lost, as a `GatheredParameters`
    block's without ``modifier_rank`` is — but for a partition in memory gathered without a copy (CPU
    memory, one rank), where the write reached the stored value itself, so it stays: the warning says which
    (the same model keeps it or not by its tier)."""
    if changed_in_place(p, st):
        note_gathered(p, st)  # said once per change
        stored = st.store.load(st.key, st.partition_numel, st.dtype)[0] if _in_memory(st) else None
        kept = stored is not None and stored.numel() > 0 and stored.data_ptr() == p.data.data_ptr()
        master = (
            "" if st.dtype == torch.float32 else " (until an optimizer step writes it from a float32 master)"
        )
        fate = (
            "its gathered data is the stored partition (params in CPU memory, one rank), so the change "
            f"stays{master}, where with params on NVMe or over several ranks it would be lost"
            if kept
            else "the engine drops its gathered copy, so the change is lost"
        )
        warnings.warn(
            f"a param of shape {tuple(st.shape)} was changed in place while an open zswap Engine had it "
            f"gathered (an in-place op on it under torch.no_grad, in a forward say); {fate}: change params "
            "with zswap.GatheredParameters(params, modifier_rank=0) outside the forward",
            ZswapWarning,
            stacklevel=3,
        )


def _in_memory(st: ParamState) -> bool:
    return st.world_size == 1 and st.tier in ("cpu", "none")


def checksum(t: torch.Tensor) -> int:
    """A cheap fingerprint of a tensor's bytes (CRC-32 on the CPU, one pass; a weighted sum elsewhere)."""
    with no_torch_function():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.device.type == "cpu":
            return zlib.crc32(raw.numpy().data)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        weights = torch.arange(words.numel(), device=words.device) % 65521 + 1
        return int((words.to(torch.int64) * weights).sum())


def flatten_params(params: object) -> list[torch.Tensor]:
    """Tensors in ``params`` (a tensor, or any iterable of them, nested), deduplicated by identity, in order
    of first appearance — an order every rank computes alike. ``None`` entries are skipped."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj: object) -> None:
        if obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
            return
        if isinstance(obj, (str, bytes)) or not isinstance(obj, Iterable):
            raise TypeError(
                f"GatheredParameters takes a param or an iterable of params (nested lists and generators "
                f"too), not {type(obj).__name__}"
            )
        for x in obj:
            walk(x)

    walk(params)
    return out


def _cancel_prefetches(items: list[Item]) -> None:
    """Params an open Engine is prefetching (issued ahead of their use, not yet waited for: between a
    forward and its backward, say) or keeps gathered with no holder (retained for a later use) go back to
    not gathered, so the block gathers them like any other; the engine fetches them again at their use."""
    if not items:
        return
    for p, st in items:
        for runner in open_runners():
            if runner.yield_prefetch(p):
                break
        if st.status is Status.INFLIGHT:
            raise ZswapError(
                f"GatheredParameters: a param of shape {tuple(st.shape)} is being gathered by something "
                "other than an open zswap Engine's prefetch; gather it once that is done"
            )


class GatheredParameters:
    """Inside the block each managed param in ``params`` holds its full data in ``.data``.

    On exit with ``modifier_rank``, that rank's data is broadcast and written back to every rank's
    partition and tier. Without it, changes are dropped — with a `ZswapWarning` if the data did change
    (checked by a checksum taken at entry). If the block raises, changes are dropped and the exception
    propagates. Params that are not managed by zswap are left alone; ``enabled=False`` does nothing.
    Params already gathered by someone other than a `GatheredParameters` block (a running forward, a
    persistent or ``max_in_cpu`` param) stay gathered after the block; without ``modifier_rank`` the block
    works on a copy of each, so that their changes are dropped too (their data may be the stored partition
    itself, and each rank's own change would otherwise stay on that rank).
    """

    def __init__(self, params: object, modifier_rank: int | None = None, enabled: bool = True) -> None:
        self._modifier_rank = modifier_rank
        self._items: list[Item] = []
        if enabled:
            for p in flatten_params(params):
                st = param_state(p)
                if st is not None:
                    self._items.append((p, st))
        self._fetched: list[Item] = []
        self._marks: list[tuple[int, torch.Size, torch.dtype, int]] = []
        self._held: list[tuple[torch.Tensor, ParamState, torch.Tensor]] = []
        """Params gathered before the block: (param, state, data at entry); ``.data`` is the block's copy."""
        self._mastered: list[tuple[torch.Tensor, ParamState, int]] = []
        """With ``modifier_rank``: params whose float32 master an open engine's optimizer holds, with their
        data's checksum at entry (a change the write-back would store, and the next step undo)."""

    def __enter__(self) -> None:
        if not self._items:
            return
        for _, st in self._items:
            if st.gathered_by is not None:
                raise ZswapError(
                    f"GatheredParameters: a param of shape {tuple(st.shape)} is already gathered by an "
                    "enclosing GatheredParameters block; nesting blocks over the same params is not supported"
                )
        world = self._items[0][1].world_size
        if self._modifier_rank is not None and not 0 <= self._modifier_rank < world:
            raise ValueError(f"modifier_rank={self._modifier_rank} is not a rank of a group of {world}")
        # Params `zswap.Init` gathered on access hold writes not yet stored: store them before reading.
        release([(p, st) for p, st in self._items if st.touched], write_back=True, from_first_rank=True)
        _cancel_prefetches([(p, st) for p, st in self._items if st.status is not Status.NOT_AVAILABLE])
        self._fetched = [(p, st) for p, st in self._items if st.status is Status.NOT_AVAILABLE]
        fetch(self._fetched, private=True)
        for _, st in self._items:
            st.gathered_by = self
        if self._modifier_rank is not None:
            masters: set[int] = set()
            for runner in open_runners():
                masters |= runner.mastered()
            with no_torch_function():
                self._mastered = [(p, st, checksum(p.data)) for p, st in self._items if id(p) in masters]
        if self._modifier_rank is None:
            fetched = {id(p) for p, _ in self._fetched}
            with no_torch_function():
                self._marks = [
                    (p.data.data_ptr(), p.shape, p.dtype, checksum(p.data)) for p, _ in self._fetched
                ]
                for p, st in self._items:
                    if id(p) not in fetched and st.status is Status.AVAILABLE:
                        entry = p.data
                        p.data = entry.clone()
                        self._held.append((p, st, entry))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._items:
            return
        try:
            if exc_type is None and self._modifier_rank is not None:
                self._refuse_stale_master()
                self._write_back()
            else:
                changed = self._restore_held()
                if exc_type is None:
                    self._warn_if_changed(changed)
                release(self._fetched, write_back=False)
        finally:
            for p, st in self._items:
                st.gathered_by = None
                note_gathered(p, st)  # what it holds now is the stored value (written back or restored)
            self._fetched, self._marks, self._held = [], [], []

    def _restore_held(self) -> ParamState | None:
        """Give each param gathered before the block its data at entry back (unless something released it
        meanwhile); returns the state of one whose copy was changed, if any."""
        changed = None
        with no_torch_function():
            for p, st, entry in self._held:
                d = p.data
                if d.shape != entry.shape or d.dtype != entry.dtype or not _same_bits(d, entry):
                    changed = changed or st
                if st.status is Status.AVAILABLE:
                    p.data = entry
        return changed

    def _write_back(self) -> None:
        fetched = {id(p) for p, _ in self._fetched}
        with no_torch_function():
            for p, st in self._items:
                if st.world_size > 1:
                    if p.data.shape != st.shape or p.data.dtype != st.dtype:
                        release(self._fetched, write_back=False)
                        raise ZswapError(
                            f"GatheredParameters: a param of shape {tuple(st.shape)} and dtype {st.dtype} "
                            f"became {tuple(p.data.shape)} {p.data.dtype}; across ranks only values may "
                            "change"
                        )
                    if not p.data.is_contiguous():
                        p.data = p.data.contiguous()
                    _dist.broadcast(p.data, self._modifier_rank or 0, st.group)
                if id(p) in fetched:
                    offload(p, st)
                else:  # gathered by someone else: store the new values, keep it gathered
                    flat = p.data.reshape(-1)
                    st.store.put(st.key, local_slice(flat, st.rank, st.partition_numel).clone())
            for store in {id(st.store): st.store for _, st in self._items}.values():
                store.wait_all()

    def _refuse_stale_master(self) -> None:
        """A change to a param whose float32 master an open engine's optimizer holds would be stored, then
        undone by the next step (which steps the master and rounds it into the param): refused on every rank
        alike (the modifier rank's verdict), the change dropped, as `load_weights` refuses such a load."""
        with no_torch_function():
            changed = next((st for p, st, crc in self._mastered if checksum(p.data) != crc), None)
        if self._items[0][1].world_size > 1:
            st0 = self._items[0][1]
            flag = torch.tensor([0 if changed is None else 1], device=_dist.small_tensor_device(st0.group))
            _dist.broadcast(flag, self._modifier_rank or 0, st0.group)
            if int(flag.item()) and changed is None:
                changed = st0
        if changed is None:
            return
        self._restore_held()
        release(self._fetched, write_back=False)
        self._fetched = []
        raise ZswapError(
            f"GatheredParameters(modifier_rank={self._modifier_rank}): a param of shape "
            f"{tuple(changed.shape)} was changed, but the optimizer of an open zswap Engine holds its "
            "float32 master copy, which its next step would write over the change; the change is dropped. "
            "Set the master with zswap.deepspeed.utils.safe_set_full_fp32_param(param, value) (the param "
            "follows it at the next step), or change the param before the first step"
        )

    def _warn_if_changed(self, changed: ParamState | None) -> None:
        with no_torch_function():
            for (p, st), (ptr, shape, dtype, crc) in zip(self._fetched, self._marks, strict=True):
                d = p.data
                if d.data_ptr() != ptr or d.shape != shape or d.dtype != dtype or checksum(d) != crc:
                    changed = st
                    break
        if changed is not None:
            warnings.warn(
                f"GatheredParameters: a param of shape {tuple(changed.shape)} was changed inside a block "
                "without modifier_rank; the change is dropped (pass modifier_rank to keep it)",
                ZswapWarning,
                stacklevel=3,
            )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one shape and dtype (a NaN equals itself)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
