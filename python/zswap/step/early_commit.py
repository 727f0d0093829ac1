"""The early step's commit: at `Engine.step`, make the staged records and partitions live if nothing they
depended on moved since (gradients, hyper-parameters, step counters, layout, stored versions), else drop
them; and the checks that raise `GradientsNotKeptError` where gradients were let go (see
`zswap.earlystep`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import GradientsNotKeptError
from ..gradients.gradstore import NOT_KEPT, RESTART, NvmeGrads
from ..parts.params import ParamState, param_state
from .early_pipeline import _ps
from .optim import OffloadedAdamW

if TYPE_CHECKING:
    from .earlystep import EarlyStep


def commit(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> bool:
    """Make the early step live if it is exactly the step `Engine.step` would take now (see the
    module docstring); True if it did. Otherwise it is dropped and the caller steps as usual."""
    if es.state != "running" or not es.ended:  # not begun, dropped, or its backward raised (then
        es.abort()  # that backward's gradients went with it, applied ones included: nothing is lost)
        es.check_kept(items)
        return False
    why = es._mismatch(items)
    if why:
        dropped, gs = es.dropped, es.gs
        es.abort()
        if dropped:
            es.lost = why
            _wanted(gs)
            raise GradientsNotKeptError(
                f"engine.step(): {why}, but the early step already applied this step's gradients in "
                f"backward and did not keep them {NOT_KEPT}, so the ordinary step cannot run instead. "
                f"{RESTART}"
            )
        return False
    txn, ready, steps, seeds, dropped = es.txn, es.ready, es.steps, list(es.seeds), es.dropped
    gs = es.gs

    def counters() -> None:
        for i in ready:
            es.opt.records.set_step(i, steps[i] + 1)
        es.opt.last_grad_norm = None

    txn.on_commit(counters)
    es._reset()
    try:
        txn.commit()
    except Exception as exc:
        es.aborts += 1  # commit aborted itself: nothing changed
        if dropped:
            es.lost = f"its writes failed ({exc})"
            _wanted(gs)
            raise GradientsNotKeptError(
                f"engine.step(): the early step's writes failed ({exc}) and it applied this step's "
                f"gradients in backward without keeping them {NOT_KEPT}, so the ordinary step cannot run "
                f"instead. {RESTART}"
            ) from exc
        return False
    es.commits += 1
    es._committed_seeds = seeds
    return True


def take_seeds(es: EarlyStep) -> list[tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]]:
    """(param, its updated partition, still valid) for the params the last `commit` made live whose
    new value is still in memory; ``still_valid()`` is false once anything wrote the partition since
    (a `GatheredParameters` write-back, a checkpoint load). `zswap.prefetch.Scheduler.seed` gathers
    them from it when the next pass begins."""
    seeds, es._committed_seeds = es._committed_seeds, []
    out: list[tuple[torch.Tensor, torch.Tensor, Callable[[], bool]]] = []
    for p, copy in seeds:
        st = param_state(p)
        if st is not None:
            ns = _ps(st).ns
            out.append((p, copy, _unchanged(ns, st.key, ns._live.get(st.key))))
    return out


def mismatch(es: EarlyStep, items: list[tuple[torch.Tensor, ParamState]]) -> str:
    """Why the early step is not the step `Engine.step` would take now ("" if it is)."""
    if not es.eligible():
        return (
            "the early step is no longer allowed for this step (engine.early_step, max_grad_norm, fp16 "
            "loss scaling, gradient_accumulation_steps or the optimizer changed since backward)"
        )
    if es.reads or es.writes or es.early:
        return "its transfers did not all settle in backward"
    if _hyper(es.opt) != es.hyper:
        return "a param group's lr, betas, eps or weight_decay changed between backward and step"
    if tuple(es.opt.records.sub_groups) != es.layout or list(es.opt.records.steps) != es.steps:
        return "the optimizer's sub-groups or step counters changed between backward and step"
    if not es._same_grads(items):
        return "the params with gradients are not those the early step updated"
    if not es._same_versions():
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
    with_grad = {
        es.index.get(id(p)) for p, st in items if st.grad_store is not None and st.grad_store.has(st)
    }
    with_grad.discard(None)
    return with_grad == set(es.ready) and all(es.left[i] == 0 for i in es.ready)


def same_versions(es: EarlyStep) -> bool:
    store = es.records
    for name, physical in es.versions.items():
        if store.ns._live.get(name) != physical or name in store.ns._pending:
            return False
    for st, _, _, physical in es.ready.values():
        ns = _ps(st).ns
        if ns._live.get(st.key) != physical or st.key in ns._pending:
            return False
    return True


def reset(es: EarlyStep) -> None:
    es.holding.clear()
    es.writing.clear()
    es.state = "idle"
    es.task = -1
    es.gs = None
    es.txn = None
    es.hyper = []
    es.layout = ()
    es.steps = []
    es.by_param = {}
    es.waiting = {}
    es.left = {}
    es.ready = {}
    es.versions = {}
    es.keeping = True
    es.dropped = 0
    es.plan = frozenset()
    es.held = 0
    es.seeds = deque()
    es.seeded = 0
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


def _hyper(opt: OffloadedAdamW) -> list[tuple[Any, ...]]:
    return [
        (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["decoupled_weight_decay"])
        for g in opt.param_groups
    ]


def _wanted(gs: object) -> None:
    """A `GradientsNotKeptError` is raised for gradients of ``gs``: ``keep_applied_grads = "auto"`` keeps
    them from the next backward on (`zswap.gradstore.RESTART` says so)."""
    if isinstance(gs, NvmeGrads):
        gs.wanted = True


def _unchanged(ns: Any, key: str, physical: str | None) -> Callable[[], bool]:
    """Whether ``key``'s stored value is still ``physical`` (nothing wrote it since)."""
    return lambda: physical is not None and ns._live.get(key) == physical and key not in ns._pending
