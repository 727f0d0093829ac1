"""DDP's gradient of one optimizer step in plain PyTorch, the reference the multi-rank step tests compare
zswap's partitioned gradients with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def ddp_grads(
    params: Sequence[torch.Tensor], gas: int, world: int, backward: Callable[[int, int], None]
) -> None:
    """Set each of ``params``' ``.grad`` to DDP's gradient over ``gas`` micro-batches of ``world`` ranks:
    ``backward(k, r)`` runs rank r's micro-batch k (its loss divided by ``gas``); each micro-batch's
    gradients are averaged over the ranks (one rank: taken as they are), then summed over the micro-batches
    (as zswap adds each averaged partition); ``None`` where no micro-batch gave the param one."""
    total: list[torch.Tensor | None] = [None] * len(params)
    for k in range(gas):
        ranks = []
        for r in range(world):
            backward(k, r)
            ranks.append([p.grad for p in params])
            for p in params:
                p.grad = None
        for i, gs in enumerate(zip(*ranks, strict=True)):
            if gs[0] is not None:
                avg = gs[0] if world == 1 else sum(gs[1:], gs[0]) / world
                total[i] = avg if total[i] is None else total[i] + avg
    for p, g in zip(params, total, strict=True):
        p.grad = g
