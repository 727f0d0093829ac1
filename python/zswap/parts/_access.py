"""The access hook of `zswap.Init`: a torch-function mode that gathers a managed param before any torch call
that reads or writes its data.

Metadata (dtype, device, requires_grad, grad…) never needs the data; shape queries (``shape``, ``size``,
``dim``, ``numel``, ``len``) and ``empty_like`` / ``zeros_like`` / ``ones_like`` / ``full_like`` are answered
from the `ParamState` without I/O; ``p.data = x`` makes ``x`` the
param's data. Anything else reaching a not-gathered param (as an argument, or inside a list/tuple argument)
gathers it first. The mode is off inside its own handler, so the call it wraps, and zswap's own tensor
work (run under `no_torch_function`), are never intercepted.
"""

from __future__ import annotations

import types
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .params import ParamState, Status, param_state

_ABSENT = object()


class _Context(Protocol):
    """What the access mode asks of Init's context (`zswap.init._InitContext`)."""

    @property
    def active(self) -> bool: ...

    def adopt(self, p: torch.Tensor) -> None: ...

    def touch(self, items: list[tuple[torch.Tensor, ParamState]]) -> None: ...

    def made(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None: ...


def _getsets(*names: str) -> frozenset[Any]:
    found = (getattr(torch.Tensor, n, None) for n in names)
    return frozenset(d for d in found if isinstance(d, types.GetSetDescriptorType))


# Tensor attributes and methods that never need the data: no gather for them.
_META_GETSETS = _getsets(
    "dtype", "device", "layout", "requires_grad", "grad", "grad_fn", "is_leaf", "_version", "output_nr",
    "_base", "name", "itemsize", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
    "is_nested", "_backward_hooks", "_post_accumulate_grad_hooks",
)  # fmt: skip
_META_METHODS = frozenset(
    getattr(torch.Tensor, n)
    for n in ("requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device",
              "register_hook", "retain_grad", "register_post_accumulate_grad_hook")
    if hasattr(torch.Tensor, n)
)  # fmt: skip
_SHAPE_GETSETS = _getsets("shape", "ndim")
_DATA = torch.Tensor.data
_SIZE, _LEN = torch.Tensor.size, torch.Tensor.__len__
_RANK_METHODS = frozenset((torch.Tensor.dim, torch.Tensor.ndimension))
_NUMEL_METHODS = frozenset((torch.Tensor.numel, torch.Tensor.nelement))


# ``torch.*_like(p)`` needs only p's shape, dtype and device: answered without gathering p (transformers'
# _init_weights calls ``empty_like`` on loaded weights to build values it then does not copy in).
_LIKE: dict[Any, Any] = {
    torch.empty_like: torch.empty,
    torch.zeros_like: torch.zeros,
    torch.ones_like: torch.ones,
}
_LIKE_KWARGS = frozenset({"dtype", "device", "layout", "requires_grad", "pin_memory"})


def _like_answer(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], st: ParamState) -> Any:
    """``empty_like`` / ``zeros_like`` / ``ones_like`` / ``full_like`` of a not-gathered param, built from
    its state; ``_ABSENT`` for anything else (or a memory format other than the default)."""
    make: Any = _LIKE.get(func)
    fill: tuple[Any, ...] = ()
    if make is None and func is torch.full_like and len(args) == 2:
        make, fill = torch.full, (args[1],)
    extra = set(kwargs) - _LIKE_KWARGS
    fmt = kwargs.get("memory_format", torch.preserve_format)
    if make is None or len(args) != 1 + len(fill) or extra - {"memory_format"} or fmt not in (
        torch.preserve_format, torch.contiguous_format,
    ):  # fmt: skip
        return _ABSENT
    opts = {k: v for k, v in kwargs.items() if k in _LIKE_KWARGS and v is not None}
    opts.setdefault("dtype", st.dtype)
    opts.setdefault("device", st.device)
    return make(st.shape, *fill, **opts)


def _unavailable(x: object) -> ParamState | None:
    st = param_state(x)
    return st if st is not None and st.status is Status.NOT_AVAILABLE else None


def _shape_answer(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], st: ParamState) -> Any:
    """The answer to a shape query on a not-gathered param, from its state; ``_ABSENT`` if not one."""
    owner = getattr(func, "__self__", None)
    if owner in _SHAPE_GETSETS and func.__name__ == "__get__":
        return st.shape if owner is torch.Tensor.shape else len(st.shape)
    if func is _SIZE:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return st.shape if dim is None else st.shape[dim]
    if func in _RANK_METHODS:
        return len(st.shape)
    if func in _NUMEL_METHODS:
        return st.numel
    if func is _LEN and st.shape:
        return st.shape[0]
    return _ABSENT


class AccessMode(TorchFunctionMode):
    """Gathers a managed, not-gathered param before any torch call that reads or writes its data."""

    def __init__(self, ctx: _Context) -> None:
        super().__init__()
        self._ctx = ctx

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        ctx = self._ctx
        if not ctx.active or func in _META_METHODS:
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if owner in _META_GETSETS:
            return func(*args, **kwargs)
        if owner is _DATA and func.__name__ == "__set__":
            out = func(*args, **kwargs)
            ctx.adopt(args[0])
            return out
        if args and (st := _unavailable(args[0])) is not None:
            answer = _shape_answer(func, args, kwargs, st)
            if answer is _ABSENT:
                answer = _like_answer(func, args, kwargs, st)
            if answer is not _ABSENT:
                return answer
        pending = _collect(args, kwargs)
        if pending:
            ctx.touch(pending)
        out = func(*args, **kwargs)
        ctx.made(func, args, kwargs, out)
        return out


def _collect(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, ParamState]]:
    found: dict[int, tuple[torch.Tensor, ParamState]] = {}
    for x in (*args, *kwargs.values()):
        for y in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(y, torch.Tensor) and (st := _unavailable(y)) is not None:
                found[id(y)] = (y, st)
    return list(found.values())
