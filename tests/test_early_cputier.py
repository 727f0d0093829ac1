"""The early step with optimizer states, params or both in CPU memory (`zswap.step.early_memory`).

Each setup — states in CPU memory with params on NVMe, params in CPU memory with states on NVMe, both in
CPU memory — trains twins, the early step on and off (the ordinary step), and asserts params, optimizer
records and step counters bitwise equal after every optimizer step, in every case of
`zswap.step.speculation` (clipping that does not bite, that bites, the deferred step after it, gradient
accumulation, the bf16 overflow check, the fp16 loss scale, the stand-in compute device, two gloo ranks);
that the early step ran (``steps_in_backward``); that the stored state does not change before the step
commits; that what happens between backward and step, and a fault in backward, are honoured; that past
its cap it says why; and the exact bytes a warm step moves (resident params included).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from zswap import GatheredParameters, SwapIOError
from zswap.device import StandInDevice
from zswap.errors import GradientsNotKeptError
from zswap.step import early_memory, earlystep
from zswap.train import bridge

from .conftest import run_ranks
from .test_earlystep import model_bytes, state
from .test_faults import cfg_for, engine_of, inject, same
from .test_runtime import TinyLM, build, engine_for, ids, no_seeds, sq
from .test_speculation import poisoned_copies, resident_twins

SETUPS = [("nvme", "cpu"), ("cpu", "nvme"), ("cpu", "cpu")]
"""(offload_param.device, offload_optimizer.device)"""
SETUP_IDS = ["states-cpu", "params-cpu", "both-cpu"]


def twins(
    tmp_path: Path, setup: tuple[str, str], keep: bool = False, device: bool = False, **extra: Any
) -> list[tuple[Any, Any]]:
    """(early step on, off) over the same model with params and states where ``setup`` puts them."""
    runs = []
    for name, early in (("early", True), ("plain", False)):
        cfg = cfg_for(tmp_path / name, *setup, **extra)
        m, _ = build(TinyLM, cfg)
        e = engine_for(m, cfg, **({"device": StandInDevice()} if device else {}))
        e.early_step = early
        e.keep_applied_grads = keep
        runs.append((m, e))
    return runs


def run(
    tmp_path: Path,
    setup: tuple[str, str],
    steps: int,
    gas: int = 1,
    clip: list[float | None] | None = None,
    loss_mult: list[float] | None = None,
    device: bool = False,
    cap: int | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Train both twins ``steps`` optimizer steps of ``gas`` micro-batches (``clip[step]``: both
    engines' ``max_grad_norm``; ``loss_mult[step]``: a factor on the loss) and return the early one's
    stats after each step; bitwise equal after every one."""
    if gas > 1:
        extra["gradient_accumulation_steps"] = gas
    tmp_path.mkdir(parents=True, exist_ok=True)
    runs = twins(tmp_path, setup, device=device, **extra)
    (m, e), (ref, ref_e) = runs
    assert e._early is not None, e._early_off
    if cap is not None:
        e._early.cap = cap
    seen = []
    for step in range(steps):
        for mm, ee in runs:
            if clip is not None:
                ee.max_grad_norm = clip[step]
            ee.stats(reset=True)
            for micro in range(gas):
                loss = sq(mm(ids(seed=10 * step + micro)).float())
                ee.backward(loss * (1.0 if loss_mult is None else loss_mult[step]))
                ee.step()
        seen.append(e.stats())
        assert same(state(m, e), state(ref, ref_e)), step
        assert e.global_steps == ref_e.global_steps and e.skipped_steps == ref_e.skipped_steps
        assert repr(e.last_grad_norm) == repr(ref_e.last_grad_norm), step
    assert ref_e.stats()["steps_in_backward"] == 0
    for _, ee in runs:
        ee.close()
    return seen


def counts(seen: list[dict[str, Any]], key: str) -> list[int]:
    return [s[key] for s in seen]


BITES = [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6]


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_clipping_that_does_not_bite_commits_every_warm_step(setup, tmp_path):
    seen = run(tmp_path, setup, 4, clip=[1e6] * 4)
    assert counts(seen, "steps_in_backward") == [0, 1, 1, 1]
    assert seen[0]["steps_ordinary_reason"].startswith("it updated no record")


