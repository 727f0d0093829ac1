"""Who runs a param: the open training engines, seen from below.

Code under the engine (a `GatheredParameters` block, loading weights, the module API's deepcopy and
resize) must ask "does an open engine run these params, and if so, let it step aside". It cannot import
the engine (that is above it), so the engine implements the small `Runner` protocol declared here and
adds itself to `RUNNERS` when it opens; the lower layers ask the registry.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch


class Runner(Protocol):
    """What an open engine offers the layers below it."""

    closed: bool
    module: torch.nn.Module
    """The model it trains."""

    def runs(self, ids: set[int]) -> bool:
        """Whether it runs any of the params whose ``id`` is in ``ids``."""

    def yield_prefetch(self, p: torch.Tensor) -> bool:
        """Give up ``p`` if it is prefetching it or keeps it gathered with no holder; True if it did."""

    def drop_gathered(self) -> None:
        """Release every copy it gathered or is prefetching (they are gathered again at their next use)."""

    def mastered(self) -> set[int]:
        """Ids of the params whose float32 master copy its optimizer holds and steps from, whatever the
        param now says (a param not yet stepped starts from one written meanwhile)."""

    def check_resizable(self, params: list[torch.Tensor]) -> None:
        """Raise (before anything changed) if it could not follow a change of these params' sizes."""

    def rewired(self) -> contextlib.AbstractContextManager[None]:
        """A block during which it is unwired, wired again over the params' new shapes at the exit."""

    def swap_params(self, new: dict[int, torch.Tensor]) -> None:
        """Put ``new[id(old)]`` wherever its optimizer lists ``old``."""

    def zero_grad(self) -> None:
        """Drop every gradient it accumulated (an optimizer's ``zero_grad`` over its params: `guards`)."""


RUNNERS: weakref.WeakSet[Runner] = weakref.WeakSet()
"""The engines opened in this process (a closed one leaves when collected; `open_runners` skips it)."""


def open_runners() -> list[Runner]:
    return [r for r in list(RUNNERS) if not r.closed]


def runners_of(params: Iterable[torch.Tensor]) -> list[Runner]:
    """The open engines that run any of ``params``."""
    ids = {id(p) for p in params}
    return [r for r in open_runners() if r.runs(ids)]
