"""PEFT's ZeRO-3 seams, pointed at the params zswap partitions.

PEFT reads (or rewrites) a base layer's whole weight in a few places: DoRA's weight norm, the PiSSA / OLoRA /
LoftQ / EVA / CorDA initialisations, trainable tokens, CPT. Each runs inside
``peft.utils.integrations.gather_params_ctx``, which gathers through DeepSpeed only when transformers says
ZeRO-3 is on — never for zswap's params, so PEFT computed on their empty placeholders and failed with shape
errors. ``ModulesToSaveWrapper.update`` (``modules_to_save``, and the task types that add it) imports
``deepspeed`` itself when a param's ``numel()`` is 0 and it carries ``ds_numel``, which zswap sets on every
partitioned param (PEFT's param counts read it).

`install` (run by `zswap.checkpoint.peft_save.install` whenever `zswap.Init` partitions a module, once peft is
imported) changes both, once per process, and only for params zswap manages (anything else goes PEFT's own
way):

- the generator behind ``gather_params_ctx`` (modules that imported the function by name call it through the
  closure of the ``contextmanager`` wrapper, so the wrapper's cell is what is replaced) gathers zswap's params
  with `GatheredParameters` and PEFT's own ``modifier_rank`` (0 where PEFT may rewrite the weight: written
  back at the end), one layer's params at a time;
- ``ModulesToSaveWrapper.update`` runs inside a read-only `GatheredParameters` of the wrapped module's
  params, so the copy PEFT makes for training holds their values (and PEFT never reaches ``deepspeed``);
- ``TrainableTokensLayer.update_layer`` (``trainable_token_indices``) reads the rows it trains from the
  base embedding's weight (through DeepSpeed's API only when transformers says ZeRO-3 is on), and
  ``LoHaLayer.update_layer`` sizes its factors from the base weight's shape (where LoRA's read
  ``ds_shape``): each runs inside a read-only `GatheredParameters` of the base layer's params;
- ``onload_layer``, around which PEFT merges and unmerges each tuner layer (``merge_and_unload``,
  ``merge_adapter``, ``unmerge_adapter``), also gathers the layer's params: its base layer's with
  ``modifier_rank`` 0 (the merged weight is written back), the adapter's read-only; a wrapper that merges
  itself on unloading (trainable tokens' — which writes the embedding —, ``modules_to_save``'s) all its
  params with ``modifier_rank`` 0. Before, the merge computed on the empty placeholders and changed
  nothing, silently. ``merge_and_unload`` calls it on every module of the model: one that merges nothing
  (a decoder layer, the model itself) gathers nothing — before, each was gathered whole, the model itself
  included.

Params some enclosing block already gathered are whole already and are left to it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .gather import GatheredParameters, flatten_params
from .params import param_state

_MARK = "_zswap_seam"
_installed = False


def install() -> None:
    """Point PEFT's seams at zswap, if peft is imported and they are not already (cheap once done)."""
    global _installed
    if _installed:
        return
    integrations = sys.modules.get("peft.utils.integrations")
    other = sys.modules.get("peft.utils.other")
    if integrations is None or other is None:
        return  # not imported (or still importing): the next partitioned module looks again
    _replace_gather(getattr(integrations, "gather_params_ctx", None))
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    onload = getattr(tuners, "onload_layer", None)
    if tuners is not None and onload is not None and not getattr(onload, _MARK, False):
        tuners.onload_layer = _gathering_onload(onload)  # type: ignore[attr-defined]
    tokens = sys.modules.get("peft.tuners.trainable_tokens.layer")
    _read_only(getattr(tokens, "TrainableTokensLayer", None), "update_layer", lambda m: m.get_base_layer())
    loha = sys.modules.get("peft.tuners.loha.layer")  # sizes its factors from base_layer.weight.shape
    _read_only(getattr(loha, "LoHaLayer", None), "update_layer", lambda m: m.get_base_layer())
    _read_only(
        getattr(other, "ModulesToSaveWrapper", None), "update", lambda m: getattr(m, "original_module", None)
    )
    _installed = True


def _managed(params: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every param in ``params``, those zswap manages that no block has gathered)."""
    every = flatten_params(params)
    todo = []
    for p in every:
        st = param_state(p)
        if st is not None and st.gathered_by is None:
            todo.append(p)
    return every, todo


def _replace_gather(ctx: Any) -> None:
    closure = getattr(ctx, "__closure__", None)
    names = getattr(getattr(ctx, "__code__", None), "co_freevars", ())
    if not closure or "func" not in names:
        return  # not contextlib's wrapper: a peft whose seam zswap does not know stays as it is
    cell = closure[names.index("func")]
    original = cell.cell_contents
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def gather_params_ctx(
        param: Any, modifier_rank: int | None = 0, fwd_module: Any = None
    ) -> Iterator[None]:
        every, todo = _managed(param)
        if not todo:
            with contextlib.contextmanager(original)(every, modifier_rank, fwd_module):
                yield
            return
        with GatheredParameters(todo, modifier_rank=modifier_rank):
            yield

    setattr(gather_params_ctx, _MARK, True)
    cell.cell_contents = gather_params_ctx


def _read_only(cls: Any, name: str, module_of: Callable[[Any], Any]) -> None:
    """``cls.name`` run inside a read-only `GatheredParameters` of ``module_of(self)``'s params (those zswap
    manages that no block holds), once."""
    method = getattr(cls, name, None)
    if cls is None or not callable(method) or getattr(method, _MARK, False):
        return

    @functools.wraps(method)
    def gathered(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = module_of(self)
        _, todo = _managed(module.parameters()) if module is not None else ([], [])
        with GatheredParameters(todo, modifier_rank=None):
            return method(self, *args, **kwargs)

    setattr(gathered, _MARK, True)
    setattr(cls, name, gathered)


def _gathering_onload(onload: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @contextlib.contextmanager
    @functools.wraps(onload)
    def onload_layer(layer: Any) -> Iterator[None]:
        tuners = sys.modules.get("peft.tuners.tuners_utils")
        tuner = tuners is not None and isinstance(layer, tuners.BaseTunerLayer)
        if not tuner and not hasattr(layer, "unload_and_optionally_merge_module"):
            with onload(layer):  # merge_and_unload visits every module: this one has nothing to merge
                yield
            return
        base = layer.get_base_layer() if tuner else None
        if base is None or base is layer:  # a wrapper (trainable tokens, modules_to_save): its params
            _, written = _managed(layer.parameters())
        else:
            _, written = _managed(base.parameters())
        ids = {id(p) for p in written}
        _, read = _managed(p for p in layer.parameters() if id(p) not in ids)
        with (
            GatheredParameters(written, modifier_rank=0),
            GatheredParameters(read, modifier_rank=None),
            onload(layer),
        ):
            yield

    setattr(onload_layer, _MARK, True)
    return onload_layer
