"""The early step (`zswap.earlystep`): OffloadedAdamW updates run in backward and `Engine.step` commits them.

Each test trains twins — one with ``engine.early_step`` on, one with it off — and asserts the params
(through GatheredParameters), the optimizer records and the step counters are bitwise equal after every
step; that the early step really ran (its commit counter) where it may, and did not where it may not; that
it moves fewer bytes; and that what happens between backward and step (``full_grad``, an lr change, a
second backward, ``zero_grad``, a param rewritten through GatheredParameters, a fault) is honoured.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import GatheredParameters, earlystep, full_grad, param_state

from .test_faults import cfg_for, engine_of, inject, optim_state, params_of, same
from .test_runtime import TinyLM, all_released, build, engine_for, ids, no_seeds, sq


def twins(tmp_path: Path, stash: int | None = None, keep: bool = True, **extra: Any) -> tuple[Any, Any]:
    """(early step on, off) over the same model; ``stash``: both engines' ``grad_stash_bytes``; ``keep``:
    the early one's ``keep_applied_grads`` (its gradients stored too, so every case between backward and
    step falls back; not kept, the default: tests/test_applied_grads.py)."""
    runs = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, early in (("early", True), ("plain", False)):
        cfg = cfg_for(tmp_path / name, "nvme", "nvme", **extra)
        m, _ = build(TinyLM, cfg)
        e = engine_for(m, cfg)
        e.early_step = early
        e.keep_applied_grads = keep
        if stash is not None:
            e.grad_stash_bytes = stash
        runs.append((m, e))
    return runs[0], runs[1]


def model_bytes(m: Any) -> int:
    return sum(param_state(p).partition_numel * p.dtype.itemsize for p in m.parameters())


def state(m: Any, e: zswap.Engine) -> Any:
    return params_of(m), optim_state(e.optimizer, m)


def train(pairs: Any, seed: int) -> None:
    for m, e in pairs:
        sq(m(ids(seed=seed))).backward()
        e.step()


def train_counting_forward_reads(pairs: Any, seed: int) -> list[int]:
    """`train` from models with nothing gathered (kept values are not gathered between step and forward),
    their logits bitwise alike; returns the bytes each forward read."""
    reads, outs = [], []
    for m, e in pairs:
        assert all_released(m)
        e.stats(reset=True)
        outs.append(m(ids(seed=seed)))
        reads.append(e.stats()["bytes_read"])
        sq(outs[-1]).backward()
        e.step()
    assert torch.equal(outs[0], outs[1]), seed
    return reads


def test_steps_are_bitwise_those_of_the_ordinary_step_and_move_fewer_bytes(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path, stash=0)  # every gradient written (tests/test_gradstash.py: kept)
    no_seeds(e, ref_e)  # each forward reads what the step wrote, as the twin's does
    train([(m, e), (ref, ref_e)], 0)  # the first step places the records: never early
    assert e._early is not None and e._early.commits == 0
    nbytes = model_bytes(m)
    for seed in range(1, 4):
        moved = []
        for mm, ee in ((m, e), (ref, ref_e)):
            ee.stats(reset=True)
            sq(mm(ids(seed=seed))).backward()
            ee.step()
            s = ee.stats()
            moved.append((s["bytes_read"], s["bytes_written"]))
        assert same(state(m, e), state(ref, ref_e)), seed
        # the same writes (gradients, records, params); no step-time read of params and gradients
        assert moved[1][0] - moved[0][0] == 2 * nbytes and moved[0][1] == moved[1][1], moved
    assert e._early.commits == 3
    assert ref_e._early is not None and ref_e._early.commits == 0
    e.close()
    ref_e.close()


def test_what_happens_between_backward_and_step_is_honoured(tmp_path):
    (m, e), (ref, ref_e) = twins(tmp_path)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    # full_grad after backward: the gradients are still there
    for mm, _ in pairs:
        sq(mm(ids(seed=1))).backward()
    assert same([full_grad(p) for p in m.parameters()], [full_grad(p) for p in ref.parameters()])
    # an lr change between backward and step is used by the step (the update in backward redone)
    for _, ee in pairs:
        ee.optimizer.param_groups[0]["lr"] = 3e-2
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1 and e.stats()["steps_hypers_redone"] == 1
    # a second backward accumulates: no early step
    for mm, ee in pairs:
        sq(mm(ids(seed=2))).backward()
        sq(mm(ids(seed=3))).backward()
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 1
    # zero_grad after backward drops the gradients and the early step with them
    for mm, ee in pairs:
        sq(mm(ids(seed=4))).backward()
        ee.zero_grad()
        sq(mm(ids(seed=5))).backward()
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 2  # the backward after zero_grad stepped early
    # a param rewritten between backward and step is what the step updates
    for mm, ee in pairs:
        sq(mm(ids(seed=6))).backward()
        first = next(mm.parameters())
        with GatheredParameters([first], modifier_rank=0):
            first.data.mul_(0.5)
        ee.step()
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits == 2
    e.close()
    ref_e.close()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("write", errno.EIO), ("read", errno.EIO)])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_fault_in_the_early_step_falls_back_to_the_exact_ordinary_step(op, code, where, keep, tmp_path):
    """A fault in one of backward's transfers: if it hit a gradient write (or, applied gradients not
    kept, one of the early step's after it let one go), backward raises and nothing counts; else backward
    succeeds, the early step is dropped and `step` gives the exact result."""
    (m, e), (ref, ref_e) = twins(tmp_path, keep=keep)
    pairs = [(m, e), (ref, ref_e)]
    train(pairs, 0)
    swap = engine_of(m)
    ref_swap = engine_of(ref)
    n = int(ref_swap.stats()["reads" if op == "read" else "writes"])
    out = m(ids(seed=1))
    sq(ref(ids(seed=1))).backward()
    n = int(ref_swap.stats()["reads" if op == "read" else "writes"]) - n
    before = int(swap.stats()["reads" if op == "read" else "writes"])
    inject(swap, op, code, int(where * max(n - 1, 0)))
    try:
        sq(out).backward()
        raised = False
    except zswap.SwapIOError:
        raised = True
    swap._engine.clear_faults()
    assert int(swap.stats()["reads" if op == "read" else "writes"]) > before
    if raised:  # a gradient (or param) transfer failed: that backward counts for nothing; run it again
        sq(m(ids(seed=1))).backward()
    e.step()
    ref_e.step()
    assert same(state(m, e), state(ref, ref_e))
    train(pairs, 2)  # and the next step is early again, and exact
    assert same(state(m, e), state(ref, ref_e))
    assert e._early.commits >= 1
    e.close()
    ref_e.close()


def test_the_early_step_is_off_where_its_setup_cannot_give_the_same_result(tmp_path):
    # Params or states in CPU memory run it (tests/test_early_cputier.py); params left on their device
    # and an optimizer other than OffloadedAdamW do not.
    cfg = cfg_for(tmp_path / "none", "none", "cpu")
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as e:
        assert e._early is None
        assert e._early_off == "some params stay on their device (offload_param.device none)"
    cfg = cfg_for(tmp_path / "torch", "nvme", "nvme")
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as e:
        assert e._early is None


def test_stats_count_the_bytes_of_every_engine_a_step_uses(tmp_path):
    """Params in memory, states and gradients on NVMe: the traffic is all on the optimizer's engine."""
    cfg = cfg_for(tmp_path, "cpu", "nvme")
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as e:
        swap = e.optimizer._store.engine
        before = swap.stats()
        e.stats(reset=True)
        sq(m(ids(seed=0))).backward()
        e.step()
        s, after = e.stats(), swap.stats()
        assert s["bytes_written"] == after["bytes_written"] - before["bytes_written"] > 0
        assert s["bytes_read"] == after["bytes_read"] - before["bytes_read"]


