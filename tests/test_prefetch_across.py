"""Reads ahead across passes (`zswap.prefetch`, "Across passes"): when a pass ends (an inference forward,
`Engine.step`, `initialize`) the next pass's first params are read ahead, so every fetch of a later pass
is a prefetch hit; a write in between (the optimizer, a `GatheredParameters` write-back,
``load_state_dict``) drops the stale reads unused, and logits, gradients, params and optimizer records are
bitwise those of a twin that reads nothing ahead and of plain PyTorch. Counts are exact, not timed."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import GatheredParameters, Status, SwapIOError, full_grad, param_state
from zswap.optim import OffloadedAdamW

from .test_faults import cfg_for, engine_of, inject, optim_state, same, transfers
from .test_prefetch_guess import STREAM, Deep, assert_adds_up, x
from .test_runtime import (
    Block,
    TinyLM,
    all_released,
    assert_same_grads,
    build,
    config,
    engine_for,
    ids,
    sq,
)

LINEAR = 24 * 24 + 24  # elements of one of Deep's Linears


def plain_adamw(ref: Any) -> Any:
    """The optimizer of `cfg_for`'s config (its kernel too) over the plain model's params, in memory."""
    return OffloadedAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)


def twins(cfg: dict[str, Any], make: Any = Deep, **kwargs: Any) -> tuple[Any, Any, Any, Any, Any]:
    """(model, its engine reading ahead, twin, its engine reading nothing ahead, the plain model)."""
    m, ref = build(make, cfg)
    twin, _ = build(make, cfg)
    e = engine_for(m, cfg, **kwargs)
    off = engine_for(twin, cfg, **kwargs)
    off.prefetch_across_passes = False
    assert e.prefetch_across_passes and not off.prefetch_across_passes
    return m, e, twin, off, ref


def test_every_fetch_of_a_later_inference_pass_is_a_hit(tmp_path):
    # A live budget of three Linears of six: the reads ahead stop there; the pass's own prefetch goes on.
    cfg = config("nvme", tmp_path, **STREAM, stage3_max_live_parameters=3 * LINEAR)
    m, e, twin, off, ref = twins(cfg)
    with torch.no_grad():
        for mm in (m, twin, ref):
            mm.eval()
        rows = []
        for seed in range(4):
            for ee in (e, off):
                ee.stats(reset=True)
            out = [mm(x(seed)) for mm in (m, twin, ref)]
            assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[2]), seed
            rows.append((e.stats(), off.stats()))
            assert all_released(m) and all_released(twin)  # a read ahead gathers nothing
    for i, (s, t) in enumerate(rows):
        assert_adds_up(s)
        assert_adds_up(t)
        # 12 params, one step per Linear. Reading ahead: the first three Linears' reads were issued when
        # the pass before ended (pass 1: when initialize ended, along the guess), so none is on demand.
        assert (s["fetches"], s["demand_fetches"], s["prefetch_hits"]) == (12, 0, 12), i
        assert (s["read_ahead_used"], s["read_ahead_issued"], s["read_ahead_dropped"]) == (6, 6, 0), i
        assert s["peak_live_elements"] <= 3 * LINEAR
        # The twin: the first step of every pass on demand.
        assert (t["fetches"], t["demand_fetches"], t["prefetch_hits"]) == (12, 2, 10), i
        assert t["read_ahead_issued"] == t["read_ahead_used"] == 0
        assert s["bytes_read"] == t["bytes_read"]  # the same reads, only earlier
    e.close()
    off.close()


@pytest.mark.parametrize("early", [True, False], ids=["early-step", "step-after-backward"])
def test_training_reads_the_next_forward_after_the_step_and_is_bitwise(early, tmp_path):
    """Params and AdamW states on NVMe: the reads ahead are issued after the step wrote (or committed) the
    params, so they read the updated values; logits, gradients, params and records are bitwise the twin's
    and plain PyTorch's; from the second iteration on no fetch waits on demand."""
    # A live budget of about half the model (a tighter one leaves misses inside the pass: its prefetch cannot
    # stay far enough ahead; benches/README.md, "Prefetch").
    cfg = cfg_for(tmp_path, "nvme", "nvme", stage3_max_live_parameters=4000)
    m, e, twin, off, ref = twins(cfg, TinyLM)
    for ee in (e, off):
        ee.early_step = early
    ref_opt = plain_adamw(ref)
    for it in range(4):
        for ee in (e, off):
            ee.stats(reset=True)
        outs = [mm(ids(seed=it)) for mm in (m, twin, ref)]
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), it
        for out in outs:
            sq(out).backward()
        assert_same_grads(m, ref)
        assert same([full_grad(p) for p in m.parameters()], [full_grad(p) for p in twin.parameters()])
        s, t = e.stats(), off.stats()  # forward + backward (the step's reads are not fetches)
        e.step()
        off.step()
        ref_opt.step()
        ref_opt.zero_grad()
        assert same(optim_state(e.optimizer, m), optim_state(off.optimizer, twin)), it
        assert s["fetches"] == t["fetches"] > 0
        if it:  # from the second iteration on: the twin waits for its first step only, this one never
            # After a step that was not the first (which lays the records out) params are seeded
            # (`Scheduler.seed`: no fetch): 8 by the early step's commit, 6 by an ordinary step (those of its
            # last chunk: `bridge.Kept`); the twin's first fetch is then prefetched behind them.
            n = 32 if it == 1 else (24 if early else 26)
            miss = 1 if it == 1 else 0
            assert (s["fetches"], s["demand_fetches"], s["prefetch_hits"]) == (n, 0, n), it
            assert (t["fetches"], t["demand_fetches"], t["prefetch_hits"]) == (n, miss, n - miss), it
        # The reads ahead fill the live budget less what the seeds take.
        assert s["read_ahead_used"] == (10 if it < 2 else 2 if early else 4), it
        assert s["read_ahead_dropped"] == 0 and t["read_ahead_used"] == 0, it
        assert all_released(m)
    with GatheredParameters(list(m.parameters()) + list(twin.parameters())):
        for p, q, r in zip(m.parameters(), twin.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, r.data) and torch.equal(q.data, r.data)
    e.close()
    off.close()


