"""The early step's commit: at `Engine.step`, make the staged records and partitions live if nothing they
depended on moved since (gradients, hyper-parameters, step counters, layout, stored versions), else drop
them; and the checks that raise `GradientsNotKeptError` where gradients were let go (see
`zswap.earlystep`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from ..errors import GradientsNotKeptError
from ..fetch.nextpass import Seed
from ..gradients.gradstore import NOT_KEPT, RESTART, NvmeGrads, store_of
from ..parts.params import ParamState, param_state
from ..store.storage import within
from . import early_memory, early_rehyper
from .early_pipeline import _empty, _ps
from .optim import OffloadedAdamW
from .speculation import Guess

if TYPE_CHECKING:
    from .earlystep import EarlyStep

Ordinary = Callable[[list[int], float, frozenset[int]], list[tuple[torch.Tensor, torch.Tensor]]]
"""``ordinary(indices, scale, seeding)``: the engine's ordinary step over the optimizer's params
``indices`` with gradient scale ``scale``, inside the transaction made current
(`zswap.store.storage.within`); returns ``(param, updated partition)`` for those among ``seeding`` (ids:
the next pass's first params) whose partitions it updated in memory: seeds once committed."""


def prepare(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
    """At `Engine.step`, before the step computes its gradient scale: keep the early step only if it is
    the step the engine would take now, whatever that scale (see the module docstring); True if kept.
    Otherwise it is dropped, or, where it let go of gradients the ordinary step needs, this raises
    `GradientsNotKeptError`. Notes whether the hyper-parameters were assigned since the backward began
    (`EarlyStep.hypers_moved`), for the next step's plan."""
    moved = es.begun_hyper is not None and hyper_seen(es.opt) != es.begun_hyper
    try:
        return _prepare(es, items)
    finally:
        es.hypers_moved = moved  # after `mismatch`, which compares the plan of this step's backward
        es.begun_hyper = None


def _prepare(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
    if es.state != "running" or not es.ended:  # not begun, dropped, or its backward raised (then
        if es.state == "running":
            es.why = "its backward did not reach its end"
        es.abort()  # that backward's gradients went with it, applied ones included: nothing is lost)
        es.check_kept(items)
        return False
    why = mismatch(es, items)
    if why:
        drop(es, why)
        return False
    return True


def drop(es: EarlyStep, why: str) -> None:
    """Drop the early step; gradients it holds and did not store go to their store; raises
    `GradientsNotKeptError` if it had let go of some already."""
    es.why = why
    dropped, gs = es.dropped, es.gs
    held = held_grads(es)  # a deferred step's: all of them
    es.abort()
    if not dropped:
        hand_back(gs, held)
    if dropped:
        es.lost = why
        _wanted(gs)
        raise GradientsNotKeptError(
            f"engine.step(): {why}, but the early step already applied this step's gradients in "
            f"backward and did not keep them {NOT_KEPT}, so the ordinary step cannot run instead. "
            f"{RESTART}"
        )


def held_grads(es: EarlyStep) -> list[tuple[ParamState, torch.Tensor]]:
    """The gradients the early step holds and did not store (``keeping`` false): when it is dropped
    before it let go of any, `hand_back` gives them to their store."""
    return [] if es.keeping else [(st, g) for st, _, g, _ in es.ready.values() if g is not _empty]


def hand_back(gs: object, held: list[tuple[ParamState, torch.Tensor]], room: int = 0) -> None:
    """Store ``held`` (`held_grads`) as the sink would have, their notes as applied taken back (``room``:
    bytes of them the stash may keep in memory past its cap, `NvmeGrads.add`)."""
    if isinstance(gs, NvmeGrads):
        for st, g in held:
            gs.unapply(st)
            gs.add(st, g, room)


def commit(es: EarlyStep, scale: float | None, ordinary: Ordinary | None = None) -> bool:
    """Make the early step `prepare` kept live if ``scale``, the gradient scale the step computed, is
    the one it ran with; True if it did. ``None`` (the gradients are not finite: the step is skipped)
    or another scale (clipping bit: the ordinary step runs from the kept gradients) drops it.

    Deferred, the params it did not hold (`ordinary_part`) are stepped first by ``ordinary(indices,
    scale, seeding)`` (the engine's ordinary step over those params) inside its transaction: one commit
    for all; the updated partitions it returns are seeds with the early step's own (the params backward
    completes last, which the ordinary part takes, are those the next forward starts with).
    Where that raises, nothing changed (the transaction is aborted), the gradients it held go to their
    store, and the error is raised: as after any failed ordinary step."""
    if es.state != "running":
        return False
    if scale is None:  # an overflow: the step is skipped and the gradients dropped, applied ones too
        es.tally.overflow += 1
        es.why = "the gradients were not finite (the step is skipped)"
        es.abort()
        return False
    deferred = es.guess.factor is None
    if not deferred and scale != es.guess.factor:
        es.tally.redone += 1
        if math.isfinite(scale):
            drop(es, f"clipping bit (gradient scale {scale!r}; the early step assumed {es.guess.factor!r})")
        else:  # no finite check asked for (fp32, bf16 without check_grad_overflow): applied as PyTorch does
            drop(
                es, f"the gradient norm is not finite (gradient scale {scale!r}), and no check skips the step"
            )
        return False
    rest = ordinary_part(es)
    if rest and ordinary is None:
        drop(es, "the param copies and gradients did not all fit in the early step's cap")
        return False
    part_seeds: list[tuple[torch.Tensor, torch.Tensor]] = []
    if rest:  # first, while every gradient it holds can still go to its store
        try:
            with within(es.txn):
                part_seeds = cast(Ordinary, ordinary)(rest, scale, es.seeding)
        except BaseException as exc:
            held, gs, room, dropped = held_grads(es), es.gs, es.allowance, es.dropped
            es.abort()
            hand_back(gs, held, room)
            if dropped and isinstance(exc, Exception):  # (in backward: the part it updated let them go)
                es.lost = f"the ordinary step of the params past its cap failed ({exc})"
                _wanted(gs)
                raise GradientsNotKeptError(
                    f"engine.step(): {es.lost}, and the early step applied this step's other gradients in "
                    f"backward without keeping them {NOT_KEPT}, so the step cannot run again. {RESTART}"
                ) from exc
            raise
    if deferred:
        es.finish_at(scale)  # the update waited for the scale: it runs now, from what backward left held
        if es.state != "running":
            return False  # it gave up: the gradients are in their store, the ordinary step runs
        if not all(es.left[i] == 0 for i in es.ready) or es.reads or es.writes:
            drop(es, "its updates did not all complete at the step")
            return False
    txn, ready, steps, seeds, dropped = es.txn, es.ready, es.steps, [*es.seeds, *part_seeds], es.dropped
    kept, swaps, part_why = list(es.kept), es.swaps, es.part_why
    gs = es.gs

    def counters() -> None:
        early_memory.swap_in(swaps)  # copies in CPU memory become the records and partitions
        for i in ready:
            es.opt.records.set_step(i, steps[i] + 1)
        es.opt.last_grad_norm = None

    txn.on_commit(counters)
    rehyper, what = es.rehyper, "redo at the step for the hyper-parameters set after backward"
    try:
        if rehyper:
            early_rehyper.redo(es, rehyper)  # before `_reset`: it reads what the early step staged
        what = "writes"
        es._reset()
        txn.commit()
    except Exception as exc:
        es._reset()
        txn.abort()  # a commit that failed aborted itself already; a failed redo did not
        es.aborts += 1  # nothing changed
        if dropped:
            es.lost = f"its {what} failed ({exc})"
            _wanted(gs)
            raise GradientsNotKeptError(
                f"engine.step(): the early step's {what} failed ({exc}) and it applied this step's "
                f"gradients in backward without keeping them {NOT_KEPT}, so the ordinary step cannot run "
                f"instead. {RESTART}"
            ) from exc
        return False
    es._committed_resident = kept
    es.commits += 1
    if deferred:
        es.tally.deferred += 1
        es.tally.partly += bool(rest)
    else:
        es.tally.early += 1
        es.tally.early_partly += bool(rest)
        es.tally.rehyped += bool(rehyper)
    if rest:
        es.tally.part_reason = part_why or "the param copies and gradients held past the early step's cap"
    es.why = ""
    es._committed_seeds = seeds
    return True


def passes(es: EarlyStep, i: int, nbytes: int, landed: bool = False) -> bool:
    """Whether param ``i`` (``nbytes`` held for it: its gradient and copy, `early_memory.holds`) is left
    to the ordinary step (`EarlyStep.passed`): one outside the part planned as backward began
    (`early_memory.plan_part`), and, deferred, the first params backward completes are held, as many as
    fit in the cap, the rest (from the first that did not, ``capped``; ``landed``: taken before, landed
    from a device now) are not."""
    if i in es.outside:
        es.passed.add(i)  # its gradient goes to its store like any the early step does not take
        return True
    if es.factor is not None:
        return False
    if (es.capped and not landed) or es.held + es.copying + es.staged + nbytes > es.cap:
        es.capped = True
        es.passed.add(i)
        return True
    return False


def ordinary_part(es: EarlyStep) -> list[int]:
    """The params left to the ordinary step: those it did not hold (`EarlyStep.passed`) and, deferred,
    transitively every held one that shares a record with one of them — a record, and a param split
    over records, is updated by one of the two (a part planned as backward began is closed already).
    Those it held are let go, their gradients stored."""
    rest, todo = set(es.passed), list(es.passed)
    while todo:
        for sg in es.by_param.get(todo.pop(), ()):
            for s in sg.segments:
                if s.param in es.ready and s.param not in rest:
                    rest.add(s.param)
                    todo.append(s.param)
    back = []
    for i in rest & es.ready.keys():
        st, copy, g, _ = es.ready.pop(i)
        es.held -= early_memory.held_bytes(copy)
        es.holding.add(-copy.numel() * copy.element_size() - early_memory.plain(st, copy))
        back.append((st, g))
    if not es.keeping:
        hand_back(es.gs, back, es.allowance)  # held, not stored: the ordinary part reads them there
    return sorted(rest)


def second_backward(es: EarlyStep, task: int) -> None:
    """A gradient of another backward while an early step whose gradients were let go waits for
    `Engine.step`: nothing can be accumulated onto them."""
    _wanted(es.gs)
    es.abort()
    es.lost = "a second backward ran before engine.step()"
    es.state, es.task = "off", task
    raise GradientsNotKeptError(
        "a second backward before engine.step(): the early step applied the first one's gradients to the "
        f"optimizer in backward and did not keep them {NOT_KEPT}, so this backward cannot accumulate "
        f"onto them (use gradient_accumulation_steps to accumulate). The early step is dropped. {RESTART}"
    )


def take_seeds(es: EarlyStep) -> list[Seed]:
    """(param, its updated partition, still valid) for the params the last `commit` made live whose
    new value is still in memory; ``still_valid()`` is false once anything wrote the partition since
    (a `GatheredParameters` write-back, a checkpoint load). `zswap.prefetch.Scheduler.seed` gathers
    them from it when the next pass begins."""
    seeds, es._committed_seeds = es._committed_seeds, []
    return as_seeds(seeds)


def as_seeds(
    copies: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[Seed]:
    """(param, copy, still valid) for params on NVMe whose stored value ``copy`` is now, just committed:
    valid until anything writes the partition again."""
    live = [
        (p, copy, _ps(st).ns._live.get(st.key)) for p, copy in copies if (st := param_state(p)) is not None
    ]
    return unchanged_seeds(live)


def unchanged_seeds(
    copies: list[tuple[torch.Tensor, torch.Tensor, str | None]],
) -> list[Seed]:
    """(param, copy, still valid) for copies of params' stored partitions taken when their stored value
    was the given version: valid while it still is."""
    out: list[Seed] = []
    for p, copy, version in copies:
        st = param_state(p)
        if st is not None:
            out.append((p, copy, _unchanged(_ps(st).ns, st.key, version)))
    return out


def mismatch(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> str:
    """Why the early step is not the step `Engine.step` would take now ("" if it is)."""
    if es.plan() != es.guess:
        return (
            "the early step is no longer allowed for this step (engine.early_step, max_grad_norm, fp16 "
            "loss scaling, gradient_accumulation_steps or the optimizer changed since backward)"
        )
    if not es.ready:
        if es.capped:
            return "the first param copy and gradient did not fit in the early step's cap"
        if es.passed:
            return "no param of the part it updates got a gradient"
        return "it updated no record (the first step makes the optimizer's records)"
    if es.reads or es.writes or es.early:
        return "its transfers did not all settle in backward"
    # Deferred, every record is updated at the step, with the hyper-parameters it finds then; else
    # changes the moments do not depend on are redone at the commit (`early_rehyper`).
    begun = es.begun_hyper  # taken as this backward began (`EarlyStep._begin`)
    es.rehyper = []
    if es.guess.factor is not None:
        changed = None if begun is None else early_rehyper.changed_groups(begun[0], _hyper(es.opt))
        if changed is None:
            return (
                "a param group's betas, Adam (L2) weight_decay or decoupled_weight_decay changed between "
                "backward and step"
            )
        es.rehyper = changed
    if tuple(es.opt.records.sub_groups) != es.layout or list(es.opt.records.steps) != es.steps:
        return "the optimizer's sub-groups or step counters changed between backward and step"
    if not same_grads(es, items):
        return "the params with gradients are not those the early step updated"
    if not same_versions(es):
        return (
            "a param partition or optimizer record was written between backward and step "
            "(GatheredParameters with modifier_rank, a checkpoint load)"
        )
    return ""


def check_kept(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> None:
    """Raise `GradientsNotKeptError` if any of ``items`` has a gradient an early step applied and did
    not keep, and that early step was dropped (the ordinary step would need it)."""
    lost = [st.key for _, st in items if isinstance(st.grad_store, NvmeGrads) and st.grad_store.not_kept(st)]
    if lost:
        why = es.lost or "it was dropped"
        for _, st in items:
            _wanted(st.grad_store)
        raise GradientsNotKeptError(
            f"engine.step(): the gradients of {len(lost)} params (first {lost[0]}) were applied in "
            f"backward by an early step that was not made live ({why}) and were not kept {NOT_KEPT}. "
            f"{RESTART}"
        )


def same_grads(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
    with_grad = {es.index.get(id(p)) for p, st in items if store_of(st).has(st)}
    with_grad.discard(None)
    deferred = es.factor is None  # its records are updated at the step: none yet
    return with_grad == es.ready.keys() | es.passed and (deferred or all(es.left[i] == 0 for i in es.ready))


def same_versions(es: EarlyStep) -> bool:
    return early_memory.same_records(es) and all(
        early_memory.unchanged(st, seen) for st, _, _, seen in es.ready.values()
    )


def reset(es: EarlyStep) -> None:
    es.holding.clear()
    es.writing.clear()
    es.state = "idle"
    es.task = -1
    es.gs = None
    es.txn = None
    es.layout = ()
    es.steps = []
    es.by_param = {}
    es.waiting = {}
    es.landing = deque()
    es.device = None
    es.left = {}
    es.ready = {}
    es.versions = {}
    es.keeping = True
    es.dropped = 0
    es.seeding = frozenset()
    es.guess = _NONE
    es.factor = 1.0
    es.held = 0
    es.seeds = deque()
    es.seeded = 0
    es.micro = []
    es.micro_copies = []
    es.staying = frozenset()
    es.kept = []
    es.masters = frozenset()
    es.ring = []
    es.free = deque()
    es.reads = deque()
    es.early = {}
    es.upcoming = deque()
    es.order = []
    es.writes = deque()
    es.copies = deque()
    es.copying = 0
    es.write_ahead = 0
    es.staged = 0
    es.swaps = []
    es.passed = set()
    es.earlier = frozenset()
    es.outside = frozenset()
    es.capped = False
    es.part_why = ""
    es.rehyper = []
    es.kept_mem.clear()


_NONE = Guess(1.0, keep=False, sums=False, ranks=1)


def _hyper(opt: OffloadedAdamW) -> list[tuple[Any, ...]]:
    return [
        (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["decoupled_weight_decay"])
        for g in opt.param_groups
    ]


def hyper_seen(opt: OffloadedAdamW) -> tuple[list[tuple[Any, ...]], list[int]]:
    """Each param group's hyper-parameters and how many times they were assigned (`ParamGroup.writes`):
    changed between two calls if either differs."""
    return _hyper(opt), [getattr(g, "writes", 0) for g in opt.param_groups]


def _wanted(gs: object) -> None:
    """A `GradientsNotKeptError` is raised for gradients of ``gs``: ``keep_applied_grads = "auto"`` keeps
    them from the next backward on (`zswap.gradstore.RESTART` says so)."""
    if isinstance(gs, NvmeGrads):
        gs.wanted = True


def _unchanged(ns: Any, key: str, physical: str | None) -> Callable[[], bool]:
    """Whether ``key``'s stored value is still ``physical`` (nothing wrote it since)."""
    return lambda: physical is not None and ns._live.get(key) == physical and key not in ns._pending
