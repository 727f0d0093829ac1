"""Gradients the early step applies are not stored (`zswap.earlystep`, ``Engine.keep_applied_grads`` false,
and "auto", the default, until they are wanted): one model's bytes fewer written per step, and every path
that would have needed them after backward raises `GradientsNotKeptError` — or, inside backward before any
was let go, falls back — leaving params and optimizer records bitwise as they were.

Each test trains twins over the same model: the default engine (early step on, applied gradients not
kept) and a reference (the ordinary step, every gradient written), and compares params, records and step
counters bitwise; ``keep_applied_grads = True`` is shown to restore the fallback in each case.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap import GatheredParameters, full_grad
from zswap.errors import GradientsNotKeptError
from zswap.step import early_memory, early_pipeline

from .test_earlystep import model_bytes, state, train
from .test_faults import cfg_for, engine_of, grads_of, inject, same
from .test_runtime import TinyLM, assert_same_grads, build, engine_for, ids, sq

RESTART = (
    'call engine.zero_grad() and run backward again. With engine.keep_applied_grads = "auto" (the default) '
    "applied gradients are kept from the next backward on, after this error; set "
    "engine.keep_applied_grads = True to keep them always"
)


def twins(tmp_path: Path, keep: bool = False, make: Callable[[], Any] = TinyLM) -> tuple[Any, Any]:
    """(the default engine, ``keep_applied_grads`` = ``keep``; the ordinary step, every gradient written)."""
    runs = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("early", "ordinary"):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme")
        m, _ = build(make, cfg)
        e = engine_for(m, cfg)
        if name == "early":
            assert e.keep_applied_grads == "auto" and e.early_step  # the defaults
            e.keep_applied_grads = keep
        else:
            e.early_step = False
        runs.append((m, e))
    return runs[0], runs[1]


def test_applied_gradients_are_never_written_and_each_step_is_bitwise_the_ordinary_one(tmp_path):
    """Default vs ``keep_applied_grads`` (both early): exactly the gradients' bytes fewer written, the same
    reads; both bitwise the ordinary step."""
    (m, e), (ref, ref_e) = twins(tmp_path)
    cfg = cfg_for(tmp_path / "kept", "nvme", "nvme")
    kept, _ = build(TinyLM, cfg)
    kept_e = engine_for(kept, cfg)
    kept_e.keep_applied_grads = True
    runs = [(m, e), (kept, kept_e), (ref, ref_e)]
    train(runs, 0)  # the first step places the records: never early
    nbytes = model_bytes(m)
    for seed in range(1, 4):
        moved = []
        for mm, ee in runs:
            ee.stats(reset=True)
            sq(mm(ids(seed=seed))).backward()
            if ee is e:
                assert ee.stats()["grad_stash_bytes"] == 0  # nor kept in memory
            ee.step()
            s = ee.stats()
            moved.append((s["bytes_read"], s["bytes_written"]))
        assert same(state(m, e), state(ref, ref_e)), seed
        assert same(state(kept, kept_e), state(ref, ref_e)), seed
        assert moved[1][1] - moved[0][1] == nbytes, moved  # the gradients, not written
        assert moved[0][0] == moved[1][0], moved  # the same reads
    assert e._early.commits == 3 and kept_e._early.commits == 3
    for _, ee in runs:
        ee.close()


def _before_step(tmp_path: Path, keep: bool) -> tuple[Any, Any, Any]:
    """Twins trained one step, then one backward each; returns them and the early one's state before."""
    (m, e), (ref, ref_e) = twins(tmp_path, keep)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    before = state(m, e)
    for mm, _ in pairs:
        sq(mm(ids(seed=1))).backward()
    return pairs, before, e


def _lr(pairs: Any) -> None:
    for _, ee in pairs:
        ee.optimizer.param_groups[0]["lr"] = 3e-2


def _betas(pairs: Any) -> None:  # the moments depend on them: the update in backward cannot be redone
    for _, ee in pairs:
        ee.optimizer.param_groups[0]["betas"] = (0.8, 0.99)


def _clip(pairs: Any) -> None:
    for _, ee in pairs:
        ee.max_grad_norm = 0.05


def _write(pairs: Any) -> None:
    for mm, _ in pairs:
        first = next(mm.parameters())
        with GatheredParameters([first], modifier_rank=0):
            first.data.mul_(0.5)


def _steps(pairs: Any) -> None:  # the optimizer's step counter moved (a load_state_dict, say)
    for _, ee in pairs:
        ee.optimizer._steps[0] += 1


