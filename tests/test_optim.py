"""The offloaded optimizer against torch: `cpu_adam_step` and `OffloadedAdamW` (CPU and NVMe tiers,
pipelined or not, sub-groups that split params) next to `torch.optim.AdamW` / `Adam` on the same params
and gradients, step by step."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap.errors import ConfigError, ZswapWarning
from zswap.optim import OffloadedAdamW, cpu_adam_step, kernel_isa
from zswap.step.optim._kernel import cpu_adam_redo

TOL = {"rtol": 1e-6, "atol": 1e-7}
SHAPES = [(64, 33), (33,), (7,), (1000,), (5, 5, 5)]


def _engine(path: Path) -> zswap.SwapEngine:
    with warnings.catch_warnings():  # a psync / buffered fallback is fine for these tests
        warnings.simplefilter("ignore", ZswapWarning)
        return zswap.SwapEngine(path)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[zswap.SwapEngine]:
    e = _engine(tmp_path)
    yield e
    e.close()


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _twins(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """float32 copies for the torch reference run."""
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def _grads(
    params: list[torch.nn.Parameter], step: int, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # Magnitudes vary by step so the second moment sees both growth and decay.
    scale = 10.0 ** (step % 3 - 1)
    return [(torch.randn(p.shape, generator=g) * scale).to(dtype or p.dtype) for p in params]


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _torch_opt(params: list[torch.nn.Parameter], decoupled: bool, **kw: Any) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, foreach=False, **kw)


def _offloaded(
    params: Any, tier: tuple[str, Any], tmp_path: Path, sub_group_size: int | None = None, **kw: Any
) -> OffloadedAdamW:
    device, pipeline = tier
    if device == "nvme":
        kw["engine"] = _engine(tmp_path)
    return OffloadedAdamW(params, device=device, pipeline=pipeline, sub_group_size=sub_group_size, **kw)


TIERS = [("cpu", True), ("nvme", True), ("nvme", False), ("nvme", "read"), ("nvme", "write")]
HYPER = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.01, "decoupled": True},
    {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1, "decoupled": False},
    {"lr": 1e-1, "betas": (0.3, 0.5), "weight_decay": 0.0, "decoupled": True},
]


# -- cpu_adam_step -----------------------------------------------------------------------------------


@pytest.mark.parametrize("h", HYPER, ids=["adamw", "adam-l2", "low-betas"])
def test_kernel_matches_torch_fp32(h: dict[str, Any]) -> None:
    (p,) = _params()[:1]
    ref = _twins([p])
    opt = _torch_opt(ref, h["decoupled"], lr=h["lr"], betas=h["betas"], weight_decay=h["weight_decay"])
    m, v = torch.zeros(p.numel()), torch.zeros(p.numel())
    for step in range(1, 11):
        (g,) = _grads([p], step)
        _set_grads(ref, [g])
        opt.step()
        cpu_adam_step(
            p.data, g, None, m, v, step=step, lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1],
            eps=1e-8, weight_decay=h["weight_decay"], decoupled=h["decoupled"],
        )  # fmt: skip
        st = opt.state[ref[0]]
        torch.testing.assert_close(p.data, ref[0].data, **TOL)
        torch.testing.assert_close(m, st["exp_avg"].view(-1), **TOL)
        torch.testing.assert_close(v, st["exp_avg_sq"].view(-1), **TOL)


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_low_precision_param_follows_fp32_master(pdtype: torch.dtype, gdtype: torch.dtype) -> None:
    p = _params(pdtype)[3]
    ref = _twins([p])
    master = p.detach().float().clone()
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    opt = _torch_opt(ref, True, lr=1e-2, weight_decay=0.05)
    for step in range(1, 11):
        (g,) = _grads([p], step, gdtype)
        _set_grads(ref, [g.float()])
        opt.step()
        cpu_adam_step(
            p.data, g, master, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.05, decoupled=True,
        )  # fmt: skip
        torch.testing.assert_close(master, ref[0].data, **TOL)
        assert torch.equal(p.data, master.to(pdtype))


def test_kernel_grad_scale_is_applied_first() -> None:
    p, q = torch.randn(100), None
    g = torch.randn(100)
    q = p.clone()
    m1, v1, m2, v2 = (torch.zeros(100) for _ in range(4))
    kw: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    cpu_adam_step(p, g, None, m1, v1, step=1, decoupled=True, grad_scale=0.25, **kw)
    cpu_adam_step(q, g * 0.25, None, m2, v2, step=1, decoupled=True, **kw)
    assert torch.equal(p, q) and torch.equal(m1, m2) and torch.equal(v1, v2)


def test_kernel_reports_its_instruction_set() -> None:
    assert kernel_isa() in ("avx512", "avx2", "portable")


def _kernel_args(**over: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    t = {
        "param": torch.zeros(8),
        "grad": torch.zeros(8),
        "master": None,
        "m": torch.zeros(8),
        "v": torch.zeros(8),
    }
    kw = {
        "step": 1,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "decoupled": True,
    }
    for k, val in over.items():
        (t if k in t else kw)[k] = val
    return (t["param"], t["grad"], t["master"], t["m"], t["v"]), kw


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"grad": [0.0] * 8}, TypeError, "grad must be a torch.Tensor"),
        ({"grad": torch.zeros(8, dtype=torch.int32)}, TypeError, "grad must be"),
        ({"param": torch.zeros(8, dtype=torch.float64)}, TypeError, "param must be"),
        ({"m": torch.zeros(8, dtype=torch.bfloat16)}, TypeError, "exp_avg must be torch.float32"),
        ({"grad": torch.zeros(9)}, ValueError, "grad shape"),
        ({"v": torch.zeros(7)}, ValueError, "exp_avg_sq has 7 elements"),
        ({"param": torch.zeros(8, 2)[:, 0], "grad": torch.zeros(8)}, ValueError, "param must be contiguous"),
        (
            {"param": torch.zeros(8, dtype=torch.bfloat16), "grad": torch.zeros(8)},
            ValueError,
            "needs a float32 master",
        ),
        ({"step": 0}, ValueError, "step must be an int >= 1"),
        ({"step": 1.0}, ValueError, "step must be an int >= 1"),
        ({"beta2": 1.0}, ValueError, r"betas in \[0, 1\)"),
        ({"lr": -1.0}, ValueError, "lr >= 0"),
        ({"param": torch.zeros(8, device="meta")}, ValueError, "dense CPU tensor"),
    ],
)
def test_kernel_rejects_bad_inputs(over: dict[str, Any], exc: type[Exception], match: str) -> None:
    args, kw = _kernel_args(**over)
    with pytest.raises(exc, match=match):
        cpu_adam_step(*args, **kw)


def test_kernel_rejects_aliased_tensors() -> None:
    buf = torch.zeros(16)
    args, kw = _kernel_args(m=buf[:8], v=buf[4:12])
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        cpu_adam_step(*args, **kw)


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_step_redone_from_its_moments_is_the_step_with_the_new_values(pdtype: torch.dtype) -> None:
    """`cpu_adam_redo`: from the moments a step left (they do not depend on lr, eps or decoupled weight
    decay) and the master before it, the master and param a step with new values gives, bitwise — across
    the kernel's chunks and torch's scalar tail."""
    n = (1 << 16) + 1003
    g0 = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=g0).to(pdtype)
    m0, v0, g = (
        torch.randn(n, generator=g0) * 0.1,
        torch.rand(n, generator=g0) * 1e-2,
        torch.randn(n, generator=g0),
    )
    old = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.01}
    new = {"lr": 3e-4, "eps": 1e-6, "weight_decay": 0.1}

    def full(values: dict[str, float]) -> list[torch.Tensor]:
        p, w, m, v = p0.clone(), p0.float(), m0.clone(), v0.clone()
        master = None if pdtype == torch.float32 else w
        cpu_adam_step(p, g, master, m, v, step=7, beta1=0.9, beta2=0.99, decoupled=True, **values)
        return [p, w, m, v]

    ran, want = full(old), full(new)
    assert torch.equal(ran[2], want[2]) and torch.equal(ran[3], want[3])
    p, w = p0.clone(), p0.float()
    master = None if pdtype == torch.float32 else w
    cpu_adam_redo(p, master, ran[2], ran[3], step=7, beta1=0.9, beta2=0.99, decoupled=True, **new)
    assert torch.equal(p, want[0]) and (master is None or torch.equal(w, want[1]))
    assert not torch.equal(ran[0], want[0])  # the values moved it elsewhere


def test_param_groups_count_every_way_of_assigning_a_hyper_parameter() -> None:
    """The early step tells a loop that sets the lr between backward and step by these counts, the value
    set being the old one or not: item assignment, ``update`` and ``|=`` alike; other keys do not count."""
    opt = OffloadedAdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    g = opt.param_groups[0]
    before = g.writes
    g["lr"] = g["lr"]
    g.update(lr=g["lr"], eps=1e-8)
    g.update({"weight_decay": 0.0}, name="head")
    g |= {"betas": g["betas"]}
    g["name"] = "body"
    assert g.writes - before == 5 and g["name"] == "body" and isinstance(g, dict)
    opt.close()


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"param": torch.zeros(8, dtype=torch.bfloat16)}, "needs a float32 master"),
        ({"v": torch.zeros(7)}, "exp_avg_sq has 7 elements"),
        ({"step": 0}, "step must be an int >= 1"),
    ],
)
def test_a_redo_rejects_bad_inputs(over: dict[str, Any], match: str) -> None:
    (param, _, master, m, v), kw = _kernel_args(**over)
    with pytest.raises(ValueError, match=match):
        cpu_adam_redo(param, master, m, v, **kw)


# -- OffloadedAdamW against torch --------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: f"{t[0]}-pipeline={t[1]}")
@pytest.mark.parametrize("sub_group_size", [None, 1000, 777])
@pytest.mark.parametrize("h", HYPER, ids=["adamw", "adam-l2", "low-betas"])
def test_offloaded_matches_torch(
    tier: Any, sub_group_size: int | None, h: dict[str, Any], tmp_path: Path
) -> None:
    params = _params()
    ref = _twins(params)
    hyper = {"lr": h["lr"], "betas": h["betas"], "weight_decay": h["weight_decay"]}
    topt = _torch_opt(ref, h["decoupled"], **hyper)
    opt = _offloaded(params, tier, tmp_path, sub_group_size, decoupled_weight_decay=h["decoupled"], **hyper)
    if sub_group_size is not None:
        assert len(opt.sub_groups) == 0  # placed lazily, on the first step
    for step in range(10):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, grads)
        opt.step()
        topt.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
    if sub_group_size is not None:
        assert any(len(sg.segments) > 1 for sg in opt.sub_groups)  # several params in one record
        assert len({sg.segments[0].param for sg in opt.sub_groups}) < len(opt.sub_groups)  # a param split
    opt.close()


@pytest.mark.parametrize("tier", TIERS[:2], ids=lambda t: t[0])
@pytest.mark.parametrize("sub_group_size", [None, 700])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_offloaded_is_bitwise_torchs_fused_adamw(
    tier: Any, sub_group_size: int | None, decoupled: bool, tmp_path: Path
) -> None:
    """Element for element torch's fused CPU AdamW, the scalar tail of every tensor included (its last
    ``numel % 8`` elements, which torch computes with another contraction: small gradients, as after
    clipping, show the difference within a few steps), also where a record splits a param."""
    g = torch.Generator().manual_seed(3)
    sizes = [1003, 7, 2050, 9, 16, 33]
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    ref = _twins(params)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    topt = cls(ref, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, fused=True)
    opt = _offloaded(
        params, tier, tmp_path, sub_group_size, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01,
        decoupled_weight_decay=decoupled,
    )  # fmt: skip
    for _ in range(20):
        grads = [torch.randn(n, generator=g) * 0.02 for n in sizes]
        _set_grads(params, grads)
        _set_grads(ref, grads)
        opt.step()
        topt.step()
        assert all(torch.equal(p, r) for p, r in zip(params, ref, strict=True))
    opt.close()


def test_kernel_tail_from_is_checked_and_defaults_to_torchs_tail() -> None:
    from zswap.step.optim._kernel import torch_tail

    assert [torch_tail(n) for n in (0, 7, 8, 17, 1003)] == [0, 0, 8, 16, 1000]
    p, gr = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match="tail_from must be an int >= 0, got -1"):
        cpu_adam_step(
            p, gr, None, torch.zeros(4), torch.zeros(4), step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
            weight_decay=0.0, decoupled=True, tail_from=-1,
        )  # fmt: skip


@pytest.mark.parametrize("tier", TIERS[:3], ids=lambda t: f"{t[0]}-pipeline={t[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offloaded_low_precision_params_keep_fp32_master(
    tier: Any, dtype: torch.dtype, tmp_path: Path
) -> None:
    params = _params(dtype)
    ref = _twins(params)
    topt = _torch_opt(ref, True, lr=1e-2, betas=(0.85, 0.995), weight_decay=0.02)
    opt = _offloaded(params, tier, tmp_path, 900, lr=1e-2, betas=(0.85, 0.995), weight_decay=0.02)
    for step in range(10):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, [g.float() for g in grads])
        opt.step()
        topt.step()
        state = opt.state_dict()["state"]
        for i, (p, r) in enumerate(zip(params, ref, strict=True)):
            master = state[i]["master"]
            torch.testing.assert_close(master, r.data, **TOL)
            assert torch.equal(p.data, master.to(dtype))
    opt.close()


def _snapshot(opt: OffloadedAdamW) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("tier", TIERS[:2], ids=lambda t: t[0])
def test_fp16_grads_with_inf_skip_the_step(tier: Any, tmp_path: Path) -> None:
    params = _params(torch.float16)
    ref = _twins(params)
    topt = _torch_opt(ref, True, lr=1e-2)
    opt = _offloaded(params, tier, tmp_path, 1000, lr=1e-2)
    for step in range(4):
        grads = _grads(params, step)
        if step == 2:
            grads[1][3] = float("inf")
            before_p = [p.detach().clone() for p in params]
            before_s = _snapshot(opt)
            _set_grads(params, grads)
            opt.step()
            assert opt.skipped_steps == 1 and opt.last_grad_norm == float("inf")
            for p, b in zip(params, before_p, strict=True):
                assert torch.equal(p.data, b)
            after = _snapshot(opt)
            for i, st in before_s.items():
                for k, t in st.items():
                    assert torch.equal(after[i][k], t), (i, k)
            continue
        _set_grads(params, grads)
        _set_grads(ref, [g.float() for g in grads])
        opt.step()
        topt.step()
        state = opt.state_dict()["state"]
        for i, r in enumerate(ref):
            torch.testing.assert_close(state[i]["master"], r.data, **TOL)
    assert opt.state_dict()["state"][0]["step"].item() == 3
    opt.close()


@pytest.mark.parametrize("tier", TIERS[:2], ids=lambda t: t[0])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_matches_clip_grad_norm(tier: Any, max_norm: float, tmp_path: Path) -> None:
    params = _params()
    ref = _twins(params)
    topt = _torch_opt(ref, True, lr=1e-2)
    opt = _offloaded(params, tier, tmp_path, 1000, lr=1e-2, max_grad_norm=max_norm)
    for step in range(10):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, grads)
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        opt.step()
        topt.step()
        assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
        for p, r, g in zip(params, ref, grads, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
            assert torch.equal(p.grad, g)  # the optimizer scales inside the kernel, not the grads
    opt.close()


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_step_grad_scale_scales_before_clipping(max_norm: float | None, tmp_path: Path) -> None:
    params = _params()
    ref = _twins(params)
    topt = _torch_opt(ref, True, lr=1e-2)
    opt = _offloaded(params, ("nvme", True), tmp_path, 1000, lr=1e-2, max_grad_norm=max_norm)
    for step in range(5):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, [g * 0.5 for g in grads])  # a power of two: the same bits either way
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref, max_norm)
        opt.step(grad_scale=0.5)
        topt.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
    opt.close()


def test_a_param_must_keep_its_size() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    opt = OffloadedAdamW([p])
    p.grad = torch.ones(10)
    opt.step()
    p.data, p.grad = torch.zeros(4), torch.ones(4)
    with pytest.raises(ValueError, match="has 4 elements but its optimizer state 10"):
        opt.step()


@pytest.mark.parametrize("tier", TIERS[:2], ids=lambda t: t[0])
def test_frozen_and_gradless_params_are_untouched(tier: Any, tmp_path: Path) -> None:
    params = _params()
    params[0].requires_grad_(False)
    frozen, gradless = params[0].detach().clone(), params[2].detach().clone()
    opt = _offloaded(params, tier, tmp_path, 500, lr=1e-2)
    for step in range(3):
        grads = _grads(params, step)
        _set_grads(params, grads)
        params[0].grad = None  # frozen: backward gives it none (one that has a .grad is stepped, as by torch)
        params[2].grad = None
        opt.step()
    assert torch.equal(params[0].data, frozen) and torch.equal(params[2].data, gradless)
    assert sorted(opt.state_dict()["state"]) == [1, 3, 4]
    placed = {s.param for sg in opt.sub_groups for s in sg.segments}
    assert placed == {1, 3, 4}  # no state is kept for params that never had a gradient
    opt.close()


def test_step_is_seen_by_autograd_like_an_in_place_op() -> None:
    params = _params()
    opt = OffloadedAdamW(params, lr=1e-2)
    before = [p._version for p in params]
    _set_grads(params, _grads(params, 0))
    opt.step()
    assert all(p._version > v for p, v in zip(params, before, strict=True))


def test_zero_grad_is_torchs(tmp_path: Path) -> None:
    params = _params()
    opt = OffloadedAdamW(params)
    _set_grads(params, _grads(params, 0))
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    _set_grads(params, _grads(params, 0))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)


def test_lr_changes_between_steps_and_param_groups(tmp_path: Path) -> None:
    params = _params()
    ref = _twins(params)
    opt = _offloaded(
        [{"params": params[:2]}, {"params": params[2:], "lr": 1e-1, "weight_decay": 0.0}],
        ("nvme", True), tmp_path, 1000, lr=1e-2,
    )  # fmt: skip
    topt = torch.optim.AdamW(
        [{"params": ref[:2]}, {"params": ref[2:], "lr": 1e-1, "weight_decay": 0.0}], lr=1e-2, foreach=False
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=2, gamma=0.5)
    for step in range(6):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, grads)
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
    assert {sg.group for sg in opt.sub_groups} == {0, 1}
    opt.close()


# -- state dicts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), [(TIERS[0], TIERS[1]), (TIERS[1], TIERS[0]), (TIERS[2], TIERS[1])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(src: Any, dst: Any, dtype: torch.dtype, tmp_path: Path) -> None:
    a = _params(dtype)
    opt_a = _offloaded(a, src, tmp_path, 1000, lr=1e-2)
    for step in range(3):
        _set_grads(a, _grads(a, step))
        opt_a.step()
    sd = opt_a.state_dict()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = _offloaded(b, dst, tmp_path, 640, lr=0.5)  # a different layout and lr: both come from sd
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        grads = _grads(a, step)
        _set_grads(a, grads)
        _set_grads(b, grads)
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p.data, q.data)
    for st_a, st_b in zip(
        opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values(), strict=True
    ):
        for k in st_a:
            assert torch.equal(st_a[k], st_b[k]), k
    opt_a.close()
    opt_b.close()


def test_state_dict_interoperates_with_torch_adamw(tmp_path: Path) -> None:
    params = _params()
    ref = _twins(params)
    topt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for step in range(3):
        _set_grads(ref, _grads(ref, step))
        topt.step()
    for p, r in zip(params, ref, strict=True):
        p.data.copy_(r.data)
    opt = _offloaded(params, ("nvme", True), tmp_path, 1000, lr=1.0)
    opt.load_state_dict(topt.state_dict())
    for step in range(3, 6):
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, grads)
        opt.step()
        topt.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
    back = torch.optim.AdamW(_twins(params), lr=1e-2, foreach=False)
    back.load_state_dict(opt.state_dict())
    for st, tst in zip(back.state.values(), topt.state.values(), strict=True):
        torch.testing.assert_close(st["exp_avg"], tst["exp_avg"], **TOL)
        assert float(st["step"]) == float(tst["step"]) == 6
    opt.close()


def test_load_state_dict_rejects_mismatches() -> None:
    opt = OffloadedAdamW(_params())
    sd = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match="parameter group 0 has 2 params"):
        opt.load_state_dict(sd)
    sd = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}}
    sd["param_groups"] = [{"params": list(range(len(SHAPES)))}]
    with pytest.raises(ValueError, match="exp_avg has 3 elements"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match="2 parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": []}, {"params": []}]})


# -- construction ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"betas": (0.9, 1.0)}, "betas must be two values"),
        ({"eps": -1.0}, "Invalid epsilon"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"device": "gpu"}, "device must be 'cpu' or 'nvme'"),
        ({"device": "nvme"}, "exactly one of nvme_path"),
        ({"nvme_path": "/tmp"}, "are for device='nvme'"),
        ({"sub_group_size": 0}, "sub_group_size must be a positive int"),
        ({"pipeline": "both"}, "pipeline must be"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be > 0"),
    ],
)
def test_constructor_rejects_bad_settings(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadedAdamW(_params(), **kw)


def test_step_rejects_unsupported_params() -> None:
    p = torch.nn.Parameter(torch.zeros(4, 4).t())
    opt = OffloadedAdamW([p])
    p.grad = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="must be contiguous"):
        opt.step()


def test_params_of_a_dtype_the_kernel_does_not_step_are_refused_when_built(tmp_path: Path) -> None:
    """A float64 param was accepted and failed at the first step with the kernel's bare ``TypeError``:
    refused when the optimizer is built (also through ``initialize``'s config section), naming it."""
    ok = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(zswap.errors.UnsupportedDtypeError) as info:
        OffloadedAdamW([ok, torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))])
    assert str(info.value) == (
        "OffloadedAdamW steps float32, bfloat16 and float16 params: a param of shape (2, 3) in param group "
        "0 is torch.float64; cast the model to one of them (model.float()) before building the optimizer"
    )
    assert isinstance(info.value, TypeError)
    opt = OffloadedAdamW([ok])
    unsupported = zswap.errors.UnsupportedDtypeError
    with pytest.raises(unsupported, match=r"shape \(2,\) in param group 1 is torch\.float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    frozen = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    OffloadedAdamW([ok, frozen])  # never stepped: taken, as torch's optimizers take it
    cfg = {
        "zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    with zswap.Init(cfg):
        m = torch.nn.Linear(3, 2)
    m.double()
    with pytest.raises(
        zswap.errors.UnsupportedDtypeError, match=r"shape \(2, 3\) in param group 0 is torch\.float64"
    ):
        zswap.initialize(m, cfg)


def test_close_frees_the_keys_of_a_shared_engine(engine: zswap.SwapEngine) -> None:
    params = _params()
    opt = OffloadedAdamW(params, device="nvme", engine=engine, sub_group_size=1000)
    _set_grads(params, _grads(params, 0))
    opt.step()
    assert len(list(engine.keys())) == len(opt.sub_groups) > 1
    opt.close()
    assert list(engine.keys()) == [] and not engine.closed


def test_owned_engine_is_closed(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZswapWarning)
        opt = OffloadedAdamW(_params(), device="nvme", nvme_path=tmp_path)
    engine = opt._store.engine  # type: ignore[union-attr]
    opt.close()
    assert engine.closed


def _config(tmp_path: Path, **opt_params: Any) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": False},
            "sub_group_size": 1234,
        },
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.8, 0.9], **opt_params}},
    }


