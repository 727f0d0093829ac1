"""The early step's per-record pipeline: records read into the optimizer's ring (ahead of their last
gradient where a slot is free), updated by the AdamW kernel once complete, written back with the param
copies, and the copies kept as seeds for the next pass or let go once written (see `zswap.earlystep`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, cast

import torch

from ..gradients.gradstore import store_of
from ..memory import ENGINE_COPY
from ..parts.gather import no_torch_function
from ..parts.params import NvmeStore, ParamState, Status, local_slice, param_state
from ..store.storage import _memcpy
from . import early_memory
from .optim._layout import SubGroup

if TYPE_CHECKING:
    from .earlystep import EarlyStep


def plan(es: EarlyStep) -> None:
    """A backward begins an early step: which records wait for which params, the order to read them in
    (the last backward's), how much of the copies' writes may be in flight, the params only written."""
    es.layout = tuple(es.opt.records.sub_groups)
    es.steps = list(es.opt.records.steps)
    es.by_param = {}
    es.waiting = {}
    for sg in es.layout:
        es.waiting[sg.key] = len({s.param for s in sg.segments})
        for s in sg.segments:
            if sg not in es.by_param.setdefault(s.param, []):
                es.by_param[s.param].append(sg)
    # Every param's count, 0 for one in no record (a param of no elements): nothing of it left to update.
    es.left = {i: len(es.by_param.get(i, ())) for i in range(len(es.opt.records.params))}
    keys = {sg.key: sg for sg in es.layout}
    es.upcoming = deque(keys[k] for k in es._order if k in keys)
    es.order = []
    params = es.opt.records.params
    itemsize = max((p.element_size() for p in params), default=4)
    es.write_ahead = 2 * max((sg.numel for sg in es.layout), default=0) * itemsize
    only_written = es.opt.overwrites(params)
    es.masters = frozenset(i for i, p in enumerate(params) if id(p) in only_written)


def read_ahead(es: EarlyStep) -> None:
    """Read the records backward completes next into the ring's free slots, before their gradients
    are: those of a record some of whose params have theirs, then the order the last backward completed
    them in (`_order`). Waiting for a record's last gradient to read it left the disk idle while
    backward computed and held backward while it read: 0.6–0.9 s of a 2 GiB step. At most all slots but
    one are so taken, so a record that completes out of that order always finds one. Records in CPU
    memory are copied when complete (`early_memory.start`): nothing to read ahead."""
    if early_memory.cpu_records(es):
        return
    room = es.records.ring_size - 1
    while es.upcoming and len(es.early) < room:
        sg = es.upcoming[0]
        if sg.key in es.early or es.waiting.get(sg.key, 0) == 0:
            es.upcoming.popleft()  # read, or complete (then `_ready` read it)
            continue
        while es.writes and not es.free and es.writes[0][1].done():
            es._land_oldest()
        if es.ring and not es.free:
            return
        es.upcoming.popleft()
        es.early[sg.key] = es._start(sg)
        es.read_ahead += 1


def start(es: EarlyStep, sg: SubGroup) -> tuple[SubGroup, torch.Tensor, torch.Tensor, Any]:
    """Issue the read of ``sg``'s record into a free ring slot (waiting for one if none is)."""
    if early_memory.cpu_records(es):
        return early_memory.start(es, sg)
    store = es.records
    if not es.free:
        if not es.ring:
            es.ring = list(store._buffers(max(s.record_numel for s in es.layout)))
            es.free.extend(es.ring)
            for buf in es.ring:
                es.txn.scratch(buf)
        while not es.free:
            if es.writes:
                es._land_oldest()
            else:
                es._pump(keep=0)
    buf = es.free.popleft()
    rec = buf[: sg.record_numel]
    name = store._name(sg)
    es.versions[name] = store.ns._live.get(name)
    handle = store.ns.read(name, rec, es.txn) if store.ns.has(name, es.txn) else None
    if handle is None:
        rec.zero_()
    return sg, buf, rec, handle


def pump(es: EarlyStep, keep: int) -> None:
    """Update and write the complete records read so far: every one whose read has landed, and the
    oldest ones while more than ``keep`` are left."""
    while len(es.reads) > keep or (es.reads and _landed(es.reads[0][3])):
        sg, buf, rec, handle = es.reads.popleft()
        if handle is not None:
            handle.wait()
        steps = {s.param: es.steps[s.param] + 1 for s in sg.segments if s.param in es.ready}
        for i in steps:
            early_memory.materialize(es, i)
        grads = {i: es.ready[i][2] for i in steps}
        targets = {i: es.ready[i][1] for i in steps}
        es.opt.records.update(sg, rec, steps, grads, cast(float, es.factor), es.txn, targets=targets)
        early_memory.write(es, sg, buf, rec)
        for i in steps:
            es.left[i] -= 1
            if es.left[i] == 0:
                st, copy, _, _ = es.ready[i]
                if early_memory.in_memory(st):  # kept for the commit
                    early_memory.stage(es, i, st, copy)
                    es.ready[i] = (st, _empty, _empty, es.ready[i][3])
                    es.dropped += 0 if es.keeping else 1
                    continue
                nbytes = copy.numel() * copy.element_size()
                # Bounded here (`write_ahead`), not by the storage's write queue: backward goes on while
                # a sub-group's worth of copies is written, and waits only past two of them.
                w = _ps(st).ns.put(st.key, copy, es.txn, held=0)
                es.holding.add(-nbytes)  # the gradient
                es.ready[i] = (st, _empty, _empty, es.ready[i][3])  # the write holds the copy
                es.dropped += 0 if es.keeping else 1  # that gradient is gone: no falling back from here on
                kept = seed(es, i, copy)
                small = 0 if kept else _small(copy)  # moved from ``holding`` to ``writing``
                es.copies.append((0 if kept else nbytes, small, w))
                es.copying += 0 if kept else nbytes
                es.writing.add(small)


def seed(es: EarlyStep, i: int, copy: torch.Tensor) -> bool:
    """Keep ``copy`` (param ``i``'s updated partition) as a seed if the next pass would take it
    (`seeding`), up to ``seed_numel`` elements; past that the oldest seeds go first. True if kept."""
    nbytes = copy.numel() * copy.element_size()
    p = es.opt.records.params[i]
    es.held -= 2 * nbytes  # the gradient, and the copy: counted in ``copying`` until written
    if id(p) in es.staying:  # resident: becomes its gathered copy at the commit
        es.kept.append((p, copy))
        es.held += nbytes
        return True
    if id(p) in es.seeding and copy.numel() <= es.seed_numel:
        es.seeds.append((p, copy))
        es.seeded += copy.numel()
        es.held += nbytes
    else:
        es.holding.add(-_small(copy))
        return False
    while es.seeded > es.seed_numel:
        _drop_oldest_seed(es)
    return True


def _drop_oldest_seed(es: EarlyStep) -> None:
    _, old = es.seeds.popleft()
    es.seeded -= old.numel()
    es.held -= old.numel() * old.element_size()
    es.holding.add(-_small(old))


def make_room(es: EarlyStep) -> None:
    """Past the cap: update every complete record now, waiting for its read (their params' copies are
    written, gradients let go: the reads of a sub-group size small next to the params run behind
    backward), let go of seeds, oldest first (the next forward reads those params instead: their copies
    were written), then wait for every copy's write in flight — before the early step gives up for want
    of room, which it cannot fall back from once it let go of applied gradients."""

    def over() -> bool:
        return es.held + es.copying + es.staged > es.cap

    if over():
        pump(es, 0)
    while es.seeds and over():
        _drop_oldest_seed(es)
    if over():
        land_copies(es, 0)


def land_copies(es: EarlyStep, limit: int) -> None:
    """Settle the copies' writes that have landed, and the oldest ones while more than ``limit`` bytes
    are in flight."""
    while es.copies and (es.copying > limit or es.copies[0][2].done()):
        nbytes, small, w = es.copies.popleft()
        w.settle()
        es.copying -= nbytes
        es.writing.add(-small)
        es.txn.check()


def land_oldest(es: EarlyStep) -> None:
    buf, w = es.writes.popleft()
    w.settle()
    es.free.append(buf)
    es.txn.check()


def keep_as_seed(es: EarlyStep, p: torch.Tensor, st: ParamState, sink: Any = None) -> None:
    """A micro-batch before the boundary: no step will change ``p`` before the next forward, which
    takes it first (`seed_plan`): a copy of it is kept for `take_micro_seeds`. On a compute device
    (``sink``, a `zswap.gradients.grads.GradSink`) the gathered param is the stored partition on the
    device: it is copied to the host on the copy stream (the device holds both ends until it completed),
    and `landed_micro` waits for it."""
    data = p.data.reshape(-1)
    if st.world_size > 1:  # this rank's partition, as stored (the next pass all-gathers it again)
        data = local_slice(data, st.rank, st.partition_numel)
    copy = early_memory.alloc(st, data, None if sink is None else sink.device)
    with no_torch_function():
        if sink is None:
            _memcpy(copy, data)
        else:
            es.micro_copies.append((sink.device, sink.device.d2h(data.contiguous(), copy)))
    es.micro.append((p, copy, early_memory.version(st)))
    es.held += copy.numel() * copy.element_size()
    es.seeded += copy.numel()
    es.holding.add(_small(copy))
    while es.seeded > es.seed_numel:
        _, old, _ = es.micro.pop(0)
        es.seeded -= old.numel()
        es.held -= old.numel() * old.element_size()
        es.holding.add(-_small(old))


def landed_micro(es: EarlyStep) -> list[tuple[torch.Tensor, torch.Tensor, str | None]]:
    """The micro-batch seeds `keep_as_seed` made, every device-to-host copy among them completed."""
    for dev, copy in es.micro_copies:
        dev.synchronize(copy)
    return es.micro


def late_sums(es: EarlyStep) -> None:
    """At the end of backward: params whose whole gradient came in earlier micro-batches of this step (an
    expert, a branch the boundary micro-batch did not take) arrive with their stored sums, final now, and
    their partitions read, as this backward's gradients would, so their records are updated with the rest
    rather than dropping the early step for the ordinary one (which reads the same). Once only: a deferred
    step's `ordinary_part` later lets go of held params it does not count as passed."""
    params = es.opt.records.params
    for i in sorted(es.earlier - es.ready.keys() - es.passed):
        if es.state != "running":
            return  # it gave up (`_arrive`, for room)
        st = param_state(params[i])
        if st is None:  # (`early_memory.summed` took managed params only)
            continue
        if not es.opt.records.placed(i):  # its first gradient: as `EarlyStep._on_grad` leaves one
            if es.opt.records.sub_groups:
                es.passed.add(i)
                es.part_why = es.part_why or "a param got its first gradient"
            continue
        if i in es.outside:
            es.passed.add(i)
            continue
        grad, handle = store_of(st).earlier(st)
        copy = early_memory.copy_of(es, i, st, _partition(es, i, st, params[i]))
        version = early_memory.version(st)
        if handle is not None:
            handle.wait()
        es._arrive(i, st, copy, grad, version, es.task)


def _partition(es: EarlyStep, i: int, st: ParamState, p: torch.Tensor) -> torch.Tensor:
    """This rank's partition of param ``i`` outside its backward: a stand-in where the update only writes
    it, the gathered copy's slice where it stays gathered on the host, else read from its store."""
    if i in es.masters:
        return torch.empty(st.partition_numel, dtype=st.dtype, device="meta")
    if st.status is Status.AVAILABLE and p.device.type == "cpu":
        data = p.data.reshape(-1)
        return local_slice(data, st.rank, st.partition_numel) if st.world_size > 1 else data
    data, handle = st.store.load(st.key, st.partition_numel, st.dtype)
    if handle is not None:
        handle.wait()
    return data


def finish(es: EarlyStep) -> None:
    """Update and write the records not updated yet, and wait for every write."""
    for sg in es.layout:  # records some params of which got no gradient (deferred: every one)
        if es.waiting[sg.key] > 0 and any(s.param in es.ready for s in sg.segments):
            es.waiting[sg.key] = 0
            es._ready(sg)
    for sg, buf, _, handle in es.early.values():  # read ahead, but no param of it got a gradient
        if handle is not None:
            handle.wait()
        es.versions.pop(es.records._name(sg))
        es.free.append(buf)
        es.read_unused += 1
    es.early = {}
    es._pump(keep=0)
    while es.writes:
        es._land_oldest()
    es._land_copies(0)
    es._order = es.order


_empty = torch.empty(0)


def _landed(handle: Any) -> bool:
    return handle is None or bool(handle.done())


def _small(copy: torch.Tensor) -> int:
    """Bytes of a param copy that is an ordinary tensor (under `ENGINE_COPY`), else 0."""
    nbytes = copy.numel() * copy.element_size()
    return nbytes if nbytes < ENGINE_COPY else 0


def _ps(st: ParamState) -> NvmeStore:
    return cast(NvmeStore, st.store)  # for_engine: every managed param is on NVMe
