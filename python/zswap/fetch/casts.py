"""Saved tensors that are a managed param in another dtype: autocast's copies of the weights.

Under autocast an op casts its float32 weight to the autocast dtype and saves that copy for backward
(``linear`` saves ``weight.to(bfloat16).t()``, a view of the copy). Saved as it is, a copy of every weight
of the pass (half the float32 model in bfloat16) stays alive from forward to backward whatever the live
budget, and autocast's cast cache holds each one until the outermost autocast region ends. The module
hooks (`zswap.fetch.hooks`) save such a copy as the param's layout instead and cast the param again when
backward unpacks it: a cast rounds the same way every time, so the bits are those the forward saved. They
also turn the cast cache off while their forward runs (`uncached`); a weight used twice is cast twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from ..parts.params import param_state

FROZEN_MIN_NUMEL = 1 << 12
"""A frozen param's copy smaller than this is saved as it is: it costs little memory, and telling it is a
copy means comparing it with the param."""


def param_cast(c: torch.Tensor, held: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The managed param ``c`` is a fresh contiguous copy of in another dtype (on its device), else None.

    A param that requires grad is known from the graph: ``c`` came out of a copy (``ToCopyBackward0``)
    whose input is that param itself. A frozen param's copy has no graph, so it is told by its bits: a
    param of ``held`` (those the running forward holds) of ``c``'s shape whose cast equals ``c`` byte for
    byte, which makes rebuilding it from that param exact whatever ``c`` came from (on a CUDA device the
    comparison waits for the copy)."""
    if not c.is_floating_point() or not c.is_contiguous():
        return None
    fn = c.grad_fn
    if fn is not None:
        if type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
            return None
        p = getattr(fn.next_functions[0][0], "variable", None)
        return p if p is not None and _castable(p, c) else None
    if c.requires_grad or c.numel() < FROZEN_MIN_NUMEL:
        return None
    for p in held:
        if not p.requires_grad and _castable(p, c) and _same_bits(recast(p, c.dtype), c):
            return p
    return None


def recast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Param ``p``'s gathered value in ``dtype``, contiguous (as autocast's copy is)."""
    return p.detach().to(dtype, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Autocast's cast cache off within (it kept every weight's copy to the region's end), as it was after."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def _castable(p: torch.Tensor, c: torch.Tensor) -> bool:
    return (
        param_state(p) is not None
        and p.dtype != c.dtype
        and p.is_floating_point()
        and p.device == c.device
        and p.shape == c.shape
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
