"""The few collectives a checkpoint needs, and agreement on failure: when one rank fails, every rank raises
(the failing rank its own error, the others a `ZswapError` naming it), so no rank goes on alone."""

from __future__ import annotations

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
    """Raise ``error`` here, or a `ZswapError` when another rank failed, on every rank alike."""
    reports = all_gather(None if error is None else f"{type(error).__name__}: {error}", group, world)
    if error is not None:
        raise error
    for rank, msg in enumerate(reports):
        if msg is not None:
            raise ZswapError(f"{what} failed on rank {rank}: {msg}")