@pytest.mark.parametrize("persistent", [0, 100], ids=["streamed", "small-ones-persistent"])
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_without_clipping_every_warm_step_runs_in_backward(setup, persistent, tmp_path):
    # Persistent params in CPU memory are gathered as their stored partition itself: the commit's swap
    # must reach them (the step releases them first and gathers them again after).
    seen = run(tmp_path, setup, 3, stage3_param_persistence_threshold=persistent)
    assert counts(seen, "steps_in_backward") == [0, 1, 1]
    assert counts(seen, "steps_ordinary") == [1, 0, 0]


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_clipping_that_bites_is_redone_then_deferred(setup, tmp_path):
    seen = run(tmp_path, setup, len(BITES), clip=BITES)
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 0, 0, 1]
    assert counts(seen, "steps_redone") == [0, 0, 1, 0, 0, 0]
    assert counts(seen, "steps_deferred") == [0, 0, 0, 1, 1, 0]
    assert seen[2]["steps_ordinary_reason"].startswith("clipping bit (gradient scale ")


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_accumulation_updates_in_the_boundary_backward(setup, tmp_path):
    seen = run(tmp_path, setup, 4, gas=2)
    assert counts(seen, "steps_in_backward") == [0, 1, 1, 1]


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_accumulation_with_clipping_that_bites(setup, tmp_path):
    seen = run(tmp_path, setup, 5, gas=2, clip=[1e6, 1e6, 1e-3, 1e6, 1e6])
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 0, 1]
    assert counts(seen, "steps_redone") == [0, 0, 1, 0, 0]
    assert counts(seen, "steps_deferred") == [0, 0, 0, 1, 0]


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_bf16_overflow_drops_the_early_step_and_skips(setup, tmp_path):
    seen = run(
        tmp_path,
        setup,
        5,
        loss_mult=[1.0, 1.0, 1e38, 1.0, 1.0],
        bf16={"enabled": True, "check_grad_overflow": True},
    )
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 1, 1]
    assert counts(seen, "steps_overflow_dropped") == [0, 0, 1, 0, 0]


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_fp16_loss_scale_is_the_factor_the_early_step_runs_with(setup, tmp_path):
    seen = run(
        tmp_path,
        setup,
        5,
        loss_mult=[1.0, 1.0, 6e4, 1.0, 1.0],
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
    )
    assert counts(seen, "steps_in_backward") == [0, 1, 0, 1, 1]
    assert counts(seen, "steps_overflow_dropped") == [0, 0, 1, 0, 0]


