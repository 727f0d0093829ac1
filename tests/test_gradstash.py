"""Fewer bytes per step without other results: gradients kept in memory (`zswap.gradstore`, the *stash*)
instead of written to NVMe, and params a forward's last modules release kept gathered for their backward
(`zswap.prefetch`).

Each stash test trains twins over the same model — one keeping gradients in memory (all of them, or only
some: ``grad_stash_bytes`` between), the other writing every one (``grad_stash_bytes = 0``) with the early
step off, the ordinary step as it always ran — and asserts params, optimizer records, step counters and
gradients bitwise equal; and that what happens between backward and step (``full_grad``, a second backward,
``zero_grad``, an lr change, a param rewritten through GatheredParameters, a checkpoint) and a fault in
backward leave both alike.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import GatheredParameters, full_grad, param_state

from .test_earlystep import model_bytes, state, train, train_counting_forward_reads
from .test_faults import cfg_for, engine_of, grads_of, inject, same
from .test_runtime import TinyLM, all_released, assert_same_grads, build, engine_for, ids, no_seeds, sq

ALL = 1 << 30


def twins(tmp_path: Path, stash: int, **extra: Any) -> tuple[Any, Any]:
    """(keeping up to ``stash`` bytes of gradients, early step on; writing all, early step off)."""
    runs = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, keep in (("kept", stash), ("written", 0)):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme", **extra)
        m, _ = build(TinyLM, cfg)
        e = engine_for(m, cfg)
        e.grad_stash_bytes = keep
        e.early_step = keep > 0
        e.keep_applied_grads = True  # stored, so kept in the stash (not kept: tests/test_applied_grads.py)
        runs.append((m, e))
    return runs[0], runs[1]


def test_kept_gradients_are_never_written_and_every_step_is_bitwise_the_written_ones(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path, ALL)
    no_seeds(e, ref_e)  # each forward reads what the step wrote, as the twin's does
    train([(m, e), (ref, ref_e)], 0)  # the first step places the records: never early
    grad_bytes = model_bytes(m)
    for seed in range(1, 4):
        moved = []
        for mm, ee in ((m, e), (ref, ref_e)):
            ee.stats(reset=True)
            sq(mm(ids(seed=seed))).backward()
            if mm is m:
                assert ee.stats()["grad_stash_bytes"] == grad_bytes  # every gradient in memory
            ee.step()
            s = ee.stats()
            moved.append((s["bytes_read"], s["bytes_written"]))
            assert s["grad_stash_bytes"] == 0  # the step let go of them
        assert same(state(m, e), state(ref, ref_e)), seed
        # not written: the gradients; not read at the step: params and gradients
        assert moved[1][1] - moved[0][1] == grad_bytes, moved
        assert moved[1][0] - moved[0][0] == 2 * grad_bytes, moved
    assert e._early.commits == 3 and ref_e._early.commits == 0
    e.close()
    ref_e.close()


@pytest.mark.parametrize("stash", [ALL, 900])  # every gradient kept; some kept, the rest written
def test_what_happens_between_backward_and_step_sees_kept_gradients(stash, tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path, stash)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    # full_grad after backward: the gradients are there, equal to plain PyTorch's
    for mm, _ in pairs:
        sq(mm(ids(seed=1))).backward()
    kept = e.stats()["grad_stash_bytes"]
    assert 0 < kept <= stash
    assert kept == model_bytes(m) or stash < model_bytes(m)
    assert same(grads_of(m), grads_of(ref))
    # an lr change between backward and step is used by the step
    for _, ee in pairs:
        ee.optimizer.param_groups[0]["lr"] = 3e-2
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    # a second backward accumulates onto the kept gradients
    for mm, _ in pairs:
        sq(mm(ids(seed=2))).backward()
        sq(mm(ids(seed=3))).backward()
    assert same(grads_of(m), grads_of(ref))
    for _, ee in pairs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    # zero_grad after backward drops the kept gradients
    for mm, ee in pairs:
        sq(mm(ids(seed=4))).backward()
        ee.zero_grad()
        assert ee.stats()["grad_stash_bytes"] == 0
        assert all(full_grad(p) is None for p in mm.parameters())
        sq(mm(ids(seed=5))).backward()
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    # a param rewritten between backward and step is what the step updates
    for mm, ee in pairs:
        sq(mm(ids(seed=6))).backward()
        first = next(mm.parameters())
        with GatheredParameters([first], modifier_rank=0):
            first.data.mul_(0.5)
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    # a checkpoint between backward and step, then the step
    for i, (mm, ee) in enumerate(pairs):
        sq(mm(ids(seed=7))).backward()
        ee.save_checkpoint(tmp_path / f"ckpt{i}")
    assert same(grads_of(m), grads_of(ref))
    for _, ee in pairs:
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    train(pairs, 8)
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits >= 2
    e.close()
    ref_e.close()


def test_kept_gradients_equal_plain_pytorchs(tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as e:
        e.grad_stash_bytes = ALL
        for seed in range(2):
            sq(m(ids(seed=seed))).backward()
            sq(ref(ids(seed=seed))).backward()
            assert e.stats()["grad_stash_bytes"] == model_bytes(m)
            assert_same_grads(m, ref)  # after two backwards: accumulated from memory
        assert all_released(m)


@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("write", errno.EIO), ("read", errno.EIO)])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_fault_in_backward_with_kept_gradients_gives_the_written_ones_result(op, code, where, tmp_path):
    """Some gradients kept, the rest written: a fault in one of backward's transfers either fails that
    backward (nothing counts, kept gradients included: it runs again) or drops the early step; the step
    is then exactly the one over written gradients."""
    (m, e), (ref, ref_e) = twins(tmp_path, 900)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    swap = engine_of(m)
    ref_swap = engine_of(ref)
    key = "reads" if op == "read" else "writes"
    n = int(ref_swap.stats()[key])
    out = m(ids(seed=1))
    sq(ref(ids(seed=1))).backward()
    n = int(ref_swap.stats()[key]) - n
    before = int(swap.stats()[key])
    inject(swap, op, code, int(where * max(n - 1, 0)))
    try:
        sq(out).backward()
        raised = False
    except zswap.SwapIOError:
        raised = True
        assert all(full_grad(p) is None for p in m.parameters())
        assert e.stats()["grad_stash_bytes"] == 0  # the failed backward's kept gradients went too
    swap._engine.clear_faults()
    if raised:
        sq(m(ids(seed=1))).backward()
    else:
        assert int(swap.stats()[key]) > before  # the fault was hit (not a write the stash saved)
    assert same(grads_of(m), grads_of(ref))
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    train(pairs, 2)
    assert same(state(m, e), state(ref, ref_e))
    e.close()
    ref_e.close()


def test_grad_stash_bytes_takes_a_non_negative_int(tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as e:
        assert e.grad_stash_bytes == 0  # default: every gradient written (memory: benches/README)
        for bad in (-1, 1.5, True, "1"):
            with pytest.raises(ValueError, match="grad_stash_bytes"):
                e.grad_stash_bytes = bad
        e.grad_stash_bytes = 0
        sq(m(ids(seed=0))).backward()
        assert e.stats()["grad_stash_bytes"] == 0


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_last_forward_modules_stay_gathered_for_their_backward(tier, tmp_path):
    """Six Linears of 272 elements, a live budget of three, reuse distance 0: the last two are kept from
    their forward to their backward (all they need until then fits in the budget, with room left for the
    read of the third), so a training pass fetches 6 + 4 layers, not 6 + 6; gradients are bitwise plain
    PyTorch's."""
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": tier, **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})},
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 3 * 272,
            "stage3_prefetch_bucket_size": 2 * 272,
            "stage3_max_reuse_distance": 0,
        }
    }
    m, ref = build(Chain, cfg)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with engine_for(m, cfg) as e:
        for it in range(3):
            e.stats(reset=True)
            sq(m(x)).backward()
            sq(ref(x)).backward()
            s = e.stats()
            assert s["fetches"] == 2 * (6 + 4), (it, s["fetches"])
            assert s["peak_live_elements"] <= 3 * 272
            assert_same_grads(m, ref)
            assert all_released(m)
            e.zero_grad()
            ref.zero_grad()
        with torch.no_grad():  # inference: no backward follows, nothing is kept
            e.stats(reset=True)
            assert torch.equal(m(x), ref(x))
            assert e.stats()["fetches"] == 12 and all_released(m)


