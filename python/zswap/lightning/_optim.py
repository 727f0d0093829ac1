"""The client optimizer a LightningModule returns, turned into zswap's offloaded one.

`configure_optimizers` builds a ``torch.optim.AdamW`` / ``Adam`` over the partitioned params; its state
would live in RAM in the params' full shapes. As Lightning's DeepSpeed strategy hands its client optimizer
to DeepSpeed, this module builds an `OffloadedAdamW` with the same param groups and hyperparameters (group
by group, extra keys such as ``initial_lr`` kept) whose state lives where the config's ``offload_optimizer``
says, and points the module's lr schedulers at it. Knobs the offloaded kernel does not have (``amsgrad``,
``maximize``, ``capturable``, ``differentiable``) are refused rather than dropped; ``foreach`` / ``fused``
only choose torch's implementation (zswap's kernel gives ``fused=True``'s bits) and are dropped.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..config import ZswapConfig
from ..errors import ConfigError
from ..step.optim import OffloadedAdamW

_IMPLEMENTATION_ONLY = ("foreach", "fused")
"""torch implementation switches: no effect on the values zswap's kernel computes."""
_REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")
"""Knobs that change what a step computes and that `OffloadedAdamW` does not have: must be off."""
_OWN_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")


def is_convertible(optimizer: Any) -> bool:
    """A plain torch Adam / AdamW (not a subclass: a subclass may step differently)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def to_offloaded(optimizer: torch.optim.Optimizer, config: ZswapConfig) -> OffloadedAdamW:
    """An `OffloadedAdamW` over ``optimizer``'s param groups with its hyperparameters, its state placed as
    ``config`` (``offload_optimizer``, ``aio``, ``zero_optimization.sub_group_size``) says.

    Raises `ConfigError` naming the group and key for a knob it cannot honour, and when ``optimizer``
    already holds state (it must come straight from ``configure_optimizers``)."""
    name = type(optimizer).__name__
    if optimizer.state:
        raise ConfigError(
            f"the {name} from configure_optimizers already holds state for {len(optimizer.state)} params; "
            "ZswapStrategy moves a fresh optimizer to zswap's offloaded AdamW and cannot carry state over"
        )
    groups = [
        _group(name, i, g, decoupled=type(optimizer) is torch.optim.AdamW)
        for i, g in enumerate(optimizer.param_groups)
    ]
    first = groups[0] if groups else {}
    return OffloadedAdamW.from_config(
        groups, config, lr=float(first.get("lr", 1e-3)), weight_decay=float(first.get("weight_decay", 0.0))
    )


def _group(name: str, index: int, group: dict[str, Any], *, decoupled: bool) -> dict[str, Any]:
    for key in _REFUSED:
        if group.get(key):
            raise ConfigError(
                f"{name} param group {index}: {key}=True is not supported by zswap's offloaded AdamW; "
                f"set {key}=False or use zswap.initialize with your own optimizer"
            )
    out = {k: v for k, v in group.items() if k not in (*_REFUSED, *_IMPLEMENTATION_ONLY)}
    out["params"] = list(group["params"])
    out["betas"] = tuple(float(b) for b in group["betas"])
    # torch >= 2.6 keeps the flag in every group; before, AdamW alone decoupled.
    out["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay", decoupled))
    for key in ("lr", "eps", "weight_decay"):
        if isinstance(out[key], torch.Tensor):
            out[key] = float(out[key])
    return out


def rebind_schedulers(schedulers: Iterable[Any], old: Any, new: torch.optim.Optimizer) -> None:
    """Point every scheduler (and the schedulers nested in a ``SequentialLR`` / ``ChainedScheduler``) that
    drove ``old`` at ``new``, whose groups carry the same values (the lr the scheduler last set, its
    ``initial_lr``), so the schedule goes on from where it stands."""
    for scheduler in schedulers:
        _rebind(scheduler, old, new)
    _track_steps(new)


def _rebind(scheduler: Any, old: Any, new: torch.optim.Optimizer) -> None:
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", ()):
        _rebind(inner, old, new)


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """What torch's ``LRScheduler.__init__`` does to its optimizer: mark ``step`` as wrapped and record that
    it ran, so the scheduler's first ``step()`` does not warn that the optimizer never stepped."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    func = type(opt).step
    ref = weakref.ref(opt)

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        assert target is not None  # the method is reached through the optimizer
        target._opt_called = True  # type: ignore[attr-defined]
        return func(target, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]