DEVICE_CASES: dict[str, tuple[dict[str, Any], list[int]]] = {
    "no-clip": ({}, [0, 1, 1, 1, 1]),
    "clip-bites": ({"clip": [1e6, 1e6, 1e-3, 1e6, 1e6]}, [0, 1, 0, 0, 1]),
    "gas2-clip-bites": ({"gas": 2, "clip": [1e6, 1e6, 1e-3, 1e6, 1e6]}, [0, 1, 0, 0, 1]),
    "bf16": ({"bf16": {"enabled": True}}, [0, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_on_the_stand_in_device(setup, case, tmp_path):
    """The device path: each param's partition and gradient are copied to the host (the stand-in runs a
    copy only when waited for and poisons its destination until then) and updated there."""
    kwargs, expect = DEVICE_CASES[case]
    seen = run(tmp_path, setup, 5, device=True, **kwargs)
    assert counts(seen, "steps_in_backward") == expect


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "stand-in"])
@pytest.mark.parametrize("clip", [1e6, 1e-3], ids=["in-backward", "deferred"])
@pytest.mark.parametrize("setup", SETUPS[1:], ids=SETUP_IDS[1:])
def test_bf16_params_in_memory_are_not_copied_for_their_update(setup, clip, device, tmp_path, monkeypatch):
    """A bf16 param past its first step is only written by its update (the kernel steps its float32 master
    and rounds it into the param): with its partition in CPU memory the early step takes a buffer for it at
    its gradient (reserved for the commit) but copies nothing into it — no host copy, and on a device no
    device-to-host copy. Bitwise the ordinary step from buffers that start as NaN."""
    poisoned_copies(monkeypatch)
    alloc, memcpy, d2h = early_memory.alloc, early_memory._memcpy, StandInDevice.d2h
    last: list[Any] = [None]  # the buffer the early step took last: a param copy's, made right before
    into_param: list[bool] = []  # each copy made: whether into a bf16 param's (records are float32)

    def noted(st: Any, like: torch.Tensor) -> torch.Tensor:
        last[0] = alloc(st, like)
        return last[0]

    def host_copy(dst: torch.Tensor, src: torch.Tensor) -> Any:
        into_param.append(dst is last[0] and dst.dtype == torch.bfloat16)
        return memcpy(dst, src)

    def device_copy(dev: StandInDevice, t: torch.Tensor, out: torch.Tensor) -> Any:
        into_param.append(out is last[0] and out.dtype == torch.bfloat16)
        return d2h(dev, t, out)

    monkeypatch.setattr(early_memory, "alloc", noted)
    monkeypatch.setattr(early_memory, "_memcpy", host_copy)
    monkeypatch.setattr(StandInDevice, "d2h", device_copy)
    seen = run(tmp_path, setup, 4, clip=[1e6] + [clip] * 3, device=device, bf16={"enabled": True})
    assert counts(seen, "steps_in_backward") == ([0, 1, 1, 1] if clip > 1 else [0, 0, 0, 0])
    assert counts(seen, "steps_deferred") == ([0, 0, 0, 0] if clip > 1 else [0, 0, 1, 1])
    assert not any(into_param)  # (the old code copied every one: True here from the second step on)


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_the_stored_state_changes_only_when_the_step_commits(setup, tmp_path):
    """Copies, not the undo log: between backward and step the params and records as stored (and read
    through the public ways: GatheredParameters, the optimizer's records) are the previous step's."""
    runs = twins(tmp_path, setup)
    (m, e), (ref, ref_e) = runs
    for step in range(3):
        before = state(m, e)
        for mm, ee in runs:
            ee.backward(sq(mm(ids(seed=step))))
        assert same(state(m, e), before), step
        assert e._early is not None and e._early.state == "running"
        for _, ee in runs:
            ee.step()
        assert same(state(m, e), state(ref, ref_e)), step
        assert not same(state(m, e), before)
    assert e._early.commits == 2
    for _, ee in runs:
        ee.close()


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_what_happens_between_backward_and_step_is_honoured(setup, tmp_path):
    runs = twins(tmp_path, setup, keep=True)
    (m, e), (ref, ref_e) = runs

    def check(commits: int) -> None:
        assert same(state(m, e), state(ref, ref_e))
        assert e._early.commits == commits

    for mm, ee in runs:
        ee.backward(sq(mm(ids(seed=0))))
        ee.step()
    for mm, ee in runs:  # an lr change between backward and step: the step redoes the update with it
        ee.backward(sq(mm(ids(seed=1))))
        ee.optimizer.param_groups[0]["lr"] = 3e-2
        ee.step()
    check(1)
    assert e.stats()["steps_hypers_redone"] == 1
    for mm, ee in runs:  # betas set: deferred (the step before set the lr), so updated at the step
        ee.backward(sq(mm(ids(seed=9))))
        ee.optimizer.param_groups[0]["betas"] = (0.8, 0.99)
        ee.step()
    check(2)
    for mm, ee in runs:  # a second backward accumulates: no early step
        sq(mm(ids(seed=2))).backward()
        sq(mm(ids(seed=3))).backward()
        ee.step()
    check(2)
    for mm, ee in runs:  # zero_grad drops the early step with the gradients
        sq(mm(ids(seed=4))).backward()
        ee.zero_grad()
        sq(mm(ids(seed=5))).backward()
        ee.step()
    check(3)
    for mm, ee in runs:  # a param rewritten between backward and step is what the step updates
        sq(mm(ids(seed=6))).backward()
        first = next(mm.parameters())
        with GatheredParameters([first], modifier_rank=0):
            first.data.mul_(0.5)
        ee.step()
    check(3)
    for mm, ee in runs:  # the optimizer's state loaded between backward and step: records written
        sq(mm(ids(seed=7))).backward()
        ee.optimizer.load_state_dict(ee.optimizer.state_dict())
        ee.step()
    check(3)
    assert "written between backward and step" in e.stats()["steps_ordinary_reason"]
    for mm, ee in runs:
        sq(mm(ids(seed=8))).backward()
        ee.step()
    check(4)
    for _, ee in runs:
        ee.close()


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_copies_past_any_part_take_the_ordinary_step_and_say_why(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(earlystep, "CAP_EXTRA", 0)  # the cap: the live budget only (1500 elements)
    seen = run(tmp_path, setup, 3)
    assert counts(seen, "steps_in_backward") == [0, 0, 0]
    why = seen[-1]["steps_ordinary_reason"]
    assert why.startswith("the copies of the optimizer records and params kept in CPU memory (")
    assert "bytes) and the param copies and gradients held while backward runs (16384) exceed " in why
    assert f"exceed the early step's cap of {1500 * 4} bytes, even for the first records backward " in why


PART_CAP = 2 * 8192 + 10_000
"""A cap the copies of a part fit: room for two records' param copies and gradients (TinyLM's widest
record's params hold 8192 bytes) and 10,000 bytes of copies kept for the commit — in each setup the
records backward completes first, short of all."""

PART_CASES = {
    "plain": {},
    "clipping-bites": {"clip": BITES},
    "gas-2": {"gas": 2},
    "gas-2-clipping-bites": {"gas": 2, "clip": [1e6, 1e6, 1e-3, 1e6, 1e6]},
    "stand-in": {"device": True},
    "stand-in-clipping-bites": {"device": True, "clip": BITES},
}


@pytest.mark.parametrize("case", PART_CASES, ids=list(PART_CASES))
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_copies_past_the_cap_update_the_part_that_fits_in_backward(setup, case, tmp_path):
    """The records backward completes first are updated in backward, the others by the ordinary step in
    the same commit: bitwise the ordinary step (`run`) in every case of `zswap.step.speculation`."""
    kw: dict[str, Any] = PART_CASES[case]
    steps = len(kw.get("clip", [None] * 4))
    seen = run(tmp_path, setup, steps, cap=PART_CAP, **kw)
    clip = kw.get("clip", [None] * steps)
    bit = [c is not None and c < 1 for c in clip]
    after_bite = [step > 0 and bit[step - 1] for step in range(steps)]
    in_backward = [int(step > 0 and not bit[step] and not after_bite[step]) for step in range(steps)]
    assert counts(seen, "steps_in_backward") == in_backward
    assert counts(seen, "steps_in_backward_partly") == in_backward
    why = next(s["steps_partly_reason"] for s in seen if s["steps_in_backward_partly"])
    assert why.startswith("the copies of the optimizer records and params kept in CPU memory (")
    found = re.search(rf"cap of {PART_CAP} bytes: (\d+) of 22 params updated in backward$", why)
    assert found is not None and 0 < int(found[1]) < 22, why
    assert counts(seen, "steps_deferred") == [int(a) for a in after_bite]


@pytest.mark.parametrize("setup", SETUPS[:2], ids=SETUP_IDS[:2])
def test_a_failed_ordinary_part_changes_nothing(setup, tmp_path, monkeypatch):
    """The params past the cap take their ordinary step in the early step's commit, in its transaction:
    where it fails after it changed their records and partitions, nothing changed. Gradients in memory
    were kept, so the step runs again; on NVMe the part updated in backward let its gradients go, so the
    step raises `GradientsNotKeptError` and backward runs again. Either way bitwise the twin's. (With
    both in CPU memory no I/O takes part: nothing can fail there, `Transaction.fallible`.)"""
    runs = twins(tmp_path, setup)
    (m, e), (ref, ref_e) = runs
    e._early.cap = PART_CAP
    for mm, ee in runs:
        for seed in range(2):
            ee.backward(sq(mm(ids(seed=seed))))
            ee.step()
    assert e.stats()["steps_in_backward_partly"] == 1
    before = state(m, e)
    for mm, ee in runs:
        ee.backward(sq(mm(ids(seed=2))))
    ordinary_part = bridge.step_indices

    def failing(*args: Any) -> None:  # every record and partition of the ordinary part written, then a fault
        ordinary_part(*args)
        raise OSError(errno.EIO, "injected after the ordinary part")

    monkeypatch.setattr(bridge, "step_indices", failing)
    kept = setup[1] == "cpu"  # gradients in memory (states there)
    with pytest.raises(OSError if kept else GradientsNotKeptError) as raised:
        e.step()
    monkeypatch.setattr(bridge, "step_indices", ordinary_part)
    assert same(state(m, e), before)
    if not kept:
        assert "the ordinary step of the params past its cap failed ([Errno 5] injected" in str(raised.value)
        e.zero_grad()
        e.backward(sq(m(ids(seed=2))))
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e.stats()["steps_in_backward_partly"] == 1 + (not kept)
    for _, ee in runs:
        ee.close()


@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_a_warm_step_reads_no_param_or_gradient_for_the_step(setup, tmp_path):
    """Per warm step: states in CPU memory, params on NVMe — the early step reads exactly one model's
    bytes less than the ordinary one (the step's read of every param; gradients are in memory) and
    writes the same (the params, once); params in CPU memory, states on NVMe — only the records move
    (AdamW's two fp32 moments: read and written once each, 2 × the params' fp32 bytes), against the
    ordinary step's gradients written and read besides; both in memory — nothing."""
    runs = twins(tmp_path, setup)
    (m, e), (ref, ref_e) = runs
    no_seeds(e, ref_e)  # the next forward reads as the twin's
    nbytes = model_bytes(m)
    for step in range(4):
        moved = []
        for mm, ee in runs:
            ee.stats(reset=True)
            ee.backward(sq(mm(ids(seed=step))))
            ee.step()
            s = ee.stats()
            moved.append((s["bytes_read"], s["bytes_written"]))
        assert same(state(m, e), state(ref, ref_e)), step
    (read, written), (ref_read, ref_written) = moved
    assert e._early.commits == 3
    if setup == ("nvme", "cpu"):
        assert (read, written) == (ref_read - nbytes, nbytes) and ref_written == nbytes
    elif setup == ("cpu", "nvme"):
        assert (read, written) == (2 * nbytes, 2 * nbytes)
        assert (ref_read, ref_written) == (3 * nbytes, 3 * nbytes)
    else:
        assert (read, written, ref_read, ref_written) == (0, 0, 0, 0)
    for _, ee in runs:
        ee.close()


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("setup", SETUPS[:2], ids=SETUP_IDS[:2])
def test_a_fault_in_backward_falls_back_or_fails_that_backward(setup, op, where, tmp_path):
    """A failed transfer in the early step's backward: the backward either succeeds (the early step is
    dropped, and `step` gives the exact ordinary result) or raises and counts for nothing (run again);
    the stored state is the previous step's either way."""
    runs = twins(tmp_path, setup)
    (m, e), (ref, ref_e) = runs
    for mm, ee in runs:
        ee.backward(sq(mm(ids(seed=0))))
        ee.step()
    swap, ref_swap = engine_of(m, e.optimizer), engine_of(ref, ref_e.optimizer)
    kind = "reads" if op == "read" else "writes"
    n = int(ref_swap.stats()[kind])
    sq(ref(ids(seed=1))).backward()
    n = int(ref_swap.stats()[kind]) - n
    before = state(m, e)
    out = m(ids(seed=1))
    inject(swap, op, errno.EIO, int(where * max(n - 1, 0)))
    try:
        sq(out).backward()
    except SwapIOError:
        swap._engine.clear_faults()
        assert same(state(m, e), before)
        e.zero_grad()  # gradients in memory keep what the failed backward added (none on NVMe)
        sq(m(ids(seed=1))).backward()
    swap._engine.clear_faults()
    for _, ee in runs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    for mm, ee in runs:  # and the next step is early again, and exact
        ee.backward(sq(mm(ids(seed=2))))
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e.stats()["steps_in_backward"] >= 1
    for _, ee in runs:
        ee.close()


@pytest.mark.dist
def test_two_ranks_update_their_partitions_in_backward_bitwise(tmp_path):
    run_ranks(Path(__file__).with_name("_early_cputier_dist_worker.py"), tmp_path)


@pytest.mark.parametrize("device", ["cpu", "stand-in"])
@pytest.mark.parametrize("clip", [None, 1e6, 1e-3], ids=["off", "not-biting", "biting"])
def test_resident_params_with_states_in_memory_read_nothing(clip, device, tmp_path):
    """``offload_param.max_in_cpu`` covering the model, states in CPU memory: the updated copies become
    the gathered copies at the commit (on a compute device, what they are gathered from again), so a warm
    step reads nothing and writes the params once."""
    s, nbytes = resident_twins(tmp_path, "cpu", clip, device=device)
    assert s["steps_in_backward"] + s["steps_deferred"] == 1
    assert (s["bytes_read"], s["bytes_written"]) == (0, nbytes)


@pytest.mark.parametrize("change", ["lr", "betas", "written"])
@pytest.mark.parametrize("setup", SETUPS, ids=SETUP_IDS)
def test_a_change_after_backward_with_applied_gradients_not_kept(setup, change, tmp_path):
    """``keep_applied_grads`` false: gradients on NVMe (states there) were let go in backward, so a change
    between backward and step raises `GradientsNotKeptError` and changes nothing, as with everything on
    NVMe; gradients in memory are kept, so the ordinary step runs instead, bitwise the twin's. An lr
    change is redone at the step from the staged moments on every tier: made live, bitwise the twin's."""
    runs = twins(tmp_path, setup)
    (m, e), (ref, ref_e) = runs
    for mm, ee in runs:
        ee.backward(sq(mm(ids(seed=0))))
        ee.step()
        ee.backward(sq(mm(ids(seed=1))))
        if change == "lr":
            ee.optimizer.param_groups[0]["lr"] = 3e-2
        elif change == "betas":
            ee.optimizer.param_groups[0]["betas"] = (0.8, 0.99)
        else:
            first = next(mm.parameters())
            with GatheredParameters([first], modifier_rank=0):
                first.data.mul_(0.5)
    before = state(m, e)
    if change == "lr":
        for _, ee in runs:
            ee.step()
        assert same(state(m, e), state(ref, ref_e))
        assert e._early.commits == 1 and e.stats()["steps_hypers_redone"] == 1
        for _, ee in runs:
            ee.close()
        return
    if setup[1] == "nvme":
        with pytest.raises(GradientsNotKeptError, match=r"engine\.step\(\)"):
            e.step()
        assert same(state(m, e), before)
        for _, ee in runs:
            ee.close()
        return
    for _, ee in runs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 0 and e.stats()["steps_ordinary"] == 2
    for _, ee in runs:
        ee.close()


@pytest.mark.parametrize("setup", SETUPS[1:], ids=SETUP_IDS[1:])
def test_copies_kept_for_the_commit_are_counted_while_held(setup, tmp_path):
    """Between backward and step the copies kept in CPU memory are ordinary tensors the early step
    holds: ``mem_early_step_tensors`` has every byte of them (each param's partition; with states in
    CPU memory each record too), and none once the step committed them into their stores."""
    (m, e), (_, ref_e) = twins(tmp_path, setup)
    ref_e.close()
    e.backward(sq(m(ids(seed=0))))
    e.step()
    base = e.stats()["mem_early_step_tensors"]
    e.backward(sq(m(ids(seed=1))))
    records = sum(sg.record_numel * 4 for sg in e.optimizer.records.sub_groups) if setup[1] == "cpu" else 0
    assert e.stats()["mem_early_step_tensors"] - base == model_bytes(m) + records
    e.step()
    assert e._early.commits == 1
    assert e.stats()["mem_early_step_tensors"] == base
    e.close()