CHANGES = {
    "betas": (_betas, "a param group's betas, Adam (L2) weight_decay or decoupled_weight_decay changed"),
    "clipping": (_clip, "the early step is no longer allowed for this step"),
    "written": (_write, "a param partition or optimizer record was written between backward and step"),
    "counters": (_steps, "the optimizer's sub-groups or step counters changed between backward and step"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_backward_and_step_raises_and_changes_nothing(change, tmp_path):
    edit, why = CHANGES[change]
    pairs, before, e = _before_step(tmp_path, keep=False)
    (m, _), (ref, ref_e) = pairs
    edit(pairs)
    expected = state(m, e)  # what the edit itself did (a partition written); the step adds nothing
    for _ in range(2):  # the second: the gradients are still gone
        with pytest.raises(GradientsNotKeptError, match=r"engine\.step\(\)") as info:
            e.step()
        assert why in str(info.value) and RESTART in str(info.value)
        assert same(state(m, e), expected)
    if change in ("betas", "clipping"):  # the others changed stored state themselves
        assert same(expected, before)
    with pytest.raises(GradientsNotKeptError, match="was applied to the optimizer in backward"):
        full_grad(next(m.parameters()))
    # zero_grad starts over; from there the twins train alike
    for _, ee in pairs:
        ee.zero_grad()
        ee.max_grad_norm = None
    assert all(full_grad(p) is None for p in m.parameters())
    train(pairs, 2)
    train(pairs, 3)
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits >= 1
    for _, ee in pairs:
        ee.close()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_with_keep_applied_grads_a_change_falls_back_to_the_ordinary_step(change, tmp_path):
    edit, _ = CHANGES[change]
    pairs, _, e = _before_step(tmp_path, keep=True)
    (m, _), (ref, ref_e) = pairs
    assert same(grads_of(m), grads_of(ref))  # kept: full_grad sees them
    edit(pairs)
    for _, ee in pairs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 0
    for _, ee in pairs:
        ee.max_grad_norm = None
    train(pairs, 2)
    train(pairs, 3)
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits >= 1
    for _, ee in pairs:
        ee.close()


@pytest.mark.parametrize("keep", [False, True])
def test_an_lr_eps_or_weight_decay_set_between_backward_and_step_is_redone_at_the_step(keep, tmp_path):
    """The update in backward ran with the old values and let its gradients go (or kept them): the step
    recomputes the params from the moments it staged, with the values set — bitwise the ordinary step's,
    no error, the early step made live; the steps after it are too."""
    pairs, _, e = _before_step(tmp_path, keep=keep)
    (m, _), (ref, ref_e) = pairs
    for _, ee in pairs:
        ee.optimizer.param_groups[0].update(lr=3e-2, eps=1e-6, weight_decay=0.2)
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1 and e.stats()["steps_hypers_redone"] == 1
    train(pairs, 2)  # deferred: the step before it set them
    train(pairs, 3)  # in backward again
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 3 and e.stats()["steps_hypers_redone"] == 1
    for _, ee in pairs:
        ee.close()


def test_full_grad_of_an_applied_gradient_raises_and_the_step_still_commits(tmp_path):
    pairs, _, e = _before_step(tmp_path, keep=False)
    (m, _), (ref, ref_e) = pairs
    for p in m.parameters():
        with pytest.raises(GradientsNotKeptError) as info:
            full_grad(p)
        assert "Set engine.keep_applied_grads = True before backward" in str(info.value)
    for _, ee in pairs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1
    for _, ee in pairs:
        ee.close()


@pytest.mark.parametrize("keep", [False, True])
def test_a_second_backward_before_the_step(keep, tmp_path):
    """Not kept: the second backward raises at its first gradient, nothing changes, and the step raises
    until zero_grad. Kept: it accumulates and the ordinary step runs (as before)."""
    pairs, before, e = _before_step(tmp_path, keep)
    (m, _), (ref, ref_e) = pairs
    if keep:
        for mm, ee in pairs:
            sq(mm(ids(seed=2))).backward()
            ee.step()
        assert same(state(m, e), state(ref, ref_e))
        assert e._early.commits == 0
    else:
        with pytest.raises(GradientsNotKeptError, match=r"a second backward before engine\.step\(\)") as info:
            sq(m(ids(seed=2))).backward()
        assert RESTART in str(info.value)
        assert same(state(m, e), before)
        with pytest.raises(GradientsNotKeptError, match=r"\(a second backward ran before engine.step\(\)\)"):
            e.step()
        assert same(state(m, e), before)
        for _, ee in pairs:
            ee.zero_grad()
    train(pairs, 3)
    train(pairs, 4)
    assert same(state(m, e), state(ref, ref_e))
    for _, ee in pairs:
        ee.close()


def test_the_cap_reached_before_any_gradient_was_let_go_falls_back(tmp_path, monkeypatch):
    (m, e), (ref, ref_e) = twins(tmp_path)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    plan_part = early_memory.plan_part

    def then_no_room(es: Any, deferred: bool = False) -> str:  # begun (a cap of 0 would not begin it)
        why = plan_part(es, deferred)
        es.cap = 0  # gives up at the first gradient: it hands it (and any other) to the store
        return why

    monkeypatch.setattr(early_memory, "plan_part", then_no_room)
    aborts = e._early.aborts
    for mm, _ in pairs:
        sq(mm(ids(seed=1))).backward()
    assert same(grads_of(m), grads_of(ref))  # stored: the ordinary step has them
    for _, ee in pairs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 0 and e._early.aborts > aborts
    for _, ee in pairs:
        ee.close()


def test_the_cap_reached_after_a_gradient_was_let_go_fails_that_backward(tmp_path, monkeypatch):
    (m, e), (ref, ref_e) = twins(tmp_path)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    before = state(m, e)
    early = e._early
    seed = early_pipeline.seed

    def then_cap(es: Any, i: int, copy: torch.Tensor) -> bool:  # right after the first gradient was let go
        kept = seed(es, i, copy)
        early.cap = 0
        return kept

    monkeypatch.setattr(early_pipeline, "seed", then_cap)
    stop = r"the early step had to stop in this backward \(it held more than its cap of 0 bytes"
    with pytest.raises(GradientsNotKeptError, match=stop) as info:
        sq(m(ids(seed=1))).backward()
    assert "this backward counts for nothing" in str(info.value) and RESTART in str(info.value)
    assert all(full_grad(p) is None for p in m.parameters())  # counted for nothing
    assert same(state(m, e), before)
    monkeypatch.setattr(early_pipeline, "seed", seed)
    early.cap = 1 << 40
    train(pairs, 1)  # run again: the same as the twin's
    train(pairs, 2)
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 2
    for _, ee in pairs:
        ee.close()


@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("read", errno.EIO)])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_fault_in_backward_either_falls_back_or_fails_that_backward(op, code, where, tmp_path):
    """A fault in one of backward's transfers: before any applied gradient was let go the early step
    hands its gradients to the store and the ordinary step runs; after, backward raises the SwapIOError
    (noting why) and counts for nothing: nothing changed, run it again. Either way the result is exact."""
    (m, e), (ref, ref_e) = twins(tmp_path)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    before = state(m, e)
    swap = engine_of(m)
    key = "reads" if op == "read" else "writes"
    n = int(swap.stats()[key])
    out = m(ids(seed=1))
    fwd = int(swap.stats()[key])
    sq(ref(ids(seed=1))).backward()
    # the early twin's own backward transfers: counted on a dry run of the same model is not possible, so
    # aim within the early step's (records read, records and params written: a few per sub-group)
    inject(swap, op, code, int(where * 4))
    try:
        sq(out).backward()
        raised = None
    except zswap.SwapIOError as exc:
        raised = exc
    swap._engine.clear_faults()
    assert int(swap.stats()[key]) > fwd >= n
    if raised is not None:  # counted for nothing
        assert all(full_grad(p) is None for p in m.parameters())
        assert same(state(m, e), before)
        sq(m(ids(seed=1))).backward()
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    train(pairs, 2)
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits >= 1
    for _, ee in pairs:
        ee.close()


