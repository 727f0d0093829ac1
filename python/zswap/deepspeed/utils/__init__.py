"""``deepspeed.utils`` on zswap: the tensor-fragment API — one param's float32 value, optimizer state and
gradient, read and written outside the step (`zswap.train.fragments` says what each is) — and ZeRO-3
leaf modules (`set_z3_leaf_modules` and its kin, `zswap.fetch.leaves`); and ``RepeatingLoader``, ``logger``
and ``log_dist``, which training loops use.

As in DeepSpeed: the ``full`` functions take and give the param's shape and are collectives (every rank
calls them for the same params in the same order); the ``local`` ones this rank's flat partition; reads
are float32 copies on the param's device, ``None`` for a param that does not require grad (or, for a
gradient, with none). Where zswap differs it says so instead of doing less:

- a write to a param that does not require grad, or of an optimizer state or float32 master before the
  param's first step (zswap makes them at that step), is a `zswap.ZswapError`, not a no-op;
- writing a float32 param's value is a collective in ``safe_set_local_fp32_param`` too (the whole param
  is written, from every rank's partition), and changes the param at once;
- a write between backward and step (and ``safe_set_full_grad``) makes that step the ordinary one: the
  update made in backward used the old values. The gradients it needs are kept when a gradient was read
  or written in an earlier step (``engine.keep_applied_grads = "auto"``); otherwise the write raises
  `zswap.errors.GradientsNotKeptError`, with what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ...fetch import leaves
from ...parts.runners import runners_of
from ...train import fragments
from .._data import RepeatingLoader
from ._logging import log_dist, logger

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return fragments.read(param, "fp32", full=True, api="safe_get_full_fp32_param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    fragments.write(param, value, "fp32", full=True, api="safe_set_full_fp32_param")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return fragments.read(param, optim_state_key, full=True, api="safe_get_full_optimizer_state")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    fragments.write(param, value, optim_state_key, full=True, api="safe_set_full_optimizer_state")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    return fragments.read_grad(param, full=True, api="safe_get_full_grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    fragments.write_grad(param, value, full=True, api="safe_set_full_grad")


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return fragments.read(param, "fp32", full=False, api="safe_get_local_fp32_param")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    fragments.write(param, value, "fp32", full=False, api="safe_set_local_fp32_param")


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return fragments.read(param, optim_state_key, full=False, api="safe_get_local_optimizer_state")


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    fragments.write(param, value, optim_state_key, full=False, api="safe_set_local_optimizer_state")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    return fragments.read_grad(param, full=False, api="safe_get_local_grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    fragments.write_grad(param, value, full=False, api="safe_set_local_grad")


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor], update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """``update_func(full gradient, param)`` gives each param's new gradient. Params that do not require
    grad are skipped, as DeepSpeed does, and so are params with no gradient this step (DeepSpeed would
    hand ``update_func`` zeros there; zswap does not step a param that got no gradient)."""
    for p in param_list:
        if not p.requires_grad:
            continue
        old = fragments.read_grad(p, full=True, api="safe_update_full_grad_vectorized")
        if old is not None:
            fragments.write_grad(p, update_func(old, p), full=True, api="safe_update_full_grad_vectorized")


# -- leaf modules (`zswap.fetch.leaves`) ---------------------------------------------------------------


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a leaf module (its params gathered together)."""
    return leaves.is_leaf(model)


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is inside a leaf module of the model an open engine runs."""
    for engine in runners_of([param]):
        return any(any(q is param for q in m.parameters()) for m in leaves.leaves(engine.module))
    return False


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return leaves.leaves(model)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    leaves.mark(model, [model], flag)


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or
    class names: plain or fully qualified) as a leaf: its params are gathered together when it runs,
    whatever runs inside — what a mixture-of-experts block needs over several ranks. Marks made on a
    model an open engine runs take effect from its next forward. Returns the modules marked; a
    `ValueError` if none matched (unless ``raise_if_not_found`` is false)."""
    return _by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    return _by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named ``module_names`` in ``model.named_modules()``: (those marked, the names that
    matched none — a `ValueError` if any, unless ``raise_if_not_found`` is false)."""
    return _by_name(model, module_names, flag, raise_if_not_found, suffix=False)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """As `set_z3_leaf_modules_by_name`, for every module whose name ends with one of the suffixes."""
    return _by_name(model, module_name_suffixes, flag, raise_if_not_found, suffix=True)


def _by_class(model: nn.Module, classes: Sequence[type | str], flag: bool, strict: bool) -> list[nn.Module]:
    found = leaves.by_class(model, classes)
    if not found and strict:
        raise ValueError(f"no module of {list(classes)} in the model")
    return leaves.mark(model, found, flag)


def _by_name(
    model: nn.Module, names: Sequence[str], flag: bool, strict: bool, suffix: bool
) -> tuple[list[nn.Module], list[str]]:
    found, missing = leaves.by_name(model, names, suffix=suffix)
    if missing and strict:
        raise ValueError(f"no module {'ending with' if suffix else 'named'} {missing} in the model")
    return leaves.mark(model, found, flag), missing
