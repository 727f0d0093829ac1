"""zswap.outputs: backward's matmul outputs in reused memory — the pool never hands out memory a live
tensor shares, maps at most its peak in use, and training through it stays bitwise the plain model's."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack

import zswap
from zswap import full_grad, outputs
from zswap.outputs import OutputPool

from .test_runtime import (
    STREAM,
    TIERS,
    TinyLM,
    _adamw,
    assert_same_grads,
    build,
    config,
    engine_for,
    ids,
    sq,
    train_pass,
)

MiB = 1 << 20


def test_a_pooled_buffer_is_reused_only_once_nothing_views_it():
    pool = OutputPool()
    a = pool.take((256, 1024), torch.float32)
    b = pool.take((256, 1024), torch.float32)
    assert a.data_ptr() != b.data_ptr()  # a is alive: its memory is not handed out again
    assert (pool.made, pool.reused, pool.pooled) == (2, 0, 2 * MiB)
    view = a[3:]
    del a
    c = pool.take((1024, 256), torch.float32)  # same bytes, other shape: a's view still holds its memory
    assert c.data_ptr() not in (b.data_ptr(), view.data_ptr() - 3 * 1024 * 4)
    assert pool.made == 3
    a_ptr = view.data_ptr() - 3 * 1024 * 4
    del view
    d = pool.take((512, 512), torch.float32)
    assert d.data_ptr() == a_ptr and d.shape == (512, 512) and d.is_contiguous()
    assert (pool.made, pool.reused) == (3, 1)
    assert pool.idle() == 0
    del b, c, d
    assert pool.idle() == pool.pooled == 3 * MiB


def test_the_pool_maps_at_most_its_peak_in_use():
    pool = OutputPool()
    x, y = pool.take((MiB // 4,), torch.float32), pool.take((MiB // 2,), torch.float32)  # 1 + 2 MiB at once
    del x, y
    z = pool.take((3 * MiB // 4,), torch.float32)  # 3 MiB, another size: the idle 1 + 2 MiB go first
    assert pool.pooled == 3 * MiB == pool.peak_pooled
    del z
    w = pool.take((MiB // 4,), torch.float32)
    assert pool.pooled <= 3 * MiB
    pool.clear()
    assert pool.pooled == 0 and pool.idle() == 0
    w.fill_(1.0)  # still the caller's, freed by its last user
    pool.reset_peak()
    assert pool.peak_pooled == 0


def test_the_pool_keeps_dtypes_apart():
    pool = OutputPool()
    a = pool.take((1024,), torch.float32)
    b = pool.take((512,), torch.float64)  # the same bytes
    c = pool.take((1024,), torch.float64)  # peak in use: 16 KiB, so nothing idle is unmapped below
    del a, b, c
    d, e = pool.take((1024,), torch.float64), pool.take((1024,), torch.float32)
    assert d.dtype is torch.float64 and e.dtype is torch.float32
    assert (pool.made, pool.reused, pool.pooled) == (3, 2, 16 << 10)
    f = pool.take((512,), torch.float32)  # a new size, with 4 KiB idle (the float64 × 512) beyond 16 KiB
    assert f.dtype is torch.float32 and pool.pooled == 14 << 10 and pool.made == 4  # the 4 KiB went


@pytest.fixture
def pool_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every backward matmul of hooked modules through the pool, however small (conftest's
    `matmul_outputs_pooled` does so for the whole suite; said again here, where the tests rely on it)."""
    monkeypatch.setattr(outputs, "MIN_BYTES", 0)


@pytest.fixture
def default_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outputs, "MIN_BYTES", zswap.memory.MMAP_THRESHOLD)