def test_reentrant_checkpointing_steps_in_backward(tmp_path):
    """A backward inside backward (reentrant activation checkpointing) is part of the outer one: the
    update runs in backward from the second step on, exact (more layouts: tests/test_checkpointed_step.py)."""
    (m, e), (ref, ref_e) = twins(tmp_path, make=lambda: TinyLM(reentrant=True))
    pairs = [(m, e), (ref, ref_e)]
    for seed in range(4):
        train(pairs, seed)
        assert same(state(m, e), state(ref, ref_e)), seed
    assert e._early.commits == 3
    for _, ee in pairs:
        ee.close()


def test_keep_applied_grads_keeps_them_for_full_grad(tmp_path):
    pairs, _, e = _before_step(tmp_path, keep=True)
    (m, _), (ref, _) = pairs
    assert same(grads_of(m), grads_of(ref))
    for _, ee in pairs:
        ee.step()
    assert e._early.commits == 1
    for _, ee in pairs:
        ee.close()


def test_only_the_copies_the_next_pass_takes_are_kept_as_seeds(tmp_path):
    """The early step asks the scheduler which params the next pass would start gathered
    (`Scheduler.seed_plan`) when backward begins and keeps only their updated copies: after backward the
    seeds are exactly those, within the live budget, and the step hands every one to the next pass."""
    (m, e), (ref, ref_e) = twins(tmp_path)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    for seed in range(1, 4):
        plan = e._sched.seed_plan()
        assert plan  # the recorded pass's first steps
        sq(m(ids(seed=seed))).backward()
        kept = {id(p) for p, _ in e._early.seeds}
        assert kept == plan, seed
        assert e._early.seeded == sum(c.numel() for _, c in e._early.seeds) <= e.sizing.budget.max_live
        e.step()
        assert {id(s.p) for s, _, _ in e._sched._seeds} == plan
        sq(ref(ids(seed=seed))).backward()
        ref_e.step()
        assert same(state(m, e), state(ref, ref_e)), seed
    for _, ee in pairs:
        ee.close()


