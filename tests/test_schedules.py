"""DeepSpeed's five LR schedules: the rate at each of 50 steps equals DeepSpeed's formula (and DeepSpeed's own
classes where deepspeed is importable); built by `initialize` from the config, stepped at accumulation
boundaries only, and not on skipped fp16 steps; a torch scheduler (or a factory) passed instead."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import zswap
from zswap import ConfigError, schedules
from zswap.step.optim import OffloadedAdamW

from .test_runtime import TinyLM, build, config, engine_for, ids, sq

STEPS = 50


def _opt(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.AdamW([{"params": [p]} for p in params], lr=lr)


def _warm(kind: str, it: int, n: int) -> float:
    return (1.0 / math.log(n)) * math.log(it + 1) if kind == "log" else it / n


# DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py), written out per step index `it` (0-based: the
# rate in force after `it + 1` calls of step()).
def warmup_lr(it: int, lo: float, hi: float, n: int, kind: str) -> float:
    n = max(2, n)
    return lo + (hi - lo) * (_warm(kind, it, n) if it < n else 1.0)


def warmup_decay_lr(it: int, total: int, lo: float, hi: float, n: int, kind: str) -> float:
    n = max(2, n)
    gamma = _warm(kind, it, n) if it < n else max(0.0, float(total - it) / float(max(1.0, total - n)))
    return lo + (hi - lo) * gamma


def warmup_cosine_lr(
    it: int, base: float, total: int, min_ratio: float, n: int, cos_min: float, kind: str
) -> float:
    n = max(2, n)
    if it < n:
        return base * (min_ratio + _warm(kind, it, n) * (1.0 - min_ratio))
    progress = min(1.0, (it - n + 1) / max(1, total - n))
    return base * max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle_lr(
    it: int, lo: float, hi: float, first: int, second: int, decay_rate: float, decay_size: int
) -> float:
    total = first + second
    if it < total:
        k = it + 1
        x = 1.0 + k / total - math.floor(1 + k / total)
        ratio = first / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * scale
    if decay_size == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * ((it - total + 1) / decay_size))


def lr_range_test_lr(it: int, lo: float, size: int, rate: float, staircase: bool) -> float:
    interval = float(it + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))


CASES: list[tuple[str, dict[str, Any], Callable[[int], float]]] = [
    ("WarmupLR", {"warmup_num_steps": 20}, lambda it: warmup_lr(it, 0.0, 0.1, 20, "log")),
    (
        "WarmupLR",
        {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 30, "warmup_type": "linear"},
        lambda it: warmup_lr(it, 0.01, 0.5, 30, "linear"),
    ),
    ("WarmupLR", {"warmup_num_steps": 1}, lambda it: warmup_lr(it, 0.0, 0.1, 1, "log")),
    (
        "WarmupDecayLR",
        {"total_num_steps": 40, "warmup_num_steps": 10},
        lambda it: warmup_decay_lr(it, 40, 0.0, 0.001, 10, "log"),
    ),
    (
        "WarmupDecayLR",
        {"total_num_steps": 45, "warmup_min_lr": 1e-4, "warmup_max_lr": 0.3, "warmup_num_steps": 5,
         "warmup_type": "linear"},
        lambda it: warmup_decay_lr(it, 45, 1e-4, 0.3, 5, "linear"),
    ),
    (
        "WarmupCosineLR",
        {"total_num_steps": 40, "warmup_num_steps": 8},
        lambda it: warmup_cosine_lr(it, 0.1, 40, 0.0, 8, 0.0001, "log"),
    ),
    (
        "WarmupCosineLR",
        {"total_num_steps": 60, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
         "warmup_type": "linear"},
        lambda it: warmup_cosine_lr(it, 0.1, 60, 0.1, 10, 0.05, "linear"),
    ),
    (
        "OneCycle",
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_second_step_size": 15,
         "decay_lr_rate": 0.5, "decay_step_size": 4},
        lambda it: one_cycle_lr(it, 0.01, 0.1, 10, 15, 0.5, 4),
    ),
    (
        "OneCycle",
        {"cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 12},
        lambda it: one_cycle_lr(it, 0.02, 0.2, 12, 12, 0.0, 0),
    ),
    ("LRRangeTest", {"lr_range_test_step_size": 7}, lambda it: lr_range_test_lr(it, 1e-3, 7, 1.0, False)),
    (
        "LRRangeTest",
        {"lr_range_test_min_lr": 0.02, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 0.5,
         "lr_range_test_staircase": True},
        lambda it: lr_range_test_lr(it, 0.02, 5, 0.5, True),
    ),
]  # fmt: skip
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)]


def _built(name: str, params: dict[str, Any], opt: torch.optim.Optimizer) -> schedules.Schedule:
    cfg = zswap.load_config({"scheduler": {"type": name, "params": params}})
    assert cfg.scheduler is not None
    return schedules.build(cfg.scheduler, opt)


@pytest.mark.parametrize(("name", "params", "formula"), CASES, ids=IDS)
def test_each_schedule_follows_deepspeeds_formula_for_50_steps(name, params, formula):
    opt = _opt()
    sched = _built(name, params, opt)
    assert type(sched).__name__ == name
    for it in range(STEPS):
        sched.step()
        assert sched.last_batch_iteration == it
        assert opt.param_groups[0]["lr"] == formula(it), f"step {it}"
        assert sched.get_last_lr() == [formula(it)]


def test_rates_before_the_first_step_are_deepspeeds():
    opt = _opt()
    _built("WarmupLR", {"warmup_min_lr": 0.02}, opt)
    assert opt.param_groups[0]["lr"] == 0.02
    opt = _opt()
    _built("WarmupCosineLR", {"total_num_steps": 10}, opt)
    assert opt.param_groups[0]["lr"] == 0.0
    opt = _opt()
    _built("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, opt)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    opt = _opt()
    _built("LRRangeTest", {"lr_range_test_min_lr": 0.3}, opt)
    assert opt.param_groups[0]["lr"] == 0.3


def test_defaults_are_deepspeeds():
    opt = _opt(lr=0.07)
    s = _built("WarmupLR", {}, opt)
    assert isinstance(s, schedules.WarmupLR)
    assert (s.min_lrs, s.max_lrs, s.warmup_num_steps, s.warmup_type) == ([0.0], [0.07], 1000, "log")
    d = _built("WarmupDecayLR", {"total_num_steps": 5000}, _opt())
    assert isinstance(d, schedules.WarmupDecayLR) and d.max_lrs == [0.001]
    c = _built("WarmupCosineLR", {"total_num_steps": 5000}, _opt())
    assert isinstance(c, schedules.WarmupCosineLR)
    assert (c.warmup_min_ratio, c.warmup_num_steps, c.cos_min_ratio) == (0.0, 1000, 0.0001)
    o = _built("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}, _opt())
    assert isinstance(o, schedules.OneCycle)
    assert (o.first_step_size, o.second_step_size, o.decay_lr_rate, o.cycle_momentum) == (
        2000,
        2000,
        0.0,
        True,
    )
    r = _built("LRRangeTest", {}, _opt())
    assert isinstance(r, schedules.LRRangeTest)
    assert (r.min_lr, r.step_size, r.step_rate, r.staircase) == ([1e-3], 2000, 1.0, False)


def test_one_cycle_cycles_beta1_against_the_rate():
    opt = _opt()
    s = _built("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4}, opt)
    for _ in range(3):
        s.step()
        lr, (b1, b2) = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        assert b1 == 0.9 - (0.9 - 0.8) * lr and b2 == 0.99


def test_per_group_rates_and_auto_max_lr():
    opt = _opt(groups=2)
    opt.param_groups[1]["lr"] = 0.5
    s = _built("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": "auto", "warmup_num_steps": 4}, opt)
    s.step(3)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]  # end of warmup: each group's own lr
    with pytest.raises(ConfigError, match="warmup_min_lr: expected 2 values"):
        _built("WarmupLR", {"warmup_min_lr": [0.0, 0.1, 0.2]}, _opt(groups=2))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"type": "WarmupDecayLR"}, "scheduler.params.total_num_steps is required for WarmupDecayLR"),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1}},
            "scheduler.params.cycle_min_lr is required for OneCycle",
        ),
    ],
)
def test_required_parameters_are_config_errors_where_the_schedule_is_built(section, message, tmp_path):
    cfg = {**config("cpu", tmp_path), "scheduler": section}
    zswap.load_config(cfg)  # "auto" and missing are accepted by load_config
    m, _ = build(TinyLM, cfg)
    with pytest.raises(ConfigError, match=message):
        engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"type": "WarmupLinear"}, "scheduler.type must be one of 'WarmupLR'"),
        ({"type": "WarmupLR", "params": {"warmup_max": 1}}, "unknown key .warmup_max. in scheduler"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cos"}}, "warmup_type must be one of"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": "yes"}}, "must be true or false"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}, "warmup_num_steps must be a positive"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, "warmup_num_steps must be a positive"),
        # DeepSpeed 0.19.8 raises for 0 too (Hugging Face fills at least 1 for it)
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps must be a positive"),
        ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0, "total_num_steps": 9}}, "a positive"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": -1}}, "warmup_min_lr must be a non-negative"),
        ({"type": "WarmupLR", "params": []}, "scheduler.params must be an object"),
    ],
)  # fmt: skip
def test_bad_scheduler_sections_are_config_errors_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        zswap.load_config({"scheduler": section})


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("steps", [1])
def test_a_warmup_of_one_step_warms_up_over_two_as_deepspeed_does(kind, steps):
    params = {"warmup_num_steps": steps} | ({"total_num_steps": 10} if kind != "WarmupLR" else {})
    assert zswap.load_config({"scheduler": {"type": kind, "params": params}}).scheduler is not None
    want = _built(kind, params | {"warmup_num_steps": 2}, _opt())
    got = _built(kind, params, _opt())
    for _ in range(5):
        assert got.get_last_lr() == want.get_last_lr()
        got.step()
        want.step()


def test_state_dict_resumes_the_sequence():
    opt = _opt()
    s = _built("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5}, opt)
    for _ in range(12):
        s.step()
    state = s.state_dict()
    want = []
    for _ in range(5):
        s.step()
        want.append(opt.param_groups[0]["lr"])
    opt2 = _opt()
    s2 = _built("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5}, opt2)
    s2.load_state_dict(state)
    got = []
    for _ in range(5):
        s2.step()
        got.append(opt2.param_groups[0]["lr"])
    assert got == want


# -- through the engine ------------------------------------------------------------------------------


def test_initialize_builds_the_schedule_and_steps_it_at_boundaries(tmp_path):
    cfg = {
        **config("cpu", tmp_path),
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
    }
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        assert isinstance(engine.lr_scheduler, schedules.WarmupLR)
        assert engine.get_lr() == [0.0]  # warmup_min_lr before the first step, as DeepSpeed
        for call in range(8):
            engine.backward(sq(engine(ids(seed=call))))
            engine.step()
            steps = (call + 1) // 2
            assert engine.global_steps == steps
            assert engine.get_lr() == [warmup_lr(steps - 1, 0.0, 0.2, 10, "linear") if steps else 0.0]


def test_a_torch_scheduler_or_a_factory_can_be_passed(tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(TinyLM, cfg)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with engine_for(m, cfg, optimizer=opt, lr_scheduler=sched) as engine:
        assert engine.lr_scheduler is sched
        for call in range(4):
            sq(m(ids(seed=call))).backward()
            engine.step()
        assert engine.get_lr() == [0.25]
    made: list[Any] = []

    def factory(o: Any) -> Any:
        made.append(o)
        return torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1))

    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    with engine_for(m, cfg, optimizer=opt, lr_scheduler=factory) as engine:
        assert made == [opt] and isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
        sq(m(ids())).backward()
        engine.step()
        assert engine.get_lr() == [0.5]


def test_a_scheduler_section_and_argument_together_are_refused(tmp_path):
    cfg = {**config("cpu", tmp_path), "scheduler": {"type": "WarmupLR"}}
    m, _ = build(TinyLM, cfg)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    with pytest.raises(ConfigError, match=r"scheduler section \(WarmupLR\) and lr_scheduler= was passed too"):
        engine_for(m, cfg, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ConfigError, match=r"scheduler \(WarmupLR\) needs an optimizer"):
        engine_for(m, cfg)


@pytest.mark.parametrize("given", ["none", "another", "section"])
def test_a_scheduler_on_another_optimizer_than_the_engines_is_refused(tmp_path, given):
    """DeepSpeed's TestClientLrScheduler: a scheduler built on an optimizer the engine does not step (none
    passed, another one, or the config's) would move rates nothing reads; DeepSpeed asserts."""
    cfg = config("cpu", tmp_path)
    if given == "section":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.1}}
    m, _ = build(TinyLM, cfg)
    stray = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.SequentialLR(
        stray, [torch.optim.lr_scheduler.ConstantLR(stray), torch.optim.lr_scheduler.StepLR(stray, 2)], [1]
    )
    opt = torch.optim.SGD(m.parameters(), lr=1.0) if given == "another" else None
    with pytest.raises(
        ConfigError, match=r"lr_scheduler= \(SequentialLR\) drives an optimizer \(SGD\) that is not"
    ):
        engine_for(m, cfg, optimizer=opt, lr_scheduler=sched)
    if given != "section":  # the same scheduler with its own optimizer passed: pointed at zswap's
        with engine_for(m, cfg, optimizer=stray, lr_scheduler=sched) as engine:
            assert engine.lr_scheduler is sched and sched.optimizer is engine.optimizer