class _Wide(torch.nn.Module):
    """Three 1 MiB weights: the early step's copies of them are engine buffers (`earlystep.ENGINE_COPY`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_from_the_third_step_on_copies_and_fetches_reuse_pooled_buffers(tmp_path, monkeypatch):
    """The fetch pool keeps what the early step may hold as well as the live budget: a step that maps
    new buffers for its param copies faults in and zeroes their pages, then unmaps them."""
    from zswap.swap import SwapEngine

    one = 512 * 512
    cfg = cfg_for(tmp_path, "nvme", "nvme", stage3_max_live_parameters=2 * one, sub_group_size=one)
    m, _ = build(_Wide, cfg)
    e = engine_for(m, cfg)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    mapped: list[int] = []
    real_empty = SwapEngine.empty

    def counted(self: Any, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        mapped.append(shape[0] if isinstance(shape, tuple) else shape)
        return real_empty(self, shape, dtype)

    in_flight: list[tuple[int, int]] = []  # (bytes of copies being written, bound), after each gradient
    real_take = earlystep.EarlyStep._take

    def take(self: Any, *args: Any) -> None:
        real_take(self, *args)
        in_flight.append((self.copying, self.write_ahead))

    monkeypatch.setattr(earlystep.EarlyStep, "_take", take)
    for step in range(4):
        if step == 2:
            monkeypatch.setattr(SwapEngine, "empty", counted)
        sq(m(x)).backward()
        e.step()
    assert e._early is not None and e._early.commits == 3
    assert mapped == []
    # backward waits for the oldest copy's write only past two sub-groups' params (2 × 1 MiB here)
    assert in_flight and all(n <= bound == 2 * 512 * 512 * 4 for n, bound in in_flight)
    e.close()


def test_records_are_read_ahead_of_their_last_gradient_in_the_last_backward_order(tmp_path, monkeypatch):
    """From the second early step on, every record but the one backward completes first is read before
    its last gradient (along the order the backward before completed them); a record read ahead that no
    gradient comes for (its params frozen) is let go unused; the results stay those of the ordinary step."""
    from zswap.storage import _Write

    def landed(self: Any) -> bool:  # a ring slot's write has always landed when asked: no timing in it
        while not (self.settled or self.handle.done()):
            pass
        return True

    monkeypatch.setattr(_Write, "done", landed)
    (m, e), (ref, ref_e) = twins(tmp_path, keep=False)
    train([(m, e), (ref, ref_e)], 0)  # places the records
    early = e._early
    assert early is not None
    records = len(e.optimizer._sub_groups)
    assert records > 3  # more records than ring slots: the read-ahead has to wait for free ones
    for seed in range(1, 4):
        before = (early.read_ahead, early.read_late)
        train([(m, e), (ref, ref_e)], seed)
        assert same(state(m, e), state(ref, ref_e)), seed
        ahead, late = early.read_ahead - before[0], early.read_late - before[1]
        assert ahead + late == records, seed
        if seed > 1:  # the first early step has no order to follow: only a record's other params
            assert late <= 1, (seed, ahead, late)  # the first one backward completes, unless a gradient
            # of a record completed later came before it
    assert early.read_unused == 0
    last = e.optimizer._sub_groups[-1]  # read ahead first (backward starts at the last params), then frozen
    frozen = {id(e.optimizer._params[s.param]) for s in last.segments}
    names = {n for n, p in m.named_parameters() if id(p) in frozen}
    for mm in (m, ref):
        for n, p in mm.named_parameters():
            p.requires_grad_(n not in names)
    train([(m, e), (ref, ref_e)], 4)
    assert early.commits == 4 and early.read_unused >= 1
    assert same(state(m, e), state(ref, ref_e))
    e.close()
    ref_e.close()


class _LateBranch(torch.nn.Module):
    """A layer first used at the third step (an expert no token picked before, a branch taken late)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, late: bool) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        return (self.b(x) if late else x).square().mean()


