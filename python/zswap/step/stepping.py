"""What `zswap.Engine` adds around the optimizer step, with DeepSpeed's semantics: gradient accumulation,
the learning-rate schedule and fp16 loss scaling.

Gradient accumulation (``gradient_accumulation_steps``, GAS): every `Engine.step` call is one micro-step;
only every GAS-th one (an *accumulation boundary*, `Engine.is_gradient_accumulation_boundary`) applies the
optimizer and the schedule and clears the gradients. `Engine.backward` divides the loss by GAS before
autograd runs, so the accumulated gradient is the mean over the micro-batches. A plain ``loss.backward()``
is not divided (as under DeepSpeed): with GAS > 1 it accumulates the *sum* — divide the loss yourself or
use `Engine.backward`.

fp16 loss scaling (`zswap.loss_scale`): `Engine.backward` multiplies the loss by the current scale, and
the step divides the gradients by it again — only for an accumulation window whose backward passes went
through `Engine.backward`; gradients from a plain ``loss.backward()`` are taken as unscaled.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _dist
from ..config import ZswapConfig
from ..errors import ConfigError, ZswapError, ZswapWarning
from . import schedules
from .loss_scale import LossScaler


@dataclass
class Tally:
    """How the optimizer steps ran since `initialize` (or the last ``Engine.stats(reset=True)``), for
    `Engine.stats` (``steps_*``): made live from the early step's work in backward (``early``), or from
    the param copies and gradients it held since backward, updated at the step once the clip factor was
    known (``deferred``: clipping bit at the last step, `zswap.step.speculation`); run the ordinary way
    after backward (``ordinary``; ``reason``: why the last one was, "" while none was), of which
    ``redone`` had an early step dropped because clipping bit (its factor was not the one assumed); early
    steps dropped because the gradients were not finite (``overflow``: the step is skipped). Of the
    ``early`` ones, ``early_partly`` updated only a part in backward (the copies kept in CPU memory for
    the commit of every param pass the early step's cap, `zswap.step.early_memory.plan_part`) and
    ``rehyped`` had their params recomputed at the step for an lr, eps or decoupled weight decay assigned
    between backward and step (`zswap.step.early_rehyper`); of the ``deferred`` ones ``partly`` held only
    the copies that fit its cap. Either leaves the other params to the ordinary step in the same commit;
    ``part_reason`` says why for the last that did."""

    early: int = 0
    deferred: int = 0
    partly: int = 0
    early_partly: int = 0
    part_reason: str = ""
    ordinary: int = 0
    redone: int = 0
    overflow: int = 0
    rehyped: int = 0
    reason: str = ""

    def ordinary_step(self, why: str, scale: float | None) -> None:
        if scale is not None:
            self.ordinary += 1
            self.reason = why

    def reset(self) -> None:
        self.early = self.deferred = self.partly = self.early_partly = self.ordinary = self.redone = (
            self.overflow
        ) = self.rehyped = 0
        self.reason = self.part_reason = ""

    def stats(self) -> dict[str, Any]:
        return {
            "steps_in_backward": self.early,
            "steps_deferred": self.deferred,
            "steps_deferred_partly": self.partly,
            "steps_in_backward_partly": self.early_partly,
            "steps_partly_reason": self.part_reason,
            "steps_ordinary": self.ordinary,
            "steps_redone": self.redone,
            "steps_hypers_redone": self.rehyped,
            "steps_overflow_dropped": self.overflow,
            "steps_ordinary_reason": self.reason,
        }


def lr_scheduler(cfg: ZswapConfig, optimizer: Any, given: Any, with_kwargs: bool = False) -> Any:
    """The engine's schedule: ``given`` (a scheduler, or a callable taking the optimizer and returning
    one, as DeepSpeed allows), else the config's ``scheduler`` section, else ``None``. ``with_kwargs``:
    the engine's ``step`` hands the schedule keywords (`zswap.deepspeed`'s ``lr_kwargs``)."""
    if given is not None:
        if cfg.scheduler is not None:
            raise ConfigError(
                f"the config has a scheduler section ({cfg.scheduler.type}) and lr_scheduler= was passed "
                "too; keep one of them"
            )
        if callable(given) and (isinstance(given, type) or not hasattr(given, "step")):  # a class: built
            if optimizer is None:
                raise ConfigError("lr_scheduler= is a callable that takes the optimizer, but there is none")
            given = given(optimizer)
        _drives(given, optimizer)
        if not with_kwargs and isinstance(given, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "lr_scheduler= is a ReduceLROnPlateau, which steps on a metric (scheduler.step(val_loss)) "
                "that engine.step() does not have: step it yourself after each evaluation and pass no "
                "lr_scheduler= (or use zswap.deepspeed, whose engine.step(lr_kwargs={'metrics': ...}) "
                "passes it, as DeepSpeed's)"
            )
        return given
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError(
            f"the config's scheduler ({cfg.scheduler.type}) needs an optimizer: pass optimizer= or add an "
            "'optimizer' section"
        )
    return schedules.build(cfg.scheduler, optimizer)


def schedule_and_clear(engine: Any, scale: float | None) -> None:
    """After an optimizer step: the schedule's step (not after a skipped one), then the gradients
    cleared, whatever the schedule raised (the step is applied: its gradients must not carry over)."""
    try:
        if scale is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
    finally:
        engine.zero_grad()


def _drives(scheduler: Any, optimizer: Any) -> None:
    """A scheduler built on another optimizer than the engine's (after a given one was adopted and its
    schedulers pointed at zswap's, `zswap.step.optim.adopt`) would move learning rates nothing reads:
    refused, as DeepSpeed asserts."""
    for s in (scheduler, *getattr(scheduler, "_schedulers", ())):
        other = getattr(s, "optimizer", optimizer)
        if other is not optimizer:
            raise ConfigError(
                f"lr_scheduler= ({type(s).__name__}) drives an optimizer ({type(other).__name__}) that is "
                "not the one the engine steps, so its schedule would never reach the training: build it on "
                "the optimizer passed as optimizer= (zswap points it at its offloaded AdamW), or pass a "
                "callable that takes the optimizer and returns the scheduler"
            )


def loss_scaler(cfg: ZswapConfig, fp16: bool, device_type: str) -> LossScaler | None:
    """The loss scaler of an fp16 run (from the ``fp16`` section), of a ``torch_autocast`` run in float16
    (given, or the device's default: CUDA's) as DeepSpeed's (`LossScaler.for_autocast`), else ``None``."""
    if fp16:
        return LossScaler.from_config(cfg.fp16)
    autocast = cfg.torch_autocast
    dtype = autocast.torch_dtype() or torch.get_autocast_dtype(device_type)
    return LossScaler.for_autocast() if autocast.enabled and dtype == torch.float16 else None