def test_from_config_needs_an_lr(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr is 'auto'.*pass lr="):
        OffloadedAdamW.from_config(_params(), _config(tmp_path))


def test_from_config_builds_the_described_optimizer(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZswapWarning)
        opt = OffloadedAdamW.from_config(_params(), _config(tmp_path, adam_w_mode=False), lr=0.5)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["decoupled_weight_decay"]) == (
        0.5,
        (0.8, 0.9),
        0.0,
        False,
    )
    assert opt.tier == "nvme" and opt._sub_group_size == 1234
    store = opt._store
    assert (store.read_ahead, store.write_behind, store.owns_engine) == (False, True, True)  # type: ignore[union-attr]
    opt.close()
    cpu = OffloadedAdamW.from_config(_params(), {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert (
        cpu.tier == "cpu"
        and cpu.param_groups[0]["lr"] == 0.1
        and cpu.param_groups[0]["decoupled_weight_decay"]
    )


# -- the pipelined walk ------------------------------------------------------------------------------


class _Recorder:
    """A SwapEngine stand-in that logs the order of transfers and buffer allocations."""

    def __init__(self, engine: zswap.SwapEngine, log: list[tuple[str, str]]) -> None:
        self._e, self.log, self.closed = engine, log, False

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.log.append(("empty", str(numel)))
        return self._e.empty(numel, dtype)

    def read(self, key: str, out: torch.Tensor) -> Any:
        self.log.append(("read", key.rsplit("@", 1)[0]))  # the record's key, without its version
        return self._e.read(key, out)

    def write(self, key: str, t: torch.Tensor) -> Any:
        self.log.append(("write", key.rsplit("@", 1)[0]))
        return self._e.write(key, t)

    def __contains__(self, key: str) -> bool:
        return key in self._e

    def free(self, key: str) -> None:
        self._e.free(key)


@pytest.mark.parametrize(
    ("pipeline", "buffers"), [(True, 3), ("read", 2), ("write", 2), (False, 1)], ids=lambda x: str(x)
)
def test_walk_reads_ahead_and_writes_behind(pipeline: Any, buffers: int, engine: zswap.SwapEngine) -> None:
    from zswap.optim._store import NvmeStore

    params = _params()
    log: list[tuple[str, str]] = []
    opt = OffloadedAdamW(params, device="nvme", engine=engine, sub_group_size=1000, pipeline=pipeline)
    store = opt._store
    assert isinstance(store, NvmeStore)
    store.storage.engine = _Recorder(engine, log)
    for step in range(2):
        _set_grads(params, _grads(params, step))
        opt.step()
    assert [e for e in log if e[0] == "empty"] == [("empty", "2000")] * buffers  # sized once, kept
    keys = [sg.key for sg in opt.sub_groups]
    second = [e for e in log if e[0] != "empty"][len(keys) :]  # the first step only writes
    events = list(second)
    # Replay: a read of record i+1 is issued before record i is written (read ahead); without it, a
    # record is read only after the previous one was written.
    for i in range(len(keys) - 1):
        read_next = events.index(("read", keys[i + 1]))
        write_this = events.index(("write", keys[i]))
        assert (read_next < write_this) == (pipeline in (True, "read")), (i, events)
    opt.close()


def test_a_failed_read_raises_and_leaves_nothing_in_flight(engine: zswap.SwapEngine) -> None:
    params = _params()
    opt = OffloadedAdamW(params, device="nvme", engine=engine, sub_group_size=1000)
    _set_grads(params, _grads(params, 0))
    opt.step()
    engine._engine.inject_fault("read", "errno", 5, skip=2)
    with pytest.raises(zswap.SwapIOError) as info:
        opt.step()
    assert info.value.errno == 5
    engine._engine.clear_faults()
    assert opt.state_dict()["state"]  # the engine and the ring are usable again
    opt.close()


def test_params_added_after_steps_get_state_on_their_first_step(tmp_path: Path) -> None:
    params = _params()
    ref = _twins(params)
    opt = _offloaded(params[:2], ("nvme", True), tmp_path, 1000, lr=1e-2)
    topt = torch.optim.AdamW(ref[:2], lr=1e-2, foreach=False)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": params[2:], "weight_decay": 0.0})
            topt.add_param_group({"params": ref[2:], "weight_decay": 0.0})
        grads = _grads(params, step)
        _set_grads(params, grads)
        _set_grads(ref, grads)
        opt.step()
        topt.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.data, r.data, **TOL)
    assert opt.state_dict()["state"][4]["step"].item() == 2
    opt.close()
