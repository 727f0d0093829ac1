"""A plain torch Adam / AdamW handed to zswap, turned into `OffloadedAdamW` over the same param groups.

`zswap.initialize(optimizer=...)` and `ZswapStrategy` (a LightningModule's ``configure_optimizers``) take a
``torch.optim.AdamW`` / ``Adam`` built over the partitioned params; kept as it is, its state would live in
RAM whatever the config's ``offload_optimizer`` says, and the update could not run in backward (it is not
zswap's kernel). Where DeepSpeed refuses a client optimizer with ZeRO-Offload (unless
``zero_force_ds_cpu_optimizer: false``) and asks for its CPU Adam, `to_offloaded` builds an `OffloadedAdamW`
with the same param groups and hyperparameters (group by group, extra keys such as ``initial_lr`` kept)
whose state lives where ``offload_optimizer`` says; `rebind_schedulers` points lr schedulers at it. Knobs the
offloaded kernel does not have (``amsgrad``, ``maximize``, ``capturable``, ``differentiable``) are refused
rather than dropped; ``foreach`` / ``fused`` only choose torch's implementation (zswap's kernel gives
``fused=True``'s bits) and are dropped.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ...config import ZswapConfig
from ...errors import ConfigError
from .adamw import OffloadedAdamW

_IMPLEMENTATION_ONLY = ("foreach", "fused")
"""torch implementation switches: no effect on the values zswap's kernel computes."""
REFUSED = ("amsgrad", "maximize", "capturable", "differentiable")
"""Knobs that change what a step computes and that `OffloadedAdamW` does not have: must be off."""
_OWN_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")


def is_convertible(optimizer: Any) -> bool:
    """A plain torch Adam / AdamW (not a subclass: a subclass may step differently)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def to_offloaded(optimizer: torch.optim.Optimizer, config: ZswapConfig, where: str) -> OffloadedAdamW:
    """An `OffloadedAdamW` over ``optimizer``'s param groups with its hyperparameters, its state placed as
    ``config`` (``offload_optimizer``, ``aio``, ``zero_optimization.sub_group_size``) says.

    Raises `ConfigError` naming the group and key for a knob it cannot honour, and when ``optimizer``
    already holds state (it must not have stepped yet). ``where``: how the messages name it ("the AdamW
    passed as optimizer=")."""
    name = type(optimizer).__name__
    if optimizer.state:
        raise ConfigError(
            f"{where} already holds state for {len(optimizer.state)} params; zswap moves a fresh {name} to "
            "its offloaded AdamW and cannot carry state over: hand it over before its first step (and "
            "restore state through engine.load_checkpoint)"
        )
    groups = [
        _group(where, i, g, decoupled=type(optimizer) is torch.optim.AdamW)
        for i, g in enumerate(optimizer.param_groups)
    ]
    first = groups[0] if groups else {}
    return OffloadedAdamW.from_config(
        groups, config, lr=float(first.get("lr", 1e-3)), weight_decay=float(first.get("weight_decay", 0.0))
    )


def refuse_without_masters(optimizer: Any, dtype: str | None, where: str, how: str) -> None:
    """For front ends whose users expect DeepSpeed's mixed precision: under ``bf16`` / ``fp16`` DeepSpeed
    steps any client optimizer over float32 master weights, while zswap keeps them in its AdamW only (the
    config's, or a torch Adam / AdamW it adopts); another optimizer would step the half-precision params
    themselves and lose every update below their precision. ``where`` names the optimizer in the
    `ConfigError`, ``how`` the way out. (`zswap.initialize` steps such an optimizer as given: plain
    PyTorch over a half-precision model.)"""
    if dtype not in ("bf16", "fp16") or optimizer is None or isinstance(optimizer, OffloadedAdamW):
        return
    if is_convertible(optimizer) or getattr(optimizer, "steps_partitions", False):
        return
    raise ConfigError(
        f"the config enables {dtype} and {where} is {type(optimizer).__name__}: DeepSpeed would step it over "
        "float32 master weights, which zswap keeps for Adam / AdamW only (it would step the "
        f"{dtype} params themselves, losing updates below their precision). {how}, or train in float32"
    )


def hand_over(old: torch.optim.Optimizer, new: OffloadedAdamW) -> None:
    """After `to_offloaded`, for a caller who keeps ``old``: its param groups become ``new``'s own dicts (an
    lr scheduler built on it, or a direct ``old.param_groups[0]["lr"] = …``, sets what ``new`` steps
    with), and taking or loading its state dict raises naming ``engine.optimizer``: its state would be
    empty, and saving that would drop the moments without a word (stepping it raises already: the guard
    on managed params, `zswap.parts.guards`)."""
    old.param_groups = new.param_groups
    # What torch's lr scheduler asks before its first step ("optimizer.step() called?"): engine.step()
    # steps in its place, and a scheduler stepped by hand after it keeps the order torch warns about.
    old._opt_called = True  # type: ignore[attr-defined]
    old.register_state_dict_pre_hook(_moved("take its state_dict()"))
    old.register_load_state_dict_pre_hook(_moved("load a state dict into it"))


def _moved(what: str) -> Any:
    def refuse(optimizer: Any, *_: Any) -> None:
        raise ConfigError(
            f"this {type(optimizer).__name__} was handed to zswap, which steps zswap's offloaded AdamW over "
            f"the same param groups in its place: do not {what}; use engine.step(), engine.optimizer "
            "(its state_dict / load_state_dict) or engine.save_checkpoint / load_checkpoint"
        )

    return refuse


def _group(where: str, index: int, group: dict[str, Any], *, decoupled: bool) -> dict[str, Any]:
    for key in REFUSED:
        if group.get(key):
            raise ConfigError(
                f"{where}, param group {index}: {key}=True is not supported by zswap's offloaded AdamW; "
                f"set {key}=False"
            )
    out = {k: v for k, v in group.items() if k not in (*REFUSED, *_IMPLEMENTATION_ONLY)}
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