class TiedGPT(nn.Module):
    """GPT-2's layout: a token embedding tied to the head, then a position embedding of its own module."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(40, 16)
        self.wpe = nn.Embedding(8, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class SharedBlock(nn.Module):
    """ALBERT's layout: one block run at every depth, the token embedding tied to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(40, 16)
        self.block = Block(16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for _ in range(3):
            h = self.block(h)
        return self.head(h)


@pytest.mark.parametrize(
    ("make", "frozen"),
    [(TiedGPT, None), (SharedBlock, None), (TiedGPT, "wpe.weight")],
    ids=["gpt2-layout", "albert-layout", "frozen-position-embedding"],
)
def test_a_model_within_the_live_budget_is_read_once_per_step(make, frozen, tmp_path):
    """With the default budgets a small model fits the live budget: what forward lets go of is kept for
    backward, and a param used again in the same half of the pass (a tied embedding, a block run at every
    depth) until then; the step's updated params seed the next forward: a warm step reads the AdamW moments
    of the params it trains, and a param it does not train once. Each param counts once toward the live
    budget: GPT-2's position embedding — whose backward step is followed by the tied embedding's, counted
    already — and ALBERT's tied embedding — the shared block's steps in between counted at each use — were
    let go and read again every step. A frozen param early in forward (Whisper's encoder starts with one; a
    fine-tune freezing its embeddings) is read ahead in its place, and the updated params after it are still
    seeds (they stopped at it, and every param after it was read)."""
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    del cfg["stage3_max_live_parameters"]
    m, _ = build(make, cfg)
    if frozen is not None:
        m.get_parameter(frozen).requires_grad_(False)
    e = engine_for(m, cfg)
    nbytes = {p.requires_grad: 0 for p in m.parameters()}
    for p in m.parameters():
        nbytes[p.requires_grad] += param_state(p).numel * 4
    trained, untrained = nbytes[True], nbytes.get(False, 0)
    for it in range(4):
        e.stats(reset=True)
        sq(m(ids(seed=it))).backward()
        e.step()
        if it:
            s = e.stats()
            moved = (s["bytes_read"], s["bytes_written"], s["steps_in_backward"])
            assert moved == (2 * trained + untrained, 3 * trained, 1), it
    e.close()


def test_a_write_between_passes_drops_the_stale_reads(tmp_path):
    """Between an inference pass and the next: a GatheredParameters block without modifier_rank changes
    nothing stored (the reads ahead are used), one with it and ``load_state_dict`` make them stale (dropped),
    ``state_dict`` reads apart — each next pass sees exactly what plain PyTorch sees."""
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(Deep, cfg)
    e = engine_for(m, cfg)
    with torch.no_grad():
        assert torch.equal(m(x(0)), ref(x(0)))
        e.stats(reset=True)
        with (
            pytest.warns(zswap.ZswapWarning, match="without modifier_rank"),
            GatheredParameters(m.parameters()),
        ):
            for p in m.parameters():
                p.data.mul_(3.0)  # dropped at the exit: the stored values are unchanged
        assert torch.equal(m(x(1)), ref(x(1)))
        s = e.stats(reset=True)
        assert s["read_ahead_used"] == 12 and s["read_ahead_dropped"] == 0 and s["demand_fetches"] == 0

        with GatheredParameters(list(m.layers[:2].parameters()), modifier_rank=0):
            for p in m.layers[:2].parameters():
                p.data.mul_(0.5)  # written back: those four reads ahead are stale
        for p in ref.layers[:2].parameters():
            p.data.mul_(0.5)
        assert torch.equal(m(x(2)), ref(x(2)))
        s = e.stats(reset=True)
        assert s["read_ahead_dropped"] == 4 and s["read_ahead_used"] == 8 and s["fetches"] == 12

        state = {
            k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
            for k, v in ref.state_dict().items()
        }
        m.load_state_dict(state)
        ref.load_state_dict(state)
        assert torch.equal(m(x(3)), ref(x(3)))
        s = e.stats(reset=True)
        assert s["read_ahead_dropped"] == 12 and s["read_ahead_used"] == 0

        sd = m.state_dict()  # between passes, with reads ahead in flight: read apart, nothing changes
        assert same([sd[k] for k in sorted(sd)], [ref.state_dict()[k] for k in sorted(sd)])
        assert torch.equal(m(x(4)), ref(x(4)))
        s = e.stats(reset=True)
        assert s["read_ahead_used"] == 12 and s["read_ahead_dropped"] == 0
    e.close()


def test_a_pass_of_another_kind_uses_the_reads_ahead(tmp_path):
    """Inference reads ahead along its own trace; a training pass (another kind) takes over those reads
    for its first steps; then `step` drops what an eval pass read ahead before it (it rewrites every
    partition) and reads ahead again after."""
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, e, twin, off, ref = twins(cfg, TinyLM)
    ref_opt = plain_adamw(ref)
    for it in range(3):
        with torch.no_grad():
            for mm in (m, twin, ref):
                mm.eval()
            outs = [mm(ids(seed=10 + it)) for mm in (m, twin, ref)]
            assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), it
            for mm in (m, twin, ref):
                mm.train()
        e.stats(reset=True)
        outs = [mm(ids(seed=it)) for mm in (m, twin, ref)]
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), it
        s = e.stats()
        assert s["read_ahead_used"] > 0 and s["off_trace"] == 0
        for out in outs:
            sq(out).backward()
        with torch.no_grad():  # an eval pass between backward and step: its reads ahead go stale
            for mm in (m, twin, ref):
                mm.eval()
            outs = [mm(ids(seed=20 + it)) for mm in (m, twin, ref)]
            assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]), it
            for mm in (m, twin, ref):
                mm.train()
        before = e.stats()["read_ahead_dropped"]
        e.step()
        off.step()
        ref_opt.step()
        ref_opt.zero_grad()
        assert e.stats()["read_ahead_dropped"] > before  # dropped by the step, not used
        assert same(optim_state(e.optimizer, m), optim_state(off.optimizer, twin)), it
    with GatheredParameters(m.parameters()):
        for p, r in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, r.data)
    e.close()
    off.close()