def test_the_next_forward_starts_from_the_params_the_early_step_kept(tmp_path):
    """After a committed early step the last params backward completed (the first the next forward uses)
    are gathered from their updated copies when the next pass begins: that forward reads fewer bytes, and
    logits, params and records are bitwise those of the ordinary step. Between step and forward nothing
    is gathered; a GatheredParameters change without modifier_rank is dropped as ever, and one written
    back with it is what the next forward sees (that copy is no longer used)."""
    (m, e), (ref, ref_e) = twins(tmp_path, 0)
    e.early_step = True
    assert e._early is not None and e._early.seed_numel == e.sizing.budget.max_live  # on by default
    e.keep_applied_grads = False  # the default
    pairs = [(m, e), (ref, ref_e)]
    for _, ee in pairs:  # a forward's reads, counted alone: none issued ahead by the step before it
        ee.prefetch_across_passes = False
    no_seeds(ref_e)  # its forward reads every param (the ordinary step's seeds: tests/test_seeds.py)
    train(pairs, 0)
    for seed in range(1, 4):
        reads = train_counting_forward_reads(pairs, seed)  # nothing gathered between step and forward
        assert same(state(m, e), state(ref, ref_e)), seed
        if seed > 1:  # after a committed early step
            assert reads[0] < reads[1], reads
    assert e._early.commits == 3
    with torch.no_grad():  # a pass of another kind (eval, no grad) starts from them too, then lets go
        for mm, _ in pairs:
            mm.eval()
        assert torch.equal(m(ids(seed=8)), ref(ids(seed=8)))
        assert all_released(m)
        for mm, _ in pairs:
            mm.train()
    for edit, modifier in ((0.5, None), (2.0, 0)):
        train(pairs, 9)
        for mm, _ in pairs:
            params = list(mm.parameters())
            if modifier is None:
                changed = pytest.warns(
                    zswap.ZswapWarning, match="changed inside a block without modifier_rank"
                )
                with changed, GatheredParameters(params):
                    for p in params:
                        p.data.mul_(edit)
            else:
                with GatheredParameters(params, modifier_rank=modifier):
                    for p in params:
                        p.data.mul_(edit)
        outs = [mm(ids(seed=10)) for mm, _ in pairs]
        assert torch.equal(outs[0], outs[1]), modifier
        for (_, ee), out in zip(pairs, outs, strict=True):
            sq(out).backward()
            ee.step()
        assert same(state(m, e), state(ref, ref_e)), modifier
    e.close()
    ref_e.close()
    assert all_released(m)