def test_reentrant_checkpointing_gradients_on_nvme_equal_plain_pytorchs(tmp_path):
    """A reentrant checkpoint's backward runs as its own autograd task inside the outer one: its gradients
    belong to the outer backward's generation (they used to open one of their own, dropping the outer's
    gradients so far: ln_f's and the head's)."""
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, ref = build(lambda: TinyLM(reentrant=True), cfg)
    with engine_for(m, cfg):
        for seed in range(2):  # the second accumulates onto the first
            sq(m(ids(seed=seed))).backward()
            sq(ref(ids(seed=seed))).backward()
            assert_same_grads(m, ref)


@pytest.mark.parametrize("keep", [False, True])
def test_a_failed_commit_raises_or_falls_back_and_changes_nothing(keep, tmp_path):
    """The commit's transaction fails (injected: it aborts itself, as a failed commit does): not kept, the
    step raises naming the failure and nothing changed; kept, the ordinary step runs instead."""
    pairs, before, e = _before_step(tmp_path, keep)
    (m, _), (ref, ref_e) = pairs
    txn = e._early.txn

    def failing() -> None:
        txn.abort()
        raise OSError(errno.EIO, "injected commit failure")

    txn.commit = failing
    if keep:
        for _, ee in pairs:
            ee.step()
    else:
        with pytest.raises(
            GradientsNotKeptError, match=r"the early step's writes failed \(.*injected"
        ) as info:
            e.step()
        assert RESTART in str(info.value)
        assert same(state(m, e), before)
        with pytest.raises(GradientsNotKeptError, match=r"\(its writes failed"):
            e.step()
        for _, ee in pairs:
            ee.zero_grad()
    train(pairs, 2)
    assert same(state(m, e), state(ref, ref_e))
    for _, ee in pairs:
        ee.close()


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_failed_redo_for_an_lr_set_after_backward_raises_or_falls_back_and_changes_nothing(
    op, keep, tmp_path
):
    """A transfer of the redo at the step fails (its first read of a staged record, or its first write of a
    recomputed partition): not kept, the step raises naming the redo and nothing changed; kept, the
    ordinary step runs instead, with the lr set."""
    pairs, before, e = _before_step(tmp_path, keep)
    (m, _), (ref, ref_e) = pairs
    _lr(pairs)
    inject(engine_of(m), op, errno.EIO, 0)
    if keep:
        for _, ee in pairs:
            ee.step()
        assert same(state(m, e), state(ref, ref_e)) and e.stats()["steps_hypers_redone"] == 0
    else:
        with pytest.raises(
            GradientsNotKeptError, match=r"the early step's redo at the step .* failed"
        ) as info:
            e.step()
        assert RESTART in str(info.value)
        assert same(state(m, e), before)
        for _, ee in pairs:
            ee.zero_grad()
    train(pairs, 2)
    assert same(state(m, e), state(ref, ref_e))
    for _, ee in pairs:
        ee.close()


# -- "auto": kept once wanted ------------------------------------------------------------------------------


