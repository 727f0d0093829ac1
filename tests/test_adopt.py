"""A torch Adam / AdamW handed to `zswap.initialize(optimizer=...)` (the plain-PyTorch way) becomes zswap's
offloaded AdamW over the same param groups (`zswap.step.optim.adopt`), so its state lives where
``offload_optimizer`` says and the update runs in backward — results bitwise those of plain PyTorch with
``fused=True`` (zswap's kernel gives its bits; ``foreach`` / the for-loop round differently), an lr
scheduler built on it drives the engine whether passed or stepped by hand, and what would silently lose
its state (stepping it, its state dict) raises naming the zswap way. Any other optimizer is stepped as
given (the ordinary step), and `engine.stats()` says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap.step.optim import OffloadedAdamW

STEPS = 4


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.Tanh(), nn.Linear(24, 5))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """The Hugging Face Trainer's split, by name (a partitioned param is flat): weight decay on the linear
    layers' weights, none on biases and the norm."""
    decay = {"0.weight", "3.weight"}
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, "lr": 3e-2},
    ]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)) for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y) * 40  # gradient norms above 1: clipping at 1.0 bites


def _config(tmp_path: Path, tier: str = "nvme", clip: float | None = 1.0) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": tier, "nvme_path": str(tmp_path)},
        },
        "train_micro_batch_size_per_gpu": 6,
        **({"gradient_clipping": clip} if clip else {}),
    }


