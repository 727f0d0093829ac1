"""What `zswap.module_api` asks of an engine whose model changes the shape of some params
(``resize_token_embeddings``): whether it can follow, and the new params in the optimizer's lists."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ZswapError
from ..gradients.gradstore import store_of
from ..step.optim._records import Records

if TYPE_CHECKING:
    from .runtime import Engine


def check_resizable(engine: Engine, params: list[torch.Tensor]) -> None:
    """Refuse (before anything changed) a resize this engine could not follow: a gradient is
    accumulated (its partition has the old size), or the optimizer holds state for a resized param
    (moments laid out for the old size: a plain torch optimizer's next step fails on the shape
    mismatch too)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    engine._grads.flush()
    if any(store_of(st).has(st) for _, st in engine._items):
        raise ZswapError(
            "resize_token_embeddings while gradients are accumulated (a micro-step into an "
            "accumulation window): call it after engine.step() at an accumulation boundary, or after "
            "engine.zero_grad()"
        )
    opt = engine.optimizer
    records = records_of(opt)
    state = getattr(opt, "state", {})
    for p in params:
        held = records is not None and any(q is p and records.placed(i) for i, q in enumerate(records.params))
        if held or state.get(p):
            raise ZswapError(
                "resize_token_embeddings: the optimizer already holds state (moments laid out for the "
                f"old size) for {names.get(id(p), 'a resized param')!r}; resize before the first "
                "optimizer step, or engine.close(), resize, and zswap.initialize the model again with a "
                "new optimizer"
            )


def swap_params(engine: Engine, new: dict[int, torch.Tensor]) -> None:
    """Put ``new[id(old)]`` wherever the optimizer lists ``old`` (none of them has state:
    `check_resizable`)."""
    opt = engine.optimizer
    if opt is None or not new:
        return
    for group in getattr(opt, "param_groups", ()):
        group["params"] = [new.get(id(p), p) for p in group["params"]]
    records = records_of(opt)  # OffloadedAdamW's flat index of its params
    if records is not None:
        records.params[:] = [new.get(id(p), p) for p in records.params]


def records_of(opt: Any) -> Records | None:
    """An `OffloadedAdamW`'s records (`zswap.optim._records`); ``None`` for any other optimizer."""
    records = getattr(opt, "records", None)
    return records if isinstance(records, Records) else None
