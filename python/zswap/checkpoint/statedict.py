"""``module.state_dict()`` of a model whose params zswap partitioned: full values, never empty tensors.

`install` (called when zswap partitions a module's params: `zswap.Init`, ``initialize``) registers a
state-dict hook on every submodule. For each of the module's own params that is partitioned (its ``.data``
empty), the hook replaces the detached empty tensor torch put in the state dict by the full value, gathered
into a new CPU tensor — one param at a time, so ``torch.save(model.state_dict())`` and Hugging Face
``save_pretrained`` write correct checkpoints, at the cost of the whole model in CPU memory; for models that
do not fit, `zswap.save_weights` streams instead. With several ranks every rank must call ``state_dict()``
(each param is all-gathered). ``keep_vars=True`` returns the params themselves, untouched. Inside
`deferred`, each partitioned param's entry is a `zswap.checkpoint._torchsave.Pending` instead, gathered
when `zswap.checkpoint._torchsave.save` writes it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

from ..parts.params import Status, param_state
from ._gather import full_copy
from ._torchsave import Pending

_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_deferring: ContextVar[bool] = ContextVar("zswap_state_dict_deferred", default=False)


@contextmanager
def deferred() -> Iterator[None]:
    """``state_dict()`` calls inside put a `Pending` where a partitioned param's full value would go;
    nothing is gathered."""
    token = _deferring.set(True)
    try:
        yield
    finally:
        _deferring.reset(token)


def install(module: nn.Module) -> None:
    for m in module.modules():
        if m not in _HOOKED:
            m._register_state_dict_hook(_full_values)
            _HOOKED.add(m)


_FILLED: dict[int, tuple[weakref.ref[Any], dict[int, Any]]] = {}
"""id(state dict being filled) -> (a weakref to it, id(param) -> the value gathered for it): a param tied
under several names (embeddings and an LM head) is gathered once, and each name gets a view of that one
storage, as a plain model's state dict holds (``param.detach()`` under each name) — which
``save_pretrained`` reads as tied and writes once. (Inside `deferred`, `zswap.checkpoint._torchsave`
writes a param once whatever names it has.)"""


def _filled(state_dict: OrderedDict[str, Any]) -> dict[int, Any]:
    key = id(state_dict)
    entry = _FILLED.get(key)
    if entry is None or entry[0]() is not state_dict:
        entry = (weakref.ref(state_dict, lambda _ref: _FILLED.pop(key, None)), {})
        _FILLED[key] = entry
    return entry[1]


def _full_values(
    module: nn.Module, state_dict: OrderedDict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for name, p in module._parameters.items():
        st = param_state(p)
        if p is None or st is None:
            continue
        key = prefix + name
        if st.status is Status.AVAILABLE or key not in state_dict or state_dict[key] is p:
            continue
        if _deferring.get():
            state_dict[key] = Pending(p, st)
            continue
        values = _filled(state_dict)
        value = values.get(id(p))
        if value is None:
            value = values[id(p)] = full_copy(p, st)
        state_dict[key] = value.detach()
