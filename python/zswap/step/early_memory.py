"""The early step where optimizer states, params or gradients stay in CPU memory (`zswap.step.earlystep`).

Tiers: records in `zswap.step.optim._store.CpuStore` (``offload_optimizer.device: cpu``), param partitions
in a `zswap.parts.params.MemoryStore` (``offload_param.device: cpu``), gradients in memory
(`zswap.gradients.gradstore.MemoryGrads`, with states in CPU memory). Each combination with NVMe ones runs
the same pipeline; only what "read", "write" and "version" mean for a memory tier is here.

**Copies, swapped in at the commit — not the undo log.** A memory tier's record or partition is updated in a
copy of it (the record read into a new tensor, the param's gathered partition copied as on NVMe), and the
copies are kept until `Engine.step`: its commit puts each in its store in place of the old tensor
(`CpuStore.replace`, `MemoryStore.put`: no bytes copied but into a pinned partition; nothing there can
fail), an abort drops them. The undo log would cost the same memory (it saves a copy of everything it lets
change) but would change the live records and partitions in backward: between backward and step
``optimizer.state_dict()``, ``save_checkpoint``, ``GatheredParameters`` and the ordinary step that redoes a
dropped one would see, or have to put back, speculative values. With copies the stored state never holds
one, so every way of dropping the early step is the NVMe one (the transaction aborts; nothing to put back).

**Memory.** Copies kept for the commit (``staged``) cannot be let go before it, so they count against
the early step's cap from the start of each backward: the records in CPU memory and the param partitions
in CPU memory of the params it updates count with what it holds from when it begins. Where those of every
param pass the cap, it updates a part (`plan_part`): the params whose records backward completes first
(the last backward's order), as many as leave room for what it holds besides, closed over shared
records; the others (``outside``) take the ordinary step in the commit, from their stored gradients
(``steps_in_backward_partly``). Only where not even the first record's fit does no early step begin, and
`engine.stats()` says why.

**Versions.** What the commit checks did not move since backward read it: a memory partition's is the
stored tensor and its in-place version counter (`torch.Tensor._version`: a gathered single-rank
partition is the stored tensor itself, so a write to ``p.data`` is seen too); a CPU record's is the
stored tensor and `CpuStore.version`'s write count.

**Gradients in memory** are always kept (``keeping``): they are the store's tensors, nothing is saved by
letting them go, and kept, every drop falls back to the ordinary step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from ..gradients.gradstore import MemoryGrads, NvmeGrads, store_of
from ..memory import ENGINE_COPY
from ..parts.gather import no_torch_function
from ..parts.params import _REGISTRY, MemoryStore, NvmeStore, ParamState, param_state
from ..store.storage import _memcpy
from .optim._layout import SubGroup
from .optim._store import CpuStore

if TYPE_CHECKING:
    from ..device.protocol import Device
    from .earlystep import EarlyStep


def why_not(engine: Any, optimizer: Any) -> str:
    """Why the params, states and gradients of ``engine`` allow no early step ("" where they do)."""
    if optimizer.tier not in ("nvme", "cpu"):
        return f"the optimizer states are on tier {optimizer.tier!r}"
    for _, st in engine._items:
        if st.tier not in ("nvme", "cpu") or not isinstance(st.store, NvmeStore | MemoryStore):
            return "some params stay on their device (offload_param.device none)"
        if not isinstance(store_of(st), NvmeGrads | MemoryGrads):
            return f"some gradients are kept in a {type(store_of(st)).__name__}"
    return ""


def in_memory(st: ParamState) -> bool:
    """Whether ``st``'s partition is kept in CPU memory (updated in a copy swapped in at the commit)."""
    return not isinstance(st.store, NvmeStore)


def on_nvme(ids: Iterable[int]) -> frozenset[int]:
    """Those of the params ``ids`` whose partitions are on NVMe (the only ones kept as seeds: a memory
    partition is gathered from its store with no read)."""
    return frozenset(i for i in ids if (st := _REGISTRY.get(i)) is not None and not in_memory(st))


