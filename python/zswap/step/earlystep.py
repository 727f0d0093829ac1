"""The early step: `OffloadedAdamW` updates run inside backward, as each record's gradients are complete, and
are made live by `Engine.step` — or dropped, and the step runs as usual.

Why: with params, gradients and AdamW states on NVMe, an ordinary step reads every param partition, its
gradient and its record, and writes the record and the partition back, while in backward the param is still
gathered and its gradient is there: updating then saves reading both (benches/README.md, "Training step").
States, params or both in CPU memory run it too (`zswap.step.early_memory`): the step's param reads are
saved where params are on NVMe, and the update overlaps backward wherever they are.

What it keeps:

- **Results.** The same kernel runs on the same bytes — the gathered param's partition (this rank's slice
  of it; on a compute device copied to the host first, `zswap.step.early_device`), the gradient the store
  would hold (with accumulation, the stored sum), the same hyper-parameters and step counts — so params and
  records are bitwise those of the ordinary step. What the step decides from every gradient (the clip
  factor, the overflow check) is speculated and checked at the step (`zswap.step.speculation`).
- **Gradients it applies are not stored** where the step cannot need them (no clipping, no accumulation,
  ``Engine.keep_applied_grads`` false): the store only notes that the param has one (`NvmeGrads.applied`),
  with its norm. Giving up in backward *before* it let go of any hands the gradients it holds to their
  store and the ordinary step runs; *after*, that backward raises (`GradientsNotKeptError`, or the
  `SwapIOError` of the failed transfer) and counts for nothing. Between backward and step, whatever would
  drop the early step — a second backward, a change of hyper-parameters, counters, sub-groups or settings,
  a partition or record written, a failed commit — raises `GradientsNotKeptError` where gradients were let
  go, and changes nothing; until `Engine.zero_grad` every `Engine.step` raises (`check_kept`). Where the
  step may need them (`Guess.keep`) they are stored too, in memory within ``room`` (written past it).
- **All or nothing.** Records and partitions are written copy-on-write into one `zswap.store.storage`
  transaction of its own; in-memory state never changes (the kernel updates copies; those of records and
  partitions in CPU memory are swapped into their store by the commit, `early_memory`). `Engine.step`
  commits it only if nothing it depended on moved since (`early_commit.prepare`): the params with
  gradients, each param group's hyper-parameters, the step counters, the sub-group layout, the stored
  versions of every partition and record it read, and every write landed.
- **Seeds.** Updated copies of the params the next pass would start gathered (`Scheduler.seed_plan`) are
  kept past their write and handed to `zswap.fetch.prefetch.Scheduler.seed` after the commit, so the next
  forward starts without a read; in a micro-batch before an accumulation boundary the same params are kept
  as they are (`take_micro_seeds`; on a device, copied to the host). Resident params keep their updated
  copies as their gathered copies (`take_resident`).
- **Memory.** Param copies and gradients wait for the rest of their record; past `cap` bytes held (with
  the copies kept in CPU memory for the commit, reserved as backward begins: where those of every param
  would not fit, only a part is updated, `early_memory.plan_part`) it lets go of seeds and waits for its
  writes, then gives up — so it does not begin where one record's copies and gradients pass the cap, and
  keeps the gradients it applies where two at once might (``thin``). A param with a
  float32 master (bf16 / fp16 past its first step) has no copy taken: the update only writes it, into a
  buffer taken then (`early_memory.copy_of`). The record
  buffers are the optimizer's own ring. Copies' writes are bounded by the early step itself (``write_ahead``:
  two sub-groups' params in flight). Copies of `ENGINE_COPY` bytes and more are buffers of the NVMe param
  stores' fetch pools, counted in the scheduler's live budget while held (`lent`); the others are ordinary
  tensors on `holding` / `writing` / `kept_mem`, so `zswap.Engine.stats` has every byte on one line.
- **Reads ahead.** A record is read before its last gradient comes, into a free slot of the ring, in the
  order the last backward completed them (`early_pipeline.read_ahead`; all slots but one).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd import Variable

from .. import memory
from ..errors import GradientsNotKeptError, SwapIOError
from ..fetch.nextpass import Seed
from ..gradients.gradstore import NOT_KEPT, RESTART, MemoryGrads, NvmeGrads, _Alive, _dead, store_of
from ..memory import ENGINE_COPY as ENGINE_COPY  # (tests and docs name it here)
from ..parts.params import GradStore, ParamState, Status, local_slice
from ..store.storage import Transaction
from . import early_commit, early_device, early_memory, early_pipeline, nesting
from .early_commit import _wanted
from .early_memory import plain
from .optim import OffloadedAdamW
from .optim._layout import SubGroup
from .speculation import ACCUMULATES, MICRO_BATCH, Guess
from .stepping import Tally

CAP_EXTRA = 256 << 20
"""Bytes of param copies and gradients the early step may hold beyond the live-param budget."""


class EarlyStep:
    """Runs the optimizer update of each record in backward (see the module docstring)."""

    state: str
    task: int
    held: int
    seeds: deque[tuple[torch.Tensor, torch.Tensor]]
    seeded: int
    keeping: bool
    dropped: int
    """Gradients of this backward applied and let go without being stored (``keeping`` false)."""
    micro: list[tuple[torch.Tensor, torch.Tensor, str | None]]
    """Copies of params kept before an accumulation boundary for the next forward (`keep_as_seed`)."""
    micro_copies: list[Any]  # (device, copy): a compute device's to the host, landing (`landed_micro`)
    staying: frozenset[int]
    """`resident()` when this backward began."""
    masters: frozenset[int]
    """Params (optimizer indices) the update only writes: copies made at it (`early_memory.copy_of`)."""
    kept: list[tuple[torch.Tensor, torch.Tensor]]
    """Updated copies of resident params, kept for `take_resident`."""
    seeding: frozenset[int]
    """ids of the params whose updated copies are kept as seeds (`seed_plan`, at backward's start)."""
    guess: Guess
    factor: float | None
    """The gradient scale the updates run with: the guess's, or, deferred, the step's (`finish_at`)."""
    gs: GradStore | None
    txn: Any
    layout: tuple[SubGroup, ...]
    steps: list[int]
    by_param: dict[int, list[SubGroup]]
    waiting: dict[str, int]
    landing: deque[tuple[int, ParamState, Any, Any, str | None]]  # a device's copies in flight
    device: Any
    left: dict[int, int]
    ready: dict[int, tuple[ParamState, torch.Tensor, torch.Tensor, Any]]
    versions: dict[str, Any]
    ring: list[torch.Tensor]
    free: deque[torch.Tensor]
    reads: deque[tuple[SubGroup, torch.Tensor, torch.Tensor, Any]]
    """Records of complete sub-groups, read or being read, in the order they are updated."""
    early: dict[str, tuple[SubGroup, torch.Tensor, torch.Tensor, Any]]
    """Records read ahead for sub-groups still waiting for gradients (`early_pipeline.read_ahead`)."""
    upcoming: deque[SubGroup]
    """Sub-groups to read ahead, next first."""
    order: list[str]
    """Sub-group keys in the order this backward completed them."""
    writes: deque[tuple[torch.Tensor, Any]]
    copies: deque[tuple[int, int, Any]]
    write_ahead: int
    """Bytes of copies' writes in flight before backward waits for the oldest: two sub-groups' params."""
    copying: int
    """Bytes of updated param copies whose writes are in flight (`copies`: bytes, of them under
    `ENGINE_COPY`, write; a seed's are 0, it stays in ``held``), counted with ``held`` against `cap` until
    they land. Those under `ENGINE_COPY` are ordinary tensors, on `writing`; the others are fetch-pool
    buffers, lent to the scheduler while their write is unsettled (`in_flight`, `lent`)."""
    staged: int
    """Bytes reserved for copies kept in CPU memory until the commit (`zswap.step.early_memory`)."""
    swaps: list[tuple[Any, str, torch.Tensor]]
    """Those copies, with the store and key each replaces at the commit (`early_memory.swap_in`)."""
    passed: set[int]
    """Params not held: those ``outside`` that got a gradient and, deferred, those whose gradient came
    once the copies and gradients held had reached `cap` (and every later one: ``capped``). Their records
    take the ordinary step in the commit (`early_commit.ordinary_part`), from their stored gradients."""
    earlier: frozenset[int]
    """Params whose gradients earlier micro-batches of this step left in their store, as backward began:
    one this backward gives none arrives at its end with that sum (`early_pipeline.late_sums`)."""
    outside: frozenset[int]
    """Params outside the part this backward updates (`early_memory.plan_part`; none where all fit)."""
    capped: bool
    """Deferred, the copies and gradients held reached `cap`: every later param is passed."""
    part_why: str
    """Why ``outside`` is not empty ("" where it is)."""
    thin: bool
    """Two records' param copies and gradients may not fit `cap` at once: the gradients it applies are
    stored too, so that giving up for room falls back to the ordinary step (`early_memory.plan_part`)."""

    def __init__(
        self,
        optimizer: OffloadedAdamW,
        plan: Callable[[], Guess | str],
        cap: int,
        seed_numel: int = 0,
        seed_plan: Callable[[], frozenset[int]] = frozenset,
        keep: Callable[[], bool] = lambda: True,
        room: Callable[[], int] = lambda: 0,
        tally: Tally | None = None,
        resident: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        tally = Tally() if tally is None else tally
        self.opt = optimizer
        self.plan = plan
        """The `Guess` for the next step, or why no early step can run for it."""
        self.cap = cap
        self.room = room
        """``room()``: bytes of gradients kept in memory past the stash where the step may need them
        (`Guess.keep`) or before an accumulation boundary; read into ``allowance`` as a backward begins."""
        self.allowance = 0
        self.resident = resident
        """ids of the params kept gathered between passes (persistent, ``max_in_cpu``): their updated
        copies become their gathered copies at the commit (`take_resident`), read no more."""
        self._committed_resident: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seed_numel = seed_numel
        """Elements of updated params kept in memory for the next forward at most (0: none)."""
        self.seed_plan = seed_plan
        """ids of the params the next pass would take as seeds (`zswap.prefetch.Scheduler.seed_plan`):
        only their copies are kept, so nothing is held for a seed that would be trimmed later."""
        self.keep = keep
        """Whether the gradients it applies are stored too (``Engine.keep_applied_grads``), read once per
        backward at its first gradient."""
        self.lost = ""
        """Why the last early step was dropped after it had let go of gradients it did not keep (those
        gradients are gone until `Engine.zero_grad`); "" when none were lost."""
        self._committed_seeds: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.records: Any = optimizer.records.store  # on NVMe or in CPU memory (`early_memory`)
        self.index = {id(p): i for i, p in enumerate(optimizer.records.params)}
        self.commits = 0
        """Steps made live by `commit` (for tests and benchmarks)."""
        self.aborts = 0
        """Early steps begun and dropped."""
        self.tally = tally
        """Where `commit` counts the early steps it drops at the step (``redone``, ``overflow``)."""
        self.why = ""
        """Why the last step was not made live by `commit` ("" if it was, or none ran yet)."""
        self.read_ahead = self.read_late = self.read_unused = 0
        """Records read before their last gradient (`early_pipeline.read_ahead`), at it, and read ahead
        for nothing (no param of theirs got a gradient)."""
        self._order: list[str] = []
        """The order the last backward that reached its end completed its records in: the next one's guess."""
        self.holding = memory.Holding("early_step")  # gradients and plain copies held (`plain`)
        self.writing = memory.Holding("early_step")  # small copies whose writes are in flight (`copies`)
        self.kept_mem = memory.Holding("early_step")  # copies kept in CPU memory for the commit (`swaps`)
        self._outer: Callable[[], object] = _dead  # the backward in progress, while it runs (`_watch`)
        self.arrivals = nesting.Arrivals()
        self.ended = True
        """Whether that backward reached its end (its final callback ran)."""
        self.accumulates = False
        """A second backward came before `Engine.step` with ``gradient_accumulation_steps`` 1: none is
        begun any more (`speculation.ACCUMULATES`)."""
        self.begun_hyper: tuple[list[tuple[Any, ...]], list[int]] | None = None
        """`early_commit.hyper_seen` when the last backward began (`_begin`), for `prepare`."""
        self.rehyper: list[int] = []
        """Param groups whose lr, eps or decoupled weight decay changed since backward (`early_rehyper`)."""
        self.hypers_moved = False
        """The last step found them assigned since its backward began (an lr set between ``backward`` and
        ``step``, even to the same value): the next step's update waits for the step (`speculation`)."""
        self._reset()

    # -- backward side ---------------------------------------------------------------------------------

    def on_grad(self, p: torch.Tensor, st: ParamState, part: torch.Tensor, sink: Any = None) -> bool:
        """A param's gradient for this backward is complete. True: it is placed (held by the early step,
        and stored too where gradients are kept); False: the caller stores it (``store.add``, or on a
        compute device ``sink``'s landing). ``sink``: the `zswap.gradients.grads.GradSink` of a compute
        device, where ``part`` and the gathered param are on the device (`zswap.step.early_device`)."""
        task = int(torch._C._current_graph_task_id())
        try:
            try:
                return self._on_grad(p, st, part, task, sink)
            except (_Void, GradientsNotKeptError):
                raise
            except Exception as exc:
                # An early step never breaks a backward it can fall back from: the ordinary step runs.
                self._give_up(task, f"it failed in backward ({exc})", exc)
                return False
        except _Void as void:
            raise void.error from void.error.__cause__  # no falling back: this backward counts for nothing
        except BaseException:
            self.abort()
            raise

    def take_micro_seeds(self) -> list[Seed]:
        """At a micro-step (no optimizer step): the copies `early_pipeline.keep_as_seed` made, each valid
        while nothing wrote its partition, for `zswap.fetch.prefetch.Scheduler.seed`."""
        micro = early_pipeline.landed_micro(self) if self.state == "summing" and self.ended else []
        self._reset()
        return early_commit.unchanged_seeds(micro)

    def summing_room(self) -> int:
        """``allowance`` in a micro-batch before the accumulation boundary or past a deferred step's cap,
        else 0 (device landings)."""
        deferred = self.state == "running" and self.factor is None
        return self.allowance if self.state == "summing" or deferred else 0

    def _give_up(
        self,
        task: int,
        why: str,
        exc: BaseException | None = None,
        also: tuple[ParamState, torch.Tensor] | None = None,
    ) -> None:
        """Drop what this backward did (freeing it now) and do nothing more until the next backward. The
        gradients it holds (and ``also``, one it took but does not hold yet) go to their store: the
        ordinary step needs them. If it already let go of one it did not keep there is no falling back:
        raises `_Void` with the error this backward raises (it then counts for nothing)."""
        gs, dropped = self.gs, self.dropped
        held = early_commit.held_grads(self)
        if also is not None:
            held.append(also)
        landed = early_device.drain(self)  # neither stored nor applied yet: to the store in any case
        self.abort()
        self.state, self.task, self.why = "off", task, why
        if dropped:
            if isinstance(exc, SwapIOError):  # as any failed transfer of backward: run it again
                raise _Void(exc)
            _wanted(gs)
            error = GradientsNotKeptError(
                f"the early step had to stop in this backward ({why}) after it had applied gradients it did "
                f"not keep {NOT_KEPT}, so it cannot fall back to the ordinary step: this backward counts for "
                f"nothing. {RESTART}"
            )
            error.__cause__ = exc
            raise _Void(error)
        early_commit.hand_back(gs, held)  # still in memory: stored now, as they would have been
        for st, g in landed:
            store_of(st).add_fp32(st, g)

    def _on_grad(self, p: torch.Tensor, st: ParamState, part: torch.Tensor, task: int, sink: Any) -> bool:
        if self.state != "idle" and task != self.task and self._outer() is not None:
            task = self.task  # a backward run inside the one in progress: its gradients (`nesting`)
        if self.state != "idle" and task != self.task:
            if task < self.task and self.why == nesting.INSIDE:  # the backward the last one ran inside goes
                self.task = task  # on (task ids grow): off to its end
                self._watch()
                return False
            if self.state == "running" and self.ended:
                self.accumulates = True  # from now on the update waits for the step (`_begin`)
            if self.state == "running" and self.dropped and self.ended:
                early_commit.second_backward(self, task)
            if self.state == "running" and self.ended:  # deferred: its gradients go to their store first
                early_commit.drop(self, "a second backward ran before engine.step()")
            self.abort()  # another backward: accumulation (then it does not begin), or the one before raised
        if self.state == "idle":
            self._begin(st, task)
        self.arrivals.note(id(p))
        if self.state == "summing":  # before the boundary: summed in memory within `room` (or landed)
            if id(p) in self.seeding and st.status is Status.AVAILABLE:
                early_pipeline.keep_as_seed(self, p, st, sink)  # (`seeding` has NVMe params only)
            if sink is None:
                store_of(st).add(st, part, self.allowance)
            return sink is None
        if self.state != "running":
            return False
        i = self.index.get(id(p))
        if i is None:
            return False  # not stepped by this optimizer: the ordinary step will say
        if not self.opt.records.placed(i):
            if self.opt.records.sub_groups:  # a first gradient after the first step (an expert, a branch):
                self.passed.add(i)  # its record is made by the ordinary step in this commit (`ordinary_part`)
                self.part_why = self.part_why or "a param got its first gradient"
            return False
        if i in self.ready or st.status is not Status.AVAILABLE:
            why = "a second gradient for one param" if i in self.ready else "a param not gathered"
            self._give_up(task, why)
            return False
        if early_commit.passes(self, i, early_memory.holds(self, i, st)):  # for the ordinary part
            if sink is None:
                store_of(st).add(st, part, self.allowance)  # (a device's lands within `summing_room`)
            return sink is None
        if sink is not None:
            early_device.take_later(self, i, p, st, part, sink)
            return True
        total = self._place(st, part, cast(NvmeGrads, self.gs).add)
        if total is None:
            return True
        try:
            self._take(i, p, st, total, task)
        except _Void:
            raise
        except Exception as exc:
            also = None if i in self.ready or self.keeping else (st, part)
            self._give_up(task, f"it failed in backward ({exc})", exc, also)
        return True

    def _place(self, st: ParamState, part: torch.Tensor, add: Callable[..., Any]) -> torch.Tensor | None:
        """Give this backward's gradient to its store: stored by ``add`` (``NvmeGrads.add``, or
        ``add_fp32`` where it landed from a device) where gradients are kept — the stored sum (with earlier
        micro-batches') is what is applied, read only — else only noted as applied (`_give_up` hands it
        back from here on). The gradient to apply; ``None`` once this backward's writes failed (its end
        raises; the early step gave up)."""
        if not self.keeping:
            cast(NvmeGrads, self.gs).applied(st, part, norm=self.factor is None)  # deferred: read no more
            return part
        stored = add(st, part, self.allowance if self.guess.keep else 0)
        if stored is None:
            self._give_up(self.task, "a gradient write failed")
        return stored

    def _take(self, i: int, p: torch.Tensor, st: ParamState, part: torch.Tensor, task: int) -> None:
        data = p.data.reshape(-1)
        if st.world_size > 1:  # this rank's partition: its slice, zero past the param's end as stored
            data = local_slice(data, st.rank, st.partition_numel)
        self._arrive(i, st, early_memory.copy_of(self, i, st, data), part, early_memory.version(st), task)

    def _arrive(
        self, i: int, st: ParamState, copy: torch.Tensor, part: torch.Tensor, version: Any, task: int
    ) -> None:
        """Param ``i``'s partition (``copy``, ours to update) and gradient are on the host: wait for the
        rest of its records, update those that are complete."""
        if early_commit.passes(self, i, early_memory.held_bytes(copy), landed=True):  # a device's
            if not self.keeping:
                early_commit.hand_back(self.gs, [(st, part)], self.allowance)  # noted as applied: stored
            return
        if not copy.is_meta:  # (a copy made at the update: `early_memory.copy_of`)
            self.txn.scratch(copy)
        self.ready[i] = (st, copy, part.reshape(-1), version)
        self.held += early_memory.held_bytes(copy)
        self.holding.add(copy.numel() * copy.element_size() + plain(st, copy))  # gradient, plain copy
        self._land_copies(self.write_ahead)
        if self.factor is not None:  # (deferred, every record is updated at the step: `finish_at`)
            for sg in self.by_param.get(i, ()):  # first: what this gradient completes frees room
                self.waiting[sg.key] -= 1
                if self.waiting[sg.key] == 0:
                    self._ready(sg)
                elif sg.key not in self.early:
                    self.upcoming.appendleft(sg)  # its other params come next: read it before the planned
        if self.held + self.copying + self.staged > self.cap:
            early_pipeline.make_room(self)
        if self.held + self.copying + self.staged > self.cap:
            self._give_up(
                task, f"it held more than its cap of {self.cap} bytes of param copies and gradients"
            )
            return
        if self.factor is None:
            return
        self._pump(keep=1)
        early_pipeline.read_ahead(self)

    def _begin(self, st: ParamState, task: int) -> None:
        gs = store_of(st)
        if task == -1:
            return  # a gradient added outside a backward
        self.begun_hyper = early_commit.hyper_seen(self.opt)
        self._watch()
        parts = self.arrivals.begin()
        guess = self.plan()
        self.allowance = self.room()
        if isinstance(guess, str):
            self.state, self.task, self.why = "off", task, guess
            if guess == MICRO_BATCH and isinstance(gs, NvmeGrads | MemoryGrads):
                self.state = "summing"  # and the next forward's first params kept as they are (seeds)
                self.seeding = early_memory.on_nvme(self.seed_plan() if self.seed_numel > 0 else frozenset())
            return
        if parts or nesting.inside_function_backward():
            self.state, self.task, self.why = "off", task, nesting.PARTS if parts else nesting.INSIDE
            return
        if self.accumulates and not guess.sums:
            self.state, self.task, self.why = "off", task, ACCUMULATES
            return
        again = early_memory.has_grads(self, gs) and not guess.sums  # a second backward before the step
        if isinstance(gs, NvmeGrads) and again:
            gs.wanted = True  # "auto" keeps applied gradients from now on
        if again:
            self.state, self.task = "off", task
            self.why = "a second backward before engine.step() (gradient_accumulation_steps is 1)"
            return
        early_pipeline.plan(self)
        too_big = early_memory.plan_part(self, deferred=guess.factor is None)
        if too_big:
            self.state, self.task, self.why = "off", task, too_big
            return
        self.task, self.gs, self.state, self.guess = task, gs, "running", guess
        self.factor = guess.factor
        self.keeping = guess.keep or early_memory.keeps(gs) or bool(self.keep()) or self.thin
        self.lost = ""
        seeds = self.seed_plan() if self.seed_numel > 0 else ()
        self.seeding = early_memory.on_nvme(seeds)
        self.staying = self.resident()
        self.index = {id(p): i for i, p in enumerate(self.opt.records.params)}
        self.earlier = early_memory.summed(self) if guess.sums else frozenset()
        self.txn = Transaction()
        early_memory.uses(self)

    def _watch(self) -> None:
        """Call `_end_backward` at the end of the backward running now. The callback holds ``alive`` until
        autograd drops it with its graph task: at the end of this backward, or when it raised. While it is
        held, a gradient of another task is of a backward run inside this one, not of the next."""
        alive = _Alive()
        self._outer, self.ended = weakref.ref(alive), False
        Variable._execution_engine.queue_callback(lambda: self._end_backward(alive))

    def _end_backward(self, alive: object = None) -> None:
        self._outer, self.ended = _dead, True
        if self.state != "running":
            return
        try:
            early_device.land(self, block=True)  # a compute device's last copies
            if self.state == "running":  # (deferred: held to the step, as every other param)
                early_pipeline.late_sums(self)
            if self.state == "running" and self.factor is not None:
                early_pipeline.finish(self)
        except Exception as exc:
            try:
                self._give_up(self.task, f"it failed at the end of backward ({exc})", exc)
            except _Void as void:
                raise void.error from void.error.__cause__

    def finish_at(self, scale: float) -> None:
        """A deferred early step (`Guess.factor` None): update every record now, with ``scale``, from the
        copies and gradients held since backward. A failure gives up as in backward (the gradients go to
        their store, or, once one was let go, the error is raised)."""
        self.factor = scale
        try:
            early_pipeline.finish(self)
        except Exception as exc:
            try:
                self._give_up(self.task, f"it failed at the step ({exc})", exc)
            except _Void as void:
                raise void.error from void.error.__cause__

    def _ready(self, sg: SubGroup) -> None:
        """Every param of ``sg`` with a gradient has it: its record is updated once read."""
        entry = self.early.pop(sg.key, None)
        if entry is None:
            self.read_late += 1
            entry = self._start(sg)
        self.reads.append(entry)
        self.order.append(sg.key)

    def _start(self, sg: SubGroup) -> tuple[SubGroup, torch.Tensor, torch.Tensor, Any]:
        return early_pipeline.start(self, sg)

    def _pump(self, keep: int) -> None:
        return early_pipeline.pump(self, keep)

    def _land_copies(self, limit: int) -> None:
        return early_pipeline.land_copies(self, limit)

    def pooled(self) -> int:
        """Bytes of the params' fetch pool it holds now: its param copies of `ENGINE_COPY` bytes or more,
        waiting for their record or kept as seeds (the rest of `held` is ordinary tensors, `holding`).
        `zswap.prefetch.Scheduler.lent` counts them against the live budget."""
        return self.held - self.holding.nbytes

    def in_flight(self) -> int:
        """Bytes of its param copies of `ENGINE_COPY` bytes or more (fetch-pool buffers) whose writes have
        not settled: the write still holds them. A write another one's push settled (`zswap.storage`'s
        queue settles landed writes at its head) let go of its copy already, so it is not counted."""
        return sum(n - small for n, small, w in self.copies if not w.settled)

    def settle(self) -> None:
        """Land the copies being written now (`in_flight` becomes 0), for the scheduler when its live
        budget is full (`zswap.prefetch.Scheduler.settle_lent`). A failed write is not raised here, in the
        scheduler's call: the transaction keeps it, and the next landing, backward's end or the commit
        reports it as any failed write of the early step."""
        if self.txn is None:
            return
        with contextlib.suppress(Exception):
            self._land_copies(0)

    def lent(self) -> int:
        """Bytes of the params' fetch pool it holds now: `pooled` (copies waiting for their record, seeds)
        and `in_flight` (copies being written). `zswap.prefetch.Scheduler.lent` counts them against the
        live budget, so gathered params, reads in flight and these never exceed it together."""
        return self.pooled() + self.in_flight()

    def _land_oldest(self) -> None:
        return early_pipeline.land_oldest(self)

    # -- step side -------------------------------------------------------------------------------------

    def prepare(self, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
        return early_commit.prepare(self, items)

    def commit(self, scale: float | None, ordinary: early_commit.Ordinary | None = None) -> bool:
        return early_commit.commit(self, scale, ordinary)

    def take_seeds(self) -> list[Seed]:
        return early_commit.take_seeds(self)

    def take_resident(self) -> dict[int, torch.Tensor]:
        """{id(param): its partition as the last `commit` made it live} for the resident params it
        updated (`resident`)."""
        out, self._committed_resident = {id(p): c for p, c in self._committed_resident}, []
        return out

    def check_kept(self, items: list[tuple[torch.Tensor, ParamState]]) -> None:
        return early_commit.check_kept(self, items)

    def zero_grad(self) -> None:
        """`Engine.zero_grad`: drop the early step in progress; gradients dropped between a backward and
        its step start a new window, so summing seen before no longer counts (`accumulates`)."""
        if self.state != "idle":
            self.accumulates = False
        self.abort()

    def abort(self) -> None:
        """Drop the early step in progress (its staged writes are freed). Idempotent."""
        with contextlib.suppress(Exception):
            early_device.drain(self)
        txn = self.txn
        if txn is not None:
            self.aborts += 1
            for _, _, _, handle in [*self.reads, *self.early.values()]:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.wait()
            txn.abort()
        self._reset()

    def _reset(self) -> None:
        return early_commit.reset(self)


class _Void(Exception):
    """`EarlyStep._give_up` could not fall back: ``error`` is what this backward raises."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
