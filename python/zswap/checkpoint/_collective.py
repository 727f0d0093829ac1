"""The few collectives a checkpoint needs, and agreement on failure: when one rank fails, every rank raises
(the failing rank its own error, the others one naming it, of the same class where that is zswap's own, so
``except FileNotFoundError`` takes the same branch on every rank), so no rank goes on alone."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from .. import _dist
from ..errors import ZswapError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .manifest import ParamRecord


def group_of(records: list[ParamRecord]) -> tuple[ProcessGroup | None, int, int]:
    """(group, rank, world) the model's params are partitioned over (the default group when none is)."""
    for r in records:
        if r.st is not None:
            return r.st.group, r.st.rank, r.st.world_size
    return _dist.resolve_group(None)


def all_gather(obj: Any, group: ProcessGroup | None, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def agree(error: BaseException | None, what: str, group: ProcessGroup | None, world: int) -> None:
    """Raise ``error`` here, or one naming the rank that failed, on every rank alike."""
    cls, code = type(error), getattr(error, "errno", None)
    mine = None if error is None else (cls.__module__, cls.__qualname__, str(error), code)
    reports = all_gather(mine, group, world)
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            module, name, message, code = report
            raise _alike(module, name, code, f"{what} failed on rank {rank}: {name}: {message}")


def _alike(module: str, name: str, code: Any, text: str) -> ZswapError:
    """An error of the failing rank's class where it is one of zswap's (a `CheckpointNotFoundError` is also
    a ``FileNotFoundError``), else a `ZswapError`."""
    cls = getattr(sys.modules.get(module), name, None) if module.startswith("zswap.") else None
    if isinstance(cls, type) and issubclass(cls, ZswapError):
        try:
            made = cls(code, text) if issubclass(cls, OSError) and isinstance(code, int) else cls(text)
        except Exception:  # a constructor of another shape: the plain error below
            made = None
        if isinstance(made, ZswapError):
            return made
    return ZswapError(text)