def cpu_records(es: EarlyStep) -> bool:
    return isinstance(es.records, CpuStore)


def _kept_bytes(es: EarlyStep, sgs: Iterable[SubGroup], params: Iterable[int]) -> int:
    """Bytes of copies kept for the commit when ``sgs``' records and ``params``' partitions are updated:
    the records where they are in CPU memory, the partitions of those params kept in CPU memory."""
    total = sum(sg.record_numel * 4 for sg in sgs) if cpu_records(es) else 0
    for i in params:
        st = param_state(es.opt.records.params[i])
        if st is not None and in_memory(st):
            total += st.partition_numel * st.dtype.itemsize
    return total


def parts(es: EarlyStep) -> list[tuple[list[SubGroup], set[int]]]:
    """The layout's records in sets closed over shared params (a param split over records is updated
    with all of them, a record with all its params), each with its params, in the order backward is
    expected to complete them: the last backward's (`EarlyStep._order`), then the rest last first."""
    keys = {sg.key: sg for sg in es.layout}
    seen = set(es._order)
    order = [keys[k] for k in es._order if k in keys]
    order += [sg for sg in reversed(es.layout) if sg.key not in seen]
    done: set[str] = set()
    out: list[tuple[list[SubGroup], set[int]]] = []
    for first in order:
        if first.key in done:
            continue
        sgs, params, todo = [], set(), [first]
        done.add(first.key)
        while todo:
            sg = todo.pop()
            sgs.append(sg)
            for s in sg.segments:
                if s.param in params:
                    continue
                params.add(s.param)
                for other in es.by_param.get(s.param, ()):
                    if other.key not in done:
                        done.add(other.key)
                        todo.append(other)
        out.append((sgs, params))
    return out


def plan_part(es: EarlyStep, deferred: bool = False) -> str:
    """Which params this backward's early step updates (see the module docstring): sets ``staged`` (the
    copies kept for the commit, counted from now on) and ``outside`` (the params left to the ordinary
    step, whose records it never reads). Why none can be updated, or "" where some can. Needs the layout
    (`zswap.step.early_pipeline.plan`). With nothing kept in CPU memory an update in backward (not
    ``deferred``) gives up once past the cap with no seed left to let go and every write landed
    (`early_pipeline.make_room`), after it may have let go of gradients: none runs where one record's
    copies and gradients pass the cap, and ``thin`` is set where two may."""
    es.outside, es.thin = frozenset(), False
    es.staged = _kept_bytes(es, es.layout, {s.param for sg in es.layout for s in sg.segments})
    if es.staged == 0 and deferred:
        return ""  # (holds what fits the cap, `EarlyStep.passed`: it never gives up for room)
    # What it holds besides while backward runs: the param copies and gradients waiting for two records at
    # once (one being completed, and one whose last param is split into it).
    wait = 0
    for sg in es.layout:
        states = [(i, param_state(es.opt.records.params[i])) for i in {s.param for s in sg.segments}]
        wait = max(wait, sum(holds(es, i, st) for i, st in states if st is not None))
    if es.staged == 0:  # nothing kept in CPU memory: the records alone must fit (seeds make way, `make_room`)
        if wait > es.cap:
            return (
                f"the param copies and gradients of one optimizer record ({wait} bytes) exceed the early "
                f"step's cap of {es.cap} bytes: a smaller sub_group_size lets the update run in backward"
            )
        # Two records at once may not fit, or (a record waiting for a param the last backward gave its
        # gradient late: a tied embedding, a block run twice) the last backward's order did not: keep them.
        es.thin = 2 * wait > es.cap or _peak(es) > es.cap
        return ""
    if es.staged + 2 * wait <= es.cap:
        return ""
    groups = parts(es)
    sizes = [_kept_bytes(es, sgs, params) for sgs, params in groups]
    over = (
        f"the copies of the optimizer records and params kept in CPU memory ({es.staged} bytes) and the "
        f"param copies and gradients held while backward runs ({2 * wait}) exceed the early step's cap of "
        f"{es.cap} bytes"
    )
    total, inside = 0, set()
    for (_, params), nbytes in zip(groups, sizes, strict=True):
        if total + nbytes + 2 * wait > es.cap:
            break
        total += nbytes
        inside |= params
    if not inside:
        es.staged = 0
        return f"{over}, even for the first records backward completes ({sizes[0]} bytes of copies)"
    es.staged = total
    es.outside = frozenset(i for _, params in groups for i in params) - inside
    es.part_why = f"{over}: {len(inside)} of {len(inside) + len(es.outside)} params updated in backward"
    es.upcoming = deque(sg for sg in es.upcoming if sg.segments[0].param not in es.outside)  # (closed)
    return ""


