"""Lightning's model summary with the real size of every partitioned param.

Lightning counts ``p.numel()``, which is 0 for a managed param between uses (its ``.data`` is empty; the
values live in its partitions), so a zswap model showed 0 params and a model size of 0 MB. `ZswapSummary`
counts each managed param by its full size (``ParamState.numel``, the same on every rank) and every other
param as Lightning does. `ZswapStrategy.setup` points the trainer's `ModelSummary` callbacks
(``RichModelSummary`` too, with their own depth and options) at it, as Lightning itself switches to its
``DeepSpeedSummary`` under ZeRO-3. ``summarize(module)`` called by hand is Lightning's and still counts 0:
call ``ZswapSummary(module)`` instead.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary import LayerSummary, ModelSummary

from ..parts.params import param_state

if TYPE_CHECKING:
    import lightning.pytorch as pl


def real_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` as the user built it: a managed param's full size, else ``p.numel()`` (0 for a
    lazy param whose shape is not known yet, as Lightning counts it)."""
    st = param_state(p)
    if st is not None:
        return int(st.numel)
    if isinstance(p, torch.nn.parameter.UninitializedParameter):
        return 0
    return p.numel()


class ZswapLayerSummary(LayerSummary):
    @property
    def num_parameters(self) -> int:
        return sum(real_numel(p) for p in self._module.parameters())


class ZswapSummary(ModelSummary):
    """`lightning.pytorch.utilities.model_summary.ModelSummary` counting partitioned params by their real
    size (per layer, in total, trainable, and the model size in MB)."""

    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, LayerSummary] = OrderedDict(
            (name, ZswapLayerSummary(module)) for name, module in self.named_modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    def total_parameters(self) -> int:
        return sum(real_numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(real_numel(p) for p in self._model.parameters() if p.requires_grad)


def _zswap_summary(self: SummaryCallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    return ZswapSummary(pl_module, max_depth=self._max_depth)


def use_real_sizes(trainer: pl.Trainer) -> None:
    """Make every `ModelSummary` callback of ``trainer`` summarise with `ZswapSummary` (it runs at
    ``on_fit_start``, after the strategy's ``setup``)."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, SummaryCallback):
            cb._summary = types.MethodType(_zswap_summary, cb)  # type: ignore[method-assign]
