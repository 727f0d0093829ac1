"""The compute-device seam (`zswap.device`) on the CPU: the fetch and gradient paths run through
`StandInDevice`, whose copies are deferred and whose destinations are poisoned until waited for, so a
missing wait, a wait on the wrong copy or a source reused before its copy completed changes the values.
Logits and gradients must still be bitwise those of the plain model; training steps those of plain AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zswap
from zswap import ZswapError, param_state
from zswap.device import Copy, CpuDevice, ReusePool, StandInDevice, UnsupportedDeviceError, resolve

from .test_runtime import (
    MLP,
    STREAM,
    TIERS,
    Reach,
    TinyLM,
    all_released,
    assert_same_grads,
    build,
    config,
    ids,
    sq,
    train_pass,
    xs,
)


def engine_on(m: nn.Module, cfg: dict, dev: object, **kwargs: object) -> zswap.Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.initialize(m, cfg, device=dev, **kwargs)


# -- the stand-in itself -------------------------------------------------------------------------------


def test_stand_in_copies_run_only_when_observed_and_in_order():
    dev = StandInDevice()
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    ca, cb = dev.h2d(a), dev.h2d(b)
    assert torch.isnan(ca.dst).all() and torch.isnan(cb.dst).all()  # poisoned until waited for
    assert not dev.query(ca)
    a.fill_(-1.0)  # changing a source before its copy completed: the copy sees the change
    assert torch.equal(dev.wait(ca), torch.full((4,), -1.0))
    assert torch.isnan(cb.dst).all()  # waiting on the first copy does not complete the second
    assert torch.equal(dev.wait(cb), b)
    assert dev.query(ca) and dev.query(cb) and ca.src is None and cb.src is None  # sources let go


def test_stand_in_waiting_on_a_later_copy_completes_earlier_ones():
    dev = StandInDevice()
    out = torch.empty(3, dtype=torch.bfloat16)
    first = dev.d2h(torch.ones(3, dtype=torch.bfloat16), out)
    second = dev.h2d(torch.zeros(2))
    dev.synchronize(second)
    assert torch.equal(first.dst, torch.ones(3, dtype=torch.bfloat16))


def test_stand_in_refuses_a_copy_it_never_issued_and_mismatched_shapes():
    dev = StandInDevice()
    with pytest.raises(ZswapError, match="never issued"):
        dev.wait(Copy(torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ZswapError, match="copy of"):
        dev.d2h(torch.zeros(3), torch.empty(4))


def test_registrations_last_as_long_as_the_buffer_and_close_unregisters():
    dev = StandInDevice()
    alloc = dev.register_alloc(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    keep = alloc((256,), torch.float32)
    gone = alloc((128,), torch.float32)
    assert dev.registered_bytes == (256 + 128) * 4
    del gone
    dev.reap()  # the registration of a buffer nobody holds is dropped
    assert dev.registered_bytes == 256 * 4
    dev.close()
    assert dev.registered_bytes == 0
    assert keep.numel() == 256  # the memory itself belongs to its holder


def test_reuse_pool_hands_out_free_buffers_with_the_event_of_their_release():
    events = iter(range(100))
    pool = ReusePool(lambda numel, dtype: torch.empty(numel, dtype=dtype), lambda: next(events))
    pool.pool_bytes = 2 * 16 * 4
    a, _ = pool.take(16, torch.float32)
    b, _ = pool.take(16, torch.float32)
    assert a.data_ptr() != b.data_ptr()
    p = nn.Parameter(torch.empty(0))
    p.data = a[:16].view(4, 4)  # a gathered param over the buffer
    del a
    c, _ = pool.take(16, torch.float32)  # a is in use, b is held: a third buffer (not pooled: over budget)
    assert c.data_ptr() not in {p.data_ptr(), b.data_ptr()}
    pool.retire(p)  # the release: its event is recorded now
    ptr = p.data_ptr()
    p.data = torch.empty(0)
    again, ev = pool.take(16, torch.float32)
    assert again.data_ptr() == ptr and ev == 3  # the release's event (0-2 went to the three takes)
    q = nn.Parameter(torch.empty(0))
    q.data = again.view(4, 4)
    alias = q.data  # outlives the release (as non-reentrant checkpointing keeps saved data)
    del again
    pool.retire(q)  # not the only user: no early event
    q.data = torch.empty(0)
    assert pool.take(16, torch.float32)[0].data_ptr() != alias.data_ptr()  # still in use: not reused
    del alias
    reused, ev = pool.take(16, torch.float32)
    assert reused.data_ptr() == ptr and ev == 5  # an event recorded when found free, after every use
    assert pool.reused == 2


def test_reuse_pool_evicts_idle_buffers_of_other_sizes_to_stay_in_budget():
    pool = ReusePool(lambda numel, dtype: torch.empty(numel, dtype=dtype), lambda: None)
    pool.pool_bytes = 16 * 4
    big, _ = pool.take(16, torch.float32)
    del big  # free again, still pooled
    small, _ = pool.take(8, torch.float32)  # pooling it needs the idle 16-element buffer's room
    assert pool._pooled == 8 * 4
    del small
    pool.take(8, torch.float32)
    assert pool.reused == 1  # the pooled 8-element buffer came back
    held, _ = pool.take(16, torch.float32)  # the idle 8-element one is evicted, this one pooled
    assert pool._pooled == 16 * 4 and list(pool._by_ptr) == [held.data_ptr()]


def test_resolve():
    assert isinstance(resolve("cpu"), CpuDevice)
    assert isinstance(resolve(torch.device("cpu")), CpuDevice)
    dev = StandInDevice()
    assert resolve(dev) is dev
    if not torch.cuda.is_available():
        assert isinstance(resolve(None), CpuDevice)
        with pytest.raises(ZswapError, match="CUDA is not available"):
            resolve("cuda")
    with pytest.raises(ValueError, match="not a device"):
        resolve("gpu0")
    with pytest.raises(UnsupportedDeviceError, match="'meta'"):
        resolve("meta")
    with pytest.raises(TypeError, match="device must be"):
        resolve(3)


def test_the_cpu_suite_runs_as_without_cuda():
    """tests/conftest.py hides CUDA from every test not marked gpu (here and in subprocesses), so that
    ``device=None`` means the CPU for the CPU suite on a GPU machine too."""
    import os

    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert isinstance(resolve(None), CpuDevice)


# -- the runtime through the stand-in ------------------------------------------------------------------


@pytest.mark.parametrize("tier", [*TIERS, "none"])
def test_mlp_bitwise_through_deferred_copies(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    dev = StandInDevice()
    with engine_on(m, cfg, dev) as engine:
        for x in xs(3, 4, 12):  # the first records the trace; the others prefetch through the device
            train_pass(m, ref, x, sq)
            assert_same_grads(m, ref)
            assert all_released(m)
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                param_state(p).grad, q.grad = None, None
        s = engine.stats()
        assert s["prefetch_hits"] > 0
        assert s["device"] == "cpu"
        assert dev.pool.reused > 0 and dev.retired > 0  # device buffers came back, after their release
    n_params = len(list(m.parameters()))
    assert dev.copies >= s["fetches"] + 3 * n_params  # an H2D copy per fetch, a D2H copy per gradient
    assert dev.pending == 0 and dev.registered_bytes == 0


@pytest.mark.parametrize("reentrant", [None, True, False])
@pytest.mark.parametrize("tier", TIERS)
def test_tied_and_checkpointed_bitwise_through_deferred_copies(tier, reentrant, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    m, ref = build(lambda: TinyLM(reentrant=reentrant), cfg)
    dev = StandInDevice()
    with engine_on(m, cfg, dev):
        for seed in (1, 2, 3):
            train_pass(m, ref, ids(seed=seed), sq)
        assert_same_grads(m, ref)
        assert all_released(m)


def test_params_used_outside_their_module_bitwise_through_deferred_copies(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(Reach, cfg)
    with engine_on(m, cfg, StandInDevice()):
        for x in xs(3, 2, 7):
            train_pass(m, ref, x, sq)
        assert_same_grads(m, ref)


def test_nvme_read_buffers_are_registered_while_the_engine_runs(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    dev = StandInDevice()
    with engine_on(m, cfg, dev):
        for x in xs(2, 4, 12):
            train_pass(m, ref, x, sq)
        assert dev.registered_bytes > 0
    assert dev.registered_bytes == 0  # close() unregistered every buffer


@pytest.mark.parametrize("tier", TIERS)
def test_adamw_steps_through_deferred_copies_match_plain_adamw(tier, tmp_path):
    cfg = config(tier, tmp_path, **STREAM)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    if tier == "nvme":
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    m, ref = build(TinyLM, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    with engine_on(m, cfg, StandInDevice()) as engine:
        for seed in (1, 2, 3):
            train_pass(m, ref, ids(seed=seed), sq)
            engine.step()
            opt.step()
            opt.zero_grad()
        out, want = m(ids(seed=9)), ref(ids(seed=9))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    with zswap.GatheredParameters(list(m.parameters())):  # after close: nothing is prefetched any more
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bf16_grads_cross_in_their_dtype(tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    cfg["bf16"] = {"enabled": True}
    m, _ = build(MLP, cfg)
    ref = MLP().to(torch.bfloat16)
    with zswap.GatheredParameters(list(m.parameters())):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            q.data.copy_(p.data)
    dev = StandInDevice()
    with engine_on(m, cfg, dev):
        x = xs(1, 4, 12)[0].to(torch.bfloat16)
        train_pass(m, ref, x, sq)
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            g = zswap.full_grad(p)
            assert (
                g.dtype == torch.float32
            )  # accumulated in fp32 where it landed (tests/test_device_grads.py)
            assert torch.equal(g, q.grad.float())


def test_initialize_takes_the_device(tmp_path):
    cfg = config("cpu", tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    with engine_on(m, cfg, "cpu") as engine:
        assert isinstance(engine.compute_device, CpuDevice) and engine.device == torch.device("cpu")
        s = engine.stats()
        assert s["device"] == "cpu" and "gpu_max_memory_allocated" not in s
        train_pass(m, ref, xs(1, 4, 12)[0], sq)
        assert_same_grads(m, ref)
    for bad, err, match in [(3, TypeError, "device must be"), ("tpu", ValueError, "not a device")]:
        with pytest.raises(err, match=match):
            zswap.initialize(m, cfg, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ZswapError, match=r"device='cuda': CUDA is not available"):
            zswap.initialize(m, cfg, device="cuda")
    assert zswap.initialize(m, cfg, device="cpu").close() is None  # the failed calls left nothing open


class _NoWait(StandInDevice):
    """A device whose compute never waits for its copies: what a missing ``wait_event`` would be."""

    def wait(self, copy: Copy) -> torch.Tensor:
        return copy.dst


class _ReusedSource(StandInDevice):
    """A device whose source buffer is refilled (the pool handing it to the next read) before the copy
    from it ran: what returning an engine buffer to its pool before the H2D copy completed would be."""

    def h2d(self, host: torch.Tensor) -> Copy:
        copy = super().h2d(host)
        host.fill_(float("nan"))
        return copy


@pytest.mark.parametrize("broken", [_NoWait, _ReusedSource])
def test_the_stand_in_catches_ordering_bugs(broken, tmp_path):
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    x = xs(1, 4, 12)[0]
    with engine_on(m, cfg, broken()):
        out = m(x)
    assert not torch.equal(out, ref(x))  # the bitwise tests above would fail