def _peak(es: EarlyStep) -> int:
    """The most bytes of copies and gradients held at once had the last backward's gradients come in
    this layout: each param's from its arrival until every record holding it is updated — one complete
    record's update trailing (`pump` keeps one read in flight), a copy made at the update (a param only
    written, `materialize`) held with its gradient meanwhile, resident params' copies until the commit."""
    params = es.opt.records.params
    index = {id(p): i for i, p in enumerate(params)}
    staying = es.resident()  # their copies stay until the commit (`early_pipeline.seed`); seeds make way
    waiting, left, peak, total = dict(es.waiting), dict(es.left), 0, 0
    held: dict[int, int] = {}
    trailing: list[SubGroup] = []

    def put(j: int, nbytes: int) -> None:  # (a running total: a sum per arrival is quadratic in params)
        nonlocal total
        total += nbytes - held.get(j, 0)
        held[j] = nbytes

    def update(sg: SubGroup) -> int:
        for j in {s.param for s in sg.segments}:
            if j in held and left[j] > 0:
                nbytes = params[j].element_size() * es.opt.state_numel(j)
                st = param_state(params[j])
                if st is not None and only_written(es, j, st) and held[j] == nbytes:
                    put(j, 2 * nbytes)  # its copy, made now
                left[j] -= 1
        during = total
        for j in {s.param for s in sg.segments}:
            if left.get(j) == 0 and j in held:
                put(j, params[j].element_size() * es.opt.state_numel(j) if id(params[j]) in staying else 0)
        return during

    for pid in es.arrivals.last:
        i = index.get(pid)
        st = None if i is None or i not in es.by_param else param_state(params[i])
        if i is None or st is None or i in held:
            continue
        put(i, holds(es, i, st))
        peak = max(peak, total)
        for sg in es.by_param[i]:
            waiting[sg.key] -= 1
            if waiting[sg.key] == 0:
                trailing.append(sg)
        while len(trailing) > 1:
            peak = max(peak, update(trailing.pop(0)))
    return peak


def uses(es: EarlyStep) -> None:
    """Declare the early step's transaction's I/O on the records' storage (none for CPU records)."""
    if not cpu_records(es):
        es.txn.uses(es.records.storage)


def keeps(gs: object) -> bool:
    """Whether gradients of ``gs`` are always kept by the early step (in memory: see the docstring)."""
    return isinstance(gs, MemoryGrads)


def has_grads(es: EarlyStep, gs: object) -> bool:
    """Whether ``gs`` already holds gradients when a backward begins (a second backward before the step)."""
    if isinstance(gs, NvmeGrads):
        return bool(gs._meta)
    return any((st := param_state(p)) is not None and st.grad is not None for p in es.opt.records.params)


def summed(es: EarlyStep) -> frozenset[int]:
    """The params (optimizer indices) with a gradient in their store as a backward begins: at an
    accumulation boundary, the sums earlier micro-batches left."""
    out = set()
    for i, p in enumerate(es.opt.records.params):
        st = param_state(p)
        if st is None:
            continue
        gs = store_of(st)
        if gs.key(st) in gs._meta if isinstance(gs, NvmeGrads) else st.grad is not None:  # committed
            out.add(i)
    return frozenset(out)


