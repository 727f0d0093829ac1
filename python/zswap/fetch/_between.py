"""Between passes: reads issued ahead for the next pass, and values kept in memory for it (*seeds*).

*Across passes* (`Scheduler.read_ahead`): when a pass ends (an inference forward; `zswap.Engine.step`,
after the optimizer wrote the partitions; `initialize`, along the guess) the swap-ins of the next pass's
first steps are issued — along the trace of the kind just run (the same kind is the likely next one), up
to ``bucket`` elements and within ``max_live`` — so the first step of a pass is a hit too. Such a read
leaves its param as it is (not gathered, `Status.NOT_AVAILABLE`: `GatheredParameters`, ``state_dict``,
checkpoints, ``load_state_dict`` see nothing in flight) and notes the stored version it reads
(`zswap.params.NvmeStore.version`: every write goes to a new version). When the next pass begins, each
one whose param is still not gathered and whose store still reads that version becomes a prefetch of that
pass, whatever its kind (`_adopt`); the rest are dropped unused, so a write in between — the optimizer's,
a `GatheredParameters` write-back, ``load_state_dict``, ``load_weights`` — is never hidden by a stale read.
`drop_all` (which `Engine.step`, checkpoint loads and `zswap.weights.quiesce` call) drops them too. A
failed read-ahead raises, naming the key, at its use in the next pass, as a failed prefetch does. Only
stores with I/O (NVMe) are read ahead; `zswap.Engine.prefetch_across_passes` turns it off.

*Seeds* (`BetweenPasses.seed`): updated params already in memory when a pass ends (the early step's copies,
`zswap.earlystep`) are gathered from that memory when the next pass begins, with no read — each only while
nothing wrote its partition since — and count in the live budget from then on, as the reads ahead leave
room for them.

`BetweenPasses` is the part of `zswap.prefetch.Scheduler` that runs between passes; it works on the
scheduler's state (declared below) and is not used alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..device import Device
from ..parts.gather import Loading, no_torch_function
from ..parts.params import Status
from ._trace import Budget, Counters, Slot, Step, Trace, guess


@dataclass(eq=False)
class Ahead:
    """A swap-in issued between passes for the next one (`Scheduler.read_ahead`); its param is untouched.
    Used only while its store still reads ``version`` (the version read)."""

    slot: Slot
    buf: torch.Tensor
    handle: Any
    version: str


class BetweenPasses:
    """Reads ahead and seeds (module docstring), over the state of `zswap.prefetch.Scheduler`."""

    budget: Budget
    counters: Counters
    live: int
    lent: Callable[[], int]
    order: list[tuple[int, Sequence[Slot]]]
    across_passes: bool
    _traces: dict[Hashable, Trace]
    _kind: Hashable
    _recording: list[Step] | None
    _prefetched: dict[int, Slot]
    _prefetched_numel: int
    _retained: dict[int, Slot]
    _seeds: list[tuple[Slot, torch.Tensor, Callable[[], bool]]]
    _ahead_reads: dict[int, Ahead]
    device: Device | None

    if TYPE_CHECKING:

        def _note_live(self) -> None: ...

    def seed(self, seeds: Iterable[tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]]) -> None:
        """Values already in memory for the next pass: ``(param, its partition, still_valid)`` where the
        partition *is* the stored value while ``still_valid()`` (`zswap.earlystep`: the updated params the
        step just made live, the last ones backward completed and so the first the next forward uses).
        The longest run of the last recorded pass's first steps whose params are all offered is taken,
        less its last steps while it and the first step after it do not fit in ``max_live`` together (so
        that step's read can still be issued ahead). Nothing is gathered now: when the next pass begins,
        each taken param still valid (no write to its partition since) is gathered from its value and kept
        as a retained param — used by that pass without a read, released at its end or evicted first for
        room; `drop_all` forgets them. One rank; host data (copied to a compute device when planted)."""
        offered = {id(p): (p, data, valid) for p, data, valid in seeds}
        self._seeds = []
        if offered:
            taken = self._seed_run(offered)
            self._seeds = [(s, offered[k][1], offered[k][2]) for k, s in taken.items()]

    def seed_plan(self) -> frozenset[int]:
        """ids of the params `seed` would take if every param were offered (from the pass running now:
        called in its backward, by `zswap.earlystep`, so that only those copies are kept)."""
        return frozenset(self._seed_run(None))

    def _seed_run(self, offered: Container[int] | None) -> dict[int, Slot]:
        """`seed`'s choice among ``offered`` (``None``: all), by param id."""
        trace = self._traces.get(self._kind)
        if trace is None:
            return {}
        run: list[Step] = []
        taken: dict[int, Slot] = {}
        after = 0
        for step in trace.steps:
            if step.key[0] != "F" or (
                offered is not None
                and any(id(s.p) not in offered and id(s.p) not in taken for s in step.slots)
            ):
                after = sum(s.numel for s in step.slots if id(s.p) not in taken)
                break
            run.append(step)
            taken.update((id(s.p), s) for s in step.slots)
        while run and sum(s.numel for s in taken.values()) + after > self.budget.max_live:
            last = run.pop()
            keep = {id(s.p) for step in run for s in step.slots}
            after = sum(s.numel for s in last.slots if id(s.p) not in keep)
            taken = {k: v for k, v in taken.items() if k in keep}
        return taken

    def read_ahead(self) -> int:
        """Between passes: issue the swap-ins of the next pass's first steps (module docstring, "Across
        passes"), along the last recorded trace of the kind run last (the static guess before any), up to
        ``bucket`` elements and within ``max_live`` (less what the seeds will take). Nothing is gathered;
        returns how many reads were issued. No-op inside a pass, when some are in flight already, or when
        `across_passes` is off."""
        if not self.across_passes or self._recording is not None or self._ahead_reads:
            return 0
        b = self.budget
        trace = self._traces.get(self._kind)
        if trace is None:
            trace = guess(self.order, False)
        if trace is None or b.bucket <= 0:
            return 0
        seeded = {id(s.p) for s, _, _ in self._seeds}
        room = min(b.bucket, b.max_live - self.live - self.lent() - sum(s.numel for s, _, _ in self._seeds))
        for step in trace.steps:
            todo = [
                s
                for s in step.slots
                if id(s.p) not in seeded and id(s.p) not in self._ahead_reads
                and s.st.status is Status.NOT_AVAILABLE and s.loading is None
                and getattr(s.st.store, "version", None) is not None
            ]  # fmt: skip
            n = sum(s.numel for s in todo)
            if n > room:
                break
            if not all(self._issue_ahead(s) for s in todo):
                break
            room -= n
        self._note_live()
        return len(self._ahead_reads)

    def _issue_ahead(self, s: Slot) -> bool:
        st = s.st
        version = st.store.version(st.key)  # type: ignore[attr-defined]
        if version is None:
            return True  # a write of it is unsettled: the pass reads it itself (counted as read: harmless)
        try:
            with no_torch_function():
                buf, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        except Exception:
            # Nothing was changed or gathered: the next pass fetches this param itself and reports
            # whatever is wrong (a closed engine, say) to its caller.
            return False
        self._ahead_reads[id(s.p)] = Ahead(s, buf, handle, version)
        self.live += s.numel
        self.counters.read_ahead_issued += 1
        return True

    def _adopt(self) -> None:
        """At a pass's start: each read ahead whose param is still not gathered and whose store still
        reads the version it read becomes a prefetch of this pass; the others are dropped."""
        reads, self._ahead_reads = self._ahead_reads, {}
        for a in reads.values():
            s, st = a.slot, a.slot.st
            valid = st.status is Status.NOT_AVAILABLE and s.loading is None
            if valid and st.store.version(st.key) == a.version:  # type: ignore[attr-defined]
                st.status = Status.INFLIGHT
                s.loading = Loading([s.item], [(a.buf, a.handle)])
                s.ours = True
                self._prefetched[id(s.p)] = s
                self._prefetched_numel += s.numel
                self.counters.prefetch_issued += 1
                self.counters.read_ahead_used += 1
            else:
                self._drop_ahead(a)

    def _drop_ahead(self, a: Ahead) -> None:
        with contextlib.suppress(Exception):
            a.handle.wait()  # the buffer must not be reused under a running read; its error is moot
        self.live -= a.slot.numel
        self.counters.read_ahead_dropped += 1

    def drop_ahead(self) -> None:
        """Drop every read ahead (`read_ahead`) not yet taken over by a pass."""
        reads, self._ahead_reads = self._ahead_reads, {}
        for a in reads.values():
            self._drop_ahead(a)

    def settle_ahead(self) -> None:
        """Wait for the reads ahead in flight (so the engine's byte counters include them); a failure
        stays with its read and is raised at its use."""
        for a in self._ahead_reads.values():
            with contextlib.suppress(Exception):
                a.handle.wait()

    def _plant(self) -> None:
        """Gather the seeds (`seed`) that are still valid, as retained params of the pass beginning
        (copied to the compute device first, where there is one)."""
        seeds, self._seeds = self._seeds, []
        with no_torch_function():
            for s, data, valid in seeds:
                st = s.st
                if s.persistent or st.status is not Status.NOT_AVAILABLE or st.world_size != 1:
                    continue
                if data.numel() < st.numel or self.live + s.numel > self.budget.max_live or not valid():
                    continue
                dev = self.device
                if dev is not None and not dev.passthrough:  # to the compute device, as a fetch crosses
                    data = dev.wait(dev.h2d(data[: st.partition_numel]))
                s.p.data = data[: st.numel].view(st.shape)
                st.status = Status.AVAILABLE
                s.ours = s.retained = True
                self._retained[id(s.p)] = s
                self.live += s.numel
        self._note_live()
