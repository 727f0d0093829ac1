"""The next-pass cache: param values made ready between passes for the first steps of the next one.

One entry per param, of either kind:

- **a read in flight** (`NextPass.read`, `Scheduler.read_ahead`): when a pass ends (an inference forward;
  `zswap.Engine.step`, after the optimizer wrote the partitions; `initialize`, along the guess) the swap-ins
  of the next pass's first steps are issued — along the trace of the kind just run (the same kind is the
  likely next one), up to ``bucket`` elements and within ``max_live`` — so the first step of a pass is a hit
  too. Such a read leaves its param as it is (not gathered, `Status.NOT_AVAILABLE`: `GatheredParameters`,
  ``state_dict``, checkpoints, ``load_state_dict`` see nothing in flight) and counts in the scheduler's live
  elements from its issue. Only stores with I/O (NVMe) are read ahead.
- **a value in memory** (`NextPass.keep`, `Scheduler.seed`, the *seeds*): updated params already in memory
  when a pass ends (the early step's copies, `zswap.step.earlystep`), gathered from that memory when the
  next pass begins, with no read (over several ranks the value is this rank's partition: it takes the
  place of the read, and the all-gather runs at the param's step as for any prefetch). They count in the
  live budget from then on; until then the reads ahead leave room for them.

Each entry carries its *still-valid* check: a read's is that its store still reads the version it read
(`zswap.parts.params.NvmeStore.version`: every write goes to a new version); a value's is the one its
giver made (nothing wrote the partition since). When the next pass begins (`take`, the one place entries
leave the cache for a pass) every entry whose param is still not gathered and whose check holds is handed
to the scheduler — a value to be gathered from memory as a retained param of that pass, a read to become a
prefetch of it, whatever the pass's kind — and the others are dropped unused, so a write in between (the
optimizer's, a `GatheredParameters` write-back, ``load_state_dict``, ``load_weights``) is never hidden by
a stale entry. `drop` (`Scheduler.drop_all`: `Engine.step`, checkpoint loads, `zswap.io.weights.quiesce`)
forgets them too. A failed read raises, naming the key, at its use in the next pass, as a failed prefetch
does.

Which params: values are the offered params of the last recorded pass's first forward steps, as far as
every param of those steps fits in ``max_live`` with the step after them (so that step's read can still be
issued ahead, `plan`); a param among them not offered (frozen: the step does not update it) is read ahead
in its place, and the steps after follow, within what the live budget leaves (`room`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..parts.gather import no_torch_function
from ..parts.params import Status
from ._trace import Budget, Counters, Slot, Trace

Seed = tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]
"""A value offered to the next pass: ``(param, its partition, still_valid)``, the partition *being* the
stored value while ``still_valid()`` (`NextPass.keep`, `zswap.fetch.prefetch.Scheduler.seed`)."""


@dataclass(eq=False)
class Entry:
    """What the next pass gets for one param: ``data`` (its partition, or a buffer being read into when
    ``handle`` is set) while ``still_valid()``."""

    slot: Slot
    data: torch.Tensor
    still_valid: Callable[[], bool]
    handle: Any = None
    """The read filling ``data`` (``None``: ``data`` is the value, in memory already)."""


def _same_version(store: Any, key: str, version: str) -> Callable[[], bool]:
    return lambda: bool(store.version(key) == version)


class NextPass:
    """The entries for the next pass, by param id (module docstring). Owned by a `Scheduler`, which
    counts the reads in its live elements and hands each entry `take` returns to the pass."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._entries: dict[int, Entry] = {}  # values first (`keep`), then reads in issue order

    # -- views -------------------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def values(self) -> list[Entry]:
        """The entries held in memory (the seeds)."""
        return [e for e in self._entries.values() if e.handle is None]

    def reads(self) -> list[Entry]:
        """The entries being read."""
        return [e for e in self._entries.values() if e.handle is not None]

    def value_numel(self) -> int:
        return sum(e.slot.numel for e in self.values())

    # -- which params ------------------------------------------------------------------------------

    def plan(self, trace: Trace | None, offered: Container[int] | None) -> dict[int, Slot]:
        """The params, by id, `keep` takes among ``offered`` (``None``: all) along ``trace`` (the last
        recorded pass of the kind run last): those of its first forward steps, as far as every param of
        those steps fits in ``max_live`` with the step after them. A param not offered (frozen, or one the
        step did not keep) is read ahead in its place (`read`), and counts beside the values."""
        if trace is None:
            return {}
        steps, limit = trace.steps, self.budget.max_live
        needed: set[int] = set()
        total, length = 0, 0  # the longest run of forward steps that fits so far
        for i, step in enumerate(steps):
            if step.key[0] != "F":
                break
            for s in step.slots:
                if id(s.p) not in needed:
                    needed.add(id(s.p))
                    total += s.numel
            if total > limit:
                break  # no longer run fits either
            after = steps[i + 1].slots if i + 1 < len(steps) else ()
            if total + sum(s.numel for s in after if id(s.p) not in needed) <= limit:
                length = i + 1
        taken = {id(s.p): s for step in steps[:length] for s in step.slots}
        return {k: s for k, s in taken.items() if offered is None or k in offered}

    def room(self, used: int) -> int:
        """Elements the reads ahead may take when ``used`` are live or lent: the prefetch bucket, within
        what the live budget leaves beside the values kept (they are gathered when the pass begins)."""
        b = self.budget
        return min(b.bucket, b.max_live - used - self.value_numel())

    # -- filling -----------------------------------------------------------------------------------

    def keep(
        self,
        trace: Trace | None,
        seeds: Iterable[Seed],
        counters: Counters,
    ) -> int:
        """Replace the values kept with those of ``seeds`` (``(param, its partition, still_valid)``, the
        partition *being* the stored value while ``still_valid()``) that `plan` takes. Nothing is
        gathered now. A read of a param taken is dropped (its value is here); returns the elements of
        such reads, no longer live."""
        offered = {id(p): (p, data, valid) for p, data, valid in seeds}
        reads = {k: e for k, e in self._entries.items() if e.handle is not None}
        values: dict[int, Entry] = {}
        dropped = 0
        if offered:
            for k, s in self.plan(trace, offered).items():
                values[k] = Entry(s, offered[k][1], offered[k][2])
                if k in reads:
                    dropped += self._drop(reads.pop(k), counters)
        self._entries = {**values, **reads}
        return dropped

    def read(self, trace: Trace, room: int, counters: Counters) -> int:
        """Issue the swap-ins of ``trace``'s first steps whose params have no entry, are not gathered and
        live in a store with versions, step by step while a whole step fits in ``room`` elements. Returns
        the elements issued (which count as live from now on)."""
        issued = 0
        for step in trace.steps:
            todo = [
                s
                for s in step.slots
                if id(s.p) not in self._entries
                and s.st.status is Status.NOT_AVAILABLE and s.loading is None
                and getattr(s.st.store, "version", None) is not None
            ]  # fmt: skip
            n = sum(s.numel for s in todo)
            if n > room:
                break
            for s in todo:
                got = self._issue(s, counters)
                if got is None:
                    return issued
                issued += got
            room -= n
        return issued

    def _issue(self, s: Slot, counters: Counters) -> int | None:
        """Elements issued for ``s`` (0: none needed); ``None``: the read could not be issued."""
        st = s.st
        version = st.store.version(st.key)  # type: ignore[attr-defined]
        if version is None:
            return 0  # a write of it is unsettled: the pass reads it itself (counted as read: harmless)
        try:
            with no_torch_function():
                buf, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        except Exception:
            # Nothing was changed or gathered: the next pass fetches this param itself and reports
            # whatever is wrong (a closed engine, say) to its caller.
            return None
        self._entries[id(s.p)] = Entry(s, buf, _same_version(st.store, st.key, version), handle)
        counters.read_ahead_issued += 1
        return s.numel

    # -- leaving -----------------------------------------------------------------------------------

    def take(self, room: int, counters: Counters) -> tuple[list[Entry], int]:
        """At a pass's start: the values still valid, in order while they fit in ``room`` elements (each
        then becomes live), then the reads still valid, all of which leave the cache; with the elements of
        the reads dropped (stale, or their param gathered meanwhile), which are no longer live."""
        entries, self._entries = self._entries, {}
        out: list[Entry] = []
        for e in entries.values():
            s, st = e.slot, e.slot.st
            if e.handle is not None:
                continue
            if s.persistent or st.status is not Status.NOT_AVAILABLE:
                continue
            if e.data.numel() < st.partition_numel or s.numel > room or not e.still_valid():
                continue
            room -= s.numel
            out.append(e)
        dropped = 0
        for e in entries.values():
            s = e.slot
            if e.handle is None:
                continue
            if s.st.status is Status.NOT_AVAILABLE and s.loading is None and e.still_valid():
                counters.read_ahead_used += 1
                out.append(e)
            else:
                dropped += self._drop(e, counters)
        return out, dropped

    def drop(self, counters: Counters, *, values: bool = True) -> int:
        """Forget the entries (only the reads when not ``values``); returns the elements of the reads
        dropped, which are no longer live."""
        dropped = 0
        kept: dict[int, Entry] = {}
        for k, e in self._entries.items():
            if e.handle is not None:
                dropped += self._drop(e, counters)
            elif not values:
                kept[k] = e
        self._entries = kept
        return dropped

    def _drop(self, e: Entry, counters: Counters) -> int:
        with contextlib.suppress(Exception):
            e.handle.wait()  # the buffer must not be reused under a running read; its error is moot
        counters.read_ahead_dropped += 1
        return e.slot.numel

    def settle(self) -> None:
        """Wait for the reads in flight (so the engine's byte counters include them); a failure stays
        with its read and is raised at its use."""
        for e in self.reads():
            with contextlib.suppress(Exception):
                e.handle.wait()