def version(st: ParamState) -> Any:
    """``st``'s stored partition as it is now (see the module docstring)."""
    if isinstance(st.store, NvmeStore):
        return st.store.ns._live.get(st.key)
    part = st.store.load(st.key, st.partition_numel, st.dtype)[0]
    return part, part._version


def unchanged(st: ParamState, seen: Any) -> bool:
    if isinstance(st.store, NvmeStore):
        ns = st.store.ns
        return bool(ns._live.get(st.key) == seen and st.key not in ns._pending)
    return _same(version(st), seen)


def alloc(st: ParamState, like: torch.Tensor, device: Device | None = None) -> torch.Tensor:
    """A buffer for a copy of ``st``'s partition: from the fetch pool for large NVMe ones (page-aligned:
    written without a bounce copy; backward lets go of one of the same shape at about every gradient, so
    copies and seeds take the memory of the gathered params they replace), else a new tensor — page-locked
    where a compute ``device`` copies into it (`Device.host_empty`: a CUDA copy into pageable memory
    returns only once it completed, stalling backward's hook) and it is not to become the partition a
    memory store keeps."""
    if isinstance(st.store, NvmeStore) and like.numel() * like.element_size() >= ENGINE_COPY:
        return st.store._buffer(like.numel(), like.dtype)
    if device is not None and not in_memory(st):
        return device.host_empty(like.numel(), like.dtype)
    return torch.empty(like.numel(), dtype=like.dtype)


def plain(st: ParamState, copy: torch.Tensor) -> int:
    """Bytes of ``st``'s copy that are an ordinary tensor (the rest is a fetch-pool buffer; a copy not
    made yet has none)."""
    nbytes = copy.numel() * copy.element_size()
    return nbytes if not copy.is_meta and (in_memory(st) or nbytes < ENGINE_COPY) else 0


# A param whose records hold its float32 master (past its first step: `OffloadedAdamW.overwrites`) is only
# written by the update — the kernel steps the master and rounds it into the param — so the early step
# takes no copy of its value at its gradient: it holds a meta tensor of the partition's shape until the
# update, which gets a buffer then (`materialize`). Where clipping bites, what is held until the step is
# the gradient alone: the cap holds twice the params (bf16), and no copy is made at all for the update.
# A partition in CPU memory gets its buffer at the gradient (reserved for the commit from the start anyway:
# `reserve`), but nothing is copied into it (`blank`).


def copy_of(es: EarlyStep, i: int, st: ParamState, data: torch.Tensor) -> torch.Tensor:
    """Param ``i``'s gathered partition ``data`` as the copy the early step updates: a copy of it, or,
    where the update only writes it (`masters`), what `blank` gives."""
    copy = blank(es, i, st, data)
    if copy is not None:
        return copy
    copy = alloc(st, data)
    with no_torch_function():
        _memcpy(copy, data)  # one thread: a torch copy here wakes its pool against the kernel's
    return copy


def blank(es: EarlyStep, i: int, st: ParamState, data: torch.Tensor) -> torch.Tensor | None:
    """What stands for param ``i``'s copy where its update only writes it (`masters`): on NVMe a meta
    tensor (`unmade`: its buffer is taken at the update); in CPU memory a buffer whose values are unset
    (reserved for the commit from the start, so made now, but nothing is copied into it: no host copy, no
    device-to-host one). ``None``: the update reads the param, so the copy must hold its value."""
    if only_written(es, i, st):
        return unmade(st)
    return alloc(st, data) if i in es.masters else None


def unmade(st: ParamState) -> torch.Tensor:
    """The stand-in for a copy of ``st``'s partition made at the update (a meta tensor: no memory)."""
    return torch.empty(st.partition_numel, dtype=st.dtype, device="meta")


def only_written(es: EarlyStep, i: int, st: ParamState) -> bool:
    return i in es.masters and not in_memory(st)