def _optimizer(kind: str, model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if kind == "AdamW" else torch.optim.Adam
    return cls(_groups(model), lr=1e-2, betas=(0.8, 0.95), **kw)


def _plain(kind: str, clip: float | None, schedule: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(kind, model, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    for x, y in _data():
        _loss(model, x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return [p.detach() for p in model.parameters()]


def _zswap(
    tmp_path: Path, kind: str, clip: float | None, schedule: str | None, tier: str = "nvme", **kw: Any
) -> tuple[list[torch.Tensor], Any, torch.optim.Optimizer, dict[str, Any]]:
    cfg = _config(tmp_path, tier, clip)
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = _model()
    opt = _optimizer(kind, model, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    passed = sched if schedule == "passed" else None
    with zswap.initialize(model, cfg, optimizer=opt, lr_scheduler=passed) as engine:
        for x, y in _data():
            engine.backward(_loss(model, x, y))
            engine.step()
            if schedule == "by hand":
                assert sched is not None
                sched.step()
        stats = engine.stats()
        with zswap.GatheredParameters(list(model.parameters())):
            got = [p.detach().clone() for p in model.parameters()]
        kept = engine.optimizer
    return got, kept, opt, stats


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("implementation", [{}, {"foreach": True}, {"fused": True}])
def test_a_torch_adam_trains_as_plain_fused_with_the_update_in_backward(kind, clip, implementation, tmp_path):
    got, kept, _, stats = _zswap(tmp_path, kind, clip, None, **implementation)
    assert isinstance(kept, OffloadedAdamW)
    for a, b in zip(got, _plain(kind, clip, False), strict=True):
        assert torch.equal(a, b)
    fast = stats["steps_in_backward"] + stats["steps_deferred"]
    assert (fast, stats["steps_ordinary"]) == (STEPS - 1, 1), stats["steps_ordinary_reason"]


@pytest.mark.parametrize("schedule", ["passed", "by hand"])
def test_an_lr_scheduler_built_on_it_drives_the_engine(schedule, tmp_path):
    got, kept, opt, _ = _zswap(tmp_path, "AdamW", 1.0, schedule)
    for a, b in zip(got, _plain("AdamW", 1.0, True), strict=True):
        assert torch.equal(a, b)
    assert opt.param_groups is kept.param_groups
    assert [g["lr"] for g in kept.param_groups] == [1e-2 * 0.5**STEPS, 3e-2 * 0.5**STEPS]


def test_its_state_lives_where_offload_optimizer_says(tmp_path):
    cfg = _config(tmp_path, "nvme", None)
    with zswap.Init(cfg):
        model = _model()
    with zswap.initialize(model, cfg, optimizer=_optimizer("AdamW", model)) as engine:
        for x, y in _data()[:2]:
            engine.backward(_loss(model, x, y))
            engine.step()
        assert engine.optimizer.tier == "nvme"
        state = engine.optimizer.state_dict()["state"]
        assert len(state) == 6 and all(s["exp_avg"].abs().sum() > 0 for s in state.values())


def test_the_handed_optimizer_refuses_what_would_lose_its_state(tmp_path):
    opt = _zswap(tmp_path, "AdamW", None, None)[2]
    done = "was handed to zswap, which steps zswap's offloaded AdamW over the same param groups in its place"
    with pytest.raises(zswap.ZswapError, match=r"AdamW.step\(\) over params zswap partitioned does nothing"):
        opt.step()
    with pytest.raises(zswap.ConfigError, match=f"{done}: do not take its state_dict()"):
        opt.state_dict()
    with pytest.raises(zswap.ConfigError, match=f"{done}: do not load a state dict into it"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_a_knob_the_kernel_lacks_is_refused_by_group(tmp_path):
    cfg = _config(tmp_path)
    with zswap.Init(cfg):
        model = _model()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, amsgrad=True)
    with pytest.raises(
        zswap.ConfigError,
        match=r"the AdamW passed as optimizer=, param group 0: amsgrad=True is not supported by zswap's "
        r"offloaded AdamW; set amsgrad=False",
    ):
        zswap.initialize(model, cfg, optimizer=opt)


def test_one_that_already_stepped_is_refused(tmp_path):
    cfg = _config(tmp_path, "cpu")
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _loss(model, *_data()[0]).backward()
    opt.step()
    with pytest.raises(
        zswap.ConfigError, match=r"the Adam passed as optimizer= already holds state for 6 params"
    ):
        zswap.initialize(model, cfg, optimizer=opt)


def test_another_optimizer_is_stepped_as_given_and_stats_say_so(tmp_path):
    cfg = _config(tmp_path, "nvme")
    with zswap.Init(cfg):
        model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with zswap.initialize(model, cfg, optimizer=opt) as engine:
        engine.backward(_loss(model, *_data()[0]))
        engine.step()
        assert engine.optimizer is opt
        assert engine.stats()["steps_ordinary_reason"] == "the optimizer is SGD, not zswap's OffloadedAdamW"


ELEMENTWISE = {
    "SGD": {"momentum": 0.9, "nesterov": True},
    "RMSprop": {"momentum": 0.5, "centered": True},
    "Adagrad": {"initial_accumulator_value": 0.25, "lr_decay": 0.01},  # makes its state when built
    "Adadelta": {},
    "Adamax": {},
    "NAdam": {},
    "RAdam": {},
    "ASGD": {},
    "Rprop": {},
}


def _trains_as_plain(model: nn.Module, cfg: dict, opt: Any, plain: nn.Module, plain_opt: Any) -> None:
    with zswap.initialize(model, cfg, optimizer=opt) as engine:
        for x, y in _data():
            engine.backward(_loss(model, x, y))
            engine.step()
            _loss(plain, x, y).backward()
            torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 1.0)
            plain_opt.step()
            plain_opt.zero_grad()
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_an_elementwise_torch_optimizer_trains_as_plain_torch(name, tier, tmp_path):
    """Stepped as given over each param's flat partition. Adagrad makes its ``sum`` when it is built, over
    the partitioned params' empty placeholders: zswap makes it again over their partitions (it failed with
    a size mismatch at the first step)."""
    cls, kw = getattr(torch.optim, name), ELEMENTWISE[name]
    cfg = _config(tmp_path, tier)
    torch.manual_seed(0)
    plain = _model()
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = _model()
    plain_opt = cls(_groups(plain), lr=1e-2, **kw)
    _trains_as_plain(model, cfg, cls(_groups(model), lr=1e-2, **kw), plain, plain_opt)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_made_over_a_plain_model_is_made_again_over_its_partitions(tier, tmp_path):
    """DeepSpeed's usual order: the model built plainly, the optimizer over it, then ``initialize``. On one
    rank Adagrad's ``sum`` has the partition's size but the param's shape: made again all the same (it
    failed with a shape mismatch at the first step)."""
    cfg = _config(tmp_path, tier)
    torch.manual_seed(0)
    plain = _model()
    torch.manual_seed(0)
    model = _model()
    plain_opt = torch.optim.Adagrad(_groups(plain), lr=1e-2, initial_accumulator_value=0.25)
    opt = torch.optim.Adagrad(_groups(model), lr=1e-2, initial_accumulator_value=0.25)
    _trains_as_plain(model, cfg, opt, plain, plain_opt)


def test_state_made_when_built_is_refused_once_stepped(tmp_path):
    cfg = _config(tmp_path)
    with zswap.Init(cfg):
        model = _model()
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    for entry in opt.state.values():
        entry["step"] += 1  # as after a step outside zswap (which its guard refuses)
    with pytest.raises(
        zswap.ConfigError,
        match=r"optimizer= \(Adagrad\) made its state when it was built, over the partitioned params' empty "
        r"placeholders, and zswap cannot make it again over their partitions \(it has stepped already\)",
    ):
        zswap.initialize(model, cfg, optimizer=opt)