def current_scale(engine: Any) -> float:
    """``engine``'s current fp16 loss scale (its `LossScaler`'s), 1.0 without fp16: `zswap.Engine.loss_scale`
    (`zswap.deepspeed`'s engine has DeepSpeed's ``loss_scale()`` method there instead)."""
    return 1.0 if engine.loss_scaler is None else float(engine.loss_scaler.loss_scale)


def world_size(items: Any) -> int:
    """Ranks the params are partitioned over (the data-parallel world of the batch arithmetic)."""
    return max((st.world_size for _, st in items), default=1)


def before_step(module: torch.nn.Module, items: Any, frozen: Collection[int] = ()) -> None:
    """At an optimizer step, before it changes anything: no managed param has a ``.grad`` set by hand
    (zswap keeps its gradient in the gradient store and ``p.grad`` None: the step would miss it, or fail
    inside the kernel on its placeholder's shape), and every rank gathered the same params in the same order
    since the last one (`zswap._dist.check_same`, per process group of ``items``, in their order).
    ``frozen``: ids of the params the engine put no gradient hooks on (they required no grad then)."""
    by_hand = {id(p) for p, _ in items if p.grad is not None}
    if by_hand:
        named = [(n, id(p)) for n, p in module.named_parameters() if id(p) in by_hand]
        unfrozen = [n for n, i in named if i in frozen]
        if unfrozen:
            raise ZswapError(
                f"engine.step(): {few(unfrozen)} required no grad when the engine was built and do now: "
                "zswap puts its gradient hooks on the params that require grad at zswap.initialize, so "
                "autograd left these gradients in .grad, which zswap does not read. Unfreeze them before the "
                "engine is built (under Lightning: before fit, e.g. in configure_model), or build a new "
                "engine after unfreezing"
            )
        raise ZswapError(
            f"engine.step(): {few([n for n, _ in named] or ['a param of the model'])} have a .grad set by "
            "hand, which zswap does not read: a partitioned param's gradient lives in zswap's gradient store "
            "(p.grad stays None). Make gradients with backward, or set one with "
            "zswap.deepspeed.utils.safe_set_full_grad(param, value)"
        )
    for group in _groups(items):
        _dist.check_same(group)


