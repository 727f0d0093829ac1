"""``PeftModel.save_pretrained`` on a model whose params zswap partitioned: only what PEFT writes is gathered.

PEFT builds the adapter's file from ``model.state_dict()`` and keeps the entries its method selects (the
adapters, a ``modules_to_save`` copy, biases or embedding layers where its config asks). The state dict of a
partitioned model holds every param's full value (`zswap.checkpoint.statedict`): the whole base model in CPU
memory to write adapters a thousandth its size, which on a model larger than memory is an out-of-memory.

`install` wraps ``PeftModel.save_pretrained`` (once peft is imported; `zswap.Init` installs it with the
state-dict hook when it partitions a module). Called without ``state_dict=`` on a model with partitioned
params, the wrapper asks PEFT's own selection, ``get_peft_model_state_dict``, for each adapter it will save,
over a state dict whose partitioned entries are meta tensors of the right shape; the entries PEFT returns
(the same tensor objects) are the ones gathered, and PEFT is handed that state dict. Where PEFT's selection
returns a meta tensor it did not get (it made a copy), the wrapper cannot tell what it chose and leaves PEFT
to read the whole state dict, as before. A transformers model given adapters by ``add_adapter`` reads them
through ``get_adapter_state_dict`` (its ``save_pretrained``, the Trainer's ``save_model``), wrapped the same.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from ..parts import peft_seam
from ..parts.params import param_state
from ._gather import full_copy
from ._torchsave import Pending
from .statedict import deferred

_MARK = "_zswap_bounded_save"


def adapters(model: object) -> str | None:
    """What makes ``model``'s state dict PEFT's rather than a model's (its keys ``base_model.model.*``,
    ``base_layer``, the adapters'), which no ``from_pretrained`` loads as a model; None for a plain model."""
    peft_model = sys.modules.get("peft.peft_model")
    if peft_model is not None and isinstance(model, peft_model.PeftModel):
        return "a PeftModel"
    if getattr(model, "_hf_peft_config_loaded", False):
        return "a model with PEFT adapters (transformers' add_adapter / load_adapter)"
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    if tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in modules):
        return "a model holding PEFT tuner layers (a PeftModel's get_base_model())"
    return None


ADAPTER_WAY = (
    "model.save_pretrained(folder) writes the adapter as PEFT does (gathering only its entries); to save the "
    "model with the adapter merged, merge it first (PeftModel.merge_and_unload()) and save that"
)
"""What to do instead of saving a model with PEFT adapters as a plain model's weights."""


def install() -> None:
    """The PEFT seams, once peft is imported: this one (for ``PeftModel.save_pretrained`` and, on a
    transformers model given adapters by ``add_adapter``, ``get_adapter_state_dict``, which its
    ``save_pretrained`` and the Trainer read the adapter through), and `zswap.parts.peft_seam` (where PEFT
    reads a base layer's whole weight, it gathers it)."""
    peft_seam.install()
    peft_model = sys.modules.get("peft.peft_model")
    cls = getattr(peft_model, "PeftModel", None) if peft_model is not None else None
    save = getattr(cls, "save_pretrained", None)
    if cls is not None and callable(save) and not getattr(save, _MARK, False):

        @functools.wraps(save)
        def save_pretrained(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> Any:
            if "state_dict" not in kwargs and any(param_state(p) is not None for p in self.parameters()):
                names = kwargs.get("selected_adapters") or list(self.peft_config)
                bounded = _selected_state_dict(self, names, kwargs.get("save_embedding_layers", "auto"))
                if bounded is not None:
                    kwargs["state_dict"] = bounded
            return save(self, save_directory, *args, **kwargs)

        setattr(save_pretrained, _MARK, True)
        cls.save_pretrained = save_pretrained
    integration = sys.modules.get("transformers.integrations.peft")
    mixin = getattr(integration, "PeftAdapterMixin", None) if integration is not None else None
    get = getattr(mixin, "get_adapter_state_dict", None)
    if mixin is not None and callable(get) and not getattr(get, _MARK, False):

        @functools.wraps(get)
        def get_adapter_state_dict(self: Any, adapter_name: str | None = None, state_dict: Any = None) -> Any:
            if (
                state_dict is None
                and getattr(self, "_hf_peft_config_loaded", False)
                and any(param_state(p) is not None for p in self.parameters())
            ):
                name = adapter_name if adapter_name is not None else self.active_adapters()[0]
                state_dict = _selected_state_dict(self, [name], "auto")
            return get(self, adapter_name, state_dict)

        setattr(get_adapter_state_dict, _MARK, True)
        mixin.get_adapter_state_dict = get_adapter_state_dict


def _selected_state_dict(model: Any, names: list[str], save_embedding_layers: Any) -> dict[str, Any] | None:
    """The state dict with only the partitioned entries PEFT will write gathered, or ``None`` where PEFT's
    choice cannot be read off."""
    from peft.utils import get_peft_model_state_dict

    with deferred():
        entries = model.state_dict()
    stand_ins = {
        k: torch.empty(v.st.shape, dtype=v.st.dtype, device="meta")
        for k, v in entries.items()
        if isinstance(v, Pending)
    }
    if not stand_ins:
        return None
    key_of = {id(t): k for k, t in stand_ins.items()}
    probe = {k: stand_ins.get(k, v) for k, v in entries.items()}
    wanted: set[str] = set()
    for name in names:
        chosen = get_peft_model_state_dict(
            model, state_dict=probe, adapter_name=name, save_embedding_layers=save_embedding_layers
        )
        for t in chosen.values():
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                if id(t) not in key_of:
                    return None
                wanted.add(key_of[id(t)])
    return {
        k: full_copy(v.p, v.st) if isinstance(v, Pending) else v
        for k, v in entries.items()
        if k not in stand_ins or k in wanted
    }
