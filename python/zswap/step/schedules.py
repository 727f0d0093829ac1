"""DeepSpeed's five learning-rate schedules (its ``scheduler`` config section), written for zswap.

`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` and `LRRangeTest` take DeepSpeed's parameter
names and defaults and give, step for step, the learning rates of DeepSpeed's own classes
(``deepspeed/runtime/lr_schedules.py``, whose formulas are the reference); `build` makes one from a
config's ``scheduler`` section. Each counts ``last_batch_iteration`` (the index of the last step taken; -1
before the first) and writes its rates into ``optimizer.param_groups`` at construction and on every
`step`, so the optimizer's first step already uses the schedule's first rate.

`zswap.Engine.step` steps the schedule once per optimizer step that was applied (at a gradient
accumulation boundary, not on an fp16 step skipped for overflow), as DeepSpeed's engine does.

A rate may be one number for every param group or a list with one per group, as in DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..config import _keys
from ..config.models import SchedulerConfig
from ..errors import ConfigError


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(f"{name}: expected {groups} values (one per param group), got {len(value)}")
        return [float(x) for x in value]
    return [float(value)] * groups


def _group_lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def _set_lrs(optimizer: Any, lrs: Sequence[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # a tensor lr (capturable optimizers) is updated in place
        else:
            group["lr"] = lr
    return [g["lr"] for g in optimizer.param_groups]


class Schedule:
    """What the five schedules share: the step counter, `step`, the last rates, state save and restore."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """The rates for step ``last_batch_iteration``, one per param group."""
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next step (or to ``last_batch_iteration``) and write its rates."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._apply()

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The rates last written into the optimizer."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step: the optimizer gets that step's rates again."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def __repr__(self) -> str:
        return f"<zswap {type(self).__name__} at step {self.last_batch_iteration}>"


def _warmup_fraction(kind: str, it: int, steps: int) -> float:
    """How far warmup has come at step ``it`` of ``steps``: log(it+1)/log(steps), or it/steps."""
    if kind == "log":
        return (1.0 / math.log(steps)) * math.log(it + 1)  # DeepSpeed's order of operations, to the last bit
    if kind == "linear":
        return it / steps
    raise ValueError(f"warmup_type must be 'log' or 'linear', got {kind!r}")


def _check_warmup(steps: object, kind: str) -> None:
    """The warmup arguments WarmupLR and WarmupCosineLR share: a positive step count (1 warms up over 2
    steps; 0 is refused, as DeepSpeed ≥ 0.19.6 refuses it) and a known kind."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {steps!r}")
    _warmup_fraction(kind, 0, 2)  # raises for an unknown kind


class WarmupLR(Schedule):
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps`` steps (at least 2), by ``warmup_type`` ``"log"`` (default) or ``"linear"``; then
    constant."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = _group_lrs(optimizer)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s warmup (``warmup_max_lr`` default 0.001), then a linear decay to 0 at step
    ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        left = self.total_num_steps - self.last_batch_iteration
        return max(0.0, float(left) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(Schedule):
    """A ratio of the optimizer's lr (as it was when the schedule was built): from ``warmup_min_ratio`` up
    to 1 over ``warmup_num_steps`` steps, then a cosine down to ``cos_min_ratio`` at ``total_num_steps``.
    The rate is 0 before the first step."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.org_lrs = _group_lrs(optimizer)
        if last_batch_iteration == -1:
            self._apply()

    def ratio(self) -> float:
        """The fraction of the original lr at step ``last_batch_iteration``."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            warm = _warmup_fraction(self.warmup_type, it, self.warmup_num_steps)
            return self.warmup_min_ratio + warm * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """`ratio` under DeepSpeed's name for it."""
        return self.ratio()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]


class OneCycle(Schedule):
    """One cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` (``cycle_first_step_size`` steps) and back
    (``cycle_second_step_size``, default the same), optionally in stairs; then, if ``decay_step_size`` and
    ``decay_lr_rate`` are set, ``min_lr / (1 + decay_lr_rate * steps_after / decay_step_size)``.

    With ``cycle_momentum`` (default) and an Adam-type optimizer, beta1 cycles the other way between
    ``cycle_max_mom`` and ``cycle_min_mom`` and beta2 is set to 0.99 — DeepSpeed's behaviour, kept so a
    config trains the same."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in getattr(optimizer, "defaults", {})
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = betas

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        after = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (after / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]]:
        """The (beta1, beta2) per group at step ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [
                (hi[0] - (hi[0] - lo[0]) * s, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        after = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (after / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            moms = self.get_mom()
            if any(b0 >= 1 for b0, _ in moms):  # DeepSpeed's optimizer runs on with it; Adam's refuses it
                raise ConfigError(
                    f"OneCycle's decay_mom_rate {self.decay_mom_rate:g} takes beta1 to "
                    f"{max(b0 for b0, _ in moms):g} at step {self.last_batch_iteration} (after the cycle, "
                    "the momentum grows by it every decay_step_size steps), and Adam needs beta1 below 1: "
                    "lower decay_mom_rate or cycle_max_mom, or set cycle_momentum false"
                )
            for group, betas in zip(self.optimizer.param_groups, moms, strict=True):
                group["betas"] = betas


class LRRangeTest(Schedule):
    """``lr_range_test_min_lr * (1 + lr_range_test_step_rate * (step + 1) / lr_range_test_step_size)``,
    the interval rounded down when ``lr_range_test_staircase``: the rate keeps growing, to find where
    training diverges."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        size = lr_range_test_step_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {size!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.min_lr)

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


SCHEDULES: dict[str, type[Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build(config: SchedulerConfig, optimizer: Any) -> Schedule:
    """The schedule a ``scheduler`` section describes, over ``optimizer``'s param groups.

    Parameters left out (or ``"auto"``) take DeepSpeed's defaults; ``warmup_max_lr: "auto"`` is the
    optimizer's lr. A parameter DeepSpeed requires (``total_num_steps``, ``cycle_min_lr``,
    ``cycle_max_lr``) missing or ``"auto"`` is a `ConfigError` naming it."""
    spec = _keys.SCHEDULES[config.type]
    kwargs: dict[str, Any] = {}
    for name, default in spec.items():
        value = config.param_values().get(name, default)
        if value is _keys.REQUIRED:
            raise ConfigError(
                f"scheduler.params.{name} is required for {config.type} (and zswap cannot choose it)"
            )
        if value is _keys.OPTIMIZER_LR or value == "auto":
            value = _group_lrs(optimizer)
        kwargs[name] = list(value) if isinstance(value, tuple) else value
    try:
        return SCHEDULES[config.type](optimizer, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"scheduler ({config.type}): {exc}") from None


__all__ = ["LRRangeTest", "OneCycle", "Schedule", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build"]