@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 2}])
def test_with_clipping_the_norm_comes_from_backward_and_no_gradient_is_read_for_it(extra, tmp_path):
    """Clipping on NVMe gradients, every one written: the norm of each stored gradient is taken in
    backward (of the sum, with accumulation), so the ordinary step reads the gradients once (for the
    update) rather than twice; norm, params and records are bitwise those of the step that reads them for
    it. (The early step, off here, holds the gradients of a step it defers and notes their norms itself.)"""
    runs = []
    for name in ("backward", "read"):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme", gradient_clipping=0.05, **extra)
        m, _ = build(TinyLM, cfg)
        e = engine_for(m, cfg)
        e.early_step = False
        e.grad_stash_bytes = 0
        if name == "read":
            for gs in e._grad_stores:
                gs.norms_wanted = lambda: False
        runs.append((m, e))
    (m, e), (ref, ref_e) = runs
    gas = extra.get("gradient_accumulation_steps", 1)
    for step in range(3):
        moved = []
        for mm, ee in runs:
            ee.stats(reset=True)
            for micro in range(gas):
                sq(mm(ids(seed=10 * step + micro))).backward()
                ee.step()
            moved.append(ee.stats()["bytes_read"])
        assert e.last_grad_norm is not None and e.last_grad_norm == ref_e.last_grad_norm
        assert e.last_grad_norm > 0.05  # really clips
        assert same(state(m, e), state(ref, ref_e)), step
        assert moved[1] - moved[0] == model_bytes(m), moved
    e.close()
    ref_e.close()


def test_a_kept_gradient_that_views_a_larger_buffer_keeps_only_its_own_bytes(tmp_path):
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as e:
        e.grad_stash_bytes = ALL
        p = m.head.weight
        st = param_state(p)
        big = torch.randn(3 * st.numel)
        st.grad_store.add(st, big[st.numel : 2 * st.numel])  # outside backward: committed at the next use
        assert torch.equal(full_grad(p), big[st.numel : 2 * st.numel].view(st.shape))
        kept = st.grad_store._stash[st.grad_store.key(st)]
        assert kept.untyped_storage().nbytes() == st.numel * 4  # not the whole buffer's
        assert e.stats()["grad_stash_bytes"] == st.numel * 4


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_tied_embedding_stays_gathered_between_its_uses_within_the_room_prefetch_leaves(tier, tmp_path):
    """TinyLM's tied embedding (640 elements) is used by forward's first and last steps and backward's
    first and last: with ``max_live - bucket`` ≥ 640 it is kept between them (gathered once per training
    pass, not three times), with less it is not; gradients are bitwise plain PyTorch's either way."""
    fetches = {}
    for room in (1000, 500):
        cfg = {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": tier, **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})},
                "stage3_param_persistence_threshold": 0,
                "stage3_max_live_parameters": 3000,
                "stage3_prefetch_bucket_size": 3000 - room,
            }
        }
        m, ref = build(TinyLM, cfg)
        with engine_for(m, cfg) as e:
            for it in range(3):
                e.stats(reset=True)
                sq(m(ids(seed=it))).backward()
                sq(ref(ids(seed=it))).backward()
                s = e.stats()
                assert s["peak_live_elements"] <= 3000
                assert_same_grads(m, ref)
                assert all_released(m)
                e.zero_grad()
                ref.zero_grad()
            fetches[room] = s["fetches"]
    assert fetches[500] - fetches[1000] == 2, fetches
