"""Clipping defaults: `zswap.deepspeed.initialize` clips at DeepSpeed's 1.0 when the config has no
``gradient_clipping`` (DeepSpeed >= 0.19.3), ``gradient_clipping: 0`` does not clip, and `zswap.initialize`
clips only when asked (PyTorch's behaviour). Each run is compared bitwise with plain PyTorch (fused AdamW
after ``clip_grad_norm_``), the engine stepping the same torch optimizer.

The norm under DeepSpeed's call shapes: taken at every step, clipping or not, and a step whose norm is not
finite skipped in every precision (``get_global_grad_norm()`` inf, the schedule not stepped), as DeepSpeed
0.19.8's ZeRO-3 does; `zswap.initialize` applies such a step in fp32, as PyTorch does."""

from __future__ import annotations

import warnings
from pathlib import Path
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


def inputs_with_nan(n: int, at: int) -> list[torch.Tensor]:
    """`inputs` with one NaN in batch ``at``: its every gradient is NaN."""
    xs = inputs(n)
    xs[at][0, 0] = float("nan")
    return xs


def reference(
    clip: float | None, steps: int, xs: list[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[float]]:
    """Plain PyTorch: fused AdamW, ``clip_grad_norm_(clip)`` before each step when ``clip``; the params
    after ``steps`` steps (over ``xs``, default `inputs`) and each step's gradient norm."""
    torch.manual_seed(0)
    ref = Net()
    opt = adamw(ref.parameters())
    norms = []
    for x in inputs(steps) if xs is None else xs:
        ref(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ref.parameters()], norms


def train(
    engine: zswap.Engine,
    model: Net,
    steps: int,
    norms: list[float] | None = None,
    xs: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    with engine:
        for i, x in enumerate(inputs(steps) if xs is None else xs):
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
    want, norms = reference(None, 3)
    clipped, _ = reference(1.0, 3)
    assert not all(torch.equal(w, c) for w, c in zip(want, clipped, strict=True))
    model = built()
    engine, *_ = deepspeed.initialize(model=model, config=config(gradient_clipping=0), optimizer=adamw)
    assert engine.max_grad_norm is None and engine.get_global_grad_norm() is None
    got = train(engine, model, 3, norms)  # the norm is taken all the same, as DeepSpeed's
    norm = engine.get_global_grad_norm()  # DeepSpeed's type: a 0-d tensor
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.item() == norms[-1]
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
    assert engine.last_grad_norm is None  # nothing asked for it
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_zswap_initialize_refuses_auto_clipping_it_has_no_trainer_to_fill():
    """``"auto"`` is the Hugging Face Trainer's max_grad_norm; in a hand-written loop it once meant no
    clipping, silently (a Trainer config reused there stopped clipping). ``max_grad_norm=`` decides it."""
    cfg = config() | {"gradient_clipping": "auto"}
    model = built()
    zswap.Init(cfg, module=model)
    with pytest.raises(
        zswap.ConfigError, match=r'gradient_clipping is "auto", which the Hugging Face Trainer'
    ):
        zswap.initialize(model, cfg, optimizer=adamw(model.parameters()))
    with zswap.initialize(model, cfg, optimizer=adamw(model.parameters()), max_grad_norm=1.0) as engine:
        assert engine.max_grad_norm == 1.0


def test_deepspeed_initialize_clips_its_config_optimizer_at_one():
    _, norms = reference(1.0, 3)
    model = built()
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, config=config(optimizer={"type": "AdamW", "params": HYPER})
    )
    assert isinstance(optimizer, zswap.optim.OffloadedAdamW) and engine.max_grad_norm == 1.0
    train(engine, model, 3, norms)  # the norms clipped are torch's


@pytest.mark.parametrize("clip", [0, 1.0])
def test_a_step_whose_norm_is_not_finite_is_skipped_as_deepspeed_does(clip):
    """DeepSpeed 0.19.8 (checked): norms ``[n, inf, n', n'']``, ``skipped_steps`` 1, the weights those of
    the steps over the finite batches alone — not NaN."""
    xs = inputs_with_nan(4, at=1)
    want, norms = reference(clip or None, 3, [xs[0], *xs[2:]])
    model = built()
    engine, *_ = deepspeed.initialize(model=model, config=config(gradient_clipping=clip), optimizer=adamw)
    applied, seen = [], []
    with engine:
        for x in xs:
            engine.backward(engine(x))
            engine.step()
            applied.append(engine.was_step_applied())
            seen.append(engine.get_global_grad_norm())
        got = train(engine, model, 0)
    assert [float(n) for n in seen] == [norms[0], float("inf"), *norms[1:]]
    assert seen[1] == float("inf") and not isinstance(seen[1], torch.Tensor)  # DeepSpeed's float there
    assert applied == [True, False, True, True]
    assert (engine.skipped_steps, engine.global_steps) == (1, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("clip", [0, 1.0])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_skipped_step_moves_neither_the_optimizer_nor_the_schedule(dtype, clip, tmp_path):
    """The config's AdamW and WarmupLR, params and states on NVMe, in fp32 and bf16 (fp32 masters): a run
    with a NaN batch ends bitwise where a run without that batch ends; the other steps keep the fast path
    (updated in backward, or deferred when clipping bites)."""
    xs = inputs_with_nan(5, at=2)

    def run(batches: list[torch.Tensor], where: Path) -> tuple[list[torch.Tensor], zswap.Engine]:
        nvme = {"device": "nvme", "nvme_path": str(where)}
        cfg = config(
            gradient_clipping=clip,
            optimizer={"type": "AdamW", "params": HYPER},
            scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            zero_optimization={"stage": 3, "offload_param": nvme, "offload_optimizer": nvme},
            **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
        )
        model = built()
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        with engine:
            for x in batches:
                engine.backward(engine(x.to(torch.bfloat16) if dtype == "bf16" else x).float())
                engine.step()
            return train(engine, model, 0), engine

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got, engine = run(xs, tmp_path / "a")
    want, plain = run([*xs[:2], *xs[3:]], tmp_path / "b")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert engine.lr_scheduler.get_last_lr() == plain.lr_scheduler.get_last_lr()
    assert (engine.skipped_steps, engine.global_steps, plain.global_steps) == (1, 5, 4)
    stats = engine.stats()
    assert stats["steps_overflow_dropped"] == 1, stats
    assert stats["steps_in_backward"] + stats["steps_deferred"] == 3, stats  # all but the first and the NaN


def subset_reference(steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """`reference` at clip 1.0 with only ``b`` in the optimizer and in the norm (``a`` requires grad):
    DeepSpeed's ZeRO-3 takes the norm over its optimizer's groups."""
    torch.manual_seed(0)
    ref = Net()
    opt = adamw(ref.b.parameters())
    norms = []
    for x in inputs(steps):
        ref(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.b.parameters(), 1.0)))
        opt.step()
        ref.zero_grad()
    return [p.detach().clone() for p in ref.parameters()], norms


@pytest.mark.parametrize("how", ["model_parameters", "optimizer"])
def test_the_norm_covers_the_optimizers_params_only_as_deepspeeds(how):
    want, norms = subset_reference(3)
    everything, _ = reference(1.0, 3)
    assert min(norms) > 1.0
    model = built()
    if how == "model_parameters":
        cfg = config(optimizer={"type": "AdamW", "params": HYPER})
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.b.parameters())
    else:
        engine, *_ = deepspeed.initialize(model=model, config=config(), optimizer=adamw(model.b.parameters()))
    got = train(engine, model, 3, norms)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not torch.equal(got[2], everything[2])


def test_zswap_initialize_takes_the_norm_over_every_gradient_as_clip_grad_norm_of_the_model():
    torch.manual_seed(0)
    ref = Net()
    opt = adamw(ref.b.parameters())
    norms = []
    for x in inputs(3):
        ref(x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        opt.step()
        ref.zero_grad()
    model = built()
    cfg = config()
    zswap.Init(cfg, module=model)
    engine = zswap.initialize(model, cfg, optimizer=adamw(model.b.parameters()), max_grad_norm=1.0)
    got = train(engine, model, 3, norms)
    assert all(torch.equal(g, w.detach()) for g, w in zip(got, ref.parameters(), strict=True))