@pytest.mark.parametrize("front", ["zswap", "deepspeed"])
def test_an_optimizer_section_and_argument_together_are_refused(tmp_path, front):
    # DeepSpeed steps the passed optimizer and ignores the section without a word; the scheduler pair
    # is refused above, and so is this one, by both entry points.
    import zswap.deepspeed

    cfg = {**config("cpu", tmp_path), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    m, _ = build(TinyLM, cfg)
    given = [torch.optim.SGD(m.parameters(), lr=1.0), lambda params: torch.optim.SGD(params, lr=1.0)]
    for opt in given if front == "deepspeed" else given[:1]:
        with pytest.raises(ConfigError, match=r"optimizer section \(AdamW\) and optimizer= was passed too"):
            if front == "zswap":
                zswap.initialize(m, cfg, optimizer=opt)
            else:
                zswap.deepspeed.initialize(model=m, config=cfg, optimizer=opt)
    m.zero_grad()
    with zswap.initialize(m, cfg) as engine:  # the section alone builds the engine's optimizer
        assert isinstance(engine.optimizer, OffloadedAdamW)


# -- against DeepSpeed's own classes, where it is installed --------------------------------------------


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("name", "params", "formula"), CASES, ids=IDS)
def test_each_schedule_equals_deepspeeds_own_class(name, params, formula):
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="deepspeed is not installed")
    ours, theirs = _opt(), _opt()
    s = _built(name, params, ours)
    kwargs = dict(params)
    if name == "WarmupLR" and "warmup_max_lr" not in kwargs:
        kwargs["warmup_max_lr"] = 0.1  # older DeepSpeed releases default to 0.001 instead of the optimizer's
    d = getattr(ds, name)(theirs, **kwargs)
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    for it in range(STEPS):
        s.step()
        d.step()
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"], f"step {it}"
        assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"], f"step {it}"


