"""Lightning hooks written for gradients in ``p.grad``, which zswap keeps in its own store: said when a fit
starts, rather than skipped without a word.

``on_after_backward`` and ``on_before_optimizer_step`` (a module's, or a callback's of the user's) are
where Lightning code reads or changes ``p.grad`` (gradient norms, masks, noise): under zswap ``p.grad`` is
None there — each gradient lives in zswap's store, read with ``zswap.full_grad(p)`` (before clipping, which
the engine does inside its step), and nothing written to ``p.grad`` is applied. ``optimizer_zero_grad``
overridden to zero less often (carrying gradients across steps) is not honoured either: the engine clears
each step's gradients when it steps (``accumulate_grad_batches`` sums micro-batches).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..errors import ZswapWarning

GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def warn_gradient_hooks(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """A `ZswapWarning` naming each gradient hook the module or a user's callback overrides (Lightning's
    own callbacks are left out: none of them reads gradients there)."""
    owners: list[tuple[Any, Any]] = [(module, pl.LightningModule)]
    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    owners += [(cb, pl.Callback) for cb in callbacks if not type(cb).__module__.startswith("lightning.")]
    found = [
        f"{type(owner).__name__}.{hook}"
        for owner, parent in owners
        for hook in GRADIENT_HOOKS
        if is_overridden(hook, owner, parent=parent)
    ]
    if found:
        warnings.warn(
            f"ZswapStrategy: {', '.join(found)} run where Lightning has the gradients in p.grad; under zswap "
            "p.grad is None there (each gradient is in zswap's store): read one with zswap.full_grad(p) "
            "(before clipping); a change made to p.grad is not applied",
            ZswapWarning,
            stacklevel=2,
        )
    if is_overridden("optimizer_zero_grad", module, parent=pl.LightningModule):
        warnings.warn(
            f"ZswapStrategy: {type(module).__name__}.optimizer_zero_grad is overridden; the zswap engine "
            "clears the gradients at every optimizer step whatever it does (accumulate over micro-batches "
            "with accumulate_grad_batches)",
            ZswapWarning,
            stacklevel=2,
        )
