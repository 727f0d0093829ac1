"""What a pass fetches, and in which order: the scheduler's records of params (`Slot`), a pass's fetch
requests (`Step`), one recorded or guessed pass (`Trace`), the static guess a first pass follows (`guess`),
the budget and the counters. Plain data and queries on it; `zswap.prefetch.Scheduler` acts on them."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..parts.gather import Loading
from ..parts.params import ParamState

StepKey = tuple[str, int]
"""("F" or "B", index of the module): a module's forward, or its backward."""


@dataclass(eq=False)
class Slot:
    """The scheduler's record of one managed param."""

    p: torch.Tensor
    st: ParamState
    persistent: bool
    holds: int = 0
    ours: bool = False
    """Gathered (or being gathered) by the scheduler, so it is the scheduler's to release."""
    loading: Loading | None = None
    """A prefetch in flight, not yet consumed."""
    retained: bool = False
    """Gathered with no holder, kept for a use soon."""

    @property
    def numel(self) -> int:
        return self.st.numel

    @property
    def item(self) -> tuple[torch.Tensor, ParamState]:
        return self.p, self.st


@dataclass(eq=False)
class Step:
    key: StepKey
    slots: tuple[Slot, ...]
    """The non-persistent params it needs."""
    numel: int


class Trace:
    """One recorded (or guessed) iteration: its steps in order, and at which steps each param is used."""

    def __init__(self, steps: list[Step], guessed: bool = False) -> None:
        self.steps = steps
        self.guessed = guessed
        self.prefix = [0]
        self.uses: dict[int, list[int]] = {}
        self.at: dict[StepKey, list[int]] = {}
        for i, step in enumerate(steps):
            self.prefix.append(self.prefix[-1] + step.numel)
            self.at.setdefault(step.key, []).append(i)
            for s in step.slots:
                self.uses.setdefault(id(s), []).append(i)

    def find(self, key: StepKey, start: int, end: int) -> int | None:
        """Index of the first step ``key`` in ``[start, end)``."""
        at = self.at.get(key, [])
        k = bisect.bisect_left(at, start)
        return at[k] if k < len(at) and at[k] < end else None

    def keys(self) -> list[StepKey]:
        return [s.key for s in self.steps]

    def next_use(self, slot: Slot, start: int) -> int | None:
        """Index of the first step at or after ``start`` that uses ``slot``."""
        uses = self.uses.get(id(slot), [])
        k = bisect.bisect_left(uses, start)
        return uses[k] if k < len(uses) else None

    def fetched_between(self, start: int, end: int) -> int:
        """Elements the steps in ``[start, end)`` fetch."""
        return self.prefix[end] - self.prefix[start]


def guess(order: Sequence[tuple[int, Sequence[Slot]]], grad: bool) -> Trace | None:
    """The static guess of a first pass: ``order``'s modules' forwards (their non-persistent params) in
    registration order and, with ``grad``, their backwards in the reverse order; None if nothing to fetch."""
    forward = []
    for index, slots in order:
        held = tuple(s for s in slots if not s.persistent)
        if held:
            forward.append(Step(("F", index), held, sum(s.numel for s in held)))
    backward = [Step(("B", s.key[1]), s.slots, s.numel) for s in reversed(forward)] if grad else []
    return Trace(forward + backward, guessed=True) if forward else None


@dataclass
class Counters:
    demand_fetches: int = 0
    """Params fetched when needed, with nothing prefetched for them."""
    prefetch_hits: int = 0
    """Params whose read was issued ahead and consumed when needed."""
    prefetch_dropped: int = 0
    """Prefetches cancelled unused (trace left, budget)."""
    prefetch_issued: int = 0
    """Prefetches started: hits + dropped + those still in flight."""
    elements_fetched: int = 0
    bytes_fetched: int = 0
    """Full-size bytes gathered (what compute saw), all tiers."""
    wait_seconds: float = 0.0
    """Time compute waited for params: demand fetches and the unfinished part of prefetches."""
    peak_live: int = 0
    peak_live_lent: int = 0
    """Most elements gathered, in flight and lent (`Scheduler.lent`) at once, as seen at each change."""
    iterations: int = 0
    traces_recorded: int = 0
    off_trace: int = 0
    """Iterations that left their recorded trace."""
    budget_exceeded: int = 0
    """Demands that went past ``max_live`` because the params held at once alone exceed it."""
    guessed_iterations: int = 0
    """Iterations that followed the static guess (`Scheduler.order`), not a recording."""
    read_ahead_issued: int = 0
    """Swap-ins issued between passes for the next one (`Scheduler.read_ahead`)."""
    read_ahead_used: int = 0
    """Of those, taken over by the next pass as its prefetches (counted in ``prefetch_issued`` then)."""
    read_ahead_dropped: int = 0
    """Of those, dropped unused: stale (written since), gathered meanwhile, `Scheduler.drop_all`."""


@dataclass
class Budget:
    """Elements; see the module docstring."""

    bucket: int
    max_live: int
    reuse_distance: int

    @property
    def keeps(self) -> bool:
        """Whether a param let go may stay gathered for a later use: not with ``reuse_distance`` and
        ``bucket`` both 0 (DeepSpeed's release after each use)."""
        return self.reuse_distance > 0 or self.bucket > 0


def distinct_numel(steps: Iterable[Step], kept: Iterable[Slot], skip: Slot, limit: int) -> int | None:
    """Elements of the params of ``kept`` and ``steps`` but ``skip``, each counted once; ``None`` as soon as
    they pass ``limit`` (the walk stops there: a release asks this along a long trace)."""
    if limit < 0:
        return None  # nothing at all passes it (``skip`` alone is past a budget DeepSpeed lets it pass)
    seen, total = {id(skip)}, 0
    for o in itertools.chain(kept, (o for step in steps for o in step.slots)):
        if id(o) not in seen:
            seen.add(id(o))
            total += o.numel
            if total > limit:
                return None
    return total