def few(names: list[str]) -> str:
    """The first three ``names`` for a message, then how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class ForwardLedger:
    """The same check at the end of each forward that no backward follows (an evaluation, a generation
    step), over the groups that forward gathered over: outputs computed from partitions of different
    params would otherwise go on unnoticed until a step — for good, in a loop that never steps. A forward
    that gathered nothing (params all gathered already: inside `GatheredParameters`, persistent ones) makes
    no collective, so one rank may still run it alone; where ranks diverge each gathers something, and
    every rank checks — its gathers paired with the others'."""

    def __init__(self, items: Any) -> None:
        self._groups = _groups(items)
        self._begun: list[int] | None = None

    def begin(self) -> None:
        self._begun = [_dist.noted(g) for g in self._groups]

    def end(self) -> None:
        begun, self._begun = self._begun, None
        if begun is None:  # (an end without its beginning: nothing known to compare)
            return
        for group, before in zip(self._groups, begun, strict=True):
            if _dist.noted(group) != before:
                _dist.check_same(group, _dist.AT_FORWARD)


def _groups(items: Any) -> list[Any]:
    """The process groups ``items`` are partitioned over (several ranks), in their order."""
    groups: dict[int, Any] = {}
    for _, st in items:
        if st.world_size > 1:
            groups.setdefault(id(st.group), st.group)
    return list(groups.values())


def cast_half(value: Any) -> Any:
    """``value`` with every floating-point tensor in it (nested in lists, tuples, dicts) cast to fp16:
    ``fp16.auto_cast``."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return (
            type(value)(*map(cast_half, value)) if hasattr(value, "_fields") else tuple(map(cast_half, value))
        )
    if isinstance(value, list):
        return [cast_half(v) for v in value]
    if isinstance(value, Mapping):
        return type(value)({k: cast_half(v) for k, v in value.items()})  # type: ignore[call-arg]
    return value


_UNTRAINED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # warned of


def unmanaged(module: torch.nn.Module, managed: set[int], optimizer: Any) -> list[torch.Tensor]:
    """The params of ``module`` zswap does not manage (ids not in ``managed``: made or attached after
    `zswap.initialize`); the step clips and steps them in memory where ``optimizer`` holds them. One with a
    gradient the optimizer does not hold is never updated: a `zswap.ZswapWarning` names it, once."""
    others: list[torch.Tensor] = [p for p in module.parameters() if id(p) not in managed]
    if others and optimizer is not None:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        new = {
            id(p): p for p in others if p.grad is not None and id(p) not in held and id(p) not in _UNTRAINED
        }
        if new:
            _UNTRAINED.update(new)
            names = [n for n, p in module.named_parameters() if id(p) in new]
            warnings.warn(
                f"{', '.join(names)} get gradients but are not trained: made after zswap.initialize, they "
                "are not in its optimizer (it holds the model's params as initialize found them); build "
                "every module before initialize, or under zswap.Init",
                ZswapWarning,
                stacklevel=4,
            )
    return others


def normed(engine: Any, others: list[torch.Tensor]) -> tuple[list[Any], list[torch.Tensor]]:
    """``(managed items, unmanaged params)`` whose gradients the global norm covers (clipping, the
    finiteness check, ``last_grad_norm``): every one with a gradient, as ``clip_grad_norm_`` over
    ``model.parameters()`` — or, where the engine says so (``norm_over_optimizer``: DeepSpeed's, whose
    ZeRO-3 takes the norm over its optimizer's param groups), only those its optimizer steps: a param that
    requires grad but is in no group (``model_parameters`` a subset) counts for nothing."""
    if not getattr(engine, "norm_over_optimizer", False) or engine.optimizer is None:
        return engine._items, others
    held = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    return [item for item in engine._items if id(item[0]) in held], [p for p in others if id(p) in held]
