"""Where new params go: the placement an active `zswap.Init` builds into, seen from below.

Loading weights into a meta-built model and the module API's resize need the current build's placement
(its store, group and dtype), and resize must build a new head where the old one lives. Both are Init's
to answer, but Init is above them; so Init registers the two answers here when it is imported, and the
layers below read `PLACING` instead of importing Init.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .gather import Placement


class Placing:
    """The current build placement (``None`` outside an active Init in this thread) and a way to build
    under a given one."""

    def __init__(self) -> None:
        self._current: Callable[[], Placement | None] = lambda: None
        self._build_at: Callable[[Placement], contextlib.AbstractContextManager[Any]] | None = None

    def register(
        self,
        current: Callable[[], Placement | None],
        build_at: Callable[[Placement], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self._current, self._build_at = current, build_at

    def current(self) -> Placement | None:
        """The innermost active Init's placement in this thread, else ``None``."""
        return self._current()

    def build_at(self, placement: Placement) -> contextlib.AbstractContextManager[Any]:
        """A block in which new params are partitioned into ``placement`` (an Init over it)."""
        if self._build_at is None:
            raise RuntimeError("zswap.init is not imported: nothing to build new params with")
        return self._build_at(placement)


PLACING = Placing()