def test_the_schedule_drives_the_offloaded_optimizer_as_it_drives_torch_adamw(tmp_path):
    # lr 0 for the first two steps (warmup_min_lr, then log(1) = 0), then rising: the same weights as
    # fused AdamW under the same schedule, bit for bit.
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 3}}
    cfg = {
        **config("cpu", tmp_path),
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
        "scheduler": sched,
    }
    m, ref = build(TinyLM, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    ref_sched = _built(sched["type"], sched["params"], ref_opt)
    with engine_for(m, cfg) as engine:
        start = [p.detach().clone() for p in ref.parameters()]
        for step in range(4):
            out, want = engine(ids(seed=step)), ref(ids(seed=step))
            assert torch.equal(out, want), f"step {step}"
            moved = any(not torch.equal(p, q) for p, q in zip(ref.parameters(), start, strict=True))
            assert moved == (step >= 3), f"step {step}"  # log warmup: lr 0 before and at iteration 0
            engine.backward(sq(out))
            sq(want).backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups]


def test_onecycle_momentum_decayed_past_one_is_an_error_naming_it():
    """DeepSpeed's OneCycle multiplies beta1 by 1 + decay_mom_rate × steps after the cycle, past 1 in time
    (its optimizer runs on); Adam's kernel refused it with a message naming neither OneCycle nor the key."""
    params = {"cycle_first_step_size": 2, "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "decay_step_size": 1,
              "cycle_min_mom": 0.85, "cycle_max_mom": 0.9, "decay_mom_rate": 0.05}  # fmt: skip
    opt = _opt()
    s = _built("OneCycle", params, opt)
    seen = []
    with pytest.raises(
        zswap.ConfigError, match=r"OneCycle's decay_mom_rate 0.05 takes beta1 to 1.0[0-9]* at step"
    ):
        for _ in range(10):
            s.step()
            seen.append(opt.param_groups[0]["betas"][0])
    assert seen[-2:] == [0.9 * 1.05, 0.9 * (1 + 0.05 * 2)] and max(seen) < 1  # grown, to the last below 1