def test_a_failed_read_ahead_raises_at_its_use_and_the_next_pass_is_exact(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM, stage3_max_live_parameters=3 * LINEAR)
    m, ref = build(Deep, cfg)
    with engine_for(m, cfg) as e, torch.no_grad():
        swap = engine_of(m)
        assert torch.equal(m(x(0)), ref(x(0)))
        e.stats(reset=True)
        n = transfers(swap, "read")
        assert torch.equal(m(x(1)), ref(x(1)))
        s = e.stats(reset=True)
        own = transfers(swap, "read") - n - s["read_ahead_issued"]  # the pass's own reads
        assert own == 12 - s["read_ahead_used"] > 0
        inject(swap, "read", errno.EIO, own)  # strikes the first read ahead at the end of the next pass
        assert torch.equal(m(x(2)), ref(x(2)))
        e.stats()  # waits for the failed read: says nothing
        swap._engine.clear_faults()
        with pytest.raises(SwapIOError) as ei:
            m(x(3))  # its first step uses that read
        assert ei.value.errno == errno.EIO and ei.value.key.startswith("p/")
        assert all(param_state(p).status is Status.NOT_AVAILABLE for p in m.parameters())
        assert e._sched.live == 0
        assert torch.equal(m(x(3)), ref(x(3)))
        assert torch.equal(m(x(4)), ref(x(4)))


