"""The next-pass cache (`zswap.fetch.nextpass`): one entry per param — a read issued when a pass ended or a
value already in memory (a seed) — taken by the next pass when still valid; and the one memory budget
(`zswap.memory.Allowances`) the early step, the seeds and the fetch pools are sized from."""

from __future__ import annotations

import torch

from zswap import param_state
from zswap.step.earlystep import CAP_EXTRA

from .test_memory import WEIGHT, _built, _lent_config, _Stack
from .test_offload_keys import nvme
from .test_runtime import TinyLM, build, engine_for, ids


def test_a_value_offered_for_a_param_read_ahead_replaces_its_read(tmp_path):
    """A param has one entry: a value kept for it drops its read ahead (counted as dropped, no longer
    live), the next pass gathers it from memory with no read, and its result is the plain model's."""
    cfg = nvme(tmp_path)
    m, ref = build(TinyLM, cfg)
    x = ids(seed=0)
    with engine_for(m, cfg) as engine, torch.no_grad():
        assert torch.equal(engine(x), ref(x))  # recorded; its end read the next pass's first params ahead
        sched = engine._sched
        read = {id(e.slot.p) for e in sched.next.reads()}
        assert read
        live = sched.live
        before = engine.stats()
        values = {name: q.detach().clone().reshape(-1) for name, q in ref.named_parameters()}
        sched.seed([(p, values[name], lambda: True) for name, p in m.named_parameters()])
        kept = {id(e.slot.p) for e in sched.next.values()}
        assert kept & read
        assert not kept & {id(e.slot.p) for e in sched.next.reads()}  # one entry per param
        replaced = kept & read
        numel = sum(param_state(p).numel for p in m.parameters() if id(p) in replaced)
        assert sched.live == live - numel
        after = engine.stats()
        assert after["read_ahead_dropped"] == before["read_ahead_dropped"] + len(replaced)
        assert torch.equal(engine(x), ref(x))
        s = engine.stats()
        assert s["read_ahead_used"] == after["read_ahead_used"] + len(read - kept)


def test_the_memory_budget_hands_out_the_early_steps_cap_the_seeds_and_the_fetch_pool(tmp_path):
    """One `Allowances` per engine, from the live budget: the early step's cap (the live budget's bytes and
    `CAP_EXTRA`) and seed allowance (``max_live``), and the fetch pool (the live budget without buffer
    keys), widened by the early step's cap since its copies come from it."""
    cfg = _lent_config(tmp_path / "budget")
    _, engine = _built(cfg, _Stack)
    try:
        a, early = engine.sizing.allowances, engine._early
        s = engine.stats()
        assert early is not None
        assert a.live == (s["max_live_elements"] + s["persistent_elements"]) * 4
        assert s["max_live_elements"] == 3 * WEIGHT
        assert early.cap == a.early_step == a.live + CAP_EXTRA
        assert early.seed_numel == a.seeds == s["max_live_elements"]
        assert a.fetch_pool == a.live
        assert s["mem_fetch_pool_limit"] == a.fetch_pool + a.early_step  # one param store
    finally:
        engine.close()