def test_auto_keeps_applied_gradients_once_full_grad_read_them_on_the_first_step(tmp_path):
    """A loop that reads gradients between backward and step (as DeepSpeed's ``safe_get_full_grad`` tests
    do) reads them on the first step too, which has no early step: from the next backward on they are kept,
    so every read works and the early step still runs."""
    (m, e), (ref, ref_e) = twins(tmp_path)
    e.keep_applied_grads = "auto"
    for seed in range(3):
        sq(m(ids(seed=seed))).backward()
        sq(ref(ids(seed=seed))).backward()
        assert same(grads_of(m), grads_of(ref)), seed
        e.step()
        ref_e.step()
        assert same(state(m, e), state(ref, ref_e)), seed
    assert e._early.commits == 2
    e.close()
    ref_e.close()


def test_auto_keeps_them_for_manual_accumulation_seen_on_the_first_step(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path)
    e.keep_applied_grads = "auto"
    for seed in range(3):
        for mm, ee in ((m, e), (ref, ref_e)):
            sq(mm(ids(seed=seed))).backward()
            sq(mm(ids(seed=seed + 10))).backward()  # a second backward before the step: accumulates
            ee.step()
        assert same(state(m, e), state(ref, ref_e)), seed
    e.close()
    ref_e.close()


def test_auto_raises_the_first_read_after_an_early_step_then_keeps_them(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path)
    e.keep_applied_grads = "auto"
    train([(m, e), (ref, ref_e)], 0)  # the first step: nothing read between backward and step
    sq(m(ids(seed=1))).backward()
    with pytest.raises(GradientsNotKeptError, match="keep_applied_grads"):
        grads_of(m)
    e.zero_grad()  # start over: this backward now keeps what it applies
    sq(m(ids(seed=1))).backward()
    sq(ref(ids(seed=1))).backward()
    assert same(grads_of(m), grads_of(ref))
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1
    e.close()
    ref_e.close()


def test_keep_applied_grads_takes_true_false_or_auto_and_refuses_anything_else(tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, _ = build(TinyLM, cfg)
    e = engine_for(m, cfg)
    for good in (True, False, "auto"):
        e.keep_applied_grads = good
        assert e.keep_applied_grads is good or e.keep_applied_grads == good == "auto"
    for bad in (1, 0, None, "Auto", "true", "yes"):
        with pytest.raises(zswap.ConfigError, match=r'keep_applied_grads must be True, False or "auto", got'):
            e.keep_applied_grads = bad  # type: ignore[assignment]
        assert e.keep_applied_grads == "auto"  # unchanged
    with pytest.raises(ValueError):  # ConfigError is a ZswapError and a ValueError
        e.keep_applied_grads = 2  # type: ignore[assignment]
    assert issubclass(zswap.ConfigError, zswap.ZswapError)
    e.close()


def test_auto_keeps_them_after_the_error_so_the_same_change_then_falls_back(tmp_path):
    """ "auto" (the default): a betas change between backward and step raises once, and the error says "auto"
    keeps the gradients from the next backward on; it does: after zero_grad the same kind of change falls
    back to the ordinary step, bitwise the twin's. The step after one that changed them is deferred (its
    update waits for the step, and takes the lr set there); after one without a change, in backward."""
    pairs, before, e = _before_step(tmp_path, keep="auto")  # type: ignore[arg-type]
    (m, _), (ref, ref_e) = pairs
    assert e.keep_applied_grads == "auto" and not e._keeps_applied_grads()
    _betas([(m, e)])
    with pytest.raises(GradientsNotKeptError, match="a param group's betas") as info:
        e.step()
    text = str(info.value)
    assert RESTART in text and '(engine.keep_applied_grads is False, or "auto", the default, before' in text
    assert same(state(m, e), before) and e._keeps_applied_grads()
    _betas([(ref, ref_e)])
    for mm, ee in pairs:
        ee.zero_grad()
        sq(mm(ids(seed=1))).backward()  # kept this time
    for _, ee in pairs:
        ee.optimizer.param_groups[0]["lr"] = 1e-2  # changed between backward and step again
        ee.step()  # deferred, after the change that raised: updated here, with this lr
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1 and e.stats()["steps_deferred"] == 1
    train(pairs, 2)  # deferred too (the step before it changed the lr), and it changes nothing
    train(pairs, 4)  # so this one runs in backward again, gradients kept
    assert same(state(m, e), state(ref, ref_e))
    assert e.stats()["steps_deferred"] == 2 and e.stats()["steps_in_backward"] == 1
    for mm, ee in pairs:
        sq(mm(ids(seed=3))).backward()
        ee.optimizer.param_groups[0]["betas"] = (0.85, 0.99)
        ee.step()  # the early one falls back to the ordinary step instead of raising
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 3 and "a param group's betas" in e._early.why
    for _, ee in pairs:
        ee.close()
