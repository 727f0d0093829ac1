"""Clipping defaults: `zswap.deepspeed.initialize` clips at DeepSpeed's 1.0 when the config has no
``gradient_clipping`` (DeepSpeed >= 0.19.3), ``gradient_clipping: 0`` does not clip, and `zswap.initialize`
clips only when asked (PyTorch's behaviour). Each run is compared bitwise with plain PyTorch (fused AdamW
after ``clip_grad_norm_``), the engine stepping the same torch optimizer."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed as deepspeed

HYPER: dict[str, Any] = {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x))) * 10).square().mean()  # gradient norm well above 1


def config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
        **extra,
    }


def adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=HYPER["lr"], betas=tuple(HYPER["betas"]), weight_decay=HYPER["weight_decay"], fused=True
    )


def inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(4, 6, generator=g) for _ in range(n)]


def reference(clip: float | None, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """Plain PyTorch: fused AdamW, ``clip_grad_norm_(clip)`` before each step when ``clip``; the params
    after ``steps`` steps and each step's gradient norm."""
    torch.manual_seed(0)
    ref = Net()
    opt = adamw(ref.parameters())
    norms = []
    for x in inputs(steps):
        ref(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ref.parameters()], norms


def train(
    engine: zswap.Engine, model: Net, steps: int, norms: list[float] | None = None
) -> list[torch.Tensor]:
    with engine:
        for i, x in enumerate(inputs(steps)):
            engine.backward(engine(x))
            engine.step()
            if norms is not None:
                assert engine.last_grad_norm == norms[i]
        with zswap.GatheredParameters(list(model.parameters())):
            return [p.detach().clone() for p in model.parameters()]


def built() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


@pytest.mark.parametrize("extra", [{}, {"gradient_clipping": "auto"}], ids=["absent", "auto"])
def test_deepspeed_initialize_clips_at_one_without_the_key(extra):
    want, norms = reference(1.0, 3)
    assert min(norms) > 1.0  # the clip bites on every step
    model = built()
    engine, *_ = deepspeed.initialize(model=model, config=config(**extra), optimizer=adamw)
    assert engine.max_grad_norm == deepspeed.GRADIENT_CLIPPING_DEFAULT == 1.0
    assert engine.config.gradient_clipping == 1.0
    got = train(engine, model, 3, norms)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_deepspeed_initialize_with_gradient_clipping_zero_does_not_clip():
    want, _ = reference(None, 3)
    clipped, _ = reference(1.0, 3)
    assert not all(torch.equal(w, c) for w, c in zip(want, clipped, strict=True))
    model = built()
    engine, *_ = deepspeed.initialize(model=model, config=config(gradient_clipping=0), optimizer=adamw)
    assert engine.max_grad_norm is None
    got = train(engine, model, 3)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_deepspeed_initialize_keeps_an_explicit_gradient_clipping():
    want, norms = reference(2.5, 3)
    assert min(norms) > 2.5
    model = built()
    engine, *_ = deepspeed.initialize(model=model, config=config(gradient_clipping=2.5), optimizer=adamw)
    assert engine.max_grad_norm == 2.5
    got = train(engine, model, 3, norms)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_zswap_initialize_does_not_clip_without_the_key():
    want, _ = reference(None, 3)
    cfg = config()
    model = built()
    zswap.Init(cfg, module=model)
    engine = zswap.initialize(model, cfg, optimizer=adamw(model.parameters()))
    assert engine.max_grad_norm is None and engine.config.gradient_clipping is None
    got = train(engine, model, 3)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_deepspeed_initialize_clips_its_config_optimizer_at_one():
    _, norms = reference(1.0, 3)
    model = built()
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, config=config(optimizer={"type": "AdamW", "params": HYPER})
    )
    assert isinstance(optimizer, zswap.optim.OffloadedAdamW) and engine.max_grad_norm == 1.0
    train(engine, model, 3, norms)  # the norms clipped are torch's
