"""``deepspeed.utils.logger`` and ``log_dist``, which training scripts log through."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger("zswap.deepspeed")
"""The logger scripts ported from DeepSpeed write to (DeepSpeed's is named "DeepSpeed"; this one is under
zswap's, so ``logging.getLogger("zswap")`` configures both)."""


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed in ``ranks`` (``[-1]``: every rank), as DeepSpeed's does: without
    torch.distributed every call logs; with it, a call without ``ranks`` logs nowhere."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    wanted = list(ranks or [])
    if rank == -1 or (wanted and (wanted[0] == -1 or rank in wanted)):
        logger.log(level, f"[Rank {rank}] {message}")
