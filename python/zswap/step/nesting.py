"""Backwards run inside a backward, for the early step: an autograd Function whose backward runs one of its
own — reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, torch's
default when ``use_reentrant`` is not passed, and DeepSpeed's and Megatron's checkpointing) re-runs a
segment's forward and runs its backward as a graph task of its own, inside the outer one.

Facts of torch's autograd engine this relies on: graph task ids grow by one per backward begun (an inner
task's id is above its outer's); a nested backward runs on the thread of the node that starts it, so the
Python frames of that Function's backward are on the stack while its gradients arrive; within one graph
task a param's gradient is accumulated once (autograd sums its uses first), but a param used in two such
segments, or inside one and outside, gets one per task — a part of its gradient, not the whole.

The early step treats an inner task's gradients as the outer backward's (`EarlyStep._on_grad`). It updates a
param's record at its gradient, so a param whose gradient comes in parts cannot run there; the last
backward tells (`Arrivals`), and the early step does not begin where it saw one. One it did not see
coming (the graph changed) gives up as for any second gradient: the ordinary step runs, or, where applied
gradients were already let go, that backward raises `GradientsNotKeptError` once.
"""

from __future__ import annotations

import sys
from types import FrameType

from torch.autograd import function as _function

INSIDE = (
    "its first gradient came in a backward run inside another (a reentrant activation checkpoint around "
    "the last layers with trainable params — the head, or with a frozen head the last block's adapters): "
    "use use_reentrant=False, or keep those layers outside the checkpoint"
)
"""Why no early step runs in a backward whose first gradient came from a nested one: the outer backward's
end, where the update must finish, cannot be watched from inside it."""

PARTS = (
    "a param's gradient came in parts (it is used in two reentrant activation checkpoints, or inside one "
    "and outside): use use_reentrant=False"
)
"""Why no early step runs after a backward in which one param got more than one gradient."""

_RUNNER = getattr(_function, "BackwardCFunction", None)
_CODES = (getattr(getattr(_RUNNER, name, None), "__code__", None) for name in ("apply", "apply_boxed"))
_BACKWARD_CODES = frozenset(code for code in _CODES if code is not None)
"""What runs a Python autograd Function's backward (torch's internal `BackwardCFunction`; where a torch
release renames it this is empty and an inner backward is found only by its outer's later gradients)."""


def inside_function_backward() -> bool:
    """Whether this thread runs inside a Python autograd Function's backward: a gradient arriving now comes
    from a backward that backward started, nested in one that began earlier."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _BACKWARD_CODES:
            return True
        frame = frame.f_back
    return False


class Arrivals:
    """Which params got a gradient in the backward in progress, and whether one got two."""

    def __init__(self) -> None:
        self._seen: dict[int, None] = {}
        self._parts = False
        self.last: list[int] = []
        """The params (``id``) that got a gradient in the last backward, in the order they got it."""

    def begin(self) -> bool:
        """A backward begins: True if in the last one a param's gradient came in parts."""
        parts, self._parts = self._parts, False
        self.last, self._seen = list(self._seen), {}
        return parts

    def note(self, pid: int) -> None:
        if pid in self._seen:
            self._parts = True
        self._seen[pid] = None
