"""Which buffers an ``Init(dtype=…)`` gives its dtype: those a build with torch's default dtype set to it
would have made in it.

zswap's Init builds in the dtypes of a plain build and casts the params at its exit (bitwise
``plain_model.to(dtype)``). A buffer is a different matter: BatchNorm's running statistics must meet the
params' dtype in the forward, while a rotary ``inv_freq`` asked for in float32 must stay float32.
transformers' ``from_pretrained(dtype=…)`` gets both by building with the default dtype set, DeepSpeed's
``zero.Init`` by casting what its tensor constructors return. So the Init records which floating tensors
would have been in its dtype had it been the default (`Lineage`): what a constructor (`FACTORIES`) returns
when no dtype is asked for, and the floating outputs of an op whose floating tensor inputs are all such
tensors or params (torch's promotion keeps that dtype: ``torch.ones(n) * 0.5``), unless the op names a
dtype (``.float()``, ``.to(torch.float32)``, ``dtype=``), but the one ``torch.get_default_dtype()`` just
returned (``emb.to(torch.get_default_dtype())``, M2M100's position tables: `watch_default`). At the Init's
exit the buffers of the modules it built that are among them take its dtype (`cast_buffers`), but those a
Hugging Face model lists to keep in float32 (`kept_in_fp32`, as transformers and DeepSpeed keep them).
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

FACTORIES = frozenset(
    (torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye, torch.randn,
     torch.rand, torch.linspace, torch.logspace)
)  # fmt: skip
"""Constructors that return the default dtype when asked for none (those DeepSpeed's Init wraps, and more)."""

_CASTS = frozenset(
    getattr(torch.Tensor, n) for n in ("float", "double", "half", "bfloat16", "to", "type", "type_as")
)
"""Tensor methods whose output dtype the caller names (``to`` / ``type`` only where they are given one)."""

_DEFAULT_DTYPE = torch.get_default_dtype  # torch's own, whatever an Init installs over it (`watch_default`)


class Lineage:
    """The floating tensors built while an Init with a dtype is active that would have been in it as the
    default dtype; weak references, each dropped with its tensor."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.asked = False
        """``torch.get_default_dtype()`` was called since the last torch call noted (`watch_default`)."""

    def __contains__(self, t: object) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def clear(self) -> None:
        self._refs.clear()

    def note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record ``func``'s floating outputs where they would have been in the default dtype."""
        asked, self.asked = self.asked, False
        if asked and _default_named(func, args, kwargs):
            self._add(out)  # in the default dtype, whatever it is
            return
        if kwargs.get("dtype") is not None:
            return
        if func in FACTORIES:
            self._add(out)
            return
        if func in _CASTS and _names_dtype(func, args):
            return
        inputs = [t for t in _tensors(args, kwargs) if t.is_floating_point()]
        inputs = [t for t in inputs if t.dim() > 0] or inputs  # a 0-dim tensor does not promote the others
        if inputs and all(t in self or isinstance(t, nn.Parameter) for t in inputs):
            self._add(out)

    def _add(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t not in self:
                self._refs[id(t)] = weakref.ref(t, functools.partial(self._drop, id(t)))

    def _drop(self, key: int, _: object) -> None:
        self._refs.pop(key, None)  # the callback runs before the id can name another tensor


def watch_default(lineage: Lineage, casting: Any) -> Any:
    """``torch.get_default_dtype`` for an Init to install: notes on ``lineage`` that the default dtype was
    asked for (while ``casting()``: an Init with a dtype is building on this thread), so that the torch call
    right after, naming the dtype it returned, counts as asking for the default."""

    @functools.wraps(_DEFAULT_DTYPE)
    def get_default_dtype() -> torch.dtype:
        if casting():
            lineage.asked = True
        return _DEFAULT_DTYPE()

    return get_default_dtype


def _default_named(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` names torch's default dtype (as ``dtype=`` or a ``.to`` / ``.type`` argument)."""
    named = [kwargs.get("dtype")]
    if func in (torch.Tensor.to, torch.Tensor.type):
        named += [a for a in args[1:] if isinstance(a, torch.dtype)]
    return any(d is not None and d == _DEFAULT_DTYPE() for d in named)


def _names_dtype(func: Any, args: tuple[Any, ...]) -> bool:
    if func in (torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as):
        return any(isinstance(a, (torch.dtype, torch.Tensor, str)) for a in args[1:])
    return True  # float / double / half / bfloat16


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    for x in (*args, *kwargs.values()):
        for y in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(y, torch.Tensor):
                yield y


def kept_in_fp32(modules: Iterable[nn.Module], dtype: torch.dtype, names: tuple[str, ...] | None) -> set[int]:
    """Ids of the floating buffers to keep in float32 under ``dtype``. ``names`` ``None`` (DeepSpeed's
    ``"auto"``): those whose names under a module listing them match its Hugging Face
    ``_keep_in_fp32_modules_strict`` (and, under float16, ``_keep_in_fp32_modules``); else those whose names
    under the outermost of ``modules`` match a pattern of ``names`` (``*``: any characters; matched
    anywhere in the name; ``()`` keeps none)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return set()
    modules = list(modules)
    if names is None:
        lists = [(m, _hf_lists(m, dtype)) for m in modules]
    else:
        inner = {id(c) for m in modules for c in m.children()}
        lists = [(m, set(names)) for m in modules if id(m) not in inner]
    kept: set[int] = set()
    for root, listed in lists:
        if not listed:
            continue
        pattern = re.compile("|".join(sorted(n.replace("*", ".*") for n in listed)))
        for name, buf in root.named_buffers():
            if buf.is_floating_point() and pattern.search(name):
                kept.add(id(buf))
    return kept


def _hf_lists(module: nn.Module, dtype: torch.dtype) -> set[str]:
    listed = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        listed |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return listed


def cast_buffers(modules: Iterable[nn.Module], dtype: torch.dtype, lineage: Lineage, kept: set[int]) -> None:
    """Give ``dtype`` to the buffers of ``modules`` (each module's own) that ``lineage`` holds, but the
    ``kept`` ones: in place (``.data``), so every alias of a buffer sees the new one."""
    for module in modules:
        for buf in module._buffers.values():
            if buf is not None and buf.dtype != dtype and buf in lineage and id(buf) not in kept:
                buf.data = buf.data.to(dtype)
