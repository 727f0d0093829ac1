"""An lr, eps or decoupled weight decay assigned between ``backward()`` and ``step()``: the early step's
params recomputed at the step from the moments it staged (see `zswap.step.earlystep`).

An early step that ran in backward used the hyper-parameters found as its backward began. A loop that
assigns new ones right before ``optimizer.step()`` every step is seen and deferred (`speculation`); one
that starts doing so after steps without it (a decay from some epoch on, a step change at a milestone)
finds this step's update done with the old values, and its gradients let go. AdamW's moments do not
depend on lr, eps or a decoupled weight decay, so the update is redone from what the transaction staged:
each record's new moments (read back from the transaction) and each param's value before the step (its
committed partition, or the master in the committed record) give the new master and param bit for bit
as a step with the new values would (`zswap.step.optim._kernel.cpu_adam_redo`); the param partitions
(and records with a master) are staged again, in the same transaction, and the copies kept as seeds or
as resident params' gathered copies take the new values. A change of betas, of Adam's (L2) weight decay
or of the decay mode changes the moments: that step cannot be redone (`early_commit.mismatch` says so).

Cost, once: every changed group's records read back (and their committed versions where they hold a
master), its params' committed partitions read, the partitions (and those records) written again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ..parts.params import NvmeStore, ParamState
from .early_memory import cpu_records
from .optim._kernel import cpu_adam_redo, group_hypers
from .optim._layout import SubGroup
from .optim._store import CpuStore

if TYPE_CHECKING:
    from .earlystep import EarlyStep

Hyper = tuple[Any, ...]
"""(lr, betas, eps, weight_decay, decoupled_weight_decay) of one param group (`early_commit._hyper`)."""


def changed_groups(before: list[Hyper], now: list[Hyper]) -> list[int] | None:
    """The param groups whose hyper-parameters differ between ``before`` and ``now``, if every difference
    can be redone from the moments (lr, eps, a decoupled weight decay); ``None`` if one cannot."""
    if len(before) != len(now):
        return None
    changed = []
    for g, (b, n) in enumerate(zip(before, now, strict=True)):
        if b == n:
            continue
        _, betas0, _, wd0, decoupled0 = b
        _, betas1, _, wd1, decoupled1 = n
        if betas0 != betas1 or decoupled0 != decoupled1 or (not decoupled1 and wd0 != wd1):
            return None
        changed.append(g)
    return changed


def redo(es: EarlyStep, groups: list[int]) -> None:
    """Recompute, with the param groups' hyper-parameters as they are now, the params of ``groups`` the
    early step updated, and stage them again in its transaction (see the module docstring). Waits for
    its transfers: a failed one raises (the caller aborts the transaction)."""
    wanted = set(groups)
    todo = [sg for sg in es.layout if sg.group in wanted and any(s.param in es.ready for s in sg.segments)]
    left: dict[int, int] = {}
    for sg in todo:
        for s in sg.segments:
            if s.param in es.ready:
                left[s.param] = left.get(s.param, 0) + 1
    new: dict[int, torch.Tensor] = {}
    for sg in todo:
        staged, master_before = _record(es, sg)
        m, v, w = sg.parts(staged)
        hypers = group_hypers(es.opt.param_groups[sg.group])
        for seg in sg.segments:
            i = seg.param
            if i not in es.ready:
                continue
            st = es.ready[i][0]
            if i not in new:
                new[i] = _before(st)
            part = slice(seg.offset, seg.offset + seg.numel)
            master = None
            if w is not None:  # the master before the step: a fresh record's is the param itself
                fresh = es.steps[i] == 0
                before = new[i][seg.start : seg.stop] if fresh else cast(torch.Tensor, master_before)[part]
                w[part].copy_(before)
                master = w[part]
            cpu_adam_redo(
                new[i][seg.start : seg.stop],
                master,
                m[part],
                v[part],
                step=es.steps[i] + 1,
                **hypers,
            )
            left[i] -= 1
            if left[i] == 0:
                _restage_param(es, i, st, new.pop(i))
        if w is not None:
            _restage_record(es, sg, staged)
    es.txn.check()


def _record(es: EarlyStep, sg: SubGroup) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sg``'s record as staged (ours to change), and, where it holds a master, that master as committed
    (the value before the step; ``None`` for a record never written)."""
    if cpu_records(es):
        store = cast(CpuStore, es.records)
        staged = _swapped(es, store, sg.key)
        committed = store.get(sg.key)
        before = None if committed is None else sg.parts(committed)[2]
        return staged, before
    store = es.records
    name = store._name(sg)
    staged = _scratch(es, 0, sg.record_numel)
    store.ns.read(name, staged, es.txn).wait()
    if not sg.has_master or not store.ns.has(name):
        return staged, None
    committed = _scratch(es, 1, sg.record_numel)
    store.ns.read(name, committed).wait()  # no transaction: the live version
    return staged, sg.parts(committed)[2]


def _swapped(es: EarlyStep, store: object, key: str) -> torch.Tensor:
    """The updated copy of ``key`` in ``store`` (a tier in CPU memory) the commit will swap in."""
    return next(t for s, k, t in es.swaps if s is store and k == key)


def _scratch(es: EarlyStep, k: int, numel: int) -> torch.Tensor:
    """A record buffer: slot ``k`` of the optimizer's ring (idle at the commit: every write landed), else
    a new engine buffer."""
    if k < len(es.ring) and es.ring[k].numel() >= numel:
        return es.ring[k][:numel]
    return cast(torch.Tensor, es.records.engine.empty(numel, torch.float32))


def _before(st: ParamState) -> torch.Tensor:
    """A flat copy of ``st``'s partition as committed: the param's value before the step."""
    if isinstance(st.store, NvmeStore):
        buf = st.store._buffer(st.partition_numel, st.dtype)
        st.store.ns.read(st.key, buf).wait()  # no transaction: the live version
        return buf
    return st.store.load(st.key, st.partition_numel, st.dtype)[0].reshape(-1).clone()


def _restage_param(es: EarlyStep, i: int, st: ParamState, value: torch.Tensor) -> None:
    """Param ``i``'s recomputed partition replaces the staged one, and every copy kept of it."""
    if not isinstance(st.store, NvmeStore):  # its updated copy waits for the commit in ``swaps``
        _swapped(es, st.store, st.key).copy_(value)
        return
    st.store.ns.put(st.key, value, es.txn).settle()
    p = es.opt.records.params[i]
    for q, copy in (*es.seeds, *es.kept):
        if q is p:
            copy.copy_(value)


def _restage_record(es: EarlyStep, sg: SubGroup, record: torch.Tensor) -> None:
    """``sg``'s record with its recomputed master replaces the staged one (in CPU memory it is that one)."""
    if not cpu_records(es):
        es.records.ns.put(es.records._name(sg), record, es.txn).settle()
