"""The early step: `OffloadedAdamW` updates run inside backward, as each record's gradients are complete, and
are made live by `Engine.step` — or dropped, and the step runs as usual.

Why: with params, gradients and AdamW states on NVMe, a step as `zswap.runtime.step_partitions` runs it reads
every param partition, its gradient and its record, and writes the record and the partition back; the
gradient was written by backward a moment before. In backward the param is still gathered in memory and
its gradient is there too, so updating then saves reading both back (2 × the model of the 10 × a step
moves; see benches/README.md, "Bytes per step").

What it keeps:

- **Results.** The same kernel runs on the same bytes (the gathered param is the partition, world size 1;
  the gradient is the one the store writes), with the same hyper-parameters and step counts, so params and
  records are bitwise those of the ordinary step. It runs only when that step would apply the gradients
  as they are: no clipping, no fp16 check or loss scale, no accumulation (``gradient_accumulation_steps``
  1, and a record is taken only when the gradient store was empty before this backward), one rank, the
  CPU as compute device, every managed param on NVMe with its gradient, an `OffloadedAdamW` on NVMe whose
  records already exist (from the second step on).
- **API.** Gradients are still stored (kept in memory up to the gradient store's stash, written past it:
  `zswap.gradstore`), so `full_grad`, `zero_grad`, another backward, a checkpoint, `GatheredParameters`
  between backward and step all see what they saw before: nothing the early step wrote is visible until
  `Engine.step` commits it. A kept gradient the commit consumed is dropped unwritten.
- **Seeds.** The updated copies of the last params backward completes (up to the live budget) are kept
  past their write; after a commit `Engine.step` hands them to `zswap.prefetch.Scheduler.seed`, so the
  next forward's first modules (the last of backward) start gathered, with no read — each only if nothing
  wrote its partition in between.
- **All or nothing.** Records and partitions are written copy-on-write into one `zswap.storage`
  transaction of its own; in-memory state never changes (the kernel updates a copy of the gathered param).
  `Engine.step` commits it only if nothing it depended on moved since: the set of params with gradients,
  the hyper-parameters of each param group, the step counters, the sub-group layout, the stored versions
  of every partition and record it read; and only if every write landed. Otherwise (or after any failure
  inside backward: a record read, the memory cap, a second gradient for a param) it is aborted — its
  staged versions freed — and the ordinary step runs, so a fault costs bytes, never a result.
- **Memory.** Param copies and gradients wait for the rest of their record (a record spans params
  backward completes at different times; a tied embedding completes last); past `cap` bytes held the early
  step gives up. The record buffers are the optimizer's own ring (idle in backward); every read and write
  using them has settled when backward ends.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd import Variable

from . import memory
from .gather import no_torch_function
from .gradstore import NvmeGrads
from .optim import OffloadedAdamW
from .optim._layout import SubGroup
from .optim._store import NvmeStore as RecordStore
from .params import NvmeStore, ParamState, Status, param_state
from .storage import Transaction, _memcpy

CAP_EXTRA = 256 << 20
"""Bytes of param copies and gradients the early step may hold beyond the live-param budget."""


def _hyper(opt: OffloadedAdamW) -> list[tuple[Any, ...]]:
    return [
        (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["decoupled_weight_decay"])
        for g in opt.param_groups
    ]


class EarlyStep:
    """Runs the optimizer update of each record in backward (see the module docstring). ``eligible()``:
    whether the engine's current settings let the ordinary step apply the gradients unscaled."""

    state: str
    task: int
    held: int
    seeds: deque[tuple[torch.Tensor, torch.Tensor]]
    seeded: int
    gs: NvmeGrads | None
    txn: Any
    hyper: list[tuple[Any, ...]]
    layout: tuple[SubGroup, ...]
    steps: list[int]
    by_param: dict[int, list[SubGroup]]
    waiting: dict[str, int]
    left: dict[int, int]
    ready: dict[int, tuple[ParamState, torch.Tensor, torch.Tensor, str | None]]
    versions: dict[str, str | None]
    ring: list[torch.Tensor]
    free: deque[torch.Tensor]
    reads: deque[tuple[SubGroup, torch.Tensor, torch.Tensor, Any]]
    writes: deque[tuple[torch.Tensor, Any]]

    def __init__(
        self,
        optimizer: OffloadedAdamW,
        eligible: Callable[[], bool],
        cap: int,
        seed_numel: int = 0,
        streamed: frozenset[int] = frozenset(),
    ) -> None:
        self.opt = optimizer
        self.eligible = eligible
        self.cap = cap
        self.seed_numel = seed_numel
        """Elements of updated params kept in memory for the next forward (the last ones backward
        completes: the first the next forward uses); see `take_seeds`."""
        self.streamed = streamed
        """ids of the params the scheduler streams (the only ones worth seeding)."""
        self._committed_seeds: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.records = cast(RecordStore, optimizer._store)  # for_engine: on NVMe
        self.index = {id(p): i for i, p in enumerate(optimizer._params)}
        self.commits = 0
        """Steps made live by `commit` (for tests and benchmarks)."""
        self.aborts = 0
        """Early steps begun and dropped."""
        self.holding = memory.Holding("early_step")  # gradients and small copies held (`_as_tensors`)
        self._reset()

    # -- backward side ---------------------------------------------------------------------------------

    def on_grad(self, p: torch.Tensor, st: ParamState, part: torch.Tensor) -> None:
        """A param's gradient for this backward is complete (``part`` is what its store keeps)."""
        task = int(torch._C._current_graph_task_id())
        try:
            self._on_grad(p, st, part, task)
        except Exception:
            self._give_up(task)  # an early step never breaks a backward: the ordinary step runs instead
        except BaseException:
            self.abort()
            raise

    def _give_up(self, task: int) -> None:
        """Drop what this backward did (freeing it now) and do nothing more until the next backward."""
        self.abort()
        self.state, self.task = "off", task

    def _on_grad(self, p: torch.Tensor, st: ParamState, part: torch.Tensor, task: int) -> None:
        if self.state != "idle" and task != self.task:
            self.abort()  # another backward: accumulation (then it does not begin), or the one before raised
        if self.state == "idle":
            self._begin(st, task)
        if self.state != "running":
            return
        i = self.index.get(id(p))
        if i is None or i not in self.opt._placed:
            return  # not stepped by this optimizer, or no record yet: the ordinary step will say
        if i in self.ready or st.status is not Status.AVAILABLE or st.world_size != 1:
            self._give_up(task)  # a second gradient for one param, or no gathered data to copy
            return
        data = p.data.reshape(-1)
        copy = self._alloc(st, data)
        with no_torch_function():
            _memcpy(copy, data)  # one thread: a torch copy here wakes its pool against the kernel's
        self.txn.scratch(copy)
        self.ready[i] = (st, copy, part.reshape(-1), _ps(st).ns._live.get(st.key))
        self.held += 2 * copy.numel() * copy.element_size()
        self.holding.add(_as_tensors(copy))
        if self.held > self.cap:
            self._give_up(task)
            return
        for sg in self.by_param.get(i, ()):
            self.waiting[sg.key] -= 1
            if self.waiting[sg.key] == 0:
                self._start(sg)
        self._pump(keep=1)

    def _begin(self, st: ParamState, task: int) -> None:
        gs = st.grad_store
        if task == -1:
            return  # a gradient added outside a backward
        if not isinstance(gs, NvmeGrads) or gs._meta or not self.eligible():
            self.state, self.task = "off", task  # accumulating onto earlier gradients, or not allowed now
            return
        self.task, self.gs, self.state = task, gs, "running"
        self.index = {id(p): i for i, p in enumerate(self.opt._params)}
        self.txn = Transaction()
        self.txn.uses(self.records.storage)
        self.hyper = _hyper(self.opt)
        self.layout = tuple(self.opt._sub_groups)
        self.steps = list(self.opt._steps)
        self.by_param = {}
        self.waiting = {}
        for sg in self.layout:
            self.waiting[sg.key] = len({s.param for s in sg.segments})
            for s in sg.segments:
                if sg not in self.by_param.setdefault(s.param, []):
                    self.by_param[s.param].append(sg)
        self.left = {i: len(sgs) for i, sgs in self.by_param.items()}
        Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        if self.state != "running":
            return
        try:
            for sg in self.layout:  # records whose other params got no gradient in this backward
                if self.waiting[sg.key] > 0 and any(s.param in self.ready for s in sg.segments):
                    self.waiting[sg.key] = 0
                    self._start(sg)
            self._pump(keep=0)
            while self.writes:
                self._land_oldest()
        except Exception:
            self.abort()

    def _alloc(self, st: ParamState, like: torch.Tensor) -> torch.Tensor:
        if like.numel() * like.element_size() >= ENGINE_COPY:  # page-aligned: written without a bounce copy
            with memory.purpose("early_step"):
                return _ps(st).engine.empty((like.numel(),), like.dtype)
        return torch.empty(like.numel(), dtype=like.dtype)

    def _start(self, sg: SubGroup) -> None:
        store = self.records
        if not self.free:
            if not self.ring:
                self.ring = list(store._buffers(max(s.record_numel for s in self.layout)))
                self.free.extend(self.ring)
                for buf in self.ring:
                    self.txn.scratch(buf)
            while not self.free:
                if self.writes:
                    self._land_oldest()
                else:
                    self._pump(keep=0)
        buf = self.free.popleft()
        rec = buf[: sg.record_numel]
        name = store._name(sg)
        self.versions[name] = store.ns._live.get(name)
        handle = store.ns.read(name, rec, self.txn) if store.ns.has(name, self.txn) else None
        if handle is None:
            rec.zero_()
        self.reads.append((sg, buf, rec, handle))

    def _pump(self, keep: int) -> None:
        """Update and write the records read so far, leaving at most ``keep`` reads in flight."""
        while len(self.reads) > keep:
            sg, buf, rec, handle = self.reads.popleft()
            if handle is not None:
                handle.wait()
            steps = {s.param: self.steps[s.param] + 1 for s in sg.segments if s.param in self.ready}
            grads = {i: self.ready[i][2] for i in steps}
            targets = {i: self.ready[i][1] for i in steps}
            self.opt._update(sg, rec, steps, grads, 1.0, self.txn, targets=targets)
            store = self.records
            self.writes.append((buf, store.ns.put(store._name(sg), rec, self.txn, held=0)))  # a ring slot
            for i in steps:
                self.left[i] -= 1
                if self.left[i] == 0:
                    st, copy, _, _ = self.ready[i]
                    _ps(st).ns.put(st.key, copy, self.txn)
                    self.held -= copy.numel() * copy.element_size()
                    self.holding.add(-copy.numel() * copy.element_size())  # the gradient
                    self.ready[i] = (st, _empty, _empty, self.ready[i][3])  # the queue holds the copy
                    self._seed(i, copy)

    def _seed(self, i: int, copy: torch.Tensor) -> None:
        """Keep ``copy`` (param ``i``'s updated partition) as a seed if it is among the last
        ``seed_numel`` elements completed; the oldest seeds go first."""
        nbytes = copy.numel() * copy.element_size()
        p = self.opt._params[i]
        if id(p) in self.streamed and copy.numel() <= self.seed_numel:
            self.seeds.append((p, copy))
            self.seeded += copy.numel()
        else:
            self.held -= nbytes
            self.holding.add(-_small(copy))
        while self.seeded > self.seed_numel:
            _, old = self.seeds.popleft()
            self.seeded -= old.numel()
            self.held -= old.numel() * old.element_size()
            self.holding.add(-_small(old))

    def _land_oldest(self) -> None:
        buf, w = self.writes.popleft()
        w.settle()
        self.free.append(buf)
        self.txn.check()

    # -- step side -------------------------------------------------------------------------------------

    def commit(self, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
        """Make the early step live if it is exactly the step `Engine.step` would take now (see the
        module docstring); True if it did. Otherwise it is dropped and the caller steps as usual."""
        if self.state != "running":
            self.abort()
            return False
        ok = (
            self.eligible()
            and not self.reads
            and not self.writes
            and _hyper(self.opt) == self.hyper
            and tuple(self.opt._sub_groups) == self.layout
            and list(self.opt._steps) == self.steps
            and self._same_grads(items)
            and self._same_versions()
        )
        if not ok:
            self.abort()
            return False
        txn, ready, steps, seeds = self.txn, self.ready, self.steps, list(self.seeds)

        def counters() -> None:
            for i in ready:
                self.opt._steps[i] = steps[i] + 1
            self.opt.last_grad_norm = None

        txn.on_commit(counters)
        self._reset()
        try:
            txn.commit()
        except Exception:
            self.aborts += 1  # commit aborted itself: nothing changed
            return False
        self.commits += 1
        self._committed_seeds = seeds
        return True

    def take_seeds(self) -> list[tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]]:
        """(param, its updated partition, still valid) for the params the last `commit` made live whose
        new value is still in memory; ``still_valid()`` is false once anything wrote the partition since
        (a `GatheredParameters` write-back, a checkpoint load). `zswap.prefetch.Scheduler.seed` gathers
        them from it when the next pass begins."""
        seeds, self._committed_seeds = self._committed_seeds, []
        out: list[tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]] = []
        for p, copy in seeds:
            st = param_state(p)
            if st is not None:
                ns = _ps(st).ns
                out.append((p, copy, _unchanged(ns, st.key, ns._live.get(st.key))))
        return out

    def _same_grads(self, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
        with_grad = {
            self.index.get(id(p)) for p, st in items if st.grad_store is not None and st.grad_store.has(st)
        }
        with_grad.discard(None)
        return with_grad == set(self.ready) and all(self.left[i] == 0 for i in self.ready)

    def _same_versions(self) -> bool:
        store = self.records
        for name, physical in self.versions.items():
            if store.ns._live.get(name) != physical or name in store.ns._pending:
                return False
        for st, _, _, physical in self.ready.values():
            ns = _ps(st).ns
            if ns._live.get(st.key) != physical or st.key in ns._pending:
                return False
        return True

    def abort(self) -> None:
        """Drop the early step in progress (its staged writes are freed). Idempotent."""
        txn = self.txn
        if txn is not None:
            self.aborts += 1
            for _, _, _, handle in self.reads:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.wait()
            txn.abort()
        self._reset()

    def _reset(self) -> None:
        self.holding.clear()
        self.state = "idle"
        self.task = -1
        self.gs = None
        self.txn = None
        self.hyper = []
        self.layout = ()
        self.steps = []
        self.by_param = {}
        self.waiting = {}
        self.left = {}
        self.ready = {}
        self.versions = {}
        self.held = 0
        self.seeds = deque()
        self.seeded = 0
        self.ring = []
        self.free = deque()
        self.reads = deque()
        self.writes = deque()


_empty = torch.empty(0)

ENGINE_COPY = 1 << 20
"""Bytes from which a param copy is an engine buffer (`zswap.memory` purpose "early_step")."""


def _small(copy: torch.Tensor) -> int:
    """Bytes of a param copy that is an ordinary tensor (under `ENGINE_COPY`), else 0."""
    nbytes = copy.numel() * copy.element_size()
    return nbytes if nbytes < ENGINE_COPY else 0


def _as_tensors(copy: torch.Tensor) -> int:
    """Bytes one ready param holds as ordinary tensors: its gradient, and its copy under `ENGINE_COPY`
    (the copy's share is let go when it is written and not kept as a seed, or when its seed goes)."""
    return copy.numel() * copy.element_size() + _small(copy)


def _unchanged(ns: Any, key: str, physical: str | None) -> Callable[[], bool]:
    """Whether ``key``'s stored value is still ``physical`` (nothing wrote it since)."""
    return lambda: physical is not None and ns._live.get(key) == physical and key not in ns._pending


def _ps(st: ParamState) -> NvmeStore:
    return cast(NvmeStore, st.store)  # for_engine: every managed param is on NVMe


def for_engine(engine: Any) -> EarlyStep | None:
    """The early step for a `zswap.Engine` whose setup allows one (see the module docstring), else None."""
    opt = engine.optimizer
    if not isinstance(opt, OffloadedAdamW) or opt.tier != "nvme" or not engine.compute_device.passthrough:
        return None
    if not engine._items or any(
        not isinstance(st.store, NvmeStore) or not isinstance(st.grad_store, NvmeGrads) or st.world_size != 1
        for _, st in engine._items
    ):
        return None
    ids = engine._ids

    def eligible() -> bool:
        return (
            engine.early_step
            and engine.max_grad_norm is None
            and opt.max_grad_norm is None
            and not engine._fp16
            and engine.loss_scaler is None
            and engine._gas == 1
            and engine.optimizer is opt
            and not any(p.requires_grad for p in engine.module.parameters() if id(p) not in ids)
        )

    size = max(st.dtype.itemsize for _, st in engine._items)
    streamed = frozenset(id(s.p) for s in engine._slots.values() if not s.persistent)
    return EarlyStep(
        opt,
        eligible,
        (engine.sizing.budget.max_live + engine.sizing.persistent) * size + CAP_EXTRA,
        streamed=streamed,  # seeds stay off (seed_numel 0): at the live budget they cost that much memory
        # on top of the bound (benches/README.md, "Bytes per step")
    )