def test_a_failed_read_ahead_dropped_by_a_step_raises_nothing(tmp_path):
    """Inference passes between backward and step; the last one's reads ahead fail: the step drops them
    (it rewrites every partition) without a word, and the next forward is plain PyTorch's."""
    cfg = cfg_for(tmp_path, "nvme", "nvme")
    m, ref = build(TinyLM, cfg)
    ref_opt = plain_adamw(ref)
    with engine_for(m, cfg) as e:
        swap = engine_of(m, e.optimizer)
        sq(m(ids(seed=1))).backward()
        sq(ref(ids(seed=1))).backward()
        with torch.no_grad():
            m(ids(seed=2))  # recorded
            e.stats(reset=True)
            n = transfers(swap, "read")
            m(ids(seed=3))
            s = e.stats(reset=True)
            own = transfers(swap, "read") - n - s["read_ahead_issued"]
            inject(swap, "read", errno.EIO, own)
            m(ids(seed=4))
            assert e.stats()["read_ahead_issued"] == s["read_ahead_issued"] > 0  # one of them failed
        swap._engine.clear_faults()
        e.step()
        ref_opt.step()
        assert e.stats()["read_ahead_dropped"] == s["read_ahead_issued"]
        assert torch.equal(m(ids(seed=5)), ref(ids(seed=5)))


def test_prefetch_across_passes_takes_a_bool_and_off_drops_the_reads_in_flight(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(Deep, cfg)
    with engine_for(m, cfg) as e:
        for bad in (1, "yes", None):
            with pytest.raises(ValueError, match="prefetch_across_passes"):
                e.prefetch_across_passes = bad
        assert e._sched.live == 6 * LINEAR  # initialize read the whole first pass ahead (all 12 params)
        e.prefetch_across_passes = False
        assert e._sched.live == 0 and e.stats()["read_ahead_dropped"] == 12
        with torch.no_grad():
            assert torch.equal(m(x(1)), ref(x(1)))
        assert e._sched.live == 0 and e.stats()["read_ahead_issued"] == 12  # none since


def test_the_cpu_tier_reads_nothing_ahead(tmp_path):
    cfg = config("cpu", tmp_path, **STREAM)
    m, ref = build(Deep, cfg)
    with engine_for(m, cfg) as e, torch.no_grad():
        for seed in range(2):
            assert torch.equal(m(x(seed)), ref(x(seed)))
        assert e.stats()["read_ahead_issued"] == 0
