"""Gradients on the device path, through `StandInDevice` on the CPU: float16/bfloat16 gradients cross to the
host in their own dtype, land in registered engine buffers, and are accumulated in float32 where they land
(memory or NVMe gradient store); the optimizer reads the float32 sums. Compared bitwise with a plain model
whose gradients are accumulated in float32 the same way (``acc += q.grad.float()`` per backward)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap import full_grad
from zswap.device import Copy, StandInDevice
from zswap.gradstore import MemoryGrads, NvmeGrads, store_of
from zswap.optim import OffloadedAdamW

from .test_runtime import MLP, STREAM, TinyLM, build, config, ids, sq, xs

LOW = [torch.bfloat16, torch.float16]
# (param tier, gradient store): memory gradients, or the optimizer on NVMe with its gradients there too
WHERE = [("cpu", "memory"), ("nvme", "memory"), ("nvme", "nvme")]


class Recording(StandInDevice):
    """Records each device-to-host copy: (dtype on the wire, whether it lands in a registered buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.d2h_log: list[tuple[torch.dtype, bool]] = []

    def d2h(self, t: torch.Tensor, out: torch.Tensor) -> Copy:
        self.d2h_log.append((t.dtype, self._regs.covers(out)))
        return super().d2h(t, out)


def low_config(tier: str, grads: str, tmp_path: Path, dtype: torch.dtype) -> dict[str, Any]:
    cfg = config(tier, tmp_path, **STREAM)
    cfg["bf16" if dtype is torch.bfloat16 else "fp16"] = {"enabled": True}
    if grads == "nvme":
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    return cfg


def low_models(make: Any, cfg: dict[str, Any], dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(the zswap model in ``dtype``, a plain one with the same ``dtype`` weights)."""
    m, ref = build(make, cfg)
    ref = ref.to(dtype)
    with zswap.GatheredParameters(list(m.parameters())):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert p.dtype == dtype
            q.data.copy_(p.data)
    return m, ref


def engine_on(m: nn.Module, cfg: dict[str, Any], dev: StandInDevice) -> zswap.Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.initialize(m, cfg, device=dev)


def backward_both(m: nn.Module, ref: nn.Module, x: torch.Tensor, acc: list[torch.Tensor | None]) -> None:
    """One backward in each model; the plain one's gradient is added to ``acc`` in float32 and cleared."""
    out, want = m(x), ref(x)
    assert torch.equal(out, want)
    sq(out.float()).backward()
    sq(want.float()).backward()
    for i, q in enumerate(ref.parameters()):
        assert q.grad is not None
        g = q.grad.float()
        acc[i] = g if acc[i] is None else acc[i].add_(g)
        q.grad = None


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("tier", "grads"), WHERE, ids=[f"{t}-{g}" for t, g in WHERE])
def test_low_precision_grads_cross_in_their_dtype_and_accumulate_in_fp32(tier, grads, dtype, tmp_path):
    cfg = low_config(tier, grads, tmp_path, dtype)
    m, ref = low_models(MLP, cfg, dtype)
    dev = Recording()
    acc: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
    with engine_on(m, cfg, dev) as engine:
        want_store = NvmeGrads if grads == "nvme" else MemoryGrads
        assert all(isinstance(store_of(zswap.param_state(p)), want_store) for p in m.parameters())
        for x in xs(4, 4, 12):
            backward_both(m, ref, x.to(dtype), acc)
        for (name, p), a in zip(m.named_parameters(), acc, strict=True):
            g = full_grad(p)
            assert g is not None and g.dtype == torch.float32, name
            assert torch.equal(g, a), f"{name}: max diff {(g - a).abs().max()}"
        assert engine.stats()["device"] == "cpu"
    # Every gradient crossed in the params' dtype; into a registered engine buffer where an engine runs
    # (CPU-tier params with memory gradients have none: torch's pinned memory then).
    assert dev.d2h_log and all(d == dtype for d, _ in dev.d2h_log)
    assert all(registered == (tier == "nvme" or grads == "nvme") for _, registered in dev.d2h_log)
    assert dev.registered_bytes == 0  # close() unregistered the landing buffers too


def test_fp32_accumulation_is_not_low_precision_accumulation(tmp_path):
    """The comparison above can fail: summing the same bfloat16 gradients in bfloat16 gives other values."""
    cfg = low_config("cpu", "memory", tmp_path, torch.bfloat16)
    m, ref = low_models(MLP, cfg, torch.bfloat16)
    acc: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
    low: list[torch.Tensor | None] = [None] * len(acc)
    with engine_on(m, cfg, StandInDevice()):
        for x in xs(6, 4, 12):
            out, want = m(x.to(torch.bfloat16)), ref(x.to(torch.bfloat16))
            sq(out.float()).backward()
            sq(want.float()).backward()
            for i, q in enumerate(ref.parameters()):
                assert q.grad is not None
                acc[i] = q.grad.float() if acc[i] is None else acc[i].add_(q.grad.float())
                low[i] = q.grad.clone() if low[i] is None else low[i].add_(q.grad)
                q.grad = None
        got = [full_grad(p) for p in m.parameters()]
    assert all(torch.equal(g, a) for g, a in zip(got, acc, strict=True))
    assert not all(torch.equal(g, lo.float()) for g, lo in zip(got, low, strict=True))  # type: ignore[union-attr]


def test_fp32_grads_of_memory_store_land_in_pinned_memory_not_the_landing_pool(tmp_path):
    """A float32 gradient kept in memory is the landed buffer itself: it is not taken from the pool of
    registered buffers (which would then be registered afresh every step)."""
    cfg = config("nvme", tmp_path, **STREAM)
    m, ref = build(MLP, cfg)
    dev = Recording()
    with engine_on(m, cfg, dev) as engine:
        for x in xs(2, 4, 12):
            out, want = m(x), ref(x)
            sq(out).backward()
            sq(want).backward()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(full_grad(p), q.grad)
        assert engine._grads.landing is not None  # there is a pool (NVMe params), unused for these
    assert dev.d2h_log and all(d == torch.float32 and not reg for d, reg in dev.d2h_log)


def test_landing_buffers_are_reused_across_backwards(tmp_path):
    cfg = low_config("nvme", "memory", tmp_path, torch.bfloat16)
    m, ref = low_models(MLP, cfg, torch.bfloat16)
    with engine_on(m, cfg, StandInDevice()) as engine:
        acc: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
        for x in xs(3, 4, 12):
            backward_both(m, ref, x.to(torch.bfloat16), acc)
        landing = engine._grads.landing
        assert landing is not None and landing.reused > 0


class StepSpy(OffloadedAdamW):
    seen: list[torch.dtype]

    def step(self, closure: Any = None, *, grad_scale: float | None = None) -> Any:
        self.seen += [p.grad.dtype for p in self._params if p.grad is not None]
        return super().step(closure, grad_scale=grad_scale)


@pytest.mark.parametrize("grads", ["memory", "nvme"])
def test_the_optimizer_reads_the_fp32_sums(grads, tmp_path):
    """Two steps over three backwards each: OffloadedAdamW gets the float32 sums and its float32 masters
    match torch's fused AdamW stepping float32 masters with the same sums."""
    dtype = torch.bfloat16
    cfg = low_config("nvme", grads, tmp_path, dtype)
    m, ref = low_models(TinyLM, cfg, dtype)
    masters = [q.detach().float().clone().requires_grad_(True) for q in ref.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01, fused=True)
    zopt = StepSpy(list(m.parameters()), lr=1e-2, weight_decay=0.01)
    zopt.seen = []
    with _engine_with(m, cfg, zopt) as engine:
        for step in range(2):
            acc: list[torch.Tensor | None] = [None] * len(masters)
            for seed in (1, 2, 3):
                backward_both(m, ref, ids(seed=seed + 3 * step), acc)
            engine.step()
            for w, a in zip(masters, acc, strict=True):
                w.grad = a
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for q, w in zip(ref.parameters(), masters, strict=True):
                    q.copy_(w)  # the plain bf16 model carries the rounded masters, as zswap's params do
        assert zopt.seen and all(d == torch.float32 for d in zopt.seen)
        state = zopt.state_dict()["state"]
        assert len(state) == len(masters)
        for i, w in enumerate(masters):
            got = state[i].get("master")
            assert got is not None
            torch.testing.assert_close(got.view(w.shape), w.detach(), rtol=1e-5, atol=1e-7)
    # After close no param keeps an opened grad_dtype.
    assert all(getattr(p, "grad_dtype", dtype) == dtype for p in m.parameters())


def _engine_with(m: nn.Module, cfg: dict[str, Any], opt: Any) -> zswap.Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.initialize(m, cfg, optimizer=opt, device=StandInDevice())


def test_a_torch_optimizer_gets_the_sum_rounded_once_to_the_param_dtype(tmp_path):
    """torch's optimizers need gradients of their params' dtype: the float32 sum is rounded once."""
    dtype = torch.bfloat16
    cfg = low_config("cpu", "memory", tmp_path, dtype)
    m, ref = low_models(MLP, cfg, dtype)
    seen: dict[int, torch.Tensor] = {}  # by the param's place in the model (chunks go in any order)
    place = {id(p): i for i, p in enumerate(m.parameters())}

    class Sgd(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            seen.update(
                (place[id(p)], p.grad.clone())
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None
            )
            return super().step(closure)

    opt = Sgd(m.parameters(), lr=0.1)
    acc: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(m, cfg, optimizer=opt, device=StandInDevice())
    with engine:
        for x in xs(3, 4, 12):
            backward_both(m, ref, x.to(dtype), acc)
        engine.step()
    grads = [seen[i] for i in sorted(seen)]
    assert [g.dtype for g in grads] == [dtype] * len(acc)
    assert all(torch.equal(g, a.to(dtype).view(-1)) for g, a in zip(grads, acc, strict=True))  # type: ignore[union-attr]
