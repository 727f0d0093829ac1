"""Which params are gathered when: holds, the recorded trace, prefetch ahead of use, and the live budget.

Every fetch request of an iteration (a module's forward or backward needing its params) is a *step*. Every
iteration is recorded; one of a kind (grad mode × train/eval) already seen follows the recording. After a
step's params are gathered, the swap-ins of the next steps' params are issued (async engine reads) up to
``bucket`` elements not yet consumed, so they load while the current module computes; when a step needs a
param whose read is in flight, only the rest of the read is waited for (a *hit*). A step that differs from
the recording (a data-dependent branch) stops prefetch for the rest of the iteration — its params are
fetched on demand — and the iteration's own recording replaces the old one.

The first iteration of a kind follows a *guess* instead (`Scheduler.order`: the modules in registration
order, ``model.modules()``, the order the hooks were installed; with grad on, their backwards follow in the
reverse order). The guess is followed leniently: a step found further on within what is already prefetched
moves the position there (prefetches of the steps passed over that no later guessed step uses are
cancelled); any other step is served on demand without leaving the guess. At the first backward step the
rest of the guess is rebuilt from the forward just recorded (backwards in the reverse order of the
forwards), which is what autograd runs. A wrong guess thus costs a cancelled read and a demand fetch; it
can never change a value, since data is only ever read from the store when a step is served.

A param is gathered while any step holds it; when the last hold goes it is released, unless it is
*persistent* (at most the persistence threshold's elements: gathered once, kept) or its next use on the
trace comes within ``reuse_distance`` elements of fetches, or forward keeps it for its backward (neither
with ``reuse_distance`` and ``bucket`` both 0: DeepSpeed's release after each use). Gathered params
(persistent ones aside), reads in flight, and the fetch-pool memory held outside the scheduler
(`Scheduler.lent`: what each `Lender` registered with `Scheduler.lend` holds — in backward, the early
step's param copies waiting for their record, being written, or kept as seeds, `zswap.step.earlystep`)
never exceed ``max_live`` elements: prefetch stops short of it, and a demand evicts retained params, then
the furthest prefetches, first; only the params held at once and what is lent can pass it.

*Between passes* the next-pass cache (`zswap.fetch.nextpass`, `Scheduler.next`) holds what the next pass
starts with: the swap-ins of its first steps issued when a pass ends (*reads ahead*,
`Scheduler.read_ahead`), and updated params the early step left in memory (*seeds*, `Scheduler.seed`),
gathered from it with no read; each is taken when the next pass begins if still valid, else dropped.

All-gathers happen when a step is served, in the order of its params, so ranks that run the same modules
issue the same collectives in the same order; nothing here depends on I/O timing.

With a compute device (`zswap.device`), a prefetched param's host-to-device copy is started on the copy
stream as soon as its swap-in has completed (checked at every step's acquire and release), so module i+1's
read and copy both run under module i's compute; the compute stream waits on the copy's event only when the
step is served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import torch

from ..device import Device
from ..parts.gather import (
    Loading,
    advance,
    cancel_fetch,
    finish_fetch,
    install,
    no_torch_function,
    release,
    start_fetch,
)
from ..parts.params import Status
from ._trace import Budget, Counters, Slot, Step, StepKey, Trace, distinct_numel, guess
from .lenders import Lender, Lenders
from .nextpass import Entry, NextPass, Seed

__all__ = [
    "Budget", "Counters", "Entry", "Lender", "NextPass", "Scheduler", "Slot", "Step", "StepKey", "Trace"
]  # fmt: skip


class Scheduler:
    def __init__(
        self,
        slots: Iterable[Slot],
        budget: Budget,
        device: Device | None = None,
        *,
        across_passes: Callable[[], bool] = lambda: True,
        order: Sequence[tuple[int, Sequence[Slot]]] = (),
        itemsize: int = 4,
        counters: Counters | None = None,
    ) -> None:
        self.slots = {id(s.p): s for s in slots}
        self.budget = budget
        self.device = device
        """The compute device gathered params go to (``None``: the CPU path); see `zswap.device`."""
        self.counters = counters if counters is not None else Counters()
        self.live = 0
        self._traces: dict[Hashable, Trace] = {}
        self._trace: Trace | None = None
        self._kind: Hashable = None
        self._recording: list[Step] | None = None
        self._pos = 0
        self._ahead = 0
        self._on_trace = False
        self._prefetched: dict[int, Slot] = {}  # issue order
        self._prefetched_numel = 0
        self._retained: dict[int, Slot] = {}
        self._shared: set[int] = set()  # ids of the slots `_kept_for_backward` keeps for a later use
        self.order: list[tuple[int, Sequence[Slot]]] = list(order)
        """The static guess: (module index, the list of its params) in registration order. The lists are
        read at each guess, so params found in use later (`zswap.hooks`) are in the next one."""
        self._rebuild_backward = False
        self.next = NextPass(budget)
        """The next-pass cache: reads ahead and values kept for the next pass (`zswap.fetch.nextpass`)."""
        self._across = across_passes  # whether to read ahead when a pass ends (`read_ahead`)
        self._lenders = Lenders(itemsize)  # fetch-pool memory held outside, counted in the budget (`lend`)

    # -- iterations --------------------------------------------------------------------------------

    def begin(self, kind: Hashable, grad: bool = False) -> None:
        """Start an iteration of ``kind``: follow its trace if one was recorded, else the static guess
        (with backward steps when ``grad``), and record this one."""
        self.end()
        self._kind = kind
        self._trace = self._traces.get(kind)
        if self._trace is None:
            self._trace = self._guess(grad)
            self._rebuild_backward = grad
            if self._trace is not None:
                self.counters.guessed_iterations += 1
        self._on_trace = self._trace is not None
        self._pos = self._ahead = 0
        self._recording = []
        self._take_next()

    def end(self) -> None:
        """End the iteration: keep its recording if it differs from the trace, release what no one holds."""
        if self._recording is None:
            return
        steps, self._recording = self._recording, None
        self.counters.iterations += 1
        if self._trace is None or self._trace.guessed or self._trace.keys() != [s.key for s in steps]:
            self._traces[self._kind] = Trace(steps)
            self.counters.traces_recorded += 1
        self._trace, self._on_trace = None, False
        self._cancel_prefetches()
        for s in list(self._retained.values()):
            self._drop(s)

    # -- steps -------------------------------------------------------------------------------------

    def acquire(self, key: StepKey, slots: Sequence[Slot]) -> list[Slot]:
        """Gather ``slots`` for step ``key`` and hold them; returns the held ones (for `release`)."""
        persistent = [s for s in slots if s.persistent and s.st.status is Status.NOT_AVAILABLE]
        if persistent:
            self.fetch_persistent(persistent)
        held = [s for s in slots if not s.persistent]
        if not held:
            return held
        if self._recording is not None:
            self._recording.append(Step(key, tuple(held), sum(s.numel for s in held)))
        self._follow(key)
        for s in held:
            s.holds += 1
            if s.retained:
                s.retained = False
                del self._retained[id(s.p)]
        try:
            self._gather(held)
        except BaseException:
            # The pass is broken (a failed read): nothing it started may stay in flight — a backward
            # that raises never reaches the end of its iteration.
            self.release(held)
            self._cancel_prefetches()
            raise
        self._prefetch()
        return held

    def release(self, held: Iterable[Slot]) -> None:
        """Drop one hold on each of ``held``; the last one releases the param unless it is reused soon."""
        for s in held:
            s.holds -= 1
            if s.holds == 0 and s.ours and s.st.status is Status.AVAILABLE:
                if self.budget.keeps and (self._reused_soon(s) or self._kept_for_backward(s)):
                    s.retained = True
                    self._retained[id(s.p)] = s
                else:
                    self._drop(s)
        self._prefetch()

    def fetch_persistent(
        self, slots: Sequence[Slot], values: Mapping[int, torch.Tensor] | None = None
    ) -> None:
        """Gather each of ``slots`` not gathered now; ``values`` ({id(param): its partition in host
        memory, the stored value}) stand for their reads."""
        todo = [s for s in slots if s.st.status is Status.NOT_AVAILABLE]
        if todo:
            t0 = time.perf_counter()
            finish_fetch(start_fetch([s.item for s in todo], values), private=False, device=self.device)
            self.counters.wait_seconds += time.perf_counter() - t0
            for s in todo:
                s.ours = True

    def drop_all(self) -> None:
        """End the iteration and release everything the scheduler gathered, persistent params included;
        empty the next-pass cache."""
        self.live -= self.next.drop(self.counters)
        self.end()
        self._cancel_prefetches()
        for s in self.slots.values():
            s.holds, s.retained = 0, False
            if s.ours and s.st.status is Status.AVAILABLE:
                self._retire(s)
                release([s.item], write_back=False, warn=True)
            s.ours = False
        self._retained.clear()
        self.live = 0

    def prefill(self) -> int:
        """Allocate and fault in, before any pass runs, the read buffers the first forward's prefetch
        window will need (the guess, up to ``max_live`` elements), in the stores' pools; returns the bytes.
        A first touch of fresh memory costs a fault per page, far slower than the disk on a VM; paid here,
        the first pass reads into memory as warm as the later ones. Call it after any other load from the
        stores (the persistent params' fetches): a pool miss at the pool's peak in use unpools idle
        buffers first, so a load of another size made after it unpools these."""
        trace = self._guess(False)
        held: list[torch.Tensor] = []
        live = 0
        for step in trace.steps if trace is not None else []:
            for s in step.slots:
                prefill = getattr(s.st.store, "prefill", None)
                if live + s.numel > self.budget.max_live:
                    return sum(t.nbytes for t in held)
                live += s.numel
                if prefill is not None and (buf := prefill(s.st.partition_numel, s.st.dtype)) is not None:
                    held.append(buf)
        return sum(t.nbytes for t in held)

    def reset_counters(self) -> None:
        """Count anew from now (`zswap.Engine.stats` with ``reset``): the peaks start at what is live and
        lent now."""
        self.counters = Counters(peak_live=self.live, peak_live_lent=self.live + self.lent())

    # -- between passes (`zswap.fetch.nextpass`) ------------------------------------------------------

    def read_ahead(self) -> int:
        """Between passes: issue the swap-ins of the next pass's first steps (`zswap.fetch.nextpass`),
        along the last recorded trace of the kind run last (the static guess before any), up to ``bucket``
        elements and within ``max_live`` (less what the values kept will take). Nothing is gathered;
        returns how many reads are in flight. No-op inside a pass, when some are in flight already, or
        when reading across passes is off (`zswap.Engine.prefetch_across_passes`)."""
        if not self._across() or self._recording is not None or self.next.reads():
            return 0
        trace = self._traces.get(self._kind)
        if trace is None:
            trace = guess(self.order, False)
        if trace is None or self.budget.bucket <= 0:
            return 0
        self.live += self.next.read(trace, self.next.room(self.live + self.lent()), self.counters)
        self._note_live()
        return len(self.next.reads())

    def seed(self, seeds: Iterable[Seed]) -> None:
        """Values already in memory for the next pass: ``(param, its partition, still_valid)`` where the
        partition *is* the stored value while ``still_valid()`` (`zswap.step.earlystep`: the updated
        params the step just made live, the last ones backward completed and so the first the next
        forward uses). Those `seed_plan`'s rule takes are kept in the next-pass cache; when the next pass
        begins each still valid is gathered from its value, with no read, and kept as a retained param —
        used by that pass, released at its end or evicted first for room. One rank; host data (copied to
        a compute device when gathered)."""
        self.live -= self.next.keep(self._traces.get(self._kind), seeds, self.counters)

    def seed_plan(self) -> frozenset[int]:
        """ids of the params `seed` would take if every param were offered (from the pass running now:
        called in its backward, by `zswap.step.earlystep`, so that only those copies are kept)."""
        return frozenset(self.next.plan(self._traces.get(self._kind), None))

    @property
    def _seeds(self) -> list[tuple[Slot, torch.Tensor, Callable[[], bool]]]:
        """The values kept for the next pass, as ``(slot, value, still_valid)``."""
        return [(e.slot, e.data, e.still_valid) for e in self.next.values()]

    def drop_ahead(self) -> None:
        """Drop every read ahead not yet taken over by a pass (the values kept stay)."""
        self.live -= self.next.drop(self.counters, values=False)

    def settle_ahead(self) -> None:
        """Wait for the reads ahead in flight (so the engine's byte counters include them); a failure
        stays with its read and is raised at its use."""
        self.next.settle()

    def _take_next(self) -> None:
        """At a pass's start, the one place next-pass entries are taken: each value still valid is
        gathered from memory as a retained param (while the live budget holds it; copied to the compute
        device first, where there is one), then each read still valid becomes a prefetch of this pass;
        `NextPass.take` drops the rest."""
        entries, dropped = self.next.take(self.budget.max_live - self.live, self.counters)
        # A value of a partitioned param is this rank's partition: gathered at its step, when every rank
        # all-gathers it in step order, as a prefetch whose read is done.
        reads = [e for e in entries if e.handle is not None or e.slot.st.world_size > 1]
        with no_torch_function():
            for e in entries:
                s, st = e.slot, e.slot.st
                if e.handle is None and st.world_size > 1:
                    self.live += s.numel  # a read ahead counted from its issue; this one from now
                elif e.handle is None:
                    data, dev = e.data, self.device
                    if dev is not None and not dev.passthrough:  # to the compute device, as a fetch crosses
                        data = dev.wait(dev.h2d(data[: st.partition_numel]))
                    install(s.p, st, data[: st.numel].view(st.shape))
                    s.ours = s.retained = True
                    self._retained[id(s.p)] = s
                    self.live += s.numel
        self._note_live()
        self.live -= dropped
        for e in reads:
            s = e.slot
            s.st.status = Status.INFLIGHT
            data = e.data if e.handle is not None else e.data[: s.st.partition_numel]
            s.loading = Loading([s.item], [(data, e.handle)])
            s.ours = True
            self._prefetched[id(s.p)] = s
            self._prefetched_numel += s.numel
            self.counters.prefetch_issued += 1

    # -- memory held outside the scheduler -----------------------------------------------------------

    def lend(self, lender: Lender) -> None:
        """Count what ``lender`` holds of the params' fetch pools against ``max_live`` from now on
        (`zswap.fetch.lenders`)."""
        self._lenders.add(lender)

    def lent(self) -> int:
        """Elements of the params' fetch pools the lenders hold now, counted with `live`."""
        return self._lenders.lent()

    def settle_lent(self) -> None:
        """Have the lenders let go of what only waits for a write to land, so it stops counting."""
        self._lenders.settle()

    # -- internals ---------------------------------------------------------------------------------

    def _gather(self, held: list[Slot]) -> None:
        t0 = time.perf_counter()
        missing = [s for s in held if s.st.status is Status.NOT_AVAILABLE]
        need = sum(s.numel for s in missing)
        if need:
            self._make_room(need, keep=held)
        loads: dict[int, Loading] = {}
        for s in missing:  # every read of the step is issued before the first wait
            loads[id(s.p)] = start_fetch([s.item])
            s.ours = True
            self.live += s.numel
        self._note_live()
        try:
            for s in held:  # in step order: the all-gathers of every rank line up
                if s.loading is not None:
                    loading, s.loading = s.loading, None
                    del self._prefetched[id(s.p)]
                    self._prefetched_numel -= s.numel
                    self._finish(s, loading)
                    self.counters.prefetch_hits += 1
                elif id(s.p) in loads:
                    self._finish(s, loads.pop(id(s.p)))
                    self.counters.demand_fetches += 1
        except BaseException:
            # A failed read: the step's other swap-ins must not be left in flight (their params would
            # stay INFLIGHT forever); they go back to not gathered, as before the step.
            for s in missing:
                left = loads.pop(id(s.p), None)
                if left is not None:
                    cancel_fetch(left)
                    s.ours = False
                    self.live -= s.numel
            raise
        self.counters.wait_seconds += time.perf_counter() - t0

    def _finish(self, s: Slot, loading: Loading) -> None:
        try:
            finish_fetch(loading, private=False, device=self.device)
        except BaseException:
            s.ours = False
            self.live -= s.numel
            raise
        self.counters.elements_fetched += s.numel
        self.counters.bytes_fetched += s.numel * s.st.dtype.itemsize

    def _follow(self, key: StepKey) -> None:
        if not self._on_trace or self._trace is None:
            return
        steps = self._trace.steps
        if self._pos < len(steps) and steps[self._pos].key == key:
            self._pos += 1
            return
        if self._trace.guessed:
            self._follow_guess(key)
            return
        self._on_trace = False  # a different branch: on demand from here, recorded anew
        self.counters.off_trace += 1
        self._cancel_prefetches()

    def _guess(self, grad: bool) -> Trace | None:
        return guess(self.order, grad)

    def _follow_guess(self, key: StepKey) -> None:
        trace = self._trace
        assert trace is not None and self._recording is not None
        if key[0] == "B" and self._rebuild_backward:
            # The forward is known now: its modules' backwards run in the reverse order of their forwards.
            self._rebuild_backward = False
            done = self._recording[:-1]  # the current step was recorded already
            slots: dict[int, dict[int, Slot]] = {}
            for step in done:
                if step.key[0] == "F":
                    # Re-inserted, so the order is that of each module's last forward; merged, since a
                    # module's backward holds every param its forwards used (params found in use too).
                    merged = slots.pop(step.key[1], {})
                    merged.update((id(s), s) for s in step.slots)
                    slots[step.key[1]] = merged
            backward = [
                Step(("B", i), tuple(m.values()), sum(s.numel for s in m.values())) for i, m in slots.items()
            ]
            trace = self._trace = Trace([*done, *reversed(backward)], guessed=True)
            self._pos = self._ahead = len(done)
            if self._pos < len(trace.steps) and trace.steps[self._pos].key == key:
                self._pos += 1
            return
        k = trace.find(key, self._pos, self._ahead)
        if k is None:
            return  # not guessed, or guessed long before: served as it comes, the guess goes on
        for step in trace.steps[self._pos : k]:  # passed over: drop the reads no later step will use
            for s in step.slots:
                if s.loading is not None and trace.next_use(s, k) is None:
                    self._cancel(s)
        self._pos = k + 1

    def _reused_soon(self, s: Slot) -> bool:
        if not self._on_trace or self._trace is None:
            return False
        nxt = self._trace.next_use(s, self._pos)
        return nxt is not None and self._trace.fetched_between(self._pos, nxt) <= self.budget.reuse_distance

    def _kept_for_backward(self, s: Slot) -> bool:
        """Whether a param a forward step lets go of stays gathered for its backward: the last modules of
        forward are the first of backward, so what they hold is kept across the boundary when everything
        the steps up to its next use need fits in ``max_live`` with it, and with the step after that use
        (`_fits`: then nothing has to be evicted to keep it, it is not read again, and the read of the
        first backward step not kept can still be issued ahead). Only from a forward (outside any
        backward: a checkpoint's re-run forward inside backward releases as usual) to its backward. A param
        whose next use is in the same half of the pass (forward to forward, backward to backward: a shared
        param) is kept within `_kept_shared`'s room, or where it fits so with every param kept now."""
        trace = self._trace
        if not self._on_trace or trace is None:
            return False
        nxt = trace.next_use(s, self._pos)
        if nxt is None:
            return False
        in_backward = torch._C._current_graph_task_id() >= 0
        if trace.steps[nxt].key[0] == ("B" if in_backward else "F"):
            if self._kept_shared(s):
                return True
            # Or where nothing is evicted for it: within the reuse distance, each param between counted
            # once (ALBERT's block at every depth let its tied embedding go however small the model).
            steps = trace.steps[self._pos : nxt]
            if distinct_numel(steps, (), s, self.budget.reuse_distance) is None:
                return False
            return self._fits(s, nxt, self._retained.values())
        return not in_backward and self._fits(s, nxt, ())

    def _fits(self, s: Slot, nxt: int, kept: Iterable[Slot]) -> bool:
        """Whether ``s``, ``kept`` and the params of the trace's steps from here to step ``nxt`` and of the
        one after it fit in ``max_live`` together, each counted once."""
        assert self._trace is not None
        steps = self._trace.steps[self._pos : nxt] + self._trace.steps[nxt + 1 : nxt + 2]
        return distinct_numel(steps, kept, s, self.budget.max_live - s.numel) is not None

    def _kept_shared(self, s: Slot) -> bool:
        """Whether a param used again later in the same half of the pass (a tied embedding: forward's
        first and last steps, backward's first and last) stays gathered until then: while the params so
        kept fit in what the live budget holds beyond the prefetch bucket (``max_live - bucket``), so the
        read-ahead loses at most that; a demand may still evict them, furthest first."""
        room = self.budget.max_live - self.budget.bucket
        if s.numel > room:
            return False
        self._shared = {k for k in self._shared if k in self._retained}
        if s.numel + sum(self._retained[k].numel for k in self._shared) > room:
            return False
        self._shared.add(id(s.p))
        return True

    def _prefetch(self) -> None:
        self._advance()
        trace, b = self._trace, self.budget
        if not self._on_trace or trace is None or b.bucket <= 0:
            return
        j = max(self._ahead, self._pos)
        while j < len(trace.steps):
            todo = [
                s for s in trace.steps[j].slots if s.st.status is Status.NOT_AVAILABLE and s.loading is None
            ]
            n = sum(s.numel for s in todo)
            if n and (self._prefetched_numel + n > b.bucket or self.live + self.lent() + n > b.max_live):
                break
            for s in todo:
                s.loading = start_fetch([s.item])
                s.ours = True
                self._prefetched[id(s.p)] = s
                self.counters.prefetch_issued += 1
            self._prefetched_numel += n
            self.live += n
            j += 1
        self._ahead = j
        self._note_live()
        self._advance()  # in-memory partitions need no read: their copies start now

    def _advance(self) -> None:
        """Start the device copies of prefetched params whose swap-in completed (next module's H2D copy
        runs under the current module's compute)."""
        dev = self.device
        if dev is None or dev.passthrough:
            return
        dev.reap()
        for s in self._prefetched.values():
            if s.loading is not None:
                advance(s.loading, dev)

    def _make_room(self, need: int, keep: list[Slot]) -> None:
        def excess() -> int:
            return self.live + self.lent() + need - self.budget.max_live

        if excess() <= 0:
            return
        if self.next.reads():  # a pass without a begin (a backward after another pass): reads ahead go first
            self.drop_ahead()
            if excess() <= 0:
                return
        self.settle_lent()  # copies being written: their memory is let go once their write lands
        over = excess()
        if over <= 0:
            return
        for s in sorted(self._retained.values(), key=self._distance, reverse=True):
            self._drop(s)
            over -= s.numel
            if over <= 0:
                return
        kept = {id(s.p) for s in keep}
        # Furthest next use first (prefetches the trace no longer uses at all before any), then newest.
        for s in sorted(reversed(list(self._prefetched.values())), key=self._distance, reverse=True):
            if id(s.p) not in kept:
                self._cancel(s)
                self._ahead = self._pos  # re-scan: what was dropped is prefetched again later
                over -= s.numel
                if over <= 0:
                    return
        self.counters.budget_exceeded += 1

    def _distance(self, s: Slot) -> int:
        nxt = self._trace.next_use(s, self._pos) if self._trace is not None else None
        return self._trace.fetched_between(self._pos, nxt) if self._trace and nxt is not None else 1 << 62

    def _retire(self, s: Slot) -> None:
        if self.device is not None and not self.device.passthrough:
            self.device.retire(s.p)  # its device memory may be refilled after the compute queued so far

    def _drop(self, s: Slot) -> None:
        self._retire(s)
        release([s.item], write_back=False, warn=True)
        self._retained.pop(id(s.p), None)
        s.retained = s.ours = False
        self.live -= s.numel
        if self._on_trace and self._trace is not None:
            nxt = self._trace.next_use(s, self._pos)
            if nxt is not None and nxt < self._ahead:
                self._ahead = nxt  # prefetch passed that step while this param was still gathered

    def _cancel(self, s: Slot) -> None:
        loading, s.loading = s.loading, None
        self._prefetched.pop(id(s.p), None)
        self._prefetched_numel -= s.numel
        s.ours = False
        self.live -= s.numel
        self.counters.prefetch_dropped += 1
        if loading is not None:
            cancel_fetch(loading, self.device)

    def yield_prefetch(self, p: torch.Tensor) -> bool:
        """Gives up the prefetch of ``p`` if one is in flight (someone else — a `GatheredParameters` block —
        gathers it now), so ``p`` is not gathered again; the read-ahead may issue it again later. Likewise
        lets go of ``p`` if it is kept gathered for a later use with no holder (retained, seeded): the
        block then gathers its own copy, and a change without ``modifier_rank`` is dropped as for any
        param. Returns whether there was either."""
        s = self.slots.get(id(p))
        if s is not None and s.retained and not s.holds and s.st.status is Status.AVAILABLE:
            self._drop(s)
            return True
        if s is None or s.loading is None:
            return False
        self._cancel(s)
        self._ahead = min(self._ahead, self._pos)
        return True

    def _cancel_prefetches(self) -> None:
        for s in list(self._prefetched.values()):
            self._cancel(s)

    def _note_live(self) -> None:
        self.counters.peak_live = max(self.counters.peak_live, self.live)
        self.counters.peak_live_lent = max(self.counters.peak_live_lent, self.live + self.lent())