class Attn(nn.Module):
    """A bmm in backward too (batched matmul of activations), beside the Linear layers' mm."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 4.0, dim=-1)
        return self.out(torch.bmm(a, v))


@pytest.mark.parametrize("kind", ["torch", "zswap"])
@pytest.mark.parametrize("tier", TIERS)
def test_training_through_the_pool_is_bitwise_the_plain_models(tier, kind, tmp_path, pool_everything):
    cfg = config(tier, tmp_path, stage3_param_persistence_threshold=20, stage3_max_live_parameters=2500)
    m, ref = build(TinyLM, cfg)
    make = _adamw(kind)
    ref_opt = make(ref.parameters())
    with engine_for(m, cfg, optimizer=make(m.parameters())) as engine:
        pool = engine._hooks.outputs.pool
        for step in range(3):
            train_pass(m, ref, ids(seed=step), sq)  # asserts equal logits: the updates were equal
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            assert pool.pooled == 0  # emptied when the backward ended
        assert pool.made > 0
        assert engine.stats()["mem_peak_output_pool"] > 0
    with zswap.GatheredParameters(m.parameters()):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_gradients_through_the_pool_with_checkpointing_and_bmm(reentrant, tmp_path, pool_everything):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(lambda: TinyLM(reentrant=reentrant), cfg)
    with engine_for(m, cfg) as engine:
        for seed in (1, 2):  # two backwards accumulate: the first's gradients outlive its pool
            train_pass(m, ref, ids(seed=seed), sq)
        assert_same_grads(m, ref)
        assert engine._hooks.outputs.pool.made > 0
    torch.manual_seed(0)
    ref = nn.Sequential(Attn(), nn.GELU(), Attn())
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = nn.Sequential(Attn(), nn.GELU(), Attn())
    x = torch.randn(2, 6, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with engine_for(m, cfg):
        out, want = m(x), ref(x2)
        assert torch.equal(out, want)
        sq(out).backward()
        sq(want).backward()
        assert_same_grads(m, ref)
        assert torch.equal(x.grad, x2.grad)


def _chain() -> nn.Module:
    return nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(16, 16), nn.Tanh())))


@pytest.mark.parametrize("tier", TIERS)
def test_a_freed_output_is_reused_by_the_next_of_its_size(tier, tmp_path, pool_everything):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(_chain, cfg)
    x = torch.randn(24, 16)
    with engine_for(m, cfg) as engine:
        train_pass(m, ref, x, sq)
        assert_same_grads(m, ref)
        pool = engine._hooks.outputs.pool
        # Each layer's input gradient (24 × 16) is dead once the Tanh before it ran; the weight
        # gradients (16 × 16) are kept for the step.
        assert pool.reused > 0 and pool.made < 8
        assert pool.pooled == 0


def test_the_mode_is_only_on_inside_a_hooked_modules_backward_nodes(tmp_path, pool_everything):
    cfg = config("cpu", tmp_path, **STREAM)
    m, _ = build(TinyLM, cfg)
    seen: list[object] = []
    hook = m.ln_f.weight.register_post_accumulate_grad_hook
    handle = hook(lambda p: seen.append(_get_current_dispatch_mode()))
    with engine_for(m, cfg) as engine:
        loss = sq(m(ids()))
        assert _get_current_dispatch_mode_stack() == []
        loss.backward(retain_graph=True)
        assert seen == [None]  # a user's hook at an AccumulateGrad node runs without it
        assert _get_current_dispatch_mode_stack() == []
        loss.backward()  # the same nodes again: hooked once, entered and left again
        assert seen == [None, None] and _get_current_dispatch_mode_stack() == []
        assert engine._hooks.outputs.pool.made > 0
    assert engine._hooks.outputs._closed  # hooks left on a graph kept past close do nothing
    handle.remove()


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 1.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        raise RuntimeError("backward fails on purpose")


class FailingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return _Fails.apply(h) if self.fail else h


def test_a_backward_that_raises_leaves_no_mode_behind(tmp_path, pool_everything):
    cfg = config("nvme", tmp_path, **STREAM)
    torch.manual_seed(0)
    ref = nn.Sequential(FailingBlock(), nn.Linear(16, 4))
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = nn.Sequential(FailingBlock(), nn.Linear(16, 4))
    x = torch.randn(3, 16)
    with engine_for(m, cfg):
        m[0].fail = True
        with pytest.raises(RuntimeError, match="backward fails on purpose"):
            sq(m(x)).backward()
        assert _get_current_dispatch_mode_stack() == []
        m[0].fail = False
        for p in m.parameters():
            zswap.param_state(p).grad = None
        gc.collect()
        train_pass(m, ref, x, sq)
        assert_same_grads(m, ref)


def test_small_outputs_and_other_ops_are_not_pooled(tmp_path, default_threshold):
    cfg = config("cpu", tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)  # its matmul outputs are far below MIN_BYTES
    with engine_for(m, cfg) as engine:
        train_pass(m, ref, ids(), sq)
        assert engine._hooks.outputs.pool.made == 0
        assert_same_grads(m, ref)


def test_disabled_it_hooks_nothing(tmp_path, pool_everything):
    cfg = config("cpu", tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.reuse_backward_outputs = False
        train_pass(m, ref, ids(), sq)
        assert engine._hooks.outputs.pool.made == 0
        assert_same_grads(m, ref)
        assert all(full_grad(p) is not None for p in m.parameters())


def test_a_matmul_of_mixed_or_other_tensors_runs_as_is(default_threshold):
    pool = OutputPool()
    mode = outputs._PooledMatmuls(pool)
    a = torch.randn(600, 300)
    with mode:
        r = torch.mm(a, a.t())  # 600 × 600 × 4 bytes: over MIN_BYTES
        s = torch.mm(a.double(), a.t().double())
        t = torch.addmm(r, a, a.t())  # other ops pass through
        u = torch.mm(a[:10], a.t()[:, :10])  # 400 bytes: below MIN_BYTES
    assert pool.made == 2 and r.dtype is torch.float32 and s.dtype is torch.float64
    assert torch.equal(r, torch.mm(a, a.t()))
    assert torch.equal(t, torch.addmm(r, a, a.t())) and torch.equal(u, torch.mm(a[:10], a.t()[:, :10]))


def test_stats_count_the_pool_while_backward_runs_and_nothing_after(tmp_path, pool_everything):
    cfg = config("nvme", tmp_path, **STREAM)
    m, _ = build(_chain, cfg)
    during: list[tuple[dict[str, int], int, int]] = []
    with engine_for(m, cfg) as engine:
        pool = engine._hooks.outputs.pool
        hook = m[0].weight.register_post_accumulate_grad_hook  # the last param whose gradient comes
        handle = hook(lambda p: during.append((engine.stats(), pool.pooled, pool.idle())))
        sq(m(torch.randn(24, 16))).backward()
        handle.remove()
        ((st, pooled, idle),) = during
        assert (st["mem_output_pool"], st["mem_output_pool_idle"]) == (pooled, idle)
        assert 0 < pooled <= st["mem_peak_output_pool"]
        assert pooled >= 4 * 16 * 16 * 4  # the four weight gradients, kept for the step, are in it
        after = engine.stats(reset=True)
        assert (after["mem_output_pool"], after["mem_output_pool_idle"]) == (0, 0)
        assert after["mem_peak_output_pool"] == st["mem_peak_output_pool"]  # the peak before the reset
        assert engine.stats()["mem_peak_output_pool"] == 0


def test_it_is_off_by_default_and_takes_a_bool(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "DEFAULT", False)  # as shipped (conftest turns it on)
    cfg = config("cpu", tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        assert engine.reuse_backward_outputs is False
        train_pass(m, ref, ids(), sq)
        assert engine._hooks.outputs.pool.made == 0
        with pytest.raises(zswap.ConfigError, match="reuse_backward_outputs must be True or False, got 1"):
            engine.reuse_backward_outputs = 1  # type: ignore[assignment]
        engine.reuse_backward_outputs = True
        train_pass(m, ref, ids(seed=2), sq)
        assert engine._hooks.outputs.pool.made > 0
        assert_same_grads(m, ref)
