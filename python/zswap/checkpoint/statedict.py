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
        state_dict[key] = Pending(p, st) if _deferring.get() else full_copy(p, st)