def test_a_param_first_used_after_the_first_step_is_stepped_in_the_same_commit(tmp_path):
    """Its gradient goes to the ordinary step (which makes its record) in the commit of the step made in
    backward for the others: before, that step could not be made live and its gradients, let go, were lost
    (`GradientsNotKeptError` with default settings)."""
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    torch.manual_seed(0)
    plain = _LateBranch()
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = _LateBranch()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    with zswap.initialize(model, cfg) as engine:
        for step in range(5):
            x = torch.randn(4, 6, generator=g)
            engine.backward(engine(x, step >= 2))
            engine.step()
            plain(x, step >= 2).backward()
            opt.step()
            opt.zero_grad()
        stats = engine.stats()
        assert stats["steps_in_backward_partly"] == 1 and stats["steps_in_backward"] == 4
        assert stats["steps_partly_reason"] == "a param got its first gradient"
        with GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("when", ["after-backward", "mid-window"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "ordinary"])
def test_a_param_frozen_after_its_gradient_came_is_stepped_as_torch_steps_it(tmp_path, when, early):
    """torch's AdamW steps every param that has a ``.grad``, whatever its ``requires_grad`` now says: a
    layer frozen between ``backward`` and the step (or between micro-batches) is stepped with the gradient
    it has. The update in backward did so; the ordinary step skipped it (its step count fell behind)."""
    gas = 2 if when == "mid-window" else 1
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "gradient_accumulation_steps": gas,
    }

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    plain = make()
    with zswap.Init(cfg):
        model = make()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    engine = zswap.initialize(model, cfg)
    engine.early_step = early
    g = torch.Generator().manual_seed(1)
    with engine:
        for step in range(3):
            for k in range(gas):
                x = torch.randn(3, 4, generator=g)
                for m in (model, plain):
                    (m(x).square().mean() / gas).backward()
                    if step == 1 and k == 0 and when == "mid-window":
                        m[0].requires_grad_(False)
                if k < gas - 1:
                    engine.step()  # not a boundary
            if step == 1 and when == "after-backward":
                model[0].requires_grad_(False)
                plain[0].requires_grad_(False)
            engine.step()
            opt.step()
            opt.zero_grad()
        with zswap.GatheredParameters(list(model.parameters())):
            bad = [
                n
                for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True)
                if not torch.equal(p, q)
            ]
        assert bad == []
        assert list(engine.optimizer.records.steps) == [int(opt.state[p]["step"]) for p in plain.parameters()]
