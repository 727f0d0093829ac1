"""Shared pieces of the tests adapted from DeepSpeed's own unit tests (tests/test_ds_*.py).

The scenarios are DeepSpeed's (its ``tests/unit``); the models, configs and checks are written for zswap.
`TwoLayer` plays the part of DeepSpeed's small test model: a linear layer and a cross-entropy loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class TwoLayer(nn.Module):
    """``forward(x, y)`` → cross-entropy of a two-layer MLP's logits against labels ``y``."""

    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        self.hidden = hidden
        self.l1 = nn.Linear(hidden, hidden)
        self.l2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.l2(torch.relu(self.l1(x))), y)


def batches(
    n: int, hidden: int = 10, batch: int = 2, seed: int = 0, dtype: Any = torch.float32
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, labels) pairs, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(batch, hidden, generator=g).to(dtype)
        yield x, torch.randint(0, hidden, (batch,), generator=g)


def base_config(**extra: Any) -> dict[str, Any]:
    """DeepSpeed's usual test config: a batch size, Adam at 1.5e-4, and whatever ``extra`` adds."""
    return {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        **extra,
    }
