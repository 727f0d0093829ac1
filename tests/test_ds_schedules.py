"""DeepSpeed's learning-rate schedule tests (``tests/unit/runtime/test_lr_schedulers.py``), adapted: each
schedule built from a config's ``scheduler`` section by `zswap.deepspeed.initialize`, stepped by
``engine.step()``, read back with the scheduler's ``get_lr()`` (and ``get_mom()``)."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed
from zswap import schedules

from ._ds_common import TwoLayer, base_config, batches


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def train(
    scheduler: dict[str, Any], steps: int, *, before: bool = False, what: str = "lr"
) -> tuple[Any, list]:
    """Runs ``steps`` steps of `TwoLayer` under ``scheduler``; the schedule's rate (or momentum) before
    (``before``) or after each step."""
    cfg = base_config(scheduler=scheduler, gradient_clipping=1.0)
    model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    seen = []
    read = sched.get_mom if what == "mom" else sched.get_lr
    with engine:
        for x, y in batches(steps):
            if before:
                seen.append(read())
            engine.backward(engine(x, y))
            engine.step()
            if not before:
                seen.append(read())
    return sched, seen


def increasing(values: list[float]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


def decreasing(values: list[float]) -> bool:
    return all(a > b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("WarmupLR", {}),
        ("WarmupDecayLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
        ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 20}),
        ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1}),
        ("LRRangeTest", {}),
    ],
)
def test_get_lr_before_training_is_what_the_optimizer_holds(kind, params):
    cfg = base_config(scheduler={"type": kind, "params": params}, gradient_clipping=1.0)
    model = TwoLayer()
    engine, optimizer, _, sched = deepspeed.initialize(
        config=cfg, model=model, model_parameters=model.parameters()
    )
    with engine:
        assert [g["lr"] for g in optimizer.param_groups] == sched.get_lr()
        for x, y in batches(5):
            sched.get_lr()
            engine.backward(engine(x, y))
            engine.step()
            assert sched.get_lr() == engine.get_lr() == [g["lr"] for g in optimizer.param_groups]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup", [10, 15, 19, 33])
def test_warmup_reaches_its_max_then_stays(warmup, warmup_type):
    params = {
        "warmup_min_lr": 0.1,
        "warmup_max_lr": 0.2,
        "warmup_num_steps": warmup,
        "warmup_type": warmup_type,
    }
    _, lrs = train({"type": "WarmupLR", "params": params}, 2 * warmup + 2)
    assert lrs[0] == [0.1]  # after the first step the schedule is at its step 0
    assert increasing([lr[0] for lr in lrs[:warmup]])
    assert all(lr == [0.2] for lr in lrs[warmup:])


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup", [10, 15, 19, 33])
def test_warmup_decay_goes_up_then_back_down_to_its_min(warmup, warmup_type):
    params = {
        "warmup_min_lr": 0.1,
        "warmup_max_lr": 0.2,
        "warmup_num_steps": warmup,
        "total_num_steps": 2 * warmup,
        "warmup_type": warmup_type,
    }
    _, lrs = train({"type": "WarmupDecayLR", "params": params}, 2 * warmup + 3)
    flat = [lr[0] for lr in lrs]
    assert flat[0] == 0.1
    assert flat[warmup] == 0.2
    assert decreasing(flat[warmup : 2 * warmup + 1])
    assert all(lr == 0.1 for lr in flat[2 * warmup :])  # the decay ends at warmup_min_lr, not 0


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("WarmupLR", {}),
        ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 10}),
        (
            "OneCycle",
            {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "decay_step_size": 5},
        ),
        ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 1}),
    ],
)
def test_the_scheduler_and_the_engine_agree_on_the_rate(kind, params):
    cfg = base_config(scheduler={"type": kind, "params": params}, gradient_clipping=1.0)
    model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    with engine:
        for x, y in batches(12):
            engine.backward(engine(x, y))
            engine.step()
            assert sched.get_lr() == engine.get_lr()


@pytest.mark.parametrize(
    ("min_lr", "step_rate", "step_size", "staircase"),
    [
        (1e-4, 1e-5, 1, True),
        (1e-5, 1e-5, 1, False),
        (1e-4, 1e-3, 10, True),
        (1e-3, 1e-3, 10, False),
        (1e-2, 1e-2, 19, True),
        (1e-2, 1e-2, 19, False),
    ],
)
def test_lr_range_test_starts_at_min_and_grows(min_lr, step_rate, step_size, staircase):
    params = {
        "lr_range_test_min_lr": min_lr,
        "lr_range_test_step_rate": step_rate,
        "lr_range_test_step_size": step_size,
        "lr_range_test_staircase": staircase,
    }
    _, lrs = train({"type": "LRRangeTest", "params": params}, max(20, 2 * step_size), before=True)
    flat = [lr[0] for lr in lrs]
    assert flat[0] == min_lr
    if staircase:  # constant within each stair of step_size steps, one stair up after each
        stairs = [flat[i : i + step_size] for i in range(0, len(flat), step_size)]
        assert all(len(set(s)) == 1 for s in stairs)
        assert increasing([s[0] for s in stairs])
    else:
        assert increasing(flat)


@pytest.mark.parametrize(
    ("min_lr", "max_lr", "decay_rate", "cycle", "decay"),
    [(1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21), (1e-3, 1e-1, 1e-1, 21, 21), (1e-5, 1e-1, 0, 10, 0)],
)
def test_one_cycle_lr_rises_falls_and_decays(min_lr, max_lr, decay_rate, cycle, decay):
    params = {
        "cycle_min_lr": min_lr,
        "cycle_max_lr": max_lr,
        "decay_lr_rate": decay_rate,
        "cycle_first_step_size": cycle,
        "decay_step_size": decay,
    }
    _, lrs = train({"type": "OneCycle", "params": params}, 3 * cycle, before=True)
    flat = [lr[0] for lr in lrs]
    assert flat[0] == min_lr
    assert flat[cycle] == max_lr
    assert increasing(flat[:cycle])
    assert decreasing(flat[cycle : 2 * cycle])
    if decay_rate > 0:
        assert decreasing(flat[2 * cycle :])


@pytest.mark.parametrize(("decay_rate", "step"), [(1e-3, 10), (0, 21)])
def test_one_cycle_momentum_falls_rises_and_decays(decay_rate, step):
    params = {
        "cycle_min_lr": 1e-3,
        "cycle_max_lr": 1e-2,
        "cycle_min_mom": 0.08,
        "cycle_max_mom": 0.09,
        "decay_mom_rate": decay_rate,
        "cycle_first_step_size": step,
        "decay_step_size": step,
    }
    _, moms = train({"type": "OneCycle", "params": params}, 3 * step, before=True, what="mom")
    beta1 = [m[0][0] for m in moms]
    assert beta1[0] == 0.09
    assert beta1[step] == 0.08
    assert decreasing(beta1[:step])
    assert increasing(beta1[step : 2 * step])
    if decay_rate > 0:
        assert increasing(beta1[2 * step :])


@pytest.mark.parametrize(
    ("total", "warmup", "cos_min", "warmup_min"),
    [(100, 10, 0.1, 0.1), (200, 20, 0.1, 0.0), (500, 30, 0.0, 0.2)],
)
def test_warmup_cosine_follows_the_optimizer_lr(total, warmup, cos_min, warmup_min):
    lr = 0.001
    cfg_params = {
        "total_num_steps": total,
        "warmup_min_ratio": warmup_min,
        "warmup_num_steps": warmup,
        "cos_min_ratio": cos_min,
    }
    cfg = base_config(scheduler={"type": "WarmupCosineLR", "params": cfg_params}, gradient_clipping=1.0)
    cfg["optimizer"]["params"]["lr"] = lr
    model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    flat = []
    with engine:
        for x, y in batches(total):
            engine.backward(engine(x, y))
            engine.step()
            flat.extend(sched.get_lr())
    assert abs(flat[0] - lr * warmup_min) < 1e-7
    assert abs(flat[warmup - 1] - lr) < 1e-7
    assert abs(flat[total - 1] - lr * cos_min) < 1e-7
    assert increasing(flat[:warmup])
    assert decreasing(flat[warmup:total])


def test_warmup_cosine_sets_every_group_and_names_the_ratio_as_deepspeed():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [a], "lr": 0.0015}, {"params": [b], "lr": 0.003}])
    sched = schedules.WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10, warmup_min_ratio=0.0)
    assert sched.get_lr_ratio() == 0.0
    assert sched.get_lr() == sched.get_last_lr() == [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    sched.step(1)
    ratio = math.log(2) / math.log(10)
    assert sched.get_lr_ratio() == pytest.approx(ratio)
    assert sched.get_lr() == pytest.approx([0.0015 * ratio, 0.003 * ratio])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0015 * ratio, 0.003 * ratio])


def test_warmup_takes_each_groups_own_lr_as_its_max():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    sched = schedules.WarmupLR(opt, warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2]
    sched.step(10)
    assert sched.get_lr() == pytest.approx([0.1, 0.2])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize(
    ("cls", "kwargs", "first", "second"),
    [
        (schedules.LRRangeTest, {}, 1e-3, 1e-3 * (1 + 2 / 2000)),
        (
            schedules.OneCycle,
            {
                "cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1,
                "cycle_first_step_size": 10,
                "cycle_second_step_size": 10,
                "cycle_momentum": False,
            },
            0.01,
            0.01 + 0.09 * 2 / 10,
        ),
        (schedules.WarmupLR, {"warmup_num_steps": 10}, 0.0, 0.1 * math.log(2) / math.log(10)),
        (
            schedules.WarmupDecayLR,
            {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 0.1},
            0.0,
            0.1 * math.log(2) / math.log(10),
        ),
        (
            schedules.WarmupCosineLR,
            {"total_num_steps": 100, "warmup_num_steps": 10},
            0.0,
            0.1 * math.log(2) / math.log(10),
        ),
    ],
)
def test_a_tensor_lr_is_updated_in_place(shape, cls, kwargs, first, second):
    p = torch.nn.Parameter(torch.zeros(1))
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    opt = torch.optim.SGD([p], lr=lr)
    sched = cls(opt, **kwargs)
    for want in (first, second):
        got = opt.param_groups[0]["lr"]
        assert got is lr and got.shape == shape and got.dtype == torch.float64
        assert got.item() == pytest.approx(want)
        sched.step(1)


def test_warmup_cosine_with_no_decay_window_stays_at_its_floor():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=0.01)
    sched = schedules.WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    for step in range(10, 15):
        sched.step(step)
        assert sched.get_lr_ratio() == pytest.approx(0.1)


class _Recorder(torch.optim.lr_scheduler.LambdaLR):
    """A constant schedule that notes the keywords of each ``step`` (Megatron's ``increment``…); passed to
    ``initialize`` as its class, which DeepSpeed calls with the optimizer."""

    def __init__(self, optimizer: Any) -> None:
        self.seen: list[dict[str, Any]] = []
        super().__init__(optimizer, lambda step: 1.0)

    def step(self, **kwargs: Any) -> None:  # type: ignore[override]
        self.seen.append(kwargs)
        super().step()


def test_step_passes_lr_kwargs_to_the_schedule_on_applied_steps_only():
    """DeepSpeed's ``engine.step(lr_kwargs=…)``: the keywords reach the schedule's ``step`` after an applied
    optimizer step — not after a micro-step between boundaries, nor after a step skipped for NaN gradients —
    and the next step without them steps it plainly."""
    cfg = base_config(gradient_accumulation_steps=2, train_batch_size=4, train_micro_batch_size_per_gpu=2)
    model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(
        config=cfg, model=model, model_parameters=model.parameters(), lr_scheduler=_Recorder
    )
    with engine:
        sched.seen.clear()  # (its first step is torch's, at construction)
        data = list(batches(8))
        poisoned = data[2][0].clone()
        poisoned[0, 0] = float("nan")
        data[2] = (poisoned, data[2][1])
        for i, (x, y) in enumerate(data[:6]):
            engine.backward(engine(x, y))
            engine.step(lr_kwargs={"increment": i})
        assert engine.skipped_steps == 1  # the second boundary (micro-batches 2 and 3)
        for x, y in data[6:]:
            engine.backward(engine(x, y))
            engine.step()
        assert engine.lr_scheduler is sched  # the keywords were for those steps only
    assert sched.seen == [{"increment": 1}, {"increment": 5}, {}]
