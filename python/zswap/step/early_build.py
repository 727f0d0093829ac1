"""Building the early step for an engine: whether its setup allows one (`speculation.why_not`), and the
pools it draws on sized for what it may hold."""

from __future__ import annotations

from typing import Any

from ..parts.params import NvmeStore
from . import speculation
from .earlystep import EarlyStep


def for_engine(engine: Any) -> EarlyStep | None:
    """The early step for a `zswap.Engine` whose setup allows one (see the module docstring), else None
    (``engine._early_off`` says why: `zswap.step.speculation.why_not`)."""
    opt = engine.optimizer
    engine._early_off = speculation.why_not(engine, opt)
    if engine._early_off:
        return None
    allowed = engine.sizing.allowances  # `zswap.memory.Allowances`: sized once with the live budget
    ranks = max(st.world_size for _, st in engine._items)
    early = EarlyStep(
        opt,
        speculation.planner(engine, opt, ranks),
        allowed.early_step,
        # `Scheduler.seed_plan` keeps seeds within the live budget with the next pass's first read
        # (benches/README.md, "Bytes per step").
        seed_numel=allowed.seeds,
        seed_plan=engine._sched.seed_plan,
        keep=engine._keeps_applied_grads,
        room=engine._grad_room,  # gradients a redo or the accumulation needs, kept in memory
        tally=engine._tally,
        resident=engine._resident_ids,
    )
    # The copies come from the param stores' fetch pools: pooled up to what the early step may hold, they
    # reuse buffers from step to step. Past the pool each would be a new mapping, its pages faulted in and
    # zeroed, then unmapped: at 2 GiB that was 1.2 s of a 10 s step (benches/README.md, "Bytes per step").
    for store in {id(st.store): st.store for _, st in engine._items}.values():
        if isinstance(store, NvmeStore):
            store.widen_pool(early.cap)
    # So does the pool a compute device's gradient copies land in: the early step holds them up to its cap
    # (a deferred step: through all of backward), and those past it wait in memory within the live budget
    # (`summing_room`). Past the landing pool each would be a new registered mapping, every step.
    landing = engine._grads.landing
    if landing is not None:
        landing.keep(landing.pool_bytes + early.cap + allowed.live)
    # While held (waiting for their record, kept as seeds, or being written) those copies count in the
    # scheduler's live budget (`zswap.fetch.prefetch.Lender`: `lent` and `settle`).
    engine._sched.lend(early)
    return early