def holds(es: EarlyStep, i: int, st: ParamState) -> int:
    """Bytes the early step holds for param ``i`` once it takes its gradient: the gradient, and the copy
    unless it is made at the update."""
    nbytes = st.partition_numel * st.dtype.itemsize
    return nbytes if only_written(es, i, st) else 2 * nbytes


def held_bytes(copy: torch.Tensor) -> int:
    """Bytes held for a param whose copy is ``copy``: it and the gradient (the gradient alone if unmade)."""
    nbytes = copy.numel() * copy.element_size()
    return nbytes if copy.is_meta else 2 * nbytes


def materialize(es: EarlyStep, i: int) -> None:
    """Param ``i``'s record is about to be updated: a copy not made yet gets its buffer (values unset: the
    update writes every element of the partition), after the copies' writes in flight past ``write_ahead``
    have landed (at the step, a deferred update makes them one after the other)."""
    st, copy, grad, version = es.ready[i]
    if not copy.is_meta:
        return
    es._land_copies(es.write_ahead)
    real = alloc(st, copy)
    es.txn.scratch(real)
    es.held += real.numel() * real.element_size()
    es.holding.add(plain(st, real))
    es.ready[i] = (st, real, grad, version)


# -- records -----------------------------------------------------------------------------------------


def start(es: EarlyStep, sg: SubGroup) -> tuple[SubGroup, torch.Tensor, torch.Tensor, Any]:
    """``sg``'s record in a copy of its own (zeros if it was never written), counted in ``staged``."""
    store = cast(CpuStore, es.records)
    rec = torch.empty(sg.record_numel, dtype=torch.float32, pin_memory=store.pin)
    es.kept_mem.add(rec.nbytes)
    es.versions[sg.key] = store.version(sg.key)
    stored = store.get(sg.key)
    if stored is None:
        rec.zero_()
    else:
        _memcpy(rec, stored)
    es.txn.scratch(rec)
    return sg, rec, rec, None


def write(es: EarlyStep, sg: SubGroup, buf: torch.Tensor, rec: torch.Tensor) -> None:
    """``sg``'s updated record: written copy-on-write on NVMe (its ring slot freed once landed), kept for
    the commit in CPU memory."""
    store = es.records
    if isinstance(store, CpuStore):
        es.swaps.append((store, sg.key, rec))
    else:
        es.writes.append((buf, store.ns.put(store._name(sg), rec, es.txn, held=0)))  # a ring slot


def same_records(es: EarlyStep) -> bool:
    """Every record the early step read is still the one stored (nothing wrote it since)."""
    store = es.records
    if isinstance(store, CpuStore):
        return all(_same(store.version(key), seen) for key, seen in es.versions.items())
    ns = store.ns
    return all(ns._live.get(name) == seen and name not in ns._pending for name, seen in es.versions.items())


# -- params ------------------------------------------------------------------------------------------


def stage(es: EarlyStep, i: int, st: ParamState, copy: torch.Tensor) -> None:
    """Param ``i``'s records are all updated: its copy (a memory partition) waits for the commit, already
    counted in ``staged``; the early step lets go of its gradient (a kept one stays in its store)."""
    nbytes = copy.numel() * copy.element_size()
    es.held -= 2 * nbytes  # the copy moves to ``staged`` (reserved at the start), the gradient goes
    es.holding.add(-2 * nbytes)
    es.kept_mem.add(nbytes)
    es.swaps.append((st.store, st.key, copy))


def swap_in(swaps: list[tuple[Any, str, torch.Tensor]]) -> None:
    """At the commit (nothing here can fail): each kept copy becomes its stored record or partition."""
    for store, key, copy in swaps:
        if isinstance(store, CpuStore):
            store.replace(key, copy)
        else:
            store.put(key, copy)


def _same(now: tuple[Any, int], seen: tuple[Any, int]) -> bool:
    return now[0] is seen[0] and now[1] == seen[1]  # by identity: ``==`` on tensors compares elements
